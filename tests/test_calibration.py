"""A node's compute figure corrected by its stages' measured compute times (coordinator/calibration.py),
and measured again while idle."""
import re

import pytest

from coordinator.calibration import (
    BOUND, MESSAGE_S, blended, forget_slowdowns, measured, observed_message_s, observed_slowdown, planned, prior,
    remeasured)
from coordinator.store import NodeRow
from ravnest.models import build_model, profile_blocks
from ravnest.partition import NodeCapacity, compute_seconds, partition, stage_seconds
from scripts.local_cluster import LocalCluster
from tests.test_lying_volunteers import PROFILE, Liar

GPT = {"vocab_size": 64, "seq_len": 16, "d_model": 64, "n_layers": 8, "n_heads": 2}
BATCH = 8


def test_the_slowdown_follows_the_docstrings_worked_example() -> None:
    slowdown = observed_slowdown(3.0 * compute_seconds(1e9, NodeCapacity(1e10, 0, 1.0)), 1e9, 1e10)
    assert slowdown == pytest.approx(3.0)
    figures = [1.0]
    for _ in range(30):
        figures.append(blended(figures[-1], slowdown))
    assert [round(figures[i], 2) for i in (1, 10, 30)] == [1.12, 2.05, 2.86]
    assert blended(None, 2.5) == 2.5  # a node's first report sets it
    assert observed_slowdown(1e9, 1.0, 1e10) == BOUND and observed_slowdown(0.0, 1.0, 1e10) is None
    assert observed_slowdown(1e-9, 1.0, 1e10) == 1.0  # faster than its profile claims: its word, not believed
    assert prior([None, 3.0, 2.0, 5.0]) == 3.0 and prior([None]) == 1.0  # a newcomer: like the measured ones


def test_the_message_cost_follows_the_docstrings_worked_example() -> None:
    """The cost per message that makes the pipeline model give the pace measured, and the planner
    pricing it: a pipeline that measured 5 ms per message is predicted slower than at the default."""
    assert observed_message_s(0.010, [(0.003, 0.001), (0.004, None)], 2) == pytest.approx(0.003)
    # the round trip binds where K is 1: (3 + 1 + 4 + 2 m) / 1 = 10 ms gives m = 1 ms
    assert observed_message_s(0.010, [(0.003, 0.001), (0.004, None)], 1) == pytest.approx(0.001)
    # faster than the compute alone allows (a clock's noise): the floor, never a negative cost
    assert observed_message_s(0.001, [(0.003, 0.001), (0.004, None)], 2) == MESSAGE_S[0]
    assert observed_message_s(0.010, [(0.004, None)], 2) is None  # one stage sends nothing
    assert observed_message_s(0.0, [(0.003, 0.001), (0.004, None)], 2) is None
    assert prior([None], default=0.001) == 0.001 and prior([0.004, None, 0.002]) == 0.003
    costs = profile_blocks(build_model("gpt", GPT), BATCH)
    default, measured = NodeCapacity(1e10, 1 << 34, 1e12), NodeCapacity(1e10, 1 << 34, 1e12, message_s=0.005)
    assert stage_seconds(costs, measured, 0, 5) == pytest.approx(stage_seconds(costs, default, 0, 5) + 2 * 0.004)
    assert stage_seconds(costs, measured, 5, 10) == stage_seconds(costs, default, 5, 10)  # the last sends nothing


