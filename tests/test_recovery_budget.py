"""The re-plan budget that progress refills (coordinator/recovery_budget.py): its worked examples."""
from __future__ import annotations

from coordinator.recovery_budget import recoveries_left


def left_after_each(loss_steps: list[int], max_recoveries: int = 3, total_steps: int = 1000) -> list[int]:
    return [recoveries_left(max_recoveries, total_steps, loss_steps[:i + 1]) for i in range(len(loss_steps))]


def test_losses_without_progress_spend_the_budget_and_the_one_past_it_fails() -> None:
    assert left_after_each([120, 130, 140, 150]) == [2, 1, 0, -1]
    assert left_after_each([0, 0]) == [2, 1]  # re-planned before a step was made, twice
    assert recoveries_left(0, 1000, [500]) == -1  # max_recoveries 0: the first loss fails the job


def test_a_job_that_keeps_making_progress_is_not_failed_by_its_count_of_replans() -> None:
    assert left_after_each([120, 400, 700, 950]) == [2, 2, 2, 2]
    assert left_after_each([120, 170, 220, 270, 320]) == [2, 1, 1, 0, 0]  # a slow crawl: one back every 100
    assert min(left_after_each(list(range(100, 100_000, 150)), total_steps=100_000)) < 0  # 150 of 10,000: too slow


def test_steps_trained_again_after_a_replan_give_nothing_back() -> None:
    # resumed from step 100 after the loss at 300, the job reached 300 again: no new steps, no refill
    assert left_after_each([300, 300, 300, 300]) == [2, 1, 0, -1]
    assert left_after_each([300, 250, 310]) == [2, 1, 0]  # 10 new steps past 300: less than a refill
