"""The pipeline partitioner: exact DP against brute-force enumeration, memory limits, errors, speed."""
from __future__ import annotations

import dataclasses
import random
import time

import pytest

from ravnest.models import BlockCost, build_model, profile_blocks
from ravnest.partition import (STAGE_OVERHEAD_S, Load, NodeCapacity, Partition, PartitionError, brute_force_partition, partition,
                               stage_memory_bytes)

MB = 1 << 20


def block(flops: float, activation: int = MB, param_bytes: int = MB) -> BlockCost:
    return BlockCost(params=param_bytes // 4, param_bytes=param_bytes, flops=flops, activation_bytes=activation,
                     saved_bytes=activation)


def node(flops: float = 1e9, memory: int = 1 << 40, bandwidth: float = 1e9, latency: float = 0.0) -> NodeCapacity:
    return NodeCapacity(flops=flops, memory_bytes=memory, bandwidth_to_next=bandwidth, latency_to_next=latency)


def check_valid(result: Partition, costs: list[BlockCost], nodes: list[NodeCapacity], in_flight: int) -> None:
    assert result.ranges[0][0] == 0 and result.ranges[-1][1] == len(costs)
    assert all(a < b for a, b in result.ranges)
    assert all(r[1] == s[0] for r, s in zip(result.ranges, result.ranges[1:]))
    assert len(result.ranges) == len(result.stage_seconds) == len(result.stage_memory) <= len(nodes)
    for (a, b), capacity, memory in zip(result.ranges, nodes, result.stage_memory):
        assert memory == stage_memory_bytes(costs, a, b, Load(in_flight)) <= capacity.memory_bytes
    assert result.bottleneck_seconds == max(result.stage_seconds)


def test_stage_time_formula_by_hand() -> None:
    costs = [block(6e9, activation=100 * MB), block(3e9, activation=7 * MB), block(3e9)]
    nodes = [node(flops=2e9, bandwidth=100 * MB, latency=0.5), node(flops=1e9)]
    result = partition(costs, nodes)
    # each stage also costs STAGE_OVERHEAD_S (2 ms) per micro-batch:
    # the link's 0.5 s round trip is in neither stage's time (K in flight hide it: in_flight.in_flight_for)
    # [0,1): 3*6e9/2e9 = 9 s + 2*100MB/100MB/s + 2 messages = 11.004 s; [1,3): 3*6e9/1e9 = 18.002 s
    # [0,2): 3*9e9/2e9 = 13.5 s + 2*7/100 + 0.002 = 13.644 s; [2,3): 9.002 s  -> the better split
    assert result.ranges == [(0, 2), (2, 3)]
    assert result.stage_seconds == pytest.approx([13.644, 9.002])
    assert result.bottleneck_seconds == pytest.approx(13.644)


def test_stage_memory_formula() -> None:
    costs = [BlockCost(0, 10, 1.0, activation_bytes=3, saved_bytes=7), BlockCost(0, 20, 1.0, 5, saved_bytes=11),
             BlockCost(0, 40, 1.0, 2, saved_bytes=13)]
    adam_k2 = Load(in_flight=2)
    # not last, K = 2: params x (live + grad + 2 Adam + 2 versions) + K x saved + the largest block's
    # saved (backward workspace) + 3 queued outputs (SEND_QUEUE + 1) + (K + 2) queued inputs, and what the
    # links keep to send again after a break: 2 more outputs (RECEIVE_SLACK) and K + 2 gradients sent back
    assert stage_memory_bytes(costs, 0, 2, adam_k2) == 30 * 6 + 2 * 18 + 11 + 3 * 5 + 4 * 0 + 2 * 5 + 4 * 0
    # K = 1 needs no weight versions; SGD keeps no state
    assert stage_memory_bytes(costs, 1, 2, Load(in_flight=1, optimizer_state=0)) == \
        20 * 2 + 11 + 11 + 3 * 5 + 3 * 3 + 2 * 5 + 3 * 3
    # the last stage: no versions, one micro-batch's activations, the loss' logits twice, sends nothing
    assert stage_memory_bytes(costs, 2, 3, adam_k2) == 40 * 4 + 13 + 2 * 2 + 13 + 4 * 5 + 4 * 5
    # recompute keeps K inputs and one forward's activations; averaging rings add two copies
    assert stage_memory_bytes(costs, 1, 2, Load(2, 2.0, recompute=True, averaging_copies=2)) == \
        20 * 8 + (2 * 3 + 11) + 11 + 3 * 5 + 4 * 3 + 2 * 5 + 4 * 3
    # the split backward holds the gradients of the parameter owners' outputs from B to W, except on
    # stage 0, whose backward is not split (its input is data)
    split = [dataclasses.replace(c, owner_output_bytes=100 * (i + 1)) for i, c in enumerate(costs)]
    assert stage_memory_bytes(split, 1, 3, adam_k2) == stage_memory_bytes(costs, 1, 3, adam_k2) + 200 + 300
    assert stage_memory_bytes(split, 0, 2, adam_k2) == stage_memory_bytes(costs, 0, 2, adam_k2)
    # activation checkpointing keeps each block's input (block 0's: none) in place of its saved
    # activations, recomputes one block in the backward, and never splits it
    checkpointed = Load(in_flight=2, checkpoint_blocks=True)
    assert stage_memory_bytes(split, 0, 2, checkpointed) == 30 * 6 + 2 * (0 + 3) + 11 + 11 + 3 * 5 + 2 * 5
    assert stage_memory_bytes(split, 1, 3, checkpointed) == 60 * 4 + (3 + 5) + 2 * 2 + 13 + 13 + 4 * 3 + 4 * 3
    # bf16/fp16: each micro-batch in flight keeps autocast's 16-bit weights (the last stage: one)
    assert stage_memory_bytes(costs, 0, 2, Load(in_flight=2, cast_weights=0.5)) == \
        stage_memory_bytes(costs, 0, 2, adam_k2) + 2 * 30 // 2
    assert stage_memory_bytes(costs, 2, 3, Load(in_flight=2, cast_weights=0.5)) == \
        stage_memory_bytes(costs, 2, 3, adam_k2) + 40 // 2
    # and every stage costs a node its base, whatever its blocks
    assert stage_memory_bytes(costs, 0, 2, Load(in_flight=2, stage_base=1000)) == \
        stage_memory_bytes(costs, 0, 2, adam_k2) + 1000
    # the first stage alone holds the job's data feed (block 0's feed_bytes)
    fed = [dataclasses.replace(costs[0], feed_bytes=500), *costs[1:]]
    assert stage_memory_bytes(fed, 0, 2, adam_k2) == stage_memory_bytes(costs, 0, 2, adam_k2) + 500
    assert stage_memory_bytes(fed, 2, 3, adam_k2) == stage_memory_bytes(costs, 2, 3, adam_k2)


