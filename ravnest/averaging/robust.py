"""Robust means of the n contributions to one share, for replicas that may lie (`averaging.robust`).

A plain mean lets one contribution put the result anywhere: one replica of four that sends its
weights times -1000 moves the mean 250 times as far as the weights themselves. A robust mean bounds
what any one contribution can do, as long as fewer than half of them lie (f < n / 2).

`centered_clip` (Karimireddy, He and Jaggi 2021, as BTARD runs it, Gorbunov et al. 2022): start at
the coordinate-wise median m, then repeat

    v <- v + (1 / n) * sum_i clip(x_i - v, tau),    clip(d, tau) = d * min(1, tau / ||d||)

with tau = CLIP_SCALE * median_i ||x_i - m||. Honest replicas drift apart by similar amounts between
rounds, so their differences stay near tau and v is close to their mean; a contribution far away pulls
v by at most tau / n per iteration, whatever it holds. Worked example, n = 4, one coordinate, x = (1,
2, 3, -1000): m = 1 (the lower median), distances (0, 1, 2, 1001), tau = 1. The first iteration clips
2 to 1 and -1001 to -1: v = 1 + (0 + 1 + 1 - 1) / 4 = 1.25; it settles at 1.5, where the differences
(-0.5, 0.5, 1, -1) cancel; the plain mean is -248.5.
A tau of 2 median distances let 3 of 8 replicas replaying 100-step-old weights hold the others back
(bench.byzantine: 0.905 against 0.950 accuracy); of 1, 0.947.
`trimmed_mean`: per coordinate, the mean of what is left once the TRIM share of the largest and of the
smallest values are dropped: less noisy than the median, but it stands only f <= TRIM * n liars.
`median`: per coordinate (the lower one of an even count), cheapest to reason about, noisiest.

Gossip has no round that sees every contribution: each replica mixes with its neighbours only. There
`clipped_gossip` (ClippedGossip, He, Karimireddy and Jaggi 2022) clips each neighbour's difference,
x_i <- x_i + sum_j w_ij clip(x_j - x_i, tau) with tau = CLIP_SCALE * the (lower) median distance of the
neighbours, which is the plain mix x_i <- sum_j w_ij x_j wherever nobody is clipped (W's rows sum to 1).

`outliers` then names the contributions that were far beyond the others: ||x_i - v|| more than
OUTLIER_RATIO times the (lower) median distance, which is an honest one while f < n / 2 (of 3
contributions, OUTLIER_RATIO_OF_3 times, and farther than OUTLIER_NORMS_OF_3 times the robust mean's
norm: the median is then the nearer pair's half-gap, which says nothing of the honest spread; the same for
a gossip replica's 2 or 3 neighbours, around its own values). A replica owning one share sees only that
share; the round takes a majority of the owners' votes (robust_round.robust_allreduce).
"""
from __future__ import annotations

from typing import Callable, Hashable

import numpy as np
import torch

CLIP_SCALE = 1.0  # tau, in median distances of the contributions from their coordinate-wise median
ITERATIONS = 20  # of centered_clip at most; it stops once v moves less than SETTLED of tau
SETTLED = 1e-3
NETWORK_ROWS = 16  # sorted_rows: a sorting network up to this many contributions, numpy's sort beyond
TRIM = 1 / 4  # trimmed_mean drops this share of the contributions at each end (at least one each, from 3)
# 8 let replicas that train on flipped labels or replay old weights go unnamed (bench.byzantine); at 4 no
# honest replica of the bench's or of tests/test_byzantine.py's jobs was ever named
OUTLIER_RATIO = 4.0
# Of 3 contributions the median distance is half the nearer pair's gap, so an honest third one twice as far
# would count: a 3 x 3 robust ring named one (tests/test_audits.py's honest run, round 19). Of 3, the bar is
# this many median distances instead (a liar times -1000, or 100 times its norm, is far beyond either)
OUTLIER_RATIO_OF_3 = 16.0
# ... and even 16 is no bar: one honest replica whose shard holds harder examples moves more for rounds on end
# (examples/jobs/digits-robust.json's CNN: 26 median distances away in rounds 18 to 22 of 150, 0.1 of the
# weights' norm; a user's 4,000-step run named it). Of 3, a contribution is named only if it also lies
# farther from the robust mean than this many times the mean's own norm: a liar times -1000 lies 1000 norms
# away, one that adds 100 times its norm 100; weights that differ by training do not
OUTLIER_NORMS_OF_3 = 1.0
# Where one round's view can be an honest accident, a member is named only once it was far off in this many
# rounds in a row: dear's per-step gradients (heavy-tailed) and gossip (each replica sees 2 or so neighbours)
STRIKES = 3
RULES = ("centered_clip", "trimmed_mean", "median")
Reducer = Callable[[torch.Tensor], torch.Tensor]


class Strikes:
    """Who was found far off in how many rounds (or steps) in a row, for naming one only at STRIKES:
    `record(who, when)` once or more per round `when`, rounds numbered 0, 1, 2, ...; a round without a
    record of `who` starts its count over."""

    def __init__(self) -> None:
        self._runs: dict[Hashable, tuple[int, int]] = {}  # who -> (the last round it was far off, rounds in a row)

    def record(self, who: Hashable, when: int) -> bool:
        """`who` was far off in round `when`: whether that makes STRIKES rounds in a row."""
        last, in_a_row = self._runs.get(who, (when - 2, 0))
        if last != when:
            self._runs[who] = when, in_a_row = when, (in_a_row + 1 if last == when - 1 else 1)
        return in_a_row >= STRIKES


