"""Planning: chain order, block ranges per cluster, caps and replicas, rings, and scale."""
from __future__ import annotations

import dataclasses
import math
import re
import time

import pytest

from bench.planner import synthetic_nodes
from coordinator.clustering import NodeInfo
from coordinator.planning import PlanningError, chain_order, coded_bytes, plan_job
from ravnest.models import build_model, profile_blocks
from ravnest.models.profile import BlockCost
from ravnest.partition import NodeCapacity, PartitionError, partition, stage_memory_bytes
from ravnest.pipeline.memory import training_load
from ravnest.spec import AveragingSettings, OptimizerRef, Placement, TrainingSettings

GIB = 1 << 30


def mlp_costs(depth: int = 10) -> list[BlockCost]:
    return profile_blocks(build_model("mlp", {"depth": depth}), 32)


def node(name: str, flops: float = 1e10, memory: int = GIB, bandwidth: float = 1e8) -> NodeInfo:
    return NodeInfo(name, flops, memory, bandwidth, 0.001, f"{name}:1")


def covers(ranges: list[tuple[int, int]], blocks: int) -> bool:
    return ranges[0][0] == 0 and ranges[-1][1] == blocks and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_two_clusters_cover_the_model_and_rings_join_them() -> None:
    costs = mlp_costs()
    nodes = [node(f"n{i}") for i in range(4)]
    plan = plan_job(costs, nodes, Placement(clusters=2, min_nodes=4, stages_per_cluster=2))
    assert len(plan.clusters) == 2
    assert {s.node_id for c in plan.clusters for s in c.stages} == {n.node_id for n in nodes}
    for cluster in plan.clusters:
        assert covers([s.blocks for s in cluster.stages], len(costs))
        assert cluster.predicted_bottleneck_seconds == max(s.predicted_seconds for s in cluster.stages) > 0
    assert covers([r.blocks for r in plan.rings], len(costs))
    for ring in plan.rings:
        for c, (stage, member) in enumerate(zip(ring.stages, ring.members)):
            held = plan.clusters[c].stages[stage]
            assert held.node_id == member and held.blocks[0] <= ring.blocks[0] and ring.blocks[1] <= held.blocks[1]


def test_chain_puts_the_slowest_link_last() -> None:
    nodes = [node("slow", bandwidth=1e6), node("fast", bandwidth=1e9), node("mid", bandwidth=1e8)]
    assert [n.node_id for n in chain_order(nodes)] == ["fast", "mid", "slow"]


def test_measured_peer_links_replace_the_estimate_from_coordinator_links() -> None:
    costs = mlp_costs()
    a, b = node("a", bandwidth=1e9), node("b", bandwidth=1e9)
    placement = Placement(clusters=1, stages_per_cluster=2)
    estimated = plan_job(costs, [a, b], placement).clusters[0]
    # both ends have fast links to the coordinator, but measured each other at 100 kB/s (either direction)
    for links in ({("a", "b"): (1e5, 0.05)}, {("b", "a"): (1e5, 0.05)}):
        measured = plan_job(costs, [a, b], placement, links=links).clusters[0]
        assert measured.stages[0].predicted_seconds > 10 * estimated.stages[0].predicted_seconds
    # a measured link faster than the estimate is believed too; the slower direction counts
    fast = plan_job(costs, [node("a", bandwidth=1e5), node("b", bandwidth=1e5)], placement,
                    links={("a", "b"): (1e9, 0.001), ("b", "a"): (5e8, 0.002)}).clusters[0]
    slow = plan_job(costs, [node("a", bandwidth=1e5), node("b", bandwidth=1e5)], placement).clusters[0]
    assert fast.predicted_bottleneck_seconds < slow.predicted_bottleneck_seconds


def test_faster_nodes_get_more_blocks() -> None:
    costs = profile_blocks(build_model("mlp", {"depth": 10, "hidden": 1024}), 32)  # compute-bound
    plan = plan_job(costs, [node("big", flops=1e12), node("small", flops=1e10)],
                    Placement(clusters=1, stages_per_cluster=2))
    sizes = {s.node_id: s.blocks[1] - s.blocks[0] for s in plan.clusters[0].stages}
    assert sizes["big"] > sizes["small"]


