"""Split a model's blocks into contiguous stages over a chain of unequal nodes.

A stage's time per micro-batch is its compute (forward + backward = 3x forward FLOPs, over the
node's FLOP/s) plus sending its boundary activation forward and the same-size gradient back over
the link to the next node. An asynchronous pipeline runs at the pace of its slowest stage, so the
partition minimises the maximum stage time, subject to every stage fitting its node's memory.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from ravnest.models.profile import BlockCost

ADAM_STATE_FACTOR = 4  # parameters + gradients + two Adam moments


@dataclass
class NodeCapacity:
    flops: float              # FLOP/s
    memory_bytes: int
    bandwidth_to_next: float  # bytes/s on the link to the next node in the chain (ignored for the last)
    latency_to_next: float = 0.0


@dataclass
class Partition:
    ranges: list[tuple[int, int]]  # half-open block ranges, one per used node, in chain order
    stage_seconds: list[float]
    bottleneck_seconds: float
    stage_memory: list[int] = field(default_factory=list)  # stage_memory_bytes of each stage


class PartitionError(ValueError):
    """No partition fits the nodes' memory, or the inputs are invalid."""


def stage_memory_bytes(costs: list[BlockCost], start: int, end: int, in_flight: int) -> int:
    """Memory to train blocks [start, end) with `in_flight` micro-batches outstanding.

    Weights, gradients and Adam state, one stashed weight version per in-flight micro-batch (so its
    backward uses the weights of its forward), and the stashed activations of each micro-batch.
    """
    return _memory(sum(c.param_bytes for c in costs[start:end]), sum(c.activation_bytes for c in costs[start:end]),
                   in_flight)


def stage_seconds(costs: list[BlockCost], node: NodeCapacity, start: int, end: int) -> float:
    """Seconds per micro-batch of blocks [start, end) on `node`; the stage ending the model sends nothing."""
    boundary = costs[end - 1].activation_bytes if end < len(costs) else None
    return _seconds(sum(c.flops for c in costs[start:end]), node, boundary)


def _memory(param_bytes: int, activation_bytes: int, in_flight: int) -> int:
    return (ADAM_STATE_FACTOR + in_flight) * param_bytes + in_flight * activation_bytes


def _seconds(forward_flops: float, node: NodeCapacity, boundary_bytes: int | None) -> float:
    compute = 3 * forward_flops / node.flops
    if boundary_bytes is None:
        return compute
    return compute + 2 * boundary_bytes / node.bandwidth_to_next + node.latency_to_next


def partition(costs: list[BlockCost], nodes: list[NodeCapacity], *, in_flight: int | None = None,
              use_all_nodes: bool = True) -> Partition:
    """Contiguous stages minimising the slowest stage, by dynamic programming over (node, block prefix).

    Node j runs stage j. With `use_all_nodes` every node gets at least one block (only the first
    len(costs) nodes when there are more nodes than blocks); otherwise a prefix of the nodes may be
    used if that is faster. `in_flight` defaults to the number of usable nodes, the pipeline's
    staleness bound. O(nodes * blocks^2).
    """
    _validate(costs, nodes, in_flight)
    nodes = nodes[:len(costs)]
    in_flight = len(nodes) if in_flight is None else in_flight
    count = len(costs)
    flops = [0.0, *itertools.accumulate(c.flops for c in costs)]
    params = [0, *itertools.accumulate(c.param_bytes for c in costs)]
    activations = [0, *itertools.accumulate(c.activation_bytes for c in costs)]

    def seconds(node: NodeCapacity, start: int, end: int) -> float:
        boundary = costs[end - 1].activation_bytes if end < count else None
        return _seconds(flops[end] - flops[start], node, boundary)

    def fits(node: NodeCapacity, start: int, end: int) -> bool:
        memory = _memory(params[end] - params[start], activations[end] - activations[start], in_flight)
        return memory <= node.memory_bytes

    # best[j][end]: smallest bottleneck placing blocks [0, end) on nodes 0..j-1, each non-empty
    best = [[math.inf] * (count + 1) for _ in range(len(nodes) + 1)]
    choice = [[0] * (count + 1) for _ in range(len(nodes) + 1)]
    best[0][0] = 0.0
    for j, node in enumerate(nodes, start=1):
        for end in range(j, count + 1):
            for start in range(j - 1, end):
                if best[j - 1][start] >= best[j][end] or not fits(node, start, end):
                    continue
                value = max(best[j - 1][start], seconds(node, start, end))
                if value < best[j][end]:
                    best[j][end], choice[j][end] = value, start
    stages = len(nodes) if use_all_nodes else min(range(1, len(nodes) + 1), key=lambda j: best[j][count])
    if math.isinf(best[stages][count]):
        raise PartitionError(_infeasible_reason(costs, nodes, in_flight))
    ranges: list[tuple[int, int]] = []
    end = count
    for j in range(stages, 0, -1):
        ranges.append((choice[j][end], end))
        end = choice[j][end]
    ranges.reverse()
    return _describe(costs, nodes, ranges, in_flight)


