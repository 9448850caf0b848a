"""Turn clusters of nodes into pipelines: chain order, block ranges per stage, averaging rings.

Rules (see also docs in examples/jobs/README.md):
- A pipeline has at most L = min(blocks, placement.stages_per_cluster or `pipeline_cap`) stages;
  deeper pipelines add latency and staleness without adding useful parallelism.
- With `placement.clusters = N` each of the N clusters is one pipeline of (up to L of) its nodes.
- With "auto", each k-means group of m similar nodes is split into R = floor(m / L) replicas of
  L nodes (one replica of m nodes when m < L; the m mod L nodes left over stay idle as spares);
  fewer, longer replicas are tried if those cannot hold the model.
- Chain order: bandwidth descending (then compute), so the slowest node goes last, where it bounds
  one link, not two, and the last stage sends no activations forward at all. A peer link is what
  the nodes measured between themselves (link probes, the slower direction) when they did, else it
  is estimated as the slower end's bandwidth to the coordinator.
- Replicas of one group are dealt rank by rank from that order (stage i of every replica comes
  from the same slice of the sorted nodes), so one partition over the slice-wise weakest capacities
  gives cut points valid for every replica: one O(L * blocks^2) DP per group, not per replica,
  which is what keeps 10,000 nodes fast. Each replica's stage times are then predicted from its
  own nodes.
- Ring shares: each ring member reduces a share of the segment balanced against the ring's link
  rates (member r -> r+1 estimated as the slower end's bandwidth to the coordinator), so a slow
  member does not bound the round; equal shares when the links are equal or the ring is large.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache

from ravnest.averaging.segments import segment_rings
from ravnest.averaging.shares import balanced_shares
from ravnest.models.profile import BlockCost
from ravnest.partition import NodeCapacity, PartitionError, partition, stage_memory_bytes, stage_seconds
from ravnest.spec import Placement

from .clustering import ClusteringError, NodeInfo, cluster_nodes
from .schemas import Plan, PlannedCluster, PlannedRing, PlannedStage


class PlanningError(ValueError):
    """The job cannot be placed on these nodes; the message says why."""


def pipeline_length(num_blocks: int, placement: Placement, pipeline_cap: int) -> int:
    return max(1, min(num_blocks, placement.stages_per_cluster or pipeline_cap))


def chain_order(nodes: Sequence[NodeInfo]) -> list[NodeInfo]:
    return sorted(nodes, key=lambda n: (-n.bandwidth, -n.flops, n.node_id))


# (node id, peer id) -> (bandwidth bytes/s, round-trip seconds) as measured from the node
Links = Mapping[tuple[str, str], tuple[float, float]]


def link(here: NodeInfo, after: NodeInfo, links: Links | None = None) -> tuple[float, float]:
    """(bandwidth, latency) between two nodes: measured (slower direction) if either end probed it,
    else estimated from both ends' links to the coordinator."""
    links = links or {}
    measured = [m for m in (links.get((here.node_id, after.node_id)), links.get((after.node_id, here.node_id)))
                if m is not None]
    if measured:
        return min(m[0] for m in measured), max(m[1] for m in measured)
    return min(here.bandwidth, after.bandwidth), (here.latency + after.latency) / 2


def capacities(chain: Sequence[NodeInfo], links: Links | None = None) -> list[NodeCapacity]:
    """Each node's capacity with its link to the next (see `link`)."""
    result = []
    for here, after in zip(chain, [*chain[1:], None]):
        bandwidth, latency = link(here, after, links) if after else (here.bandwidth, 0.0)
        result.append(NodeCapacity(here.flops, here.memory_bytes, bandwidth, latency))
    return result