def test_stages_per_cluster_caps_the_pipeline() -> None:
    plan = plan_job(mlp_costs(), [node(f"n{i}") for i in range(6)], Placement(clusters=1, stages_per_cluster=3))
    assert len(plan.clusters[0].stages) == 3 and len(plan.unused) == 3


def test_a_big_group_becomes_several_replicas_with_the_same_cuts() -> None:
    costs = mlp_costs()  # 12 blocks
    nodes = [node(f"n{i:02d}") for i in range(42)]
    plan = plan_job(costs, nodes, Placement(stages_per_cluster=4))
    assert len(plan.clusters) == 10 and all(len(c.stages) == 4 for c in plan.clusters)
    assert len({tuple(s.blocks for s in c.stages) for c in plan.clusters}) == 1
    assert len(plan.unused) == 2 and all("spare" in reason for reason in plan.unused.values())
    assert len(plan.rings) == 4 and all(len(r.members) == 10 for r in plan.rings)


def test_nodes_too_small_for_any_block_are_left_out_with_a_reason() -> None:
    costs = mlp_costs()
    plan = plan_job(costs, [node("ok"), node("tiny", memory=100)], Placement())
    assert "smallest block" in plan.unused["tiny"]
    assert [s.node_id for s in plan.clusters[0].stages] == ["ok"]
    with pytest.raises(PlanningError, match="no node can hold"):
        plan_job(costs, [node("tiny", memory=100)], Placement())


def test_ten_thousand_nodes_for_a_48_block_model_plan_fast() -> None:
    costs = [BlockCost(params=10**6, param_bytes=4 * 10**6, flops=2e9, activation_bytes=2**20) for _ in range(48)]
    nodes = synthetic_nodes(10_000)
    start = time.perf_counter()  # acid: replicas never wait for each other, so every tier is worth using
    plan = plan_job(costs, nodes, Placement(), training=TrainingSettings(batch_size=8),
                    averaging=AveragingSettings(strategy="acid"))
    elapsed = time.perf_counter() - start
    placed = sum(len(c.stages) for c in plan.clusters)
    assert placed + len(plan.unused) == 10_000 and placed > 9_900
    assert all(len(c.stages) <= 16 for c in plan.clusters)
    assert elapsed < 5.0  # about 0.3 s on an idle core (bench/planner.py); loose for a shared machine

    # with the ring the slowest cluster sets everyone's pace: the laptop tier (50-200x slower) stays out
    paced = plan_job(costs, nodes, Placement(), training=TrainingSettings(batch_size=8))
    laptops = {n.node_id for n in nodes if n.flops < 1e12}
    placed = {s.node_id for c in paced.clusters for s in c.stages}
    assert not placed & laptops and all("set the pace" in paced.unused[n] for n in laptops)
    assert "left out" in paced.reason


def test_ring_shares_are_balanced_against_the_members_bandwidth() -> None:
    from ravnest.averaging import ring_time_bound

    costs = mlp_costs()
    nodes = [node("fast1", bandwidth=1e9), node("fast2", flops=2e10, bandwidth=1e9), node("slow", bandwidth=1e7)]
    plan = plan_job(costs, nodes, Placement(clusters=3, min_nodes=3))
    bandwidth = {n.node_id: n.bandwidth for n in nodes}
    for ring in plan.rings:
        rates = [bandwidth[m] for m in ring.members]
        links = [min(a, b) for a, b in zip(rates, [*rates[1:], rates[0]])]
        assert ring.weights is not None and len(ring.weights) == 3
        # equal shares load each slow link with 4/3 of the segment; balanced ones with 1 of it
        assert ring_time_bound(1.0, ring.weights, links) == pytest.approx(1 / 1e7, rel=1e-3)
        assert ring_time_bound(1.0, [1.0] * 3, links) == pytest.approx(4 / 3 / 1e7, rel=1e-3)
    equal = plan_job(costs, [node(f"n{i}", flops=1e10 * (i + 1)) for i in range(3)], Placement(clusters=3, min_nodes=3))
    assert all(ring.weights is None for ring in equal.rings)  # equal links: equal shares


def test_a_small_model_goes_data_parallel_and_says_why() -> None:
    plan = plan_job(mlp_costs(), [node(f"n{i}") for i in range(4)], Placement())
    assert [len(c.stages) for c in plan.clusters] == [1, 1, 1, 1]
    assert plan.reason.startswith("4 clusters x 1 stage, predicted")
    assert "2 pipelines of 2 stages" in plan.reason  # a deeper alternative was considered and lost
    one = plan_job(mlp_costs(), [node(f"n{i}") for i in range(4)], Placement(clusters=1))
    assert len(one.clusters) == 1 and len(one.clusters[0].stages) == 1 and len(one.unused) == 3


