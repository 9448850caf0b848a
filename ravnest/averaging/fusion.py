"""Tensor fusion for DeAR: which gradients travel together, and the search for the size threshold.

Small messages waste the network on per-message latency; one message for everything starts only
when the whole backward is done. DeAR groups consecutive parameters (in the order backward produces
them) greedily: a group closes once adding the next parameter would pass `threshold` bytes, so each
group but the last holds at least one parameter and at most `threshold` bytes unless a single
parameter is larger.

The best threshold depends on the model, the links and the compute, so `FusionTuner` measures it:
every distinct grouping that a power-of-two threshold in [1, 256] MB gives (thresholds giving the
same groups are the same experiment) is tried for `trial_steps` steps, and the one with the
shortest mean iteration time is kept. The paper searches the same range with Bayesian optimisation;
on a range this small, trying each distinct grouping once costs a few dozen steps and cannot miss.
The members of a group must agree on the groups at every step, so the schedule is a function of the
step alone and the choice is made from iteration times averaged over all members (`choose`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

MB = 1 << 20
SEARCH_MB = tuple(2**i for i in range(9))  # 1, 2, 4, ... 256 MB


def fusion_groups(sizes: Sequence[int], threshold: float) -> list[range]:
    """Consecutive index ranges over `sizes` (bytes, in backward order), greedily under `threshold`."""
    groups: list[range] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > threshold:
            groups.append(range(start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        groups.append(range(start, len(sizes)))
    return groups


class FusionTuner:
    """The threshold to use at each step: `start_mb` during `warmup_steps`, then each candidate for
    `trial_steps`, then the best one (`choose`). The first step of each trial is not counted: its
    all-gather was started under the previous trial's groups."""

    def __init__(self, sizes: Sequence[int], start_mb: float, *, tune: bool, total_steps: int,
                 warmup_steps: int = 2, trial_steps: int = 4):
        self.start = start_mb * MB
        self.candidates: list[float] = []
        seen: set[tuple[int, ...]] = set()
        for threshold in [self.start, *(mb * MB for mb in SEARCH_MB)] if tune else [self.start]:
            starts = tuple(group.start for group in fusion_groups(sizes, threshold))
            if starts not in seen:  # thresholds giving the same groups are the same experiment
                seen.add(starts)
                self.candidates.append(threshold)
        self.warmup, self.trial = warmup_steps, trial_steps
        self.end = warmup_steps + len(self.candidates) * trial_steps  # the last step of the search
        if len(self.candidates) < 2 or self.end >= total_steps // 2:  # nothing to choose, or no time left
            self.candidates, self.end = [self.start], 0
        self.chosen: float | None = None if self.end else self.start
        self._times: list[list[float]] = [[] for _ in self.candidates]

    @property
    def searching(self) -> bool:
        return self.chosen is None

    def threshold(self, step: int) -> float:
        """The threshold for step `step` (1-based)."""
        if self.chosen is not None:
            return self.chosen
        if step <= self.warmup:
            return self.start
        return self.candidates[min((step - self.warmup - 1) // self.trial, len(self.candidates) - 1)]

    def record(self, step: int, seconds: float) -> None:
        """The iteration that ended at step `step` took `seconds` (ready to ready)."""
        if self.chosen is None and self.warmup < step <= self.end and (step - self.warmup - 1) % self.trial:
            self._times[(step - self.warmup - 1) // self.trial].append(seconds)

    def means(self) -> list[float]:
        """This member's mean iteration time per candidate (to be averaged over the group's members)."""
        return [sum(t) / len(t) if t else math.inf for t in self._times]

    def choose(self, group_means: Sequence[float]) -> float:
        """Keep the candidate whose iteration time, averaged over all members, was shortest."""
        best = min(range(len(self.candidates)), key=lambda i: (group_means[i], i))
        self.chosen = self.candidates[best]
        return self.chosen
