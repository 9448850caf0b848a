"""Ravnest's original placement (`placement.policy = "equal-split"`), kept as the baseline that
`python -m bench.testbed` measures the planner against. It looks at memory only:

- Clusters by memory: the nodes, largest memory first (ties in join order), are dealt round-robin
  into k clusters, so every cluster holds about the same memory; k is `placement.clusters`, else
  the most clusters of `stages_per_cluster` nodes (else of as many nodes as the model's memory
  needs) the nodes make. Nodes left over are spares.
- Each cluster is one pipeline over its nodes in join order, the blocks cut so that every stage
  holds about the same number of parameters, whatever their compute or links.
- Rings in cluster order with equal shares.

Bandwidth and compute play no part, which is the point of the comparison.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from ravnest.averaging.registry import NO_AVERAGING
from ravnest.models.profile import BlockCost
from ravnest.partition import stage_memory_bytes
from ravnest.pipeline.memory import training_load
from ravnest.spec import AveragingSettings, Placement, TrainingSettings

from .clustering import NodeInfo
from .peer_links import Links, capacities
from .plan_words import mib, plural
from .planning import PlanningError, assemble, make_shape
from .relay_memory import less_relaying
from .schemas import Plan


def equal_parameter_cuts(params: Sequence[int], stages: int) -> list[tuple[int, int]]:
    """Contiguous block ranges, one per stage, whose largest parameter count is smallest (every stage
    gets at least one block). O(stages x blocks^2): models have tens of blocks."""
    count = len(params)
    if not 1 <= stages <= count:
        raise ValueError(f"cannot cut {count} blocks into {stages} stages")
    before = [0]
    for p in params:
        before.append(before[-1] + p)
    # best[s][b]: the smallest largest stage over cuts of blocks [0, b) into s stages; cut[s][b] its last start
    best = [[math.inf] * (count + 1) for _ in range(stages + 1)]
    cut = [[0] * (count + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for b in range(s, count + 1):
            for a in range(s - 1, b):
                worst = max(best[s - 1][a], before[b] - before[a])
                if worst < best[s][b]:
                    best[s][b], cut[s][b] = worst, a
    ranges, end = [], count
    for s in range(stages, 0, -1):
        ranges.append((cut[s][end], end))
        end = cut[s][end]
    return ranges[::-1]


def plan_equal_split(costs: list[BlockCost], nodes: Sequence[NodeInfo], placement: Placement, *,
                     training: TrainingSettings, averaging: AveragingSettings, links: Links | None = None,
                     max_depth: int | None = None, lossiest: str | None = None) -> Plan:
    """The equal-split plan over `nodes` (in join order), with at most `max_depth` stages per pipeline;
    PlanningError with the reason if impossible."""
    if not nodes:
        raise PlanningError("no idle nodes")
    nodes = less_relaying(nodes)
    whole = stage_memory_bytes(costs, 0, len(costs), training_load(training, 1))
    by_memory = sorted(nodes, key=lambda n: -n.memory_bytes)  # stable: ties stay in join order
    if placement.stages_per_cluster:
        size = placement.stages_per_cluster
    else:  # as many of the largest as the whole model needs
        held, size = 0, 0
        while held < whole and size < len(by_memory):
            held += by_memory[size].memory_bytes
            size += 1
    size = min(size, len(costs), max_depth or len(costs))
    k = placement.clusters if isinstance(placement.clusters, int) else len(nodes) // size
    if k < 1 or k * size > len(nodes):
        raise PlanningError(f"equal-split: {plural(k, 'cluster')} of {plural(size, 'node')} need {k * size} nodes; "
                            f"{len(nodes)} idle")
    join_rank = {n.node_id: i for i, n in enumerate(nodes)}
    chosen = by_memory[:k * size]
    clusters = [sorted(chosen[c::k], key=lambda n: join_rank[n.node_id]) for c in range(k)]
    unused = {n.node_id: "spare: equal-split takes whole clusters" for n in by_memory[k * size:]}

    ranges = equal_parameter_cuts([c.params for c in costs], size)
    averaged = averaging.strategy != NO_AVERAGING and k > 1
    load = training_load(training, size, averaging=averaged)
    shapes, why = [], []
    for chain in clusters:
        for node, (a, b) in zip(chain, ranges):
            need = stage_memory_bytes(costs, a, b, load)
            if need > node.memory_bytes:
                raise PlanningError(f"equal-split: blocks [{a}, {b}) need {mib(need)}; node {node.node_id[:8]} "
                                    f"offers {mib(node.memory_bytes)}")
        shape = make_shape(costs, [chain], capacities(chain, links), ranges, load, training, averaging, lossiest)
        shapes.append(shape)
        why.append(f"{plural(len(chain), 'node')} in join order -> {shape.describe()}")
    why.insert(0, f"equal-split: {plural(k, 'cluster')} by memory, equal parameters per stage, rings in join order")
    return assemble(costs, shapes, why, unused, training=training, averaging=averaging, links=links,
                    order_rings=False, lossiest=lossiest)