def test_a_big_model_gets_as_many_stages_as_its_memory_needs() -> None:
    costs = profile_blocks(build_model("gpt", {"d_model": 256, "n_layers": 8}), 8)
    training = TrainingSettings(batch_size=8, optimizer=OptimizerRef(name="SGD", kwargs={"lr": 0.1}),
                                microbatches_in_flight=1)
    load = training_load(training, 1)
    split = sum(c.owner_output_bytes for c in costs)  # what the stages after the first add for the split backward
    offer = int(stage_memory_bytes(costs, 0, len(costs), load) + load.heap_slack * split) * 2 // 5  # >= 3 stages
    nodes = [node(f"n{i}", memory=offer) for i in range(4)]
    plan = plan_job(costs, nodes, Placement(), training=training)
    assert len(plan.clusters) == 1 and len(plan.clusters[0].stages) in (3, 4)
    assert "2 pipelines of 2 stages: does not fit" in plan.reason
    for stage in plan.clusters[0].stages:
        assert 0 < stage.predicted_memory_bytes <= offer
    assert [s.input_shape for s in plan.clusters[0].stages][1] == [8, 64, 256]
    with pytest.raises(PlanningError, match=r"all 1 nodes together have \d+ MiB of memory; the model needs \d+ MiB"):
        plan_job(costs, nodes[:1], Placement(), training=training)


def test_max_nodes_caps_the_nodes_used() -> None:
    plan = plan_job(mlp_costs(), [node(f"n{i}", flops=1e10 * (i + 1)) for i in range(5)], Placement(max_nodes=2))
    used = {s.node_id for c in plan.clusters for s in c.stages}
    assert used == {"n4", "n3"}  # the fastest
    assert sum("max_nodes" in why for why in plan.unused.values()) == 3


