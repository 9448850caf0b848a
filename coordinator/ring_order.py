"""The order of a ring's members that maximises its slowest link (a bottleneck travelling salesman).

A ring all-reduce moves every byte over every link of the ring, so it runs at the pace of its
slowest link: with bandwidths b(i, j) measured between members, the best ring is the cycle c that
maximises min over consecutive (i, j) in c of b(i, j). Ties are broken by the next slowest link and
so on (the links sorted from the slowest, compared in turn), so of two rings that must both cross a
slow link somewhere, the one that crosses it fewer times wins. Links within SAME_WITHIN of each
other compare as equal: measured on busy hosts they vary by 10% or so, and comparing them exactly
let a ring cross a slow WAN link four times because one crossing measured 24 Mbit/s and the others
27. For n <= EXACT_UP_TO members every cycle is tried (member 0 fixed first: (n-1)! cycles); up to
TWO_OPT_UP_TO, 2-opt moves (reversing a stretch of the ring, which swaps two links for two others)
are made while one improves the ring in that order; larger rings keep their order. A move improves
the ring iff, once the links it removes and adds that compare equal are set aside, the slowest of
the rest is one it removes. The members' given order (the clusters' order) is kept unless another
is better.

Relays: a member that peers cannot dial is dialled at its relay (coordinator/service/reachability.py)
and dials its own next member directly, so its incoming ring link crosses its relay in every order,
and no order puts more of a relay's links in series than another: a relay carries the same bytes
whatever the order, and the order sees a relayed link only as its measured bandwidth, capped at its
share of the relay (planning.link). Order would matter once a relayed member received over
connections it opened itself (a reachable member's link to it would then skip the relay): not built.
"""
from __future__ import annotations

import itertools
from typing import Callable, Sequence

EXACT_UP_TO = 8
TWO_OPT_UP_TO = 256  # O(n^2) candidate moves per pass
MAX_PASSES = 100  # of 2-opt: comparing within a tolerance is not a strict order, so bound the search
SAME_WITHIN = 1.2  # links within 20% of each other compare as equal
Bandwidth = Callable[[int, int], float]


def links(order: Sequence[int], bandwidth: Bandwidth) -> list[float]:
    """The bandwidths of the ring `order` (closing back to its first member), slowest first."""
    return sorted(bandwidth(a, b) for a, b in zip(order, [*order[1:], order[0]])) if len(order) > 1 else []


def bottleneck(order: Sequence[int], bandwidth: Bandwidth) -> float:
    """The slowest link of the ring `order`."""
    return min(links(order, bandwidth), default=float("inf"))


def best_ring(n: int, bandwidth: Bandwidth) -> list[int]:
    """Member indices in ring order, the slowest link as fast as it can be (see the module docstring)."""
    best = list(range(n))
    if n <= 3:  # every cycle of 3 or fewer members uses the same links
        return best
    if n > EXACT_UP_TO:
        return _two_opt(best, bandwidth) if n <= TWO_OPT_UP_TO else best
    best_links = links(best, bandwidth)
    for rest in itertools.permutations(range(1, n)):
        if better(candidate := links((0, *rest), bandwidth), best_links):
            best, best_links = [0, *rest], candidate
    return best


def faster(a: float, b: float) -> bool:
    """Whether link bandwidth `a` is faster than `b` by more than measurements vary."""
    return a > b * SAME_WITHIN


def better(candidate: Sequence[float], incumbent: Sequence[float]) -> bool:
    """Whether a ring with these links (slowest first) beats one with `incumbent`'s: the first pair
    that does not compare equal decides."""
    for c, i in zip(candidate, incumbent):
        if faster(c, i):
            return True
        if faster(i, c):
            return False
    return False


def _two_opt(order: list[int], bandwidth: Bandwidth) -> list[int]:
    """Reverse stretches of the ring while that improves it (strictly, in the order above: this ends)."""
    n, improved, passes = len(order), True, 0
    while improved and passes < MAX_PASSES:
        improved, passes = False, passes + 1
        for i, j in itertools.combinations(range(1, n), 2):
            before, first, last, after = order[i - 1], order[i], order[j], order[(j + 1) % n]
            if _improves([bandwidth(before, first), bandwidth(last, after)],
                         [bandwidth(before, last), bandwidth(first, after)]):
                order = order[:i] + order[i:j + 1][::-1] + order[j + 1:]
                improved = True
    return order


def _improves(removed: list[float], added: list[float]) -> bool:
    for value in list(added):
        same = next((r for r in removed if not faster(r, value) and not faster(value, r)), None)
        if same is not None:
            removed.remove(same)
            added.remove(value)
    return bool(removed) and faster(min(added), min(removed))
