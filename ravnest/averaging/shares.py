"""How a ring all-reduce splits its vector into member shares, and what that costs on each link.

In a ring of n members, member r sends to r+1 one share per step for 2n-2 steps (n-1 reduce-scatter,
n-1 all-gather); at step L it sends share (r - L) mod n. So link r -> r+1 carries every share twice
except shares r+1 (which r owns) and r+2, i.e. (2 - f[r+1] - f[r+2]) * S bytes for share fractions f.
With equal links and equal shares that is the classic 2(n-1)/n * S.
"""
from __future__ import annotations

import math


def share_bounds(numel: int, weights: list[float]) -> list[tuple[int, int]]:
    """Half-open element ranges of the n shares, sized in proportion to `weights`.

    Every member must pass the same weights: the bounds are computed independently on each."""
    if not weights or any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise ValueError(f"share weights must be finite, >= 0 and not all zero: {weights}")
    total = sum(weights)
    cuts, acc = [0], 0.0
    for w in weights[:-1]:
        acc += w
        cuts.append(min(numel, round(numel * acc / total)))
    cuts.append(numel)
    return list(zip(cuts, cuts[1:]))


def ring_link_loads(fractions: list[float]) -> list[float]:
    """Bytes on link r -> r+1 in units of the vector size, for share fractions summing to 1."""
    n = len(fractions)
    return [sum(fractions[(r - step) % n] for step in range(2 * n - 2)) for r in range(n)]


def ring_time_bound(nbytes: float, fractions: list[float], link_bandwidths: list[float]) -> float:
    """Seconds the busiest link needs for this split: no schedule can beat it.

    `link_bandwidths[r]` is the rate (bytes/s) of link r -> r+1, i.e. min(upload r, download r+1)."""
    total = sum(fractions)
    loads = ring_link_loads([f / total for f in fractions])
    return max(load * nbytes / bw for load, bw in zip(loads, link_bandwidths))


MIN_SHARE = 1e-6  # every member keeps a sliver of the segment: an empty share would leave it out of the ring


def balanced_shares(link_bandwidths: list[float], iterations: int = 4000) -> list[float]:
    """Share fractions that (nearly) minimise `ring_time_bound` for the given link rates.

    Not simply proportional to bandwidth: a slow member's two links carry everything except the
    shares of its two successors, so it should own a *large* share. Solved by exponentiated
    subgradient descent on the simplex (the problem is a small convex min-max)."""
    n = len(link_bandwidths)
    if n < 2:
        return [1.0] * n
    scale = max(link_bandwidths)
    rates = [bw / scale for bw in link_bandwidths]
    fractions = [1.0 / n] * n
    best = (ring_time_bound(1.0, fractions, rates), fractions)
    for t in range(iterations):
        loads = ring_link_loads(fractions)
        worst = max(range(n), key=lambda r: loads[r] / rates[r])
        # d(load_worst)/d(f_j) = how many times share j crosses the worst link (2, or 1 for its
        # successors' shares); moving mass towards the shares it carries once lowers it.
        step = 0.5 / math.sqrt(t + 1)
        crossings = [sum(1 for s in range(2 * n - 2) if (worst - s) % n == j) for j in range(n)]
        # shifted by the largest exponent so that very slow links cannot underflow every factor to 0
        exponents = [-step * c / rates[worst] for c in crossings]
        top = max(exponents)
        fractions = [max(f * math.exp(e - top), MIN_SHARE) for f, e in zip(fractions, exponents)]
        total = sum(fractions)
        fractions = [f / total for f in fractions]
        cost = ring_time_bound(1.0, fractions, rates)
        if cost < best[0]:
            best = (cost, fractions)
    return best[1]