def test_where_the_split_backward_does_not_fit_the_plan_runs_the_plain_backward() -> None:
    """The zero-bubble split holds the gradients of the parameter owners' outputs from B to W; on
    nodes too small for that, the planner keeps the pipeline and drops the split, and says so."""
    costs = profile_blocks(build_model("gpt", {"d_model": 256, "n_layers": 8}), 8)
    training = TrainingSettings(batch_size=8, optimizer=OptimizerRef(name="SGD", kwargs={"lr": 0.1}),
                                microbatches_in_flight=1)
    split = training_load(training, 4)
    plain = dataclasses.replace(split, split_backward=False)

    def fits(offer: int, load) -> bool:
        try:
            partition(costs, [NodeCapacity(1e10, offer, 1e8)] * 4, load=load)
            return True
        except PartitionError:
            return False

    low, high = 1, 1 << 34  # the smallest offer on which 4 stages fit without the split
    while high - low > 1:
        low, high = (low, (low + high) // 2) if fits((low + high) // 2, plain) else ((low + high) // 2, high)
    assert not fits(high, split), "this model's split must need more memory than its plain backward"
    plan = plan_job(costs, [node(f"n{i}", memory=high) for i in range(4)], Placement(stages_per_cluster=4),
                    training=training)
    stages = plan.clusters[0].stages
    assert len(stages) == 4 and not any(s.split_backward for s in stages)
    assert all(s.predicted_memory_bytes <= high for s in stages)
    assert "backward not split, to fit memory" in plan.reason
    roomy = plan_job(costs, [node(f"n{i}", memory=2 * high) for i in range(4)], Placement(stages_per_cluster=4),
                     training=training)
    assert all(s.split_backward for s in roomy.clusters[0].stages)


def test_rings_are_ordered_for_their_widest_slowest_measured_link() -> None:
    """Six replicas from two sites that joined alternately: within a site links are fast, across slow.
    The plan's ring visits each site's members in a row (two slow links, not six), and its shares
    are balanced over the links of that order."""
    nodes = [node(f"{'ab'[i % 2]}{i}") for i in range(6)]
    links = {(x.node_id, y.node_id): ((1e9 if x.node_id[0] == y.node_id[0] else 5e7), 0.001)
             for x in nodes for y in nodes if x is not y}
    plan = plan_job(mlp_costs(), nodes, Placement(clusters=6, min_nodes=6), links=links)
    [ring] = plan.rings
    members = [ring.members[c] for c in (ring.order or range(6))]
    crossings = sum(a[0] != b[0] for a, b in zip(members, [*members[1:], members[0]]))
    by_cluster = [plan.clusters[c].stages[0].node_id for c in range(6)]
    joined_order = sum(a[0] != b[0] for a, b in zip(by_cluster, [*by_cluster[1:], by_cluster[0]]))
    assert crossings == 2 < joined_order, (members, by_cluster)
    assert ring.members == by_cluster  # members stay indexed by cluster; `order` says how shares travel


def test_equal_parameter_cuts_minimise_the_largest_stage() -> None:
    import itertools
    from coordinator.equal_split import equal_parameter_cuts
    for params in ([5, 1, 1, 1, 5], [352, 18560, 32896, 1290], [1, 2, 3, 4, 5, 6, 7], [10]):
        for stages in range(1, len(params) + 1):
            ranges = equal_parameter_cuts(params, stages)
            assert len(ranges) == stages and covers(ranges, len(params)) and all(a < b for a, b in ranges)
            brute = min(max(sum(params[a:b]) for a, b in zip((0, *cuts), (*cuts, len(params))))
                        for cuts in itertools.combinations(range(1, len(params)), stages - 1))
            assert max(sum(params[a:b]) for a, b in ranges) == brute
    with pytest.raises(ValueError):
        equal_parameter_cuts([1, 2], 3)


def test_equal_split_clusters_by_memory_in_join_order_and_ignores_links() -> None:
    from coordinator.equal_split import plan_equal_split
    costs = mlp_costs()
    # join order interleaves three bandwidth tiers; memory is all the policy looks at
    joined = [node(f"n{i}", bandwidth=bw, memory=mem) for i, (bw, mem) in
              enumerate([(5e7, GIB), (1.25e7, GIB), (3e6, 2 * GIB), (3e6, GIB), (1.25e7, GIB), (5e7, GIB), (5e7, GIB)])]
    training, averaging = TrainingSettings(), AveragingSettings(strategy="ring")
    plan = plan_equal_split(costs, joined, Placement(stages_per_cluster=2), training=training, averaging=averaging)
    # by memory (n2 first), ties in join order, dealt round-robin into 3 clusters; n6 left over
    chains = [[s.node_id for s in c.stages] for c in plan.clusters]
    assert chains == [["n2", "n3"], ["n0", "n4"], ["n1", "n5"]]
    assert list(plan.unused) == ["n6"] and "equal-split" in plan.reason
    params = [sum(c.params for c in costs[a:b]) for a, b in (s.blocks for s in plan.clusters[0].stages)]
    assert max(params) / min(params) < 1.3  # about equal parameters, whatever the compute or links
    assert all(r.order is None and r.weights is None for r in plan.rings)
    # the measured planner keeps the tiers apart instead
    measured = plan_job(costs, joined, Placement(clusters=3, stages_per_cluster=2), training=training,
                        averaging=averaging)
    tiers = {n.node_id: n.bandwidth for n in joined}
    assert all(len({tiers[s.node_id] for s in c.stages}) == 1 for c in measured.clusters)
    with pytest.raises(PlanningError, match="equal-split"):
        plan_equal_split(costs, joined[:3], Placement(clusters=2, stages_per_cluster=2), training=training,
                         averaging=averaging)


def test_a_group_smaller_than_the_stages_asked_for_joins_another() -> None:
    """Seen in CI: four loopback nodes, one of which measured half the others' bandwidth, made a group
    of one; with 2 stages per cluster asked for it ran alone as a whole model, and the laggard rule
    then left the other three out as slower. A group too small for the asked stages merges instead."""
    costs = profile_blocks(build_model("cnn", {"channels": [32, 64]}), 32)
    nodes = [NodeInfo(f"n{i}", flops * 1e9, 17 * GIB, bandwidth * 1e6, 0.0005, f"n{i}:1")
             for i, (flops, bandwidth) in enumerate([(100.2, 396), (97.1, 328), (92.2, 374), (99.8, 161)])]
    plan = plan_job(costs, nodes, Placement(stages_per_cluster=2))
    assert not plan.unused and all(len(c.stages) == 2 for c in plan.clusters), plan.reason


def test_a_lone_node_without_averaging_of_its_own_does_not_leave_the_others_out() -> None:
    """Seen in CI: k-means put one of four alike loopback nodes (it measured 359 MB/s, the others
    119-171) in a group of its own; that group averages with nobody, so its rate with averaging
    looked 9x the others' and the laggard rule kept it alone. Groups are compared before averaging."""
    costs = mlp_costs(4)
    nodes = [NodeInfo(f"n{i}", flops * 1e9, 17 * GIB, bandwidth * 1e6, 0.0005, f"n{i}:1")
             for i, (flops, bandwidth) in enumerate([(97.0, 119), (92.3, 168), (91.6, 171), (97.2, 359)])]
    plan = plan_job(costs, nodes, Placement(), averaging=AveragingSettings(strategy="ring", every=1))
    assert not plan.unused and len(plan.clusters) == 4, plan.reason


def test_the_planner_prices_the_averaging_codec() -> None:
    """What a round moves under each codec, in the float32 ring's terms: a quarter with int8; topk's
    all-gathered 1.56% as n / 2 ring rounds of it; and on 1 MB/s links the plan's predicted step of a
    ring round follows."""
    assert coded_bytes(4e6, "", 4) == 4e6 and coded_bytes(4e6, "int8", 4) == 1e6
    assert coded_bytes(4e6, "topk", 4) == math.ceil(1e6 / 4096) * 144 * 4 / 2
    costs = mlp_costs()
    nodes = [node(f"n{i}", bandwidth=1e6) for i in range(4)]
    placement = Placement(clusters=4, min_nodes=4, stages_per_cluster=1)
    step = {codec: plan_job(costs, nodes, placement, averaging=AveragingSettings.model_validate(
        {"strategy": "ring", "every": 1, "codec": codec})).averaging.predicted_step_s["ring"]
        for codec in ("", "fp16", "int8")}
    assert step[""] > 1.9 * step["fp16"] > 3.6 * step["int8"]  # link-bound: the bytes set the pace


def test_the_plan_says_a_line_said_of_several_groups_once() -> None:
    plan = plan_job(mlp_costs(), [node(f"n{i}") for i in range(4)],
                    Placement(clusters=4, min_nodes=4, stages_per_cluster=1))
    assert plan.reason.count("1 node as 1 pipeline of 1 stage") == 1, plan.reason
    assert "; clusters 0-3: 4 groups, each 1 node as 1 pipeline of 1 stage: " in plan.reason


def test_the_plan_names_the_clusters_each_group_became() -> None:
    """Before: '2 nodes as 1 pipeline of 2 stages: 5,333 samples/s; 2 nodes as 1 pipeline of 2 stages:
    1,959 samples/s', with nothing saying which cluster was which."""
    nodes = [node("a"), node("b"), node("c", bandwidth=1e6), node("d", bandwidth=1e6)]
    plan = plan_job(mlp_costs(), nodes, Placement(clusters=2, min_nodes=4, stages_per_cluster=2))
    rates = {}
    for c in plan.clusters:
        said = re.search(rf"cluster {c.cluster}: 2 nodes as 1 pipeline of 2 stages: ([\d,]+) samples/s", plan.reason)
        assert said, plan.reason
        rates[frozenset(s.node_id for s in c.stages)] = float(said[1].replace(",", ""))
    assert rates[frozenset("ab")] > 2 * rates[frozenset("cd")], plan.reason
    assert plan.reason.count("per cluster, as the job asks") == 1


@pytest.mark.parametrize("slow, lossiest, picked, limited", [
    (2e6, "q4", "q8", False),     # bf16 would take 0.65x of its stages' compute, q8 0.33x: under the 0.5x share
    (6e5, "q4", "q4", True),      # q4 0.57x, q4g3 0.5x: but q4g3 is lossier than the model may take
    (6.2e5, "q4g3", "q4g3", False),  # q4 0.55x, q4g3 0.49x: a model that may take q4g3 gets it
    (2e6, "bf16", "bf16", True),  # a model measured for nothing lossier: bf16, though it does not fit
    (2e8, "q4", "bf16", False),   # a link that float32 would hold up, bf16 not: only that far
])
def test_auto_compresses_only_the_links_that_would_hold_their_stages_up_and_only_as_far_as_needed(
        slow: float, lossiest: str, picked: str, limited: bool) -> None:
    """codec "auto": a chain of fast links but one slow one gets the least lossy codec that brings the
    slow link under its share of compute, on that link alone, none lossier than the model may take; the
    plan says which and why, and each link's bytes per step."""
    costs = profile_blocks(build_model("llama", {"vocab_size": 256, "hidden_size": 256, "num_hidden_layers": 4}), 8)
    fast = 1e9  # bytes/s: a LAN; the slow link: a home uplink
    nodes = [node(f"n{i}", flops=2e10 if slow < 1e8 else 2e12, bandwidth=fast) for i in range(3)]
    links = {("n0", "n1"): (fast, 0.001), ("n1", "n2"): (slow, 0.02), ("n0", "n2"): (fast, 0.001)}
    placement = Placement(clusters=1, min_nodes=3, stages_per_cluster=3)
    plans = {codec: plan_job(costs, nodes, placement, links=links, lossiest=lossiest,
                             training=TrainingSettings(batch_size=8, codec=codec)) for codec in ("", "auto")}
    stages = {codec: plan.clusters[0].stages for codec, plan in plans.items()}
    order = [s.node_id for s in stages["auto"]]
    slow_link = next(i for i in range(2) if {order[i], order[i + 1]} == {"n1", "n2"})
    assert [s.codec for s in stages[""]] == ["", "", None]
    assert [s.codec for s in stages["auto"]] == [(picked if i == slow_link else "") for i in range(2)] + [None]
    full, auto = (stages[c][slow_link].predicted_link_bytes_per_step for c in ("", "auto"))
    ratio = {"bf16": 2, "q8": 4 / (1 + 2 / 64), "q4": 4 / (0.5 + 2 / 64), "q4g3": 4 / (7 / 16 + 2 / 64)}[picked]
    assert full is not None and auto is not None and full == pytest.approx(ratio * auto, rel=1e-3)
    said = f"link {slow_link}->{slow_link + 1} sends {picked}: its transfer would take "
    assert said in plans["auto"].reason and ("lossiest codec measured" in plans["auto"].reason) == limited
    assert plans["auto"].reason.count("link ") == 1  # a link left as it is is not mentioned
    if slow < 1e8:
        faster = plans["auto"].clusters[0].predicted_bottleneck_seconds
        assert faster < 0.9 * plans[""].clusters[0].predicted_bottleneck_seconds  # the slow link bounds the pace


def test_the_lossiest_codec_auto_may_pick_is_what_was_measured_for_the_model() -> None:
    """A rule in code, not a sentence in the docs: the models bench.codec_cost measured within the bound
    get what it measured within the bound, any other model bf16."""
    from coordinator.codec_choice import MEASURED_WITHIN_BOUND, lossiest_codec

    assert lossiest_codec(build_model("gpt", {})) == "q3"
    assert lossiest_codec(build_model("llama", {})) == "q4g3"  # q3 both ways cost a fine-tuned one 2.9%
    assert lossiest_codec(build_model("cnn", {})) == "bf16"
    # a subspace model's token ids cross its cuts: exact in bf16, not in a blockwise codec
    assert lossiest_codec(build_model("llama", {"residual_rank": 12})) == "bf16"
    assert set(MEASURED_WITHIN_BOUND.values()) <= {"bf16", "q8", "q4", "q4g3", "q3"}


def test_averaging_codec_auto_compresses_only_as_far_as_the_links_need() -> None:
    """averaging.codec "auto": raw on fast links; on slow ones int8 where that keeps up with training,
    else topk for a strategy that averages changes (diloco); a ring of weights never gets topk."""
    costs = mlp_costs()
    placement = Placement(clusters=4, min_nodes=4, stages_per_cluster=1)

    def picked(bandwidth: float, strategy: str) -> str:
        nodes = [node(f"n{i}", bandwidth=bandwidth) for i in range(4)]
        plan = plan_job(costs, nodes, placement, averaging=AveragingSettings.model_validate(
            {"strategy": strategy, "every": 1, "codec": "auto"}))
        assert plan.averaging is not None
        assert plan.reason.endswith(f"; averaging sends {plan.averaging.codec or 'float32'} (codec auto)")
        return plan.averaging.codec

    assert picked(1e10, "ring") == "" and picked(1e10, "diloco") == ""
    assert picked(3e5, "ring") == "int8"  # a quarter of the bytes is enough here...
    assert picked(3e3, "diloco") == "topk"  # ...and here only 1.56% of them keeps up
    assert picked(3e3, "ring") == "int8"  # weights are never delayed: the most a ring gets


def test_the_plan_says_where_a_cluster_has_fewer_stages_than_the_job_asks() -> None:
    """Three nodes for 2 clusters x 2 stages (a re-plan after a loss): the reason does not claim 2 each."""
    plan = plan_job(mlp_costs(), [node(f"n{i}") for i in range(3)],
                    Placement(clusters=2, min_nodes=3, stages_per_cluster=2))
    assert sorted(len(c.stages) for c in plan.clusters) == [1, 2]
    assert plan.reason.endswith("2 stages per cluster, as the job asks, 1 where a cluster has fewer nodes")


def test_relay_code_is_counted_on_the_nodes_it_runs_on() -> None:
    """A hidden node's tunnels, and the relay for its peers of a node sent to hidden ones, hold buffers
    beside the stage: the prediction counts them there, and a stage fits only what is left of the offer."""
    from coordinator.relay_memory import RELAYING_BYTES
    costs, one = mlp_costs(2), Placement(clusters=1, stages_per_cluster=1)
    need = plan_job(costs, [node("plain")], one).clusters[0].stages[0].predicted_memory_bytes
    hidden = dataclasses.replace(node("hidden", memory=need + RELAYING_BYTES), hidden=True)
    assert plan_job(costs, [hidden], one).clusters[0].stages[0].predicted_memory_bytes == need + RELAYING_BYTES
    with pytest.raises(PlanningError, match="the model needs"):  # its stage fits, but not beside relay code
        plan_job(costs, [dataclasses.replace(hidden, memory_bytes=need + RELAYING_BYTES - 1)], one)
    two = Placement(clusters=1, stages_per_cluster=2)
    plain = {s.node_id: s.predicted_memory_bytes for s in plan_job(costs, [node("shown"), node("hidden")], two)
             .clusters[0].stages}
    for peer_relay, extra in ((True, RELAYING_BYTES), (False, 0)):  # sent to hidden through its relay for peers
        shown = dataclasses.replace(node("shown"), peer_relay=peer_relay)
        planned = {s.node_id: s.predicted_memory_bytes for s in plan_job(
            costs, [shown, dataclasses.replace(node("hidden"), hidden=True)], two).clusters[0].stages}
        assert planned == {"shown": plain["shown"] + extra, "hidden": plain["hidden"] + RELAYING_BYTES}


def test_a_robust_jobs_pipelines_are_cut_alike_for_audits_and_on_2_clusters_it_says_what_it_lacks() -> None:
    """Three groups of unequal pairs cut where each pair is balanced; under averaging.robust, one cut over
    the weakest of all, since audits compare a stage only with stages of other clusters that start at
    the same block (ravnest/pipeline/audits.py). On 2 clusters the plan says what a robust job lacks there."""
    pairs = [(1e7, (4e10, 1e10)), (1e8, (1e10, 1e10)), (1e9, (2e10, 1e10))]
    nodes = [node(f"p{i}{j}", flops=f, bandwidth=b) for i, (b, pair) in enumerate(pairs) for j, f in enumerate(pair)]
    cuts = {}
    for robust in ("", "centered_clip"):
        plan = plan_job(mlp_costs(12), nodes, Placement(clusters=3, stages_per_cluster=2),
                        averaging=AveragingSettings(robust=robust))
        cuts[robust] = {tuple(s.blocks for s in c.stages) for c in plan.clusters}
        assert ("3 pipelines of 2 stages cut alike" in plan.reason) == bool(robust), plan.reason
    assert len(cuts[""]) > 1 and len(cuts["centered_clip"]) == 1, cuts
    two = plan_job(mlp_costs(12), nodes[:4], Placement(clusters=2, stages_per_cluster=2),
                   averaging=AveragingSettings(robust="centered_clip"))
    assert "of fewer than 3 replicas robust averaging cannot tell which one lies" in two.reason, two.reason
    mixed = plan_job(mlp_costs(12), nodes[:5], Placement(clusters=3, stages_per_cluster=2),
                     averaging=AveragingSettings(robust="centered_clip"))  # a pair lost a node: depths 2, 2 and 1
    assert sorted(len(c.stages) for c in mixed.clusters) == [1, 2, 2], mixed.reason
    assert "2 pipelines of 2 stages, where audits compare 3 or more of one depth: their stages are not audited" \
        in mixed.reason, mixed.reason


def test_a_long_round_trip_is_covered_by_whole_batches_in_flight_where_a_step_has_them() -> None:
    """A 100 ms link between two stages of ~5 ms: with accumulation 64 the planner keeps enough whole
    batches in flight that the link costs the pipeline nothing; with accumulation 1 it keeps K = 2 (more
    parts would shorten each micro-batch, not the link: the step's samples cross it once either way) and
    the plan says what would hide it; where memory cannot hold what the link needs, K stops there."""
    costs, placement = mlp_costs(), Placement(clusters=1, stages_per_cluster=2)
    nodes = [node("a"), node("b")]

    def planned(accumulation: int, round_trip: float, memory: int = GIB):
        chain = [dataclasses.replace(n, memory_bytes=memory) for n in nodes]
        return plan_job(costs, chain, placement, training=TrainingSettings(accumulation=accumulation),
                        links={("a", "b"): (1e8, round_trip)})

    near, far = planned(64, 0.0), planned(64, 0.1)
    cluster = far.clusters[0]
    assert [s.round_trip_seconds for s in cluster.stages] == [0.1, None] and near.clusters[0].in_flight == 2
    cycle = sum(s.predicted_seconds for s in cluster.stages) + 0.1
    assert cluster.in_flight == math.ceil(2 * cycle / cluster.predicted_bottleneck_seconds)
    assert far.predicted_samples_per_s == pytest.approx(near.predicted_samples_per_s)
    assert f"{cluster.in_flight} micro-batches in flight for the links' 100 ms round trips" in far.reason

    one_near, one_far = planned(1, 0.0), planned(1, 0.1)
    assert one_far.clusters[0].in_flight == 2
    assert one_far.predicted_samples_per_s < 0.2 * one_near.predicted_samples_per_s  # the link paces it
    assert f"need {cluster.in_flight} micro-batches in flight" in one_far.reason
    assert f"accumulation {cluster.in_flight} would hide them" in one_far.reason

    # memory for 6 whole batches in flight on each stage, not for what the link needs
    load = dataclasses.replace(training_load(TrainingSettings(accumulation=64), 2, in_flight=6),
                               split_backward=True)
    ranges = [s.blocks for s in cluster.stages]
    held = max(stage_memory_bytes(costs, a, b, load) for a, b in ranges)
    tight = planned(64, 0.1, memory=held)
    assert [s.blocks for s in tight.clusters[0].stages] == ranges and tight.clusters[0].in_flight == 6
    assert "it keeps 6, as the weakest node's memory holds no more" in tight.reason


def test_three_link_tiers_stay_apart_when_a_busy_host_blurs_their_compute() -> None:
    """bench.testbed's six hosts (40, 10, 2.5, 2.5, 10, 40 Mbit/s) on one busy machine: compute measured
    2.5x apart between alike machines (a draw of a simulation in which 8 of 40 did this) left k-means no
    silhouette worth splitting on, and the one group was dealt into three pipelines that each held a slow
    host (predicted 865 samples/s). The planner weighs other groupings and takes the tiered one."""
    costs = profile_blocks(build_model("cnn", {"channels": [32, 64]}), 32)
    tiers = [40, 10, 2.5, 2.5, 10, 40]
    gflops = [51.6, 25.6, 59.9, 31.1, 64.1, 50.2]
    nodes = [NodeInfo(f"n{i}", g * 1e9, 17 * GIB, mbit * 1e6 / 8, 0.0005, f"h{i}:1")
             for i, (mbit, g) in enumerate(zip(tiers, gflops))]
    averaging = AveragingSettings(strategy="ring", every=10)
    plan = plan_job(costs, nodes, Placement(stages_per_cluster=2, min_nodes=6), averaging=averaging)
    tier = {n.node_id: n.bandwidth for n in nodes}
    assert all(len({tier[s.node_id] for s in c.stages}) == 1 for c in plan.clusters), plan.reason
    assert "grouped by k-means on bandwidth alone" in plan.reason and plan.predicted_samples_per_s > 2000
    # k-means' own grouping stands where nothing predicts better: alike nodes stay one group
    alike = plan_job(costs, [node(f"a{i}") for i in range(4)], Placement(), averaging=averaging)
    assert "grouped by" not in alike.reason