def plan_job(costs: list[BlockCost], nodes: Sequence[NodeInfo], placement: Placement, *,
             batch_size: int, in_flight: int | None = None, pipeline_cap: int = 16, seed: int = 0,
             links: Links | None = None) -> Plan:
    """Clusters, stages and rings for a job over `nodes`; PlanningError with the reason if impossible.
    `links` are the peer links the nodes measured (see `link`)."""
    length = pipeline_length(len(costs), placement, pipeline_cap)
    budget = in_flight or length
    smallest = min(stage_memory_bytes(costs, i, i + 1, budget) for i in range(len(costs)))
    unused = {n.node_id: f"has {n.memory_bytes / 2**20:.0f} MiB; the smallest block needs {smallest / 2**20:.0f} MiB"
              for n in nodes if n.memory_bytes < smallest}
    usable = [n for n in nodes if n.node_id not in unused]
    if not usable:
        raise PlanningError(f"no node can hold even one block of the model ({smallest / 2**20:.0f} MiB needed)")
    exact = placement.clusters if isinstance(placement.clusters, int) else None
    try:
        groups = cluster_nodes(usable, stage_memory_bytes(costs, 0, len(costs), budget), exact, seed)
    except ClusteringError as e:
        raise PlanningError(str(e)) from e

    pipelines: list[tuple[list[NodeInfo], list[tuple[int, int]]]] = []
    for group in groups:
        chain = chain_order([usable[i] for i in group])
        replicas, ranges = _split_group(costs, chain, length, in_flight, single=exact is not None, links=links)
        used = {n.node_id for replica in replicas for n in replica}
        unused.update({n.node_id: "spare: its group did not fill another replica" for n in chain
                       if n.node_id not in used})
        pipelines += [(replica, ranges) for replica in replicas]

    # model_construct: these values are computed here, validating 10,000 of them again costs ~0.5 s
    clusters = []
    for index, (replica, ranges) in enumerate(pipelines):
        merged = _merge_stages(costs, ranges)
        stage_times = [stage_seconds(merged, capacity, s, s + 1)
                       for s, capacity in enumerate(capacities(replica, links))]
        clusters.append(PlannedCluster.model_construct(
            cluster=index, predicted_bottleneck_seconds=max(stage_times),
            stages=[PlannedStage.model_construct(stage=s, node_id=node.node_id, address=node.address,
                                                 blocks=blocks, predicted_seconds=seconds)
                    for s, (node, blocks, seconds) in enumerate(zip(replica, ranges, stage_times))]))
    rings = [PlannedRing.model_construct(segment=i, blocks=blocks, stages=stages,
                                         members=[clusters[c].stages[s].node_id for c, s in enumerate(stages)],
                                         weights=ring_weights([pipelines[c][0][s] for c, s in enumerate(stages)], links))
             for i, (blocks, stages) in enumerate(segment_rings([ranges for _, ranges in pipelines]))]
    throughput = sum(batch_size / c.predicted_bottleneck_seconds for c in clusters
                     if c.predicted_bottleneck_seconds > 0)
    return Plan.model_construct(clusters=clusters, rings=rings, unused=unused, predicted_samples_per_s=throughput)


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


def _split_group(costs: list[BlockCost], chain: list[NodeInfo], length: int, in_flight: int | None,
                 single: bool, links: Links | None = None) -> tuple[list[list[NodeInfo]], list[tuple[int, int]]]:
    """Replicas (each a chain) from one group, and the block ranges they all share."""
    count = len(chain)
    if single:  # one pipeline: up to the cap, longer only when shorter ones lack memory
        options = [(1, depth) for depth in range(min(count, length), min(count, len(costs)) + 1)]
    else:  # as many full-depth replicas as fit (fewer than `length` nodes stay over); then fewer, longer ones
        most = count // min(length, count)
        options = [(replicas, min(count // replicas, len(costs))) for replicas in range(most, 0, -1)]
    last_error = ""
    for replicas, depth in options:
        # stage i of every replica comes from slice i of the chain order
        dealt = [[chain[i * replicas + r] for i in range(depth)] for r in range(replicas)]
        try:
            return dealt, partition(costs, _weakest(dealt, links), in_flight=in_flight or depth).ranges
        except PartitionError as e:
            last_error = str(e)
    raise PlanningError(f"a group of {count} nodes cannot hold the model: {last_error}")


def _merge_stages(costs: list[BlockCost], ranges: list[tuple[int, int]]) -> list[BlockCost]:
    """One BlockCost per stage (summed flops, the stage's boundary activation), so that predicting
    10,000 stage times does not re-sum the blocks of each stage every time."""
    return [BlockCost(params=sum(c.params for c in costs[a:b]), param_bytes=sum(c.param_bytes for c in costs[a:b]),
                      flops=sum(c.flops for c in costs[a:b]), activation_bytes=costs[b - 1].activation_bytes)
            for a, b in ranges]


def _weakest(replicas: list[list[NodeInfo]], links: Links | None = None) -> list[NodeCapacity]:
    """Stage by stage, the weakest capacity over the replicas, so one plan is valid for all."""
    per_replica = [capacities(chain, links) for chain in replicas]
    return [NodeCapacity(min(c.flops for c in stage), min(c.memory_bytes for c in stage),
                         min(c.bandwidth_to_next for c in stage), max(c.latency_to_next for c in stage))
            for stage in zip(*per_replica)]
