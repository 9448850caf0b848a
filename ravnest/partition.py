"""Split a model's blocks into contiguous stages over a chain of unequal nodes.

A stage's time per micro-batch is its compute (forward + backward = 3x forward FLOPs, over the
node's FLOP/s) plus sending its boundary activation forward and the same-size gradient back over
the link to the next node, plus a fixed cost per message each way (framing, gRPC, Python: about a
millisecond on a laptop core, which is what makes a pipeline of tiny blocks slower than one node).
An asynchronous pipeline runs at the pace of its slowest stage, so the partition minimises the
maximum stage time, subject to every stage fitting its node's memory. A link's round trip occupies
neither of its stages: while a micro-batch crosses it, others are computed, as long as enough are in
flight (the planner chooses K for that: coordinator/in_flight.py).

A stage's memory (`stage_memory_bytes`), with P its blocks' parameter bytes and K micro-batches in
flight, is what the stage runner really holds:

    P x (1 live + 1 gradient + s optimizer state + v weight versions + a averaging copies)
    + activations saved for backward: K micro-batches (the last stage: 1, plus the loss' logits twice),
      each 1/parts of a batch when the pipeline cuts batches into parts (staleness "2bw")
    + backward workspace: the gradients of one block's activations (its largest block's saved bytes)
    + split backward (stages after the first, unless `split_backward` is off): the gradients of the
      parameter owners' outputs of one micro-batch, held from B (input gradient) to W (weight gradients)
    + wire queues: SEND_QUEUE + 1 outgoing and K + RECEIVE_SLACK incoming activations
    + what a link keeps to send again after a break: K + RECEIVE_SLACK gradients sent back (stages after the
      first), and RECEIVE_SLACK activations beyond the K held for their backward
    + a base: what any stage costs a node whatever its blocks (its computing thread's heap and stack,
      stream buffers, Python objects; `pipeline.memory.STAGE_BASE` for real jobs)
    + its blocks' kernels' state on that thread, once (`BlockCost.kernel_bytes`: oneDNN's convolutions)
    + the first stage: what its data feed keeps in memory (`BlockCost.feed_bytes` of block 0: a dataset
      loaded whole, as digits is; text and token files are read from disk window by window)
    + a share of P for what is alive only around a step's peak, beyond the tensors above
      (`pipeline.memory.TRANSIENT` for real jobs)

Under bf16 or fp16 each micro-batch in flight also keeps autocast's 16-bit copy of the weights (P / 2);
its activations are those the blocks save under autocast (`models.profile`, traced in that precision).

With activation checkpointing (`training.activation_checkpointing`) a micro-batch keeps only each
block's input in place of the block's saved activations, its backward recomputes one block at a time
(one more workspace), and the backward is not split (a deferred W would need what was dropped).

with activations, workspace and the split backward's gradients taken `heap_slack` times: many
short-lived tensors of mixed sizes leave holes in the allocator's heap that later ones do not fit
(`pipeline.memory.HEAP_SLACK` for real jobs).

s is the optimizer's state per parameter (SGD 0, momentum 1, Adam 2: `pipeline.optim.optimizer_state_factor`);
v = K weight snapshots while a forward's weights can change before its backward (K > 1, not on the
last stage, which runs forward and backward at once), plus the pre-step weights with weight
prediction; a = 2 (snapshot and average) when the stage takes part in averaging rings. With
weight_stash "recompute" a micro-batch keeps only its input, and one recomputed forward's
activations exist at a time.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from ravnest.errors import RavnestError
from ravnest.models.profile import BlockCost



@dataclass(frozen=True)
class Load:
    """How a stage trains, as far as its memory is concerned (see the module docstring)."""
    in_flight: int = 1               # K, micro-batches a stage may hold between forward and backward
    optimizer_state: float = 2.0     # optimizer state bytes per parameter byte (Adam: 2)
    recompute: bool = False          # weight_stash "recompute": keep inputs, redo the forward
    averaging_copies: float = 0.0    # parameter-sized buffers an averaging strategy keeps
    stage_base: int = 0              # bytes any stage costs, whatever its blocks
    transient: float = 0.0           # parameter-sized temporaries at a step's peak, per parameter byte
    parts: int = 1                   # micro-batches a batch is cut into (staleness "2bw")
    predict: int = 0                 # weight prediction's order: the buffers it keeps (schedule.prediction_order)
    heap_slack: float = 1.0          # what the allocator really takes per activation byte (see memory.py)
    split_backward: bool = True      # B/W split: owners' output gradients held from B to W (stages > 0)
    checkpoint_blocks: bool = False  # activation checkpointing: keep block inputs, recompute a block in backward
    cast_weights: float = 0.0        # bf16/fp16: autocast's 16-bit weight copies a micro-batch keeps (0.5)


# fixed cost of one activation or gradient message between stages, until a node's jobs measured its own
# (coordinator/calibration.py): four nodes sharing two cores here measured 0.2-0.7 ms
MESSAGE_OVERHEAD_S = 0.001
# fixed cost of one micro-batch through a stage besides its FLOPs (autograd, Python, the schedule, the
# optimizer's step): single-threaded on a CPU a cnn step on digits takes 2.76 ms for 0.70 ms of FLOPs, an
# MLP of 1M parameters 4.91 ms for 2.20; without it tiny models were predicted 5-12x faster than they ran
STAGE_OVERHEAD_S = 0.002
SEND_QUEUE = 2  # messages a stage queues for a neighbour before its send waits (back-pressure)
RECEIVE_SLACK = 2  # activations a stage queues beyond its K in flight (evaluation streams more)


@dataclass
class NodeCapacity:
    flops: float              # FLOP/s
    memory_bytes: int
    bandwidth_to_next: float  # bytes/s on the link to the next node in the chain (ignored for the last)
    latency_to_next: float = 0.0  # round trip seconds of that link (in no stage's time: see above)
    slowdown: float = 1.0     # its compute seconds as measured over as predicted from `flops` (calibration.py)
    message_s: float = MESSAGE_OVERHEAD_S  # what one message to or from it costs beyond bytes and latency


@dataclass
class Partition:
    ranges: list[tuple[int, int]]  # half-open block ranges, one per used node, in chain order
    stage_seconds: list[float]
    bottleneck_seconds: float
    stage_memory: list[int] = field(default_factory=list)  # stage_memory_bytes of each stage


class PartitionError(RavnestError, ValueError):
    """No partition fits the nodes' memory, or the inputs are invalid."""


