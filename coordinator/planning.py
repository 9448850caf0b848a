"""Turn clusters of nodes into pipelines: chain order, block ranges per stage, averaging rings.

Rules (see also docs/jobs.md):
- The shape is chosen by predicted throughput within memory. For each pipeline depth d a group of
  m nodes can take (up to min(blocks, `pipeline_cap`); deeper only when shallower ones lack memory;
  exactly `placement.stages_per_cluster` when given, or deeper if that lacks memory), the planner
  partitions the blocks, predicts samples/s of the whole group (R = floor(m / d) data-parallel
  replicas with "auto", one pipeline per cluster with `placement.clusters = N`) and takes the best;
  within 10% of the best it takes the shallowest, since every extra stage adds staleness. So a small
  model goes data-parallel (one node per replica) and a big one gets as many stages as it needs.
  Depths are tried from shallow to deep and the search stops after two in a row predict less than
  the best so far (throughput over depth rises, then falls).
- A replica's samples/s is batch x min(1 / slowest stage, K / round trip), capped by averaging: a
  ring all-reduce of its stage's parameters every `averaging.every` steps (bandwidth and latency
  terms) that takes longer than those steps stalls training. The round trip of a micro-batch is every
  stage's time plus every link's measured round trip, so where the job leaves K open the planner keeps
  as many micro-batches in flight as that takes (`coordinator/in_flight.py`), up to a step's micro-batches (more
  would let two updates fall between a forward and its gradient) and what the weakest node's memory holds.
- Averaging makes the fast clusters wait for the slowest (every strategy but the asynchronous ones),
  so with `placement.clusters = "auto"` a group whose pace would cost the others more than it adds
  is left out as spares: the plan keeps the fastest groups whose number of replicas times the
  slowest kept pace is largest (the most groups within 10% of the best).
- Chain order: bandwidth descending (then compute), so the slowest node goes last, where it bounds
  one link, not two, and the last stage sends no activations forward at all. A peer link is what
  the nodes measured between themselves (link probes, the slower direction) when they did, else it
  is estimated as the slower end's bandwidth to the coordinator.
- Replicas of one group are dealt rank by rank from that order (stage i of every replica comes
  from the same slice of the sorted nodes), so one partition over the slice-wise weakest capacities
  gives cut points valid for every replica: one O(L * blocks^2) DP per group, not per replica,
  which is what keeps 10,000 nodes fast. Each replica's stage times are then predicted from its
  own nodes.
- A robust job (`averaging.robust`) cuts its groups of one depth alike, over the weakest of all their
  replicas, so that audits can compare each stage with its replicas in other clusters (`_cut_alike`).
- Ring shares: each ring member reduces a share of the segment balanced against the ring's link
  rates (member r -> r+1 estimated as the slower end's bandwidth to the coordinator), so a slow
  member does not bound the round; equal shares when the links are equal or the ring is large.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from ravnest.averaging.registry import AUTO, NO_AVERAGING, strategy_info
from ravnest.averaging import runtime
from ravnest.averaging.segments import segment_rings
from ravnest.averaging.shares import balanced_shares
from ravnest.errors import RavnestError
from ravnest.models.profile import BlockCost, stage_input
from ravnest.partition import (Load, NodeCapacity, PartitionError, compute_seconds, partition, stage_memory_bytes,
                               stage_seconds)
from ravnest.pipeline.memory import training_load
from ravnest.spec import AUTO_CODEC, AveragingSettings, Placement, TrainingSettings
from ravnest.wire import codecs

from .clustering import ClusteringError, NodeInfo, candidate_groupings, cluster_nodes
from .in_flight import compute_step_s, in_flight_for
from .codec_choice import averaging_candidates, averaging_codec, averaging_predictions, coded_links, pick_codecs
from .peer_links import Links, capacities, link
from .relay_memory import less_relaying, relaying_bytes
from .plan_words import counted, mib, named_groups, plural, rate
from .ring_order import best_ring
from .schemas import Plan, PlannedAveraging, PlannedCluster, PlannedRing, PlannedStage


NEAR_BEST = 0.9  # within this share of the best predicted throughput the simpler plan wins (shallower, more groups)
class PlanningError(RavnestError, ValueError):
    """The job cannot be placed on these nodes; the message says why."""


def chain_order(nodes: Sequence[NodeInfo]) -> list[NodeInfo]:
    return sorted(nodes, key=lambda n: (-n.bandwidth, -n.effective_flops, n.node_id))


@dataclass
class Shape:
    """One way to use a group of nodes: replicas of one pipeline, its cuts, and what it predicts:
    samples/s of all its replicas averaging among themselves, and `pace`, samples/s of one replica
    from its stages alone (what decides who waits for whom once groups average together)."""
    replicas: list[list[NodeInfo]]
    ranges: list[tuple[int, int]]
    load: Load
    samples_per_s: float
    pace: float
    in_flight_note: str = ""  # what K the links' round trips asked for, where that is not the default

    def describe(self) -> str:
        fitted = not self.load.split_backward and not self.load.checkpoint_blocks  # (checkpointing never splits)
        plain = " (backward not split, to fit memory)" if fitted else ""
        shape = f"{plural(len(self.replicas), 'pipeline')} of {plural(len(self.ranges), 'stage')}"
        return f"{shape}{plain}: {rate(self.samples_per_s)}" + (f" ({self.in_flight_note})" if self.in_flight_note
                                                                else "")


def plan_job(costs: list[BlockCost], nodes: Sequence[NodeInfo], placement: Placement, *,
             training: TrainingSettings | None = None, averaging: AveragingSettings | None = None,
             pipeline_cap: int = 16, links: Links | None = None, max_depth: int | None = None,
             lossiest: str | None = None) -> Plan:
    """Clusters, stages and rings for a job over `nodes`; PlanningError with the reason if impossible.
    `links` are the peer links the nodes measured (see `link`); `max_depth` bounds the stages per
    pipeline whatever the memory (a model whose first and last blocks share a tensor: 1); `lossiest`
    the pipeline codecs `codec: "auto"` may pick (codec_choice.lossiest_codec; None: any)."""
    training, averaging = training or TrainingSettings(), averaging or AveragingSettings()
    nodes = less_relaying(nodes)
    single_load = training_load(training, 1)
    smallest = min(stage_memory_bytes(costs, i, i + 1, single_load) for i in range(len(costs)))
    unused = {n.node_id: f"offers {mib(n.memory_bytes)}; the smallest block needs {mib(smallest)}"
              for n in nodes if n.memory_bytes < smallest}
    usable = [n for n in nodes if n.node_id not in unused]
    if placement.max_nodes is not None and len(usable) > placement.max_nodes:
        usable = sorted(usable, key=lambda n: (-n.effective_flops, -n.bandwidth, n.node_id))
        capped = f"placement.max_nodes is {placement.max_nodes}"
        unused.update({n.node_id: capped for n in usable[placement.max_nodes:]})
        usable = usable[:placement.max_nodes]
    if not usable:
        raise PlanningError(f"no node can hold even one block of the model: the smallest block needs "
                            f"{mib(smallest)}; {_offers(nodes)}")
    exact = placement.clusters if isinstance(placement.clusters, int) else None
    need, min_size = stage_memory_bytes(costs, 0, len(costs), single_load), placement.stages_per_cluster or 1
    try:
        candidates = candidate_groupings(usable, need, training.seed, min_size=min_size) if exact is None \
            else [("", cluster_nodes(usable, need, exact, training.seed, min_size=min_size))]
    except ClusteringError as e:
        raise PlanningError(f"{e}; {_offers(usable)}") from e
    plans: list[tuple[str, Plan]] = []
    for name, groups in candidates:
        try:
            plans.append((name, _plan_groups(costs, usable, groups, dict(unused), placement, exact=exact,
                                             training=training, averaging=averaging, pipeline_cap=pipeline_cap,
                                             links=links, max_depth=max_depth, lossiest=lossiest)))
        except PlanningError:
            if name == candidates[0][0]:
                raise  # (an alternative that cannot be planned is only not taken)
    first_name, first = plans[0]
    name, best = max(plans, key=lambda named: named[1].predicted_samples_per_s)
    if best.predicted_samples_per_s * NEAR_BEST <= first.predicted_samples_per_s:
        return first
    return best.model_copy(update={"reason": f"{best.reason}; grouped by {name}, predicted "
                                             f"{rate(best.predicted_samples_per_s)}, where {first_name} predicted "
                                             f"{rate(first.predicted_samples_per_s)}"})


def _plan_groups(costs: list[BlockCost], usable: list[NodeInfo], groups: list[list[int]], unused: dict[str, str],
                 placement: Placement, *, exact: int | None, training: TrainingSettings, averaging: AveragingSettings,
                 pipeline_cap: int, links: Links | None, max_depth: int | None, lossiest: str | None) -> Plan:
    """The plan of one grouping of the `usable` nodes (indices per cluster): each group's shape, laggard
    groups left out where averaging waits for the slowest, robust cuts, and the rings (`assemble`)."""
    shapes: list[Shape] = []
    described: list[str] = []  # a line per group, named by its clusters once the groups kept are known
    for group in groups:
        chain = chain_order([usable[i] for i in group])
        options = _depths(min(len(costs), max_depth or len(costs)), len(chain), placement, pipeline_cap)
        shape, considered = _choose_shape(costs, chain, options, many=exact is None, averaged=len(groups) > 1,
                                          training=training, averaging=averaging, links=links, lossiest=lossiest)
        used = {n.node_id for replica in shape.replicas for n in replica}
        unused.update({n.node_id: "spare: the chosen shape leaves it over" for n in chain if n.node_id not in used})
        shapes.append(shape)
        described.append(f"{plural(len(chain), 'node')} as {shape.describe()}"
                         + (f" (weighed against: {'; '.join(considered)})" if len(considered) > 1 else ""))
    kept, replicas = set(range(len(shapes))), [len(shape.replicas) for shape in shapes]
    if exact is None and _paced_by_slowest(averaging):
        kept = _without_laggards(shapes)
        for index, shape in enumerate(shapes):
            if index not in kept:
                described[index] += ", left out: averaging would wait for it"
                unused.update({n.node_id: f"spare: its group ({shape.describe()}) would set the pace of the "
                                          f"faster ones, averaging waits for the slowest"
                               for replica in shape.replicas for n in replica})
        shapes = [shapes[i] for i in sorted(kept)]
    why = named_groups(described, replicas, kept)
    if averaging.robust:
        shapes = _cut_alike(costs, shapes, why, training=training, averaging=averaging, links=links,
                            lossiest=lossiest)
    if averaging.robust and sum(len(shape.replicas) for shape in shapes) < 3:
        why.append("of fewer than 3 replicas robust averaging cannot tell which one lies, and stages are audited "
                   "only with 3 clusters: a lying volunteer goes unnamed until a third cluster is there")
    if placement.stages_per_cluster:
        short = sorted({len(shape.ranges) for shape in shapes if len(shape.ranges) < placement.stages_per_cluster})
        why.append(f"{plural(placement.stages_per_cluster, 'stage')} per cluster, as the job asks"
                   + (f", {' or '.join(map(str, short))} where a cluster has fewer nodes" if short else ""))
    return assemble(costs, shapes, why, unused, training=training, averaging=averaging, links=links,
                    lossiest=lossiest)


def assemble(costs: list[BlockCost], shapes: list[Shape], why: list[str], unused: dict[str, str], *,
             training: TrainingSettings, averaging: AveragingSettings, links: Links | None,
             order_rings: bool = True, lossiest: str | None = None) -> Plan:
    """The plan of these shapes: a cluster per replica, predicted stage times and memory, the rings of
    every segment (ordered by measured links unless `order_rings` is off: then in cluster order with equal
    shares), the averaging the clusters run and the throughput of all of them together."""
    # model_construct: these values are computed here, validating 10,000 of them again costs ~0.5 s
    clusters: list[PlannedCluster] = []
    pipelines = [(replica, shape) for shape in shapes for replica in shape.replicas]
    # the same for every replica of a shape: one merged profile, input and memory per stage
    per_shape = {id(shape): (_merge_stages(costs, shape.ranges, shape.load.parts),
                             [stage_input(costs, a) for a, _ in shape.ranges],
                             [stage_memory_bytes(costs, a, b, shape.load) for a, b in shape.ranges])
                 for shape in shapes}
    step_s: list[float] = []  # compute seconds per optimizer step, per cluster
    hidden = any(node.hidden for replica, _ in pipelines for node in replica)
    for index, (replica, shape) in enumerate(pipelines):
        merged, inputs, memory = per_shape[id(shape)]
        chain = capacities(replica, links)
        link_codecs = pick_codecs(merged, chain, training, lossiest=lossiest,
                                  why=why if training.codec == AUTO_CODEC else None)
        coded = coded_links(merged, link_codecs)
        stage_times = [stage_seconds(coded, capacity, s, s + 1) for s, capacity in enumerate(chain)]
        round_trips = [capacity.latency_to_next for capacity in chain[:-1]]
        step_s.append(compute_step_s(stage_times, shape.load, training, round_trips))
        per_step = 2 * training.accumulation * shape.load.parts  # activations forward, gradients back
        clusters.append(PlannedCluster.model_construct(
            cluster=index, predicted_bottleneck_seconds=max(stage_times), in_flight=shape.load.in_flight,
            stages=[PlannedStage.model_construct(
                stage=s, node_id=node.node_id, address=node.address, blocks=blocks, predicted_seconds=seconds,
                predicted_compute_seconds=compute_seconds(coded[s].flops, chain[s]),
                predicted_message_seconds=chain[s].message_s,
                link_bandwidth_bytes_per_s=chain[s].bandwidth_to_next if s + 1 < len(chain) else None,
                round_trip_seconds=chain[s].latency_to_next if s + 1 < len(chain) else None,
                predicted_memory_bytes=memory[s] + relaying_bytes(node, hidden),
                split_backward=shape.load.split_backward,
                input_shape=inputs[s][0], input_dtype=inputs[s][1], codec=link_codecs[s],
                predicted_link_bytes_per_step=per_step * coded[s].activation_bytes if link_codecs[s] is not None
                else None)
                for s, (node, blocks, seconds) in enumerate(zip(replica, shape.ranges, stage_times))]))
    rings = [_planned_ring(i, blocks, stages, [pipelines[c][0][s] for c, s in enumerate(stages)], links, order_rings)
             for i, (blocks, stages) in enumerate(segment_rings([shape.ranges for _, shape in pipelines]))]
    def ring_groups(codec: str) -> list[runtime.Group]:
        return [_ring_group(ring, pipelines, costs, links, codec) for ring in rings]
    averaging_plan = _planned_averaging(averaging, training, max(step_s), ring_groups) if len(clusters) > 1 else None
    throughput = _throughput(shapes, averaging)
    depths = sorted({len(s.ranges) for s in shapes})
    reason = (f"{plural(len(clusters), 'cluster')} x {'/'.join(map(str, depths))} stage{'s' if depths != [1] else ''}, "
              f"predicted {rate(throughput)}; " + "; ".join(counted(why)))
    if averaging_plan is not None and averaging.strategy == AUTO:
        reason += f"; averaging: {averaging_plan.strategy}" + (f" ({averaging_plan.topology})" if
                                                               averaging_plan.topology else "") + \
            f", predicted fastest at {averaging_plan.predicted_step_s[_table_key(averaging_plan)] * 1e3:.3g} ms/step"
    if averaging_plan is not None and averaging.codec == AUTO_CODEC:
        reason += f"; averaging sends {averaging_plan.codec or 'float32'} (codec auto)"
    return Plan.model_construct(clusters=clusters, rings=rings, averaging=averaging_plan, unused=unused,
                                predicted_samples_per_s=throughput, reason=reason)


def _paced_by_slowest(averaging: AveragingSettings) -> bool:
    """Whether the clusters' averaging makes the fast ones wait for the slowest (all but the asynchronous)."""
    return strategy_info(averaging.strategy).waits_for_peers