def test_a_first_stage_is_planned_with_what_its_feed_holds() -> None:
    from coordinator.service.core import costs_of
    from ravnest.data.datasets import DIGITS_RESIDENT_BYTES, FILE_FEED_BYTES
    from ravnest.spec import JobSpec
    spec = {"name": "j", "model": {"name": "mlp", "config": {"input_dim": 64, "hidden": 32, "depth": 2}},
            "dataset": {"name": "digits"}}
    assert costs_of(JobSpec.model_validate(spec))[0].feed_bytes == DIGITS_RESIDENT_BYTES
    spec["dataset"] = {"name": "text", "source": "corpus", "seq_len": 8}  # read from disk window by window
    spec["model"] = {"name": "gpt", "config": {"vocab_size": 128, "seq_len": 8, "d_model": 16, "n_layers": 1,
                                              "n_heads": 2}}
    costs = costs_of(JobSpec.model_validate(spec))
    assert costs[0].feed_bytes == FILE_FEED_BYTES and costs[1].feed_bytes == 0


def test_memory_forces_a_slower_split() -> None:
    costs = [block(1e9, activation=10, param_bytes=100) for _ in range(3)]
    fast, small = node(flops=1e10, memory=2000), node(flops=1e8, memory=2000)
    need_one = stage_memory_bytes(costs, 0, 1, Load(2))
    small.memory_bytes = need_one  # the slow node can hold one block only
    result = partition(costs, [fast, small])
    assert result.ranges == [(0, 2), (2, 3)]
    fast.memory_bytes = small.memory_bytes = need_one * 5 // 4  # enough in total, but not per stage
    with pytest.raises(PartitionError, match="no contiguous split of the 3 blocks fits"):
        partition(costs, [fast, small])
    ten = [block(1, activation=1, param_bytes=100) for _ in range(10)]
    whole, largest = stage_memory_bytes(ten, 0, 10, Load(2)), max(stage_memory_bytes(ten, i, i + 1, Load(2))
                                                                    for i in range(10))
    fast.memory_bytes = small.memory_bytes = whole // 2 - 1  # each block fits, all ten do not
    assert largest <= fast.memory_bytes
    offer = f"{(whole // 2 - 1) / 1024:.3g} KiB"
    with pytest.raises(PartitionError, match=rf"too little together: the whole model needs {whole / 1024:.3g} KiB on "
                                             rf"one node, its largest block \(block \d\) {largest} B, with 2 "
                                             rf"micro-batch\(es\) in flight; the 2 node\(s\) offer {offer}, {offer}"):
        partition(ten, [fast, small])


def test_a_block_larger_than_every_node() -> None:
    costs = [block(1, param_bytes=10 * MB), block(1)]
    with pytest.raises(PartitionError,
                       match=r"block 0 fits no node: .* block \(block 0\) 6\d MiB, .* offer 5 MiB, 5 MiB"):
        partition(costs, [node(memory=5 * MB), node(memory=5 * MB)])


