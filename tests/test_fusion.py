"""DeAR's tensor fusion (ravnest/averaging/fusion.py): greedy groups and the threshold search."""
from __future__ import annotations

import math

from ravnest.averaging.fusion import MB, FusionTuner, fusion_groups


def test_groups_are_consecutive_and_close_before_passing_the_threshold() -> None:
    assert fusion_groups([3, 3, 3, 3], 6) == [range(0, 2), range(2, 4)]
    assert fusion_groups([3, 3, 3, 3], 9) == [range(0, 3), range(3, 4)]
    assert fusion_groups([10, 1, 1], 4) == [range(0, 1), range(1, 3)]  # one parameter larger than the threshold
    assert fusion_groups([1, 1], 100) == [range(0, 2)]
    assert fusion_groups([], 5) == []


def test_the_tuner_tries_each_distinct_grouping_then_keeps_the_fastest_on_every_member() -> None:
    sizes = [3 * MB, 3 * MB, 3 * MB, 3 * MB]  # 1 MB: 4 groups, 4: 4 (same), 8: 2 (3+3), 16 and up: 1
    tuner = FusionTuner(sizes, 25, tune=True, total_steps=100, warmup_steps=2, trial_steps=3)
    assert tuner.candidates == [25 * MB, 1 * MB, 8 * MB]  # 25 MB (one group) first; 2, 4, 16... repeat groupings
    assert tuner.end == 2 + 3 * 3 and tuner.searching
    assert [tuner.threshold(s) for s in range(1, 12)] == [25 * MB] * 2 + [25 * MB] * 3 + [MB] * 3 + [8 * MB] * 3
    for step, seconds in enumerate([9, 9, 5, 1.0, 1.0, 5, 0.5, 0.5, 5, 0.7, 0.7], start=1):
        tuner.record(step, seconds)  # each trial's first step is not counted (5 s each here)
    assert tuner.means() == [1.0, 0.5, 0.7]
    assert tuner.choose([1.0, 0.6, 0.55]) == 8 * MB  # the group's mean decides, not this member's
    assert not tuner.searching and tuner.threshold(50) == 8 * MB


def test_no_search_when_there_is_nothing_to_choose_or_no_time() -> None:
    one_group = FusionTuner([1000, 1000], 25, tune=True, total_steps=1000)  # any threshold >= 1 MB: one group
    assert one_group.candidates == [25 * MB] and not one_group.searching
    short = FusionTuner([3 * MB] * 4, 25, tune=True, total_steps=20)  # the search would take half the job
    assert not short.searching and short.threshold(5) == 25 * MB
    fixed = FusionTuner([3 * MB] * 4, 2, tune=False, total_steps=1000)
    assert not fixed.searching and fixed.threshold(1) == 2 * MB and math.isfinite(fixed.threshold(1))
