"""The slow-node rule on its own: a stage far slower than planned and than its peers is re-planned
around; stages that are all slower alike (a shared machine) are not; a lone stage far off its node's
profile corrects that profile."""
from __future__ import annotations

import pytest

from coordinator.config import Settings
from coordinator.failure_policy import FailurePolicy, StageSpeed
from ravnest.failures import FailureKind


def speeds(ratios: list[float], step: int = 50, flops: float = 1e10) -> list[StageSpeed]:
    """Stages of 1e8 FLOPs a micro-batch on nodes claiming `flops`, each `ratio` times its prediction."""
    return [StageSpeed(f"node-{i}", 0, i, step, 0.01 * ratio, 0.01, flops, 1e8) for i, ratio in enumerate(ratios)]


def test_a_stage_slower_than_its_peers_is_named_after_enough_reports_in_a_row(tmp_path) -> None:
    policy = FailurePolicy(Settings(data_dir=tmp_path, slow_factor=4.0, slow_checks=3))
    assert policy.slow_stage("job", speeds([1.0, 12.0])) is None
    assert policy.slow_stage("job", speeds([1.0, 12.0])) is None
    slow = policy.slow_stage("job", speeds([1.0, 12.0]))
    assert slow.stage.node_id == "node-1" and slow.failure.kind == FailureKind.SLOW and slow.failure.peer_id == "node-1"
    assert slow.said == "computes a micro-batch in 120 ms, 12.0x the 10 ms planned (the other stages: 1.0x)"
    assert slow.measured_flops == 1e10 / 12  # as fast as the plan would have predicted its slowness


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
    assert policy.slow_stage("job", speeds([2.3, 2.3, 9.2])) is None
    assert policy.slow_stage("job", speeds([0.5, 5.3])) is None
    assert policy.slow_stage("job", speeds([1.0, 30.0], step=10)) is None  # still warming up
    assert policy.slow_stage("job", speeds([30.0])) is None  # nobody to compare with


def test_a_lone_stage_far_off_its_profile_is_a_false_claim_and_gets_the_measured_figure(tmp_path) -> None:
    """The maximal fake profile: 1e17 FLOP/s claimed, and 1e8 FLOPs computed in 4 ms (2 of them the
    plan's fixed cost): 5e10 measured. No peers to compare with, so the bound is claim_factor, far
    above what crowding explains."""
    policy = FailurePolicy(Settings(data_dir=tmp_path, slow_checks=1))
    assert policy.slow_stage("job", speeds([0.4], flops=4e12)) is None  # claimed 80x what it computes like
    assert policy.slow_stage("job", speeds([0.2], flops=1e17)) is None  # the fixed cost alone: no figure
    slow = policy.slow_stage("job", speeds([0.4], flops=1e17))
    assert slow is not None and slow.measured_flops == pytest.approx(5e10)
    assert slow.said == ("computes like 50.0 GFLOP/s, where its profile claimed 100,000,000.0 (a micro-batch in "
                         "4.0 ms, not 10.0)")
