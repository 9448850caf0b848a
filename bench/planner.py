"""Planner benchmark: cluster and plan 10,000 synthetic heterogeneous nodes for a 48-block model.

    python -m bench.planner [--nodes 10000] [--repeats 3]
    python -m bench.planner --robust-cuts   # what cutting a robust job's pipelines alike costs

The model is gpt with 46 transformer layers (+ embedding and head = 48 blocks), profiled once with
FLOP counting (not timed: the coordinator caches profiles per model). The timed part is exactly
what the coordinator runs when it places a job: k-means clustering with automatic k, the replica
split, one partition DP per group, stage-time prediction for every node and the averaging rings.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import numpy as np

from ravnest.models import build_model, profile_blocks
from ravnest.models.profile import BlockCost
from ravnest.spec import AveragingSettings, Placement, TrainingSettings

from bench.common import write_section
from coordinator.clustering import NodeInfo
from coordinator.planning import plan_job

# (share of nodes, FLOP/s, memory bytes, bandwidth bytes/s, round trip s): server GPUs on 10 Gbit/s,
# gaming GPUs on 1 Gbit/s, laptop CPUs on 100 Mbit/s
TIERS = [(0.1, 20e12, 24 << 30, 1.25e9, 0.005),
         (0.3, 5e12, 8 << 30, 1.25e8, 0.02),
         (0.6, 1e11, 4 << 30, 1.25e7, 0.05)]
MODEL = ("gpt", {"vocab_size": 256, "seq_len": 128, "d_model": 256, "n_layers": 46, "n_heads": 8})
BATCH_SIZE = 8


def synthetic_nodes(count: int, seed: int = 0) -> list[NodeInfo]:
    """`count` nodes from the three tiers, each measure jittered by a log-normal factor (sigma 0.2)."""
    rng = np.random.default_rng(seed)
    shares = np.array([tier[0] for tier in TIERS])
    tiers = rng.choice(len(TIERS), size=count, p=shares / shares.sum())
    jitter = rng.lognormal(0.0, 0.2, size=(count, 4))
    nodes = []
    for i, (tier, j) in enumerate(zip(tiers, jitter)):
        _, flops, memory, bandwidth, latency = TIERS[tier]
        nodes.append(NodeInfo(f"node{i:05d}", flops * j[0], int(memory * j[1]), bandwidth * j[2], latency * j[3],
                              f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}:7000"))
    return nodes


def model_costs() -> list[BlockCost]:
    name, config = MODEL
    return profile_blocks(build_model(name, config), BATCH_SIZE)


def robust_cuts(draws: int = 10) -> None:
    """A robust job's pipelines of one depth are cut alike, for audits (coordinator/planning.py): its
    predicted samples/s over that of the same job with each cluster cut for its own nodes, for `draws`
    draws of volunteers from the tiers, per shape (clusters x stages)."""
    costs, lines = model_costs(), []
    for clusters, stages in ((3, 2), (3, 4), (4, 3)):
        ratios = []
        for seed in range(draws):
            nodes = synthetic_nodes(clusters * stages, seed)
            placement = Placement(clusters=clusters, stages_per_cluster=stages)
            own, alike = (plan_job(costs, nodes, placement, training=TrainingSettings(batch_size=BATCH_SIZE),
                                   averaging=AveragingSettings(robust=robust)).predicted_samples_per_s
                          for robust in ("", "centered_clip"))
            ratios.append(alike / own)
        lines.append(f"{clusters} clusters x {stages} stages: cut alike / each its own, predicted: median "
                     f"{statistics.median(ratios):.3f}, worst {min(ratios):.3f} ({draws} draws)")
    text = "\n".join(lines)
    print(text)
    write_section("Planner: a robust job's pipelines cut alike",
                  f"Command: `python -m bench.planner --robust-cuts`\n\n```\n{text}\n```")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--robust-cuts", action="store_true", help="what cutting a robust job alike costs, instead")
    args = parser.parse_args()
    if args.robust_cuts:
        robust_cuts()
        return

    start = time.perf_counter()
    costs = model_costs()
    profile_seconds = time.perf_counter() - start
    nodes = synthetic_nodes(args.nodes)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        plan = plan_job(costs, nodes, Placement(), training=TrainingSettings(batch_size=BATCH_SIZE))
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)

    depths = Counter(len(c.stages) for c in plan.clusters)
    bottlenecks = [c.predicted_bottleneck_seconds for c in plan.clusters]
    lines = [
        f"model: {MODEL[0]} {MODEL[1]} -> {len(costs)} blocks, {sum(c.params for c in costs) / 1e6:.1f} M params, "
        f"batch {BATCH_SIZE}; profiled once in {profile_seconds:.2f} s (not timed)",
        f"nodes: {args.nodes} in three tiers ({', '.join(f'{t[0]:.0%}' for t in TIERS)}: "
        "server GPU / 10 Gbit/s, gaming GPU / 1 Gbit/s, laptop CPU / 100 Mbit/s; log-normal jitter 0.2)",
        f"plan: {len(plan.clusters)} clusters (stages per cluster: "
        f"{', '.join(f'{d} x{n}' for d, n in sorted(depths.items()))}), {len(plan.rings)} ring segments, "
        f"{len(plan.unused)} nodes left as spares",
        f"predicted bottleneck per micro-batch: {min(bottlenecks) * 1e3:.2f} .. {max(bottlenecks) * 1e3:.2f} ms; "
        f"predicted total {plan.predicted_samples_per_s:,.0f} samples/s",
        f"clustering + planning: median {seconds:.3f} s over {args.repeats} runs "
        f"(runs: {', '.join(f'{t:.3f}' for t in times)}); target < 2 s",
    ]
    text = "\n".join(lines)
    print(text)
    write_section("Planner", f"Command: `python -m bench.planner --nodes {args.nodes}`\n\n```\n{text}\n```")
    print(f"planner nodes={args.nodes} seconds={seconds:.3f}")


if __name__ == "__main__":
    main()