def _throughput(shapes: list[Shape], averaging: AveragingSettings) -> float:
    """Samples/s of all replicas: where averaging waits for the slowest, all at the slowest rate
    (averaging included) of one replica."""
    if _paced_by_slowest(averaging):
        return sum(len(shape.replicas) for shape in shapes) * min(shape.samples_per_s / len(shape.replicas)
                                                                  for shape in shapes)
    return sum(shape.samples_per_s for shape in shapes)


def _without_laggards(shapes: list[Shape]) -> set[int]:
    """The groups to keep when the slowest sets everyone's pace: the fastest m groups (by `pace`, before
    averaging, which every kept group then shares) for the m whose replicas x slowest pace is largest,
    taking the most groups within NEAR_BEST of the best (more replicas average away more noise). A
    group 4x slower than two others costs them 3/4 of their pace."""
    by_pace = sorted(range(len(shapes)), key=lambda i: -shapes[i].pace)
    totals = [sum(len(shapes[i].replicas) for i in by_pace[:m]) * shapes[by_pace[m - 1]].pace
              for m in range(1, len(shapes) + 1)]
    keep = max(m for m in range(1, len(shapes) + 1) if totals[m - 1] >= NEAR_BEST * max(totals))
    return set(by_pace[:keep])


def _table_key(planned: PlannedAveraging) -> str:
    return f"{planned.strategy}:{planned.topology}" if planned.topology else planned.strategy