def test_a_job_is_planned_with_each_nodes_figures_on_its_model() -> None:
    """A node that computed a llama at 2x and a gpt at 4x its FLOPs' prediction is planned with 4 for a
    gpt; a node never measured on a gpt takes the gpt's median, one never measured at all the median of
    all; a job of a model no node ran, each node's overall figure. Message costs go the same way."""
    both, llama_only, fresh = NodeRow(id="a"), NodeRow(id="b"), NodeRow(id="c")
    measured(both, "llama", "slowdown", 2.0)
    measured(both, "gpt", "slowdown", 4.0)
    measured(both, "gpt", "message_s", 0.003)
    measured(llama_only, "llama", "slowdown", 3.0)
    assert both.by_model == {"llama": {"slowdown": 2.0}, "gpt": {"slowdown": 4.0, "message_s": 0.003}}
    assert both.slowdown == pytest.approx(2.0 ** 0.9 * 4.0 ** 0.1) and both.message_s == 0.003
    nodes = [both, llama_only, fresh]
    assert planned(nodes, "gpt", "slowdown", 1.0) == {"a": 4.0, "b": 4.0, "c": 4.0}
    assert planned(nodes, "llama", "slowdown", 1.0) == {"a": 2.0, "b": 3.0, "c": 2.5}
    overall = planned(nodes, "cnn", "slowdown", 1.0)
    assert overall["a"] == both.slowdown and overall["b"] == 3.0
    assert overall["c"] == pytest.approx((both.slowdown + 3) / 2)
    assert planned(nodes, "llama", "message_s", 0.001) == {"a": 0.003, "b": 0.003, "c": 0.003}
    assert planned([llama_only, fresh], "llama", "message_s", 0.001) == {"b": 0.001, "c": 0.001}
    both.profile = {"flops": 1e10}
    remeasured(both, 2e10)  # a figure twice as high: it still computes like it did, on each model
    assert both.by_model == {"llama": {"slowdown": 4.0}, "gpt": {"slowdown": 8.0, "message_s": 0.003}}
    forget_slowdowns(both)
    assert both.slowdown is None and both.by_model == {"llama": {}, "gpt": {"message_s": 0.003}}


def test_a_figure_measured_again_keeps_what_the_jobs_measured() -> None:
    """A node re-profiled while idle, or rejoining with its identity, keeps its effective FLOP/s where its
    jobs measured one; a node that never trained takes the new figure."""
    trained = NodeRow(profile={"flops": 1e10}, slowdown=4.0)
    remeasured(trained, 2e10)
    assert trained.profile["flops"] == 2e10 and trained.slowdown == 8.0  # still computes like 2.5 GFLOP/s
    remeasured(trained, 1e9)
    assert trained.slowdown == 1.0  # never below 1: 1 GFLOP/s it is
    fresh = NodeRow(profile={"flops": 1e10}, slowdown=None)
    remeasured(fresh, 3e10)
    assert fresh.profile["flops"] == 3e10 and fresh.slowdown is None


def test_a_slowed_node_gets_fewer_blocks_than_its_equal() -> None:
    costs = profile_blocks(build_model("gpt", GPT), BATCH)
    equal = partition(costs, [NodeCapacity(1e10, 1 << 34, 1e12)] * 2).ranges
    slowed = partition(costs, [NodeCapacity(1e10, 1 << 34, 1e12), NodeCapacity(1e10, 1 << 34, 1e12, slowdown=3.0)])
    blocks = [end - start for start, end in slowed.ranges]
    assert equal == [(0, 5), (5, 10)] and blocks[1] < blocks[0], slowed.ranges


