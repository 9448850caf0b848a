"""How each node's heartbeats have been arriving, and so how long a silence of it is unusual: an accrual
failure detector (as Cassandra's and Akka's, after Hayashibara et al., "The phi accrual failure
detector"), with the gaps between beats taken as normal around their recent mean.

A fixed rule (suspect after 3 missed intervals) is a datacentre's: a volunteer's laptop that is busy,
or 32 nodes sharing two cores, beats late every so often, and each late beat looked like a death. Here
a node is suspect once its silence is SIGMAS standard deviations past the mean gap between its own
recent beats; never sooner than the fixed rule (`heartbeat_timeout_factor` intervals), so a node with
a steady beat is noticed as fast as before, and one whose beats wander is given the room its history
shows. The mean and variance are exponentially weighted (WEIGHT per beat), so a node's bad evening
counts for a while and then fades.

Worked example (interval 2 s, timeout factor 3, SIGMAS 4): a quiet node's gaps are 2.0 s +- 0.05:
suspect after max(6, 2.0 + 0.2) = 6 s, as before. A node on a crowded host whose gaps ran 2.4 s
+- 1.5 (one of 8 s among them): suspect after max(6, 2.4 + 6.0) = 8.4 s, so its next 8 s gap is no
longer a suspicion. Death still takes a second source or a long silence (failure_rules/heartbeat.py),
which grows with the suspicion's threshold too.

Each coordinator process keeps the history of the beats it answered (in memory: a few floats per
node); a beat another process answered is a gap here, so a node looks more irregular there, never
less: slower to suspect, never quicker.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

SIGMAS = 4.0  # a silence this many standard deviations past a node's mean gap makes it suspect
WEIGHT = 0.1  # each beat's share of the running mean and variance (about the last 10-20 beats)
MIN_BEATS = 4  # gaps a history needs before it is believed
MAX_NODES = 200_000  # histories kept at most (the least recently heard from go first)


@dataclass
class Gaps:
    last: float  # when its latest beat came
    mean: float = 0.0  # the gaps between its beats, exponentially weighted
    variance: float = 0.0
    count: int = 0  # gaps seen

    def add(self, gap: float) -> None:
        if self.count == 0:
            self.mean = gap
        else:  # (West's exponentially weighted mean and variance)
            delta = gap - self.mean
            self.mean += WEIGHT * delta
            self.variance = (1 - WEIGHT) * (self.variance + WEIGHT * delta * delta)
        self.count += 1


class BeatHistory:
    """Per node, when its beats came (thread-safe: beats are answered on many threads)."""

    def __init__(self, max_nodes: int = MAX_NODES) -> None:
        self._gaps: OrderedDict[str, Gaps] = OrderedDict()
        self._lock = threading.Lock()
        self._max = max_nodes

    def arrived(self, node_id: str, at: float) -> None:
        with self._lock:
            gaps = self._gaps.get(node_id)
            if gaps is None:
                self._gaps[node_id] = Gaps(last=at)
                if len(self._gaps) > self._max:
                    self._gaps.popitem(last=False)
                return
            if at > gaps.last:
                gaps.add(at - gaps.last)
                gaps.last = at
            self._gaps.move_to_end(node_id)

    def usual(self, node_id: str) -> tuple[float, float] | None:
        """(mean gap, its standard deviation) in seconds, once MIN_BEATS gaps were seen; else None."""
        with self._lock:
            gaps = self._gaps.get(node_id)
            if gaps is None or gaps.count < MIN_BEATS:
                return None
            return gaps.mean, math.sqrt(gaps.variance)


def suspect_after_s(fixed_s: float, usual: tuple[float, float] | None) -> float:
    """The silence after which a node is suspect: the fixed rule's, or SIGMAS past its usual gap where
    its history says its beats wander more (the module docstring)."""
    if usual is None:
        return fixed_s
    mean, spread = usual
    return max(fixed_s, mean + SIGMAS * spread)