def _planned_ring(segment: int, blocks: tuple[int, int], stages: list[int], members: list[NodeInfo],
                  links: Links | None, ordered: bool = True) -> PlannedRing:
    """The ring of one segment (`members`: its node in each cluster), ordered for its widest slowest link
    with shares balanced over its links; `ordered` off: in cluster order with equal shares."""
    if not ordered:
        return PlannedRing.model_construct(segment=segment, blocks=blocks, stages=stages,
                                           members=[m.node_id for m in members], weights=None, order=None)
    order = best_ring(len(members), lambda i, j: link(members[i], members[j], links)[0])
    return PlannedRing.model_construct(segment=segment, blocks=blocks, stages=stages,
                                       members=[m.node_id for m in members],
                                       weights=ring_weights([members[c] for c in order], links),
                                       order=None if order == sorted(order) else order)


def coded_bytes(param_bytes: float, codec: str, members: int) -> float:
    """A segment's float32 bytes as the runtime model prices a round of them under `codec`: what the
    codec sends (ravnest/wire/codecs); one whose replicas all-gather (topk) sends n - 1 copies where a
    ring's two halves send 2 (n - 1) / n, as n / 2 times its bytes would in a ring."""
    coded = codecs.codec(codec)
    sent = coded.wire_bytes(int(param_bytes) // 4)
    return sent if coded.reduces else sent * members / 2


def _ring_group(ring: PlannedRing, pipelines: list[tuple[list[NodeInfo], Shape]], costs: list[BlockCost],
                links: Links | None, codec: str) -> runtime.Group:
    """A planned ring as the runtime model sees it: its members, its segment's bytes, its slowest link."""
    members = [pipelines[c][0][s] for c, s in enumerate(ring.stages)]
    members = [members[c] for c in ring.order] if ring.order else members
    around = [link(here, after, links) for here, after in zip(members, [*members[1:], members[0]])]
    param_bytes = sum(c.param_bytes for c in costs[ring.blocks[0]:ring.blocks[1]])
    return runtime.Group(len(members), coded_bytes(param_bytes, codec, len(members)),
                         min(b for b, _ in around), max(lat for _, lat in around),
                         fine_overlap=all(len(shape.ranges) == 1 for _, shape in pipelines))


def _offers(nodes: Sequence[NodeInfo]) -> str:
    listed = ", ".join(f"{n.node_id[:8]} {mib(n.memory_bytes)}" for n in nodes[:8])
    return f"the {plural(len(nodes), 'node')} offer {listed}{', ...' if len(nodes) > 8 else ''}"


def _depths(num_blocks: int, num_nodes: int, placement: Placement, pipeline_cap: int) -> tuple[list[int], list[int]]:
    """Pipeline depths to compare, and deeper ones to fall back on when none of those fits."""
    most = min(num_blocks, num_nodes)
    if placement.stages_per_cluster:
        first = min(placement.stages_per_cluster, most)
        return [first], list(range(first + 1, most + 1))
    cap = min(most, pipeline_cap)
    return list(range(1, cap + 1)), list(range(cap + 1, most + 1))


def _choose_shape(costs: list[BlockCost], chain: list[NodeInfo], options: tuple[list[int], list[int]], *,
                  many: bool, averaged: bool, training: TrainingSettings, averaging: AveragingSettings,
                  links: Links | None, lossiest: str | None) -> tuple[Shape, list[str]]:
    """The best shape for one group (see the module docstring) and a word on each one considered."""
    preferred, fallback = options
    shapes: list[Shape] = []
    considered: list[str] = []
    last_error = ""
    for depths in (preferred, fallback):
        falling = 0  # deeper shapes in a row predicting less than the best so far
        for depth in depths:
            if falling == 2:  # throughput over depth rises, then falls: deeper ones will not win
                break
            count = len(chain) // depth if many else 1
            # stage i of every replica comes from slice i of the chain order
            dealt = [[chain[i * count + r] for i in range(depth)] for r in range(count)]
            with_rings = averaging.strategy != NO_AVERAGING and (averaged or count > 1)
            load = training_load(training, depth, averaging=with_rings)
            weakest = _weakest(dealt, links)
            try:
                fit = _fitting_partition(costs, weakest, load)
            except PartitionError as e:
                last_error = str(e)
                considered.append(f"{plural(count, 'pipeline')} of {plural(depth, 'stage')}: does not fit")
                continue
            load, ranges = fit.load, fit.ranges
            shape = make_shape(costs, dealt, weakest, ranges, load, training, averaging, lossiest)
            falling = falling + 1 if shapes and shape.samples_per_s < max(s.samples_per_s for s in shapes) else 0
            shapes.append(shape)
            considered.append(shape.describe())
        if shapes:
            break
    if not shapes:
        raise PlanningError(f"a group of {len(chain)} nodes cannot hold the model: {last_error}")
    best = max(shape.samples_per_s for shape in shapes)
    return min((s for s in shapes if s.samples_per_s >= NEAR_BEST * best), key=lambda s: len(s.ranges)), considered


def _cut_alike(costs: list[BlockCost], shapes: list[Shape], why: list[str], *, training: TrainingSettings,
               averaging: AveragingSettings, links: Links | None, lossiest: str | None) -> list[Shape]:
    """A robust job's groups of one depth, cut at the same blocks: audits (ravnest/pipeline/audits.py)
    compare a stage's input only with the stages of other clusters that start at the same block, 3 clusters
    or more. One partition over the stage-by-stage weakest capacity of all their replicas, as the replicas
    of one group share theirs; where none fits them all, each group keeps its own, and the plan says so."""
    cut, total = list(shapes), sum(len(shape.replicas) for shape in shapes)
    for depth in sorted({len(shape.ranges) for shape in shapes}):
        alike = [i for i, shape in enumerate(shapes) if len(shape.ranges) == depth]
        replicas = [replica for i in alike for replica in shapes[i].replicas]
        if depth > 1 and len(replicas) < 3 <= total:  # (of fewer than 3 in all, the planner says so anyway)
            why.append(f"{plural(len(replicas), 'pipeline')} of {plural(depth, 'stage')}, where audits compare 3 or "
                       f"more of one depth: their stages are not audited")
        if depth == 1 or len(replicas) < 3 or len({tuple(shapes[i].ranges) for i in alike}) == 1:
            continue
        try:
            fit = _fitting_partition(costs, _weakest(replicas, links), training_load(training, depth, averaging=True))
        except PartitionError:
            why.append(f"pipelines of {plural(depth, 'stage')} cut differently, as no one cut fits them all: "
                       f"audits compare a stage only with those that start at the same block")
            continue
        for i in alike:
            cut[i] = make_shape(costs, shapes[i].replicas, _weakest(shapes[i].replicas, links), fit.ranges, fit.load,
                                training, averaging, lossiest)
        why.append(f"{plural(len(replicas), 'pipeline')} of {plural(depth, 'stage')} cut alike, so that audits can "
                   f"compare their stages (averaging.robust)")
    return cut


@dataclass
class _Fit:
    ranges: list[tuple[int, int]]
    load: Load


def _fitting_partition(costs: list[BlockCost], weakest: list[NodeCapacity], load: Load) -> _Fit:
    """The partition under `load`, or, when none fits, under `load` without the split backward (the
    plain backward holds no gradients of the owners' outputs: the zero-bubble schedule gives way to
    memory); PartitionError when neither fits."""
    try:
        return _Fit(partition(costs, weakest, load=load).ranges, load)
    except PartitionError:
        if not load.split_backward:
            raise
    plain = dataclasses.replace(load, split_backward=False)
    return _Fit(partition(costs, weakest, load=plain).ranges, plain)


def make_shape(costs: list[BlockCost], replicas: list[list[NodeInfo]], weakest: list[NodeCapacity],
               ranges: list[tuple[int, int]], load: Load, training: TrainingSettings,
               averaging: AveragingSettings, lossiest: str | None = None) -> Shape:
    """These replicas cut at `ranges`, with what they predict: the pace of `weakest` (stage by stage
    the weakest capacity over the replicas), and with averaging among them (the runtime model) times
    their number."""
    round_trips = [capacity.latency_to_next for capacity in weakest[:-1]]

    def stage_times(load: Load) -> tuple[list[BlockCost], list[float]]:
        plain = _merge_stages(costs, ranges, load.parts)
        merged = coded_links(plain, pick_codecs(plain, weakest, training, lossiest=lossiest))  # each link, as coded
        return merged, [stage_seconds(merged, capacity, s, s + 1) for s, capacity in enumerate(weakest)]
    merged, times = stage_times(load)
    note = ""
    if training.microbatches_in_flight is None and any(round_trips):
        load, note = in_flight_for(costs, ranges, weakest, load, training, lambda k: stage_times(k)[1], round_trips)
        merged, times = stage_times(load)
    codec = averaging_candidates(averaging)[-1] if averaging.codec == AUTO_CODEC else averaging.codec
    groups = [runtime.Group(len(replicas), coded_bytes(merged[s].param_bytes, codec, len(replicas)),
                            min(r[s].bandwidth for r in replicas),
                            max(r[s].latency for r in replicas), fine_overlap=len(ranges) == 1)
              for s in range(len(ranges))]
    compute_step = compute_step_s(times, load, training, round_trips)
    samples = training.batch_size * training.accumulation
    step = _averaged_step_s(averaging, training, compute_step, groups)
    return Shape(replicas, ranges, load, len(replicas) * samples / step, samples / compute_step, note)


def _averaged_step_s(averaging: AveragingSettings, training: TrainingSettings, step_s: float,
                     groups: list[runtime.Group]) -> float:
    """Seconds per step with the job's averaging (the fastest candidate for "auto"); rounds by the
    clock (`every_seconds`) and plug-ins the model does not know are taken as free."""
    if averaging.strategy == AUTO:
        return min(v for k, v in averaging_predictions(averaging, training, step_s, groups).items() if k != "allreduce")
    if averaging.every_seconds is not None or strategy_info(averaging.strategy).cost is None:
        return step_s
    return runtime.strategy_step_s(averaging.strategy, step_s, groups, every=averaging.every,
                                   topology=averaging.topology, settings=averaging.of(averaging.strategy))


def _planned_averaging(averaging: AveragingSettings, training: TrainingSettings, step_s: float,
                       ring_groups: Callable[[str], list[runtime.Group]]) -> PlannedAveraging | None:
    """The runtime model's table for the plan, and the strategy (and codec) the stages will run."""
    if averaging.strategy == NO_AVERAGING or not ring_groups(""):
        return None
    codec = averaging.codec if averaging.codec != AUTO_CODEC else \
        averaging_codec(averaging, training, step_s, ring_groups)
    groups = ring_groups(codec)
    table = averaging_predictions(averaging, training, step_s, groups)
    strategy, topology = ((averaging.strategy, averaging.topology) if averaging.strategy != AUTO
                          else runtime.pick(table))
    return PlannedAveraging.model_construct(strategy=strategy, topology=topology, compute_step_s=step_s,
                                            predicted_step_s=table, paced=runtime.link_bound(step_s, groups),
                                            codec=codec)


MAX_WEIGHTED_RING = 16  # balancing costs O(members^2) per iteration; larger rings share equally


def ring_weights(members: Sequence[NodeInfo], links: Links | None = None) -> list[float] | None:
    """Share weights for a ring of these members (in ring order), or None for equal shares."""
    rates = tuple(link(here, after, links)[0] for here, after in zip(members, [*members[1:], members[0]]))
    if len(rates) < 2 or len(rates) > MAX_WEIGHTED_RING or min(rates) == max(rates):
        return None
    return _balanced(rates)


@lru_cache(maxsize=1024)  # replicas dealt from one group often give rings with the same links
def _balanced(links: tuple[float, ...]) -> list[float]:
    return balanced_shares(list(links), iterations=200)  # within 1e-4 of 4000 iterations' bound


def _merge_stages(costs: list[BlockCost], ranges: list[tuple[int, int]], parts: int = 1) -> list[BlockCost]:
    """One BlockCost per stage (summed flops, the stage's boundary activation), so that predicting
    10,000 stage times does not re-sum the blocks of each stage every time; for one micro-batch, a
    batch cut in `parts` (staleness "2bw": a stage computes, and pays its fixed costs for, each part)."""
    return [BlockCost(params=sum(c.params for c in costs[a:b]), param_bytes=sum(c.param_bytes for c in costs[a:b]),
                      flops=sum(c.flops for c in costs[a:b]) / parts,
                      activation_bytes=-(-costs[b - 1].activation_bytes // parts))
            for a, b in ranges]


def _weakest(replicas: list[list[NodeInfo]], links: Links | None = None) -> list[NodeCapacity]:
    """Stage by stage, the weakest capacity over the replicas, so one plan is valid for all."""
    per_replica = [capacities(chain, links) for chain in replicas]
    return [NodeCapacity(min(c.flops for c in stage), min(c.memory_bytes for c in stage),
                         min(c.bandwidth_to_next for c in stage), max(c.latency_to_next for c in stage),
                         max(c.slowdown for c in stage), max(c.message_s for c in stage))
            for stage in zip(*per_replica)]
