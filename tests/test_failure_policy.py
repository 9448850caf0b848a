"""The slow-node rule on its own: a stage far slower than planned and than its peers is re-planned
around; stages that are all slower alike (a shared machine) are not."""
from __future__ import annotations

from coordinator.config import Settings
from coordinator.failure_policy import FailurePolicy, StageSpeed
from ravnest.failures import FailureKind


def speeds(ratios: list[float], step: int = 50) -> list[StageSpeed]:
    return [StageSpeed(f"node-{i}", 0, i, step, 0.01 * ratio, 0.01) for i, ratio in enumerate(ratios)]


def test_a_stage_slower_than_its_peers_is_named_after_enough_reports_in_a_row(tmp_path) -> None:
    policy = FailurePolicy(Settings(data_dir=tmp_path, slow_factor=4.0, slow_checks=3))
    assert policy.slow_stage("job", speeds([1.0, 12.0])) is None
    assert policy.slow_stage("job", speeds([1.0, 12.0])) is None
    stage, said, failure = policy.slow_stage("job", speeds([1.0, 12.0]))
    assert stage.node_id == "node-1" and failure.kind == FailureKind.SLOW and failure.peer_id == "node-1"
    assert said == "computes a micro-batch in 120 ms, 12.0x the 10 ms planned (the other stages: 1.0x)"


def test_a_slow_report_between_normal_ones_starts_the_count_again(tmp_path) -> None:
    policy = FailurePolicy(Settings(data_dir=tmp_path, slow_checks=2))
    for ratios in ([1.0, 12.0], [1.0, 1.2], [1.0, 12.0]):
        assert policy.slow_stage("job", speeds(ratios)) is None
    assert policy.slow_stage("job", speeds([1.0, 12.0])) is not None


def test_stages_slower_alike_and_early_steps_are_left_alone(tmp_path) -> None:
    policy = FailurePolicy(Settings(data_dir=tmp_path, slow_checks=1, slow_after_steps=20))
    assert policy.slow_stage("job", speeds([6.0, 7.0, 9.0, 6.5])) is None  # every node on a busy machine
    assert policy.slow_stage("job", speeds([1.0, 3.5])) is None  # within the planner's error
    # measured on healthy nodes, four on two cores with stages of a few ms: not a slow node
    assert policy.slow_stage("job", speeds([2.3, 2.3, 9.2])) is None and policy.slow_stage("job", speeds([0.5, 5.3])) is None
    assert policy.slow_stage("job", speeds([1.0, 30.0], step=10)) is None  # still warming up
    assert policy.slow_stage("job", speeds([30.0])) is None  # nobody to compare with