@pytest.mark.slow
def test_a_node_whose_stages_compute_slower_than_its_profile_says_is_planned_slower(tmp_path) -> None:
    """Two nodes with the same profile take a 2-stage job; one's stage computes 4x slower than predicted.
    The coordinator records a slowdown of about 4 for it and about 1 for the other, and the next job
    gives it fewer blocks."""
    mlp = {"input_dim": 64, "hidden": 1024, "depth": 8}  # 10 blocks, 8 of them equal
    job = {"model": {"name": "mlp", "config": mlp}, "dataset": {"name": "digits"},
           "training": {"steps": 1000, "batch_size": BATCH, "eval_every": 0, "microbatches_in_flight": 1},
           "averaging": {"strategy": "none"}, "placement": {"clusters": 1, "stages_per_cluster": 2, "min_nodes": 2}}
    costs = profile_blocks(build_model("mlp", mlp), BATCH)  # K = 1: a micro-batch is the whole batch
    with LocalCluster(tmp_path, nodes=0) as cluster:
        nodes = [Liar(cluster, "steady"), Liar(cluster, "slowed")]
        job_id = cluster.submit(job)
        cluster.wait_for(lambda: all(n.beat()["assignment"] for n in nodes), 90, "both assignments")
        plan = {s["node_id"]: s for s in cluster.job(job_id)["plan"]["clusters"][0]["stages"]}
        assert [b[1] - b[0] for b in (plan[n.id]["blocks"] for n in nodes)] == [5, 5]
        for node, factor in zip(nodes, (1.0, 4.0)):
            start, end = plan[node.id]["blocks"]
            predicted = compute_seconds(sum(c.flops for c in costs[start:end]), NodeCapacity(PROFILE["flops"], 0, 1.0))
            for step in (25, 30):
                assert node.report(job_id, step, compute_s=factor * predicted).status_code == 204
        figures = {n["id"]: n["slowdown"] for n in cluster.http.get("/v1/nodes").json()}
        assert figures[nodes[0].id] == pytest.approx(1.0) and figures[nodes[1].id] == pytest.approx(4.0)
        # the pipeline keeps 30 ms per step more than its slowest stage: its messages cost that, less the
        # other stage's compute and the link's probed round trip (K = 1: a micro-batch goes the whole cycle
        # before the next)
        first, last = sorted(plan.values(), key=lambda s: s["stage"])
        link_s = first["predicted_seconds"] - first["predicted_compute_seconds"] \
            - 2 * first["predicted_message_seconds"]
        computed = {s["node_id"]: compute_seconds(sum(c.flops for c in costs[slice(*s["blocks"])]),
                                                  NodeCapacity(PROFILE["flops"], 0, 1.0)) * factor
                    for s, factor in ((plan[nodes[0].id], 1.0), (plan[nodes[1].id], 4.0))}
        c0, c1 = computed[first["node_id"]], computed[last["node_id"]]
        pace = max(c0 + link_s, c1) + 0.030  # K = 1, one micro-batch per step
        for node in nodes:
            assert node.report(job_id, 40, compute_s=computed[node.id], step_wall_s=pace).status_code == 204
        expected = observed_message_s(pace, [(c0, link_s), (c1, None)], 1, [first["round_trip_seconds"]])
        learned = {n["id"]: n["message_s"] for n in cluster.http.get("/v1/nodes").json()}
        assert expected > 0.002 and [learned[n.id] for n in nodes] == pytest.approx([expected] * 2)

        assert cluster.http.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
        for node in nodes:
            node.beat()  # it stopped: idle again
        second = cluster.submit(job)
        cluster.wait_for(lambda: all(n.beat()["assignment"] for n in nodes), 90, "the second job's assignments")
        plan = {s["node_id"]: s["blocks"] for s in cluster.job(second)["plan"]["clusters"][0]["stages"]}
        steady, slowed = (plan[n.id][1] - plan[n.id][0] for n in nodes)
        assert slowed < steady, plan


@pytest.mark.slow
def test_an_idle_node_measures_its_compute_again_and_the_coordinator_takes_the_figure(tmp_path) -> None:
    with LocalCluster(tmp_path, nodes=1, node_args=["--reprofile-every", "1"]) as cluster:
        log = tmp_path / "logs" / "node-0.log"
        cluster.wait_for(lambda: len(re.findall(r"measured ([\d.]+) GFLOP/s again", log.read_text())) >= 2, 60,
                         "two measurements while idle")
        again = float(re.findall(r"measured ([\d.]+) GFLOP/s again", log.read_text())[-1])
        cluster.wait_for(lambda: abs(cluster.alive_nodes()[0]["profile"]["flops"] / 1e9 - again) < 0.06, 30,
                         f"the coordinator to hold the last figure, {again} GFLOP/s")


def test_a_bandwidth_claim_stands_until_two_peers_measured_it_ten_times_lower() -> None:
    from coordinator.calibration import refuted_bandwidth
    assert refuted_bandwidth(1e10, {"a": 3.6e8, "b": 1.8e8}) == 3.6e8  # the docstring's worked example
    assert refuted_bandwidth(1e10, {"a": 3.6e8}) is None  # one peer's word: it may be the liar
    assert refuted_bandwidth(3e9, {"a": 3.6e8, "b": 1.8e8}) is None  # within 10x: a slow peer, not a lie