def brute_force_partition(costs: list[BlockCost], nodes: list[NodeCapacity], *, in_flight: int | None = None,
                          use_all_nodes: bool = True) -> Partition:
    """The same optimum as `partition`, by trying every set of cut points (exponential; for tests)."""
    _validate(costs, nodes, in_flight)
    nodes = nodes[:len(costs)]
    in_flight = len(nodes) if in_flight is None else in_flight
    stage_counts = [len(nodes)] if use_all_nodes else range(1, len(nodes) + 1)
    best: Partition | None = None
    for stages in stage_counts:
        for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
            bounds = [0, *cuts, len(costs)]
            ranges = list(zip(bounds, bounds[1:]))
            if all(stage_memory_bytes(costs, a, b, in_flight) <= node.memory_bytes
                   for (a, b), node in zip(ranges, nodes)):
                candidate = _describe(costs, nodes, ranges, in_flight)
                if best is None or candidate.bottleneck_seconds < best.bottleneck_seconds:
                    best = candidate
    if best is None:
        raise PartitionError(_infeasible_reason(costs, nodes, in_flight))
    return best


def _describe(costs: list[BlockCost], nodes: list[NodeCapacity], ranges: list[tuple[int, int]],
              in_flight: int) -> Partition:
    times = [stage_seconds(costs, node, a, b) for (a, b), node in zip(ranges, nodes)]
    memory = [stage_memory_bytes(costs, a, b, in_flight) for a, b in ranges]
    return Partition(ranges, times, max(times), memory)


def _validate(costs: list[BlockCost], nodes: list[NodeCapacity], in_flight: int | None) -> None:
    if not costs:
        raise PartitionError("the model has no blocks")
    if not nodes:
        raise PartitionError("no nodes to place the model on")
    if in_flight is not None and in_flight < 1:
        raise PartitionError(f"in_flight must be >= 1, got {in_flight}")
    for index, node in enumerate(nodes[:len(costs)]):
        if not node.flops > 0:
            raise PartitionError(f"node {index} has no compute (flops={node.flops})")
        if index < min(len(nodes), len(costs)) - 1 and not node.bandwidth_to_next > 0:
            raise PartitionError(f"node {index} has no bandwidth to the next node")


def _infeasible_reason(costs: list[BlockCost], nodes: list[NodeCapacity], in_flight: int) -> str:
    largest_block = max(range(len(costs)), key=lambda i: stage_memory_bytes(costs, i, i + 1, in_flight))
    block_need = stage_memory_bytes(costs, largest_block, largest_block + 1, in_flight)
    largest_node = max(node.memory_bytes for node in nodes)
    load = f"with {in_flight} micro-batches in flight"
    if block_need > largest_node:
        return (f"block {largest_block} alone needs {_size(block_need)} ({load}) but the largest node holds "
                f"{_size(largest_node)}")
    total_need = stage_memory_bytes(costs, 0, len(costs), in_flight)
    total_have = sum(node.memory_bytes for node in nodes)
    if total_need > total_have:
        return (f"the model needs {_size(total_need)} ({load}) but the {len(nodes)} nodes hold at most "
                f"{_size(total_have)} together")
    return (f"no contiguous split of the {len(costs)} blocks fits each stage into its node's memory: the model "
            f"needs {_size(total_need)} ({load}); the nodes hold {', '.join(_size(n.memory_bytes) for n in nodes)}")


def _size(count: float) -> str:
    """Bytes for people: '20 B', '1.5 KiB', '3.2 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.3g} {unit}"
        count /= 1024
    return f"{count:.3g} TiB"