def stage_memory_bytes(costs: list[BlockCost], start: int, end: int, load: Load) -> int:
    """Bytes a node needs to train blocks [start, end) under `load` (see the module docstring)."""
    blocks = costs[start:end]
    return _memory(costs, sum(c.param_bytes for c in blocks), sum(kept_bytes(costs, load)[start:end]),
                   max(c.saved_bytes for c in blocks), sum(c.owner_output_bytes for c in blocks),
                   max(c.kernel_bytes for c in blocks), start, end, load)


def kept_bytes(costs: list[BlockCost], load: Load) -> list[int]:
    """Bytes a micro-batch keeps per block from forward to backward: what autograd saves, or with
    activation checkpointing the block's input (the previous block's output; block 0's are token ids)."""
    if load.checkpoint_blocks:
        return [costs[i - 1].activation_bytes if i else 0 for i in range(len(costs))]
    return [c.saved_bytes for c in costs]


def stage_seconds(costs: list[BlockCost], node: NodeCapacity, start: int, end: int) -> float:
    """Seconds per micro-batch of blocks [start, end) on `node`; the stage ending the model sends nothing."""
    boundary = costs[end - 1].activation_bytes if end < len(costs) else None
    return _seconds(sum(c.flops for c in costs[start:end]), node, boundary)


