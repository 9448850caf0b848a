"""The runtime model (ravnest/averaging/runtime.py) and the planner's "auto" averaging strategy."""
from __future__ import annotations

import pytest

from coordinator.clustering import NodeInfo
from coordinator.jobs import _averaging
from coordinator.planning import plan_job
from ravnest.averaging import runtime
from ravnest.averaging.runtime import Group, half_allreduce_s, mean_degree, pick, slowest_of, strategy_step_s
from ravnest.models import build_model, profile_blocks
from ravnest.spec import AveragingSettings, JobSpec, Placement, TrainingSettings

MB = 2**20


def test_the_ring_all_reduce_costs_2_n_minus_1_shares_and_latencies() -> None:
    g = Group(members=4, param_bytes=40 * MB, bandwidth=10 * MB, latency=0.01)
    assert half_allreduce_s(g) == pytest.approx(3 * (1.0 + 0.01))  # 3 steps of a quarter (1 s) each
    # a ring round of 2 x 3.03 s every 10 steps of 1 s: applied 5 steps later, so 1.06 s exposed per 10
    assert strategy_step_s("ring", 1.0, [g], every=10) == pytest.approx(1.0 + (6.06 - 5.0) / 10)
    assert strategy_step_s("ring", 1.0, [g], every=50) == 1.0  # hidden entirely
    assert strategy_step_s("none", 1.0, [g]) == 1.0
    assert strategy_step_s("dear", 1.0, [Group(1, 40 * MB, 10 * MB, 0.01)]) == 1.0  # nobody to average with


def test_dear_hides_its_halves_behind_backward_and_forward_but_not_the_first_and_last_groups() -> None:
    fast = Group(members=4, param_bytes=100 * MB, bandwidth=1000 * MB, latency=0.0, fine_overlap=True)
    half = half_allreduce_s(fast, 4)  # 4 fusion groups of 25 MB: 0.075 s per half
    step = strategy_step_s("dear", 1.0, [fast])
    assert step == pytest.approx(1.0 + 2 * half / 4)  # only the last reduce and the first gather show
    slow = Group(members=4, param_bytes=100 * MB, bandwidth=10 * MB, latency=0.0, fine_overlap=True)
    half = half_allreduce_s(slow, 4)  # 7.5 s: far more than the backward (2/3 s) and forward (1/3 s)
    assert strategy_step_s("dear", 1.0, [slow]) == pytest.approx(1.0 + (half - 2 / 3) + (half - 1 / 3))
    deep = Group(members=4, param_bytes=100 * MB, bandwidth=1000 * MB, latency=0.0, fine_overlap=False)
    assert strategy_step_s("dear", 1.0, [deep]) == pytest.approx(1.0 + 2 * half_allreduce_s(deep, 4))
    assert strategy_step_s("allreduce", 1.0, [fast]) == pytest.approx(1.0 + 2 * half_allreduce_s(fast))


def test_without_a_spare_core_nothing_hides() -> None:
    g = Group(members=4, param_bytes=40 * MB, bandwidth=10 * MB, latency=0.01, fine_overlap=True)
    ar = 2 * half_allreduce_s(g)
    assert strategy_step_s("ring", 1.0, [g], every=50, spare_core=False) == pytest.approx(1.0 + ar / 50)
    assert strategy_step_s("dear", 1.0, [g], spare_core=False) == pytest.approx(1.0 + 2 * half_allreduce_s(g, 2))
    # gossip: two neighbours, each asked for its vector (a latency) before it comes (4 s and a latency)
    assert strategy_step_s("dsgd", 1.0, [g], topology="ring", spare_core=False) == pytest.approx(1.0 + 2 * 4.02)


def test_gossip_costs_one_message_per_neighbour_of_the_round() -> None:
    assert mean_degree("one-peer-exp", 8) == 1
    assert mean_degree("ring", 8) == 2
    assert mean_degree("exponential", 8) == 3
    assert mean_degree("complete", 8) == 7
    assert mean_degree("alternating-exp-ring", 8) == 1.5
    g = Group(members=8, param_bytes=10 * MB, bandwidth=10 * MB, latency=0.0)
    assert strategy_step_s("dadam", 0.5, [g], topology="ring") == pytest.approx(0.5 + (2.0 - 0.5))
    assert strategy_step_s("dsgd", 0.5, [g], topology="one-peer-exp", every=2) == pytest.approx(0.5 + 0.5 / 2)


