"""Communication topologies for gossip strategies: in round t, whom member i hears from and with what
weight, so that one mixing round is x_i <- sum_j W_ij(t) x_j.

Every W(t) here is doubly stochastic (rows and columns sum to 1): mixing keeps the members' mean
exactly, and repeated rounds contract them towards it at a rate set by the graph's spectral gap.
Pure functions of (topology, n, t): every member computes the same W(t) without talking.

- `complete`: everyone hears everyone, W_ij = 1/n (one all-reduce's worth of traffic per member).
- `ring`: i hears i-1, i and i+1, 1/3 each (in a group of two the other is heard twice: 2/3).
- `torus`: a 2-D wrap-around grid as square as n allows; i hears its 4 grid neighbours and itself,
  1/5 each (a dimension of 2 makes two neighbours one, whose weights add).
- `exponential`: i hears i - 2^k for every k < ceil(log2 n), and itself, equally (static, directed).
- `one-peer-exp`: time-varying: in round t, i hears only i - 2^(t mod ceil(log2 n)), W = 1/2 each;
  one message per member per round, and after ceil(log2 n) rounds of a power-of-two n the product of
  the W(t) is exactly the average (Ying et al. 2021, "Exponential graph is provably efficient").
- `alternating-exp-ring`: time-varying: even rounds are `one-peer-exp` (round t // 2), odd rounds
  `ring`; the ring's cheap local mixing between the exponential graph's long jumps.
"""
from __future__ import annotations

import math

TOPOLOGIES = ("complete", "ring", "torus", "exponential", "one-peer-exp", "alternating-exp-ring")


def mixing_row(topology: str, rank: int, size: int, round: int = 0) -> dict[int, float]:
    """Row `rank` of W(round): {member j: W_rank,j} for the members it hears (itself included)."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}; choose one of {', '.join(TOPOLOGIES)}")
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside a group of {size}")
    if round < 0:
        raise ValueError("rounds count from 0")
    if size == 1:
        return {0: 1.0}
    if topology == "alternating-exp-ring":
        topology, round = ("one-peer-exp", round // 2) if round % 2 == 0 else ("ring", round // 2)
    if topology == "complete":
        heard = list(range(size))
    elif topology == "ring":
        heard = [rank - 1, rank, rank + 1]
    elif topology == "torus":
        rows = _torus_rows(size)
        cols = size // rows
        r, c = divmod(rank, cols)
        heard = [rank] + [((r + dr) % rows) * cols + (c + dc) % cols for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1))]
    elif topology == "exponential":
        heard = [rank] + [rank - 2 ** k for k in range(_hops(size))]
    else:  # one-peer-exp
        heard = [rank, rank - 2 ** (round % _hops(size))]
    row: dict[int, float] = {}
    for j in heard:  # a neighbour heard twice (small rings and tori) gets both shares
        row[j % size] = row.get(j % size, 0.0) + 1.0 / len(heard)
    return row


def mixing_matrix(topology: str, size: int, round: int = 0) -> list[list[float]]:
    """W(round) as a dense n x n list of rows (for tests and the runtime model, not for training)."""
    matrix = [[0.0] * size for _ in range(size)]
    for i in range(size):
        for j, w in mixing_row(topology, i, size, round).items():
            matrix[i][j] = w
    return matrix


def sends_to(topology: str, rank: int, size: int, round: int = 0) -> list[int]:
    """The members that hear `rank` in this round (the members whose row names it), self excluded."""
    return [i for i in range(size) if i != rank and rank in mixing_row(topology, i, size, round)]


def circulant(topology: str, size: int, round: int = 0) -> bool:
    """Whether every member hears the members at the same rank offsets in this round: then each
    member's neighbours, taken nearest first, pair up phase by phase (`RingMember.exchange(paced=True)`).
    Every topology here hears rank minus fixed offsets, except a torus whose rows wrap around inside
    the row (a torus of one row is a ring)."""
    return topology != "torus" or _torus_rows(size) in (1, size)


def _hops(size: int) -> int:
    return max(1, math.ceil(math.log2(size)))


def _torus_rows(size: int) -> int:
    """The largest divisor of `size` not above its square root (1: a ring of `size`)."""
    return max(d for d in range(1, math.isqrt(size) + 1) if size % d == 0)