def _memory(costs: list[BlockCost], param_bytes: int, saved_bytes: int, workspace: int, owner_outputs: int,
            kernels: int, start: int, end: int, load: Load) -> int:
    last = end == len(costs)
    k = load.in_flight
    versions = k + load.predict if k > 1 and not last else 0
    weights = param_bytes * (2 + load.optimizer_state + versions + load.averaging_copies)
    share = 1 / load.parts  # of a batch's activations, per micro-batch
    saved_bytes, workspace = math.ceil(saved_bytes * share), math.ceil(workspace * share)
    split = math.ceil(owner_outputs * share) if start > 0 and load.split_backward and not load.checkpoint_blocks \
        else 0  # stage 0's backward is not split
    recomputed = workspace if load.checkpoint_blocks else 0  # one block's activations, redone for its backward
    received = math.ceil((costs[start - 1].activation_bytes if start > 0 else 0) * share)
    sent = math.ceil(costs[end - 1].activation_bytes * share)
    if last:
        activations = saved_bytes + 2 * sent  # the loss keeps log-probabilities, then their gradient
    elif load.recompute:
        activations = k * received + saved_bytes
    else:
        activations = k * saved_bytes
    # autocast's 16-bit copies of the weights, saved for the backward: each micro-batch in flight has its own
    held = 1 if last or load.checkpoint_blocks or load.recompute else k
    activations += math.ceil(held * param_bytes * load.cast_weights)
    queues = (SEND_QUEUE + 1) * sent * (not last) + (k + RECEIVE_SLACK) * received
    # what a broken link may have lost is kept to send again (pipeline/neighbours.py): the last K + RECEIVE_SLACK
    # messages each way, of which the activations sent are held for their backward anyway, but for RECEIVE_SLACK
    kept = RECEIVE_SLACK * sent * (not last) + (k + RECEIVE_SLACK) * received
    feed = costs[0].feed_bytes if start == 0 else 0  # the first stage holds the job's data
    fixed = kernels + feed + load.stage_base + math.ceil(load.transient * param_bytes)
    return int(weights + load.heap_slack * (activations + recomputed + workspace + split) + queues + kept + fixed)


class _RangeMax:
    """max(values[start:end]) in O(1) after O(n log n) set-up (a sparse table)."""

    def __init__(self, values: list[int]):
        self._levels = [list(values)]
        width = 1
        while 2 * width <= len(values):
            below = self._levels[-1]
            self._levels.append([max(below[i], below[i + width]) for i in range(len(values) - 2 * width + 1)])
            width *= 2

    def __call__(self, start: int, end: int) -> int:
        level = (end - start).bit_length() - 1
        row = self._levels[level]
        return max(row[start], row[end - (1 << level)])


def compute_seconds(forward_flops: float, node: NodeCapacity) -> float:
    """Seconds per micro-batch of forward and backward (twice the forward) on `node`, sending nothing.
    Its `slowdown` scales both terms: what slows a node (another program, a shared core, kernels that
    reach less of the matmul peak) slows its Python as much as its FLOPs."""
    return (3 * forward_flops / node.flops + STAGE_OVERHEAD_S) * node.slowdown


def _seconds(forward_flops: float, node: NodeCapacity, boundary_bytes: int | None) -> float:
    compute = compute_seconds(forward_flops, node)
    if boundary_bytes is None:
        return compute
    return compute + 2 * boundary_bytes / node.bandwidth_to_next + 2 * node.message_s


def partition(costs: list[BlockCost], nodes: list[NodeCapacity], *, load: Load | None = None,
              use_all_nodes: bool = True) -> Partition:
    """Contiguous stages minimising the slowest stage, by dynamic programming over (node, block prefix).

    Node j runs stage j. With `use_all_nodes` every node gets at least one block (only the first
    len(costs) nodes when there are more nodes than blocks); otherwise a prefix of the nodes may be
    used if that is faster. `load` defaults to Adam with K = the number of usable nodes, the
    pipeline's default staleness bound. O(nodes * blocks^2).
    """
    _validate(costs, nodes, load)
    nodes = nodes[:len(costs)]
    load = load or Load(in_flight=len(nodes))
    count = len(costs)
    flops = [0.0, *itertools.accumulate(c.flops for c in costs)]
    params = [0, *itertools.accumulate(c.param_bytes for c in costs)]
    saved = [0, *itertools.accumulate(kept_bytes(costs, load))]
    owner_outputs = [0, *itertools.accumulate(c.owner_output_bytes for c in costs)]
    largest_saved = _RangeMax([c.saved_bytes for c in costs])
    largest_kernels = _RangeMax([c.kernel_bytes for c in costs])

    def seconds(node: NodeCapacity, start: int, end: int) -> float:
        boundary = costs[end - 1].activation_bytes if end < count else None
        return _seconds(flops[end] - flops[start], node, boundary)

    def fits(node: NodeCapacity, start: int, end: int) -> bool:
        memory = _memory(costs, params[end] - params[start], saved[end] - saved[start], largest_saved(start, end),
                         owner_outputs[end] - owner_outputs[start], largest_kernels(start, end), start, end, load)
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
        raise PartitionError(_infeasible_reason(costs, nodes, load))
    ranges: list[tuple[int, int]] = []
    end = count
    for j in range(stages, 0, -1):
        ranges.append((choice[j][end], end))
        end = choice[j][end]
    ranges.reverse()
    return _describe(costs, nodes, ranges, load)