def test_rounds_wait_for_the_slowest_member_of_those_they_need() -> None:
    # the expected largest of m standard normals (tabulated: 0.564, 1.029, 1.424; Blom is within 0.03)
    assert slowest_of(1) == 0.0
    assert [slowest_of(m) for m in (2, 4, 8)] == pytest.approx([0.564, 1.029, 1.424], abs=0.03)
    g = Group(members=4, param_bytes=40 * MB, bandwidth=10 * MB, latency=0.0, fine_overlap=True)
    sd = 0.1
    for strategy in ("dear", "allreduce"):  # every step waits for all 4
        plain = strategy_step_s(strategy, 1.0, [g], spare_core=False)
        assert strategy_step_s(strategy, 1.0, [g], spare_core=False, step_sd_s=sd) == pytest.approx(
            plain + sd * slowest_of(4))
    # a ring round every 4 steps: the members' lateness after 4 steps of compute, paid once per 4 steps
    plain = strategy_step_s("ring", 1.0, [g], every=4, spare_core=False)
    assert strategy_step_s("ring", 1.0, [g], every=4, spare_core=False, step_sd_s=sd) == pytest.approx(
        plain + sd * slowest_of(4) * 2 / 4)
    # gossip on one-peer-exp waits for itself and its one in-neighbour, on complete for all 4
    one_peer = strategy_step_s("dadam", 1.0, [g], topology="one-peer-exp", spare_core=False)
    assert strategy_step_s("dadam", 1.0, [g], topology="one-peer-exp", spare_core=False, step_sd_s=sd) == (
        pytest.approx(one_peer + sd * slowest_of(2)))
    complete = strategy_step_s("dadam", 1.0, [g], topology="complete", spare_core=False)
    assert strategy_step_s("dadam", 1.0, [g], topology="complete", spare_core=False, step_sd_s=sd) == (
        pytest.approx(complete + sd * slowest_of(4)))
    assert strategy_step_s("none", 1.0, [g], step_sd_s=sd) == 1.0  # nobody waits for anybody


def test_auto_takes_the_fastest_and_the_more_synchronous_one_within_5_percent() -> None:
    assert pick({"dear": 1.03, "ring": 1.0, "dadam:ring": 0.99, "allreduce": 0.5}) == ("dear", "")
    assert pick({"dear": 2.0, "ring": 1.5, "dadam:one-peer-exp": 1.0, "allreduce": 0.5}) == ("dadam", "one-peer-exp")
    assert [s for s, _ in runtime.candidates("SGD")][:3] == ["dear", "ring", "dsgd"]


def node(name: str, bandwidth: float) -> NodeInfo:
    return NodeInfo(name, 1e10, 1 << 30, bandwidth, 1e-4, f"{name}:1")


@pytest.mark.parametrize("bandwidth,expected", [(1e9, ("dear", "")), (2e5, ("dadam", "one-peer-exp"))])
def test_auto_plans_dear_on_fast_links_and_gossip_on_slow_ones(bandwidth, expected) -> None:
    """An MLP of ~1 MB in 5 fusion groups on 4 nodes, one replica each: at 1 GB/s dear's all-reduce
    hides behind the compute but for one group's share (within 5% of a ring every 50 steps, so the
    exact average wins); at 200 KB/s it cannot, and one-peer gossip every 50 steps (one copy of the
    model per member per round, where a ring all-reduce moves 1.5) costs least."""
    costs = profile_blocks(build_model("mlp", {"hidden": 256, "depth": 4}), 256)
    training = TrainingSettings(steps=500, batch_size=256)
    plan = plan_job(costs, [node(f"n{i}", bandwidth) for i in range(4)], Placement(clusters=4), training=training,
                    averaging=AveragingSettings(strategy="auto", fusion_mb=0.25))
    table = plan.averaging.predicted_step_s
    assert (plan.averaging.strategy, plan.averaging.topology) == expected
    assert f"averaging: {expected[0]}" in plan.reason
    assert {"dear", "ring", "allreduce", "dadam:one-peer-exp", "dadam:complete"} <= table.keys()  # Adam: dadam
    assert min(table.values()) >= plan.averaging.compute_step_s > 0
    # the stages get the planner's pick, never "auto"
    spec = JobSpec.model_validate({"model": {"name": "mlp"}, "dataset": {"name": "digits"},
                                   "averaging": {"strategy": "auto"}})
    assert _averaging(spec, plan).strategy == expected[0]
    # gossip is paced where a segment takes longer on the link than a step's compute: the slow links
    slow = bandwidth < 1e6
    assert plan.averaging.paced == slow and _averaging(spec, plan).paced == slow
    forced = spec.model_copy(update={"averaging": spec.averaging.model_copy(update={"paced": not slow})})
    assert _averaging(forced, plan).paced == (not slow)  # the job's own choice stands


def test_a_stage_measures_the_spread_of_its_steps() -> None:
    """The straggler term's input: the standard deviation of single steps' wall times, steady state."""
    from ravnest.pipeline.stage_metrics import StageClock
    clock = StageClock(samples_per_step=1)
    clock.steps = [(float(t), 0.0) for t in (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10)]  # every step 1 s
    assert clock.steady_state()["steady_step_sd_s"] == pytest.approx(0.0)
    clock.steps = [(t, 0.0) for t in (0.0, 1.0, 2.0, 3.0, 5.0, 6.0, 8.0, 9.0, 11.0, 12.0, 14.0)]  # 1 s, 2 s, ...
    # steps 2..9 (20%-90%) took 1, 2, 1, 2, 1, 2, 1 s: mean 10/7, sd sqrt(12/49)
    assert clock.steady_state()["steady_step_sd_s"] == pytest.approx(12**0.5 / 7)