def test_more_nodes_than_blocks_uses_the_first_ones() -> None:
    costs = [block(1e9), block(1e9)]
    result = partition(costs, [node() for _ in range(5)])
    assert result.ranges == [(0, 1), (1, 2)]


def test_prefix_of_nodes_when_links_are_slow() -> None:
    costs = [block(1e6, activation=1000 * MB) for _ in range(4)]
    nodes = [node(flops=1e9, bandwidth=1 * MB) for _ in range(3)]
    assert len(partition(costs, nodes).ranges) == 3
    alone = partition(costs, nodes, use_all_nodes=False)
    assert alone.ranges == [(0, 4)] and alone.stage_seconds == [pytest.approx(4 * 3e6 / 1e9 + STAGE_OVERHEAD_S)]


def test_in_flight_defaults_to_the_node_count() -> None:
    costs = [block(1, param_bytes=100, activation=10) for _ in range(4)]
    result = partition(costs, [node(), node(), node()])
    assert result.stage_memory == [stage_memory_bytes(costs, a, b, Load(3)) for a, b in result.ranges]
    explicit = partition(costs, [node(), node(), node()], load=Load(in_flight=1))
    assert explicit.stage_memory == [stage_memory_bytes(costs, a, b, Load(1)) for a, b in explicit.ranges]


@pytest.mark.parametrize("costs, nodes, message", [
    ([], [NodeCapacity(1, 1, 1)], "no blocks"),
    ([BlockCost(1, 4, 1.0, 4)], [], "no nodes"),
    ([BlockCost(1, 4, 1.0, 4)], [NodeCapacity(0, 1 << 30, 1)], "no compute"),
    ([BlockCost(1, 4, 1.0, 4)] * 2, [NodeCapacity(1, 1 << 30, 0), NodeCapacity(1, 1 << 30, 0)], "bandwidth"),
])
def test_invalid_inputs(costs: list[BlockCost], nodes: list[NodeCapacity], message: str) -> None:
    with pytest.raises(PartitionError, match=message):
        partition(costs, nodes)
    with pytest.raises(PartitionError, match="in_flight"):
        partition([BlockCost(1, 4, 1.0, 4)], [NodeCapacity(1, 1, 1)], load=Load(in_flight=0))


@pytest.mark.parametrize("use_all_nodes", [True, False])
def test_dp_matches_brute_force_on_random_cases(use_all_nodes: bool) -> None:
    rng = random.Random(1234)
    feasible = infeasible = 0
    for _ in range(300):
        costs = [BlockCost(params=p // 4, param_bytes=p, flops=rng.uniform(1e6, 1e9), activation_bytes=a)
                 for p, a in ((rng.randint(1, 100) * 1000, rng.randint(1, 100) * 1000)
                              for _ in range(rng.randint(1, 8)))]
        nodes = [NodeCapacity(flops=10 ** rng.uniform(8, 10), memory_bytes=rng.randint(1, 60) * 100_000,
                              bandwidth_to_next=10 ** rng.uniform(5, 8), latency_to_next=rng.uniform(0, 0.01))
                 for _ in range(rng.randint(1, 5))]
        in_flight = rng.choice([None, 1, 3])
        load = None if in_flight is None else Load(in_flight)
        try:
            expected = brute_force_partition(costs, nodes, load=load, use_all_nodes=use_all_nodes)
        except PartitionError:
            with pytest.raises(PartitionError):
                partition(costs, nodes, load=load, use_all_nodes=use_all_nodes)
            infeasible += 1
            continue
        result = partition(costs, nodes, load=load, use_all_nodes=use_all_nodes)
        assert result.bottleneck_seconds == pytest.approx(expected.bottleneck_seconds, rel=1e-9)
        used = min(len(nodes), len(costs))
        check_valid(result, costs, nodes, used if in_flight is None else in_flight)
        if use_all_nodes:
            assert len(result.ranges) == used
        feasible += 1
    assert feasible > 100 and infeasible > 20  # both branches were really exercised


def test_real_profile_48_blocks_over_16_nodes_in_milliseconds() -> None:
    embedding, layer, head = profile_blocks(build_model("gpt", {"n_layers": 1, "d_model": 64, "seq_len": 32}), 4)
    costs = [embedding, *[layer] * 46, head]  # a 46-layer gpt: every transformer block costs the same
    rng = random.Random(7)
    nodes = [node(flops=10 ** rng.uniform(9, 11), memory=1 << 30, bandwidth=10 ** rng.uniform(6, 8),
                  latency=0.001) for _ in range(16)]
    start = time.perf_counter()
    result = partition(costs, nodes)
    elapsed = time.perf_counter() - start
    check_valid(result, costs, nodes, 16)
    assert len(result.ranges) == 16
    assert elapsed < 0.5, f"partition took {elapsed:.3f} s"
    assert partition(costs, nodes, use_all_nodes=False).bottleneck_seconds <= result.bottleneck_seconds