def brute_force_partition(costs: list[BlockCost], nodes: list[NodeCapacity], *, load: Load | None = None,
                          use_all_nodes: bool = True) -> Partition:
    """The same optimum as `partition`, by trying every set of cut points (exponential; for tests)."""
    _validate(costs, nodes, load)
    nodes = nodes[:len(costs)]
    load = load or Load(in_flight=len(nodes))
    stage_counts = [len(nodes)] if use_all_nodes else range(1, len(nodes) + 1)
    best: Partition | None = None
    for stages in stage_counts:
        for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
            bounds = [0, *cuts, len(costs)]
            ranges = list(zip(bounds, bounds[1:]))
            if all(stage_memory_bytes(costs, a, b, load) <= node.memory_bytes
                   for (a, b), node in zip(ranges, nodes)):
                candidate = _describe(costs, nodes, ranges, load)
                if best is None or candidate.bottleneck_seconds < best.bottleneck_seconds:
                    best = candidate
    if best is None:
        raise PartitionError(_infeasible_reason(costs, nodes, load))
    return best


def _describe(costs: list[BlockCost], nodes: list[NodeCapacity], ranges: list[tuple[int, int]],
              load: Load) -> Partition:
    times = [stage_seconds(costs, node, a, b) for (a, b), node in zip(ranges, nodes)]
    memory = [stage_memory_bytes(costs, a, b, load) for a, b in ranges]
    return Partition(ranges, times, max(times), memory)


def _validate(costs: list[BlockCost], nodes: list[NodeCapacity], load: Load | None) -> None:
    if not costs:
        raise PartitionError("the model has no blocks")
    if not nodes:
        raise PartitionError("no nodes to place the model on")
    if load is not None and load.in_flight < 1:
        raise PartitionError(f"in_flight must be >= 1, got {load.in_flight}")
    for index, node in enumerate(nodes[:len(costs)]):
        if not node.flops > 0:
            raise PartitionError(f"node {index} has no compute (flops={node.flops})")
        if index < min(len(nodes), len(costs)) - 1 and not node.bandwidth_to_next > 0:
            raise PartitionError(f"node {index} has no bandwidth to the next node")


def _infeasible_reason(costs: list[BlockCost], nodes: list[NodeCapacity], load: Load) -> str:
    """Why nothing fits, with the figures: what the model and its largest block need against what
    each node offers."""
    need = [stage_memory_bytes(costs, i, i + 1, load) for i in range(len(costs))]
    largest_block = max(range(len(costs)), key=need.__getitem__)
    total_need = stage_memory_bytes(costs, 0, len(costs), load)
    offers = ", ".join(_size(n.memory_bytes) for n in nodes)
    figures = (f"the whole model needs {_size(total_need)} on one node, its largest block (block {largest_block}) "
               f"{_size(need[largest_block])}, with {load.in_flight} micro-batch(es) in flight; the "
               f"{len(nodes)} node(s) offer {offers}")
    if need[largest_block] > max(node.memory_bytes for node in nodes):
        return f"block {largest_block} fits no node: {figures}"
    if total_need > sum(node.memory_bytes for node in nodes):
        return f"the nodes hold too little together: {figures}"
    return f"no contiguous split of the {len(costs)} blocks fits each stage into its node's memory: {figures}"


def _size(count: float) -> str:
    """Bytes for people: '20 B', '1.5 KiB', '3.2 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.3g} {unit}"
        count /= 1024
    return f"{count:.3g} TiB"