def median(stack: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise (lower) median of `stack`, contributions along dim 0."""
    return sorted_rows(stack)[(stack.shape[0] - 1) // 2]


def trimmed_mean(stack: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise mean without the TRIM largest and smallest (the plain mean below 3)."""
    n = stack.shape[0]
    cut = max(1, int(n * TRIM)) if n >= 3 else 0
    return torch.stack(sorted_rows(stack)[cut:n - cut]).mean(dim=0)


def sorted_rows(stack: torch.Tensor) -> list[torch.Tensor]:
    """The rows of `stack` sorted coordinate-wise: row i holds the i-th smallest value of every column.

    An owner sorts a few long rows, where sorting along dim 0 is slow (torch.median(dim=0) of 8 rows of
    250,000 values: 53 ms; numpy's partition: 22 ms): up to NETWORK_ROWS rows, odd-even transposition
    instead, whose compare-exchanges are element-wise minimums and maximums of whole rows (7 ms). Pass p
    exchanges rows (i, i + 1) for every i of p's parity; n passes sort n rows. E.g. columns (3, 1, 2):
    pass 0 swaps rows 0 and 1 -> (1, 3, 2), pass 1 rows 1 and 2 -> (1, 2, 3), pass 2 finds them sorted."""
    n = stack.shape[0]
    if n > NETWORK_ROWS:  # n^2 / 2 exchanges: numpy's sort is cheaper by then
        return list(torch.from_numpy(np.sort(stack.detach().cpu().numpy(), axis=0)).to(stack.device))
    rows, spare = list(stack.detach().clone()), torch.empty_like(stack[0])  # (no row allocated per exchange)
    for p in range(n):
        for i in range(p % 2, n - 1, 2):
            low, high = rows[i], rows[i + 1]
            torch.maximum(low, high, out=spare)
            torch.minimum(low, high, out=low)
            rows[i + 1], spare = spare, high
    return rows


def centered_clip(stack: torch.Tensor) -> torch.Tensor:
    """The centered-clipping mean of the rows of `stack` (see the module docstring). Worked in
    differences from the median m, y_i = x_i - m and u = v - m, so that distances are not lost to
    rounding next to the weights' size, and with no n x d temporary per iteration: ||y_i - u||^2 =
    ||y_i||^2 - 2 y_i.u + ||u||^2 and sum_i s_i (y_i - u) = s Y - (sum_i s_i) u."""
    m = median(stack)
    y = stack - m
    squares = (y * y).sum(dim=1)
    tau = CLIP_SCALE * float(squares.sqrt().median())
    if tau == 0.0:  # most contributions are the median itself
        return m
    u = torch.zeros_like(m)
    for _ in range(ITERATIONS):
        distances = (squares - 2 * (y @ u) + u.dot(u)).clamp(min=0).sqrt()
        scale = torch.clamp(tau / torch.clamp(distances, min=1e-30), max=1.0)
        step = (scale @ y - scale.sum() * u) / len(stack)
        u += step
        if float(step.norm()) <= SETTLED * tau:
            break
    return m + u


def reducer(rule: str) -> Reducer:
    """The robust mean named `rule` (one of RULES)."""
    return {"centered_clip": centered_clip, "trimmed_mean": trimmed_mean, "median": median}[rule]


def outliers(stack: torch.Tensor, center: torch.Tensor) -> list[bool]:
    """Which rows of `stack` lie more than OUTLIER_RATIO median distances from `center`. With 2 or fewer
    contributions nobody can tell who is off, so nobody is."""
    if stack.shape[0] <= 2:
        return [False] * stack.shape[0]
    distances = _distances(stack, center)
    bar = _outlier_bar(float(distances.median()), float(center.norm()), few=stack.shape[0] == 3)
    return [bool(d > bar) for d in distances]


def clipped_gossip(own: torch.Tensor, heard: list[torch.Tensor], weights: list[float]) -> tuple[torch.Tensor,
                                                                                                list[bool]]:
    """This replica's gossip mix (the module docstring), and which neighbours were beyond OUTLIER_RATIO
    times tau (none with fewer than 2: nobody can tell who is off). `heard` is overwritten."""
    distances = [float(h.sub_(own).norm()) for h in heard]  # heard[j] is now x_j - x_i
    tau = CLIP_SCALE * sorted(distances)[(len(distances) - 1) // 2] if distances else 0.0
    mixed = own.clone()
    for difference, weight, distance in zip(heard, weights, distances):
        if distance > 0:
            mixed.add_(difference, alpha=weight * min(1.0, tau / distance))
    bar = _outlier_bar(tau, float(own.norm()), few=len(heard) <= 3)
    return mixed, [len(heard) >= 2 and d > bar for d in distances]


def _outlier_bar(typical: float, norm: float, few: bool) -> float:
    """The distance beyond which a contribution is named, `typical` the (lower) median one, `norm` the
    center's; `few`: of 3 or fewer, where that median says nothing of the honest spread."""
    floor = 1e-6 * norm + 1e-12  # identical replicas: anything measurably apart counts
    if few:
        return max(OUTLIER_RATIO_OF_3 * max(typical, floor), OUTLIER_NORMS_OF_3 * norm)
    return OUTLIER_RATIO * max(typical, floor)


def _distances(stack: torch.Tensor, center: torch.Tensor) -> torch.Tensor:
    return (stack - center).norm(dim=1)
