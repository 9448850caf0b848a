"""Whole jobs on bandwidth-shaped hosts: our planner against Ravnest's own equal-split policy.

Six nodes in network namespaces (scripts/testbed.py, needs root), links shaped with tbf to three
tiers of home upload speeds, joining in an interleaved order as volunteers would (default
40 10 2.5 2.5 10 40 Mbit/s). The coordinator measures them itself. The same job (the README's digits
CNN as 2-stage pipelines: a model cut in two as one too big for a node would be) runs under
`placement.policy` "measured" (clusters by measured bandwidth and compute, cuts by predicted time,
slow clusters left out where they would pace the others, rings ordered by measured links) and
"equal-split" (clusters by memory in join order, equal parameters per stage, rings in join order),
alternating, `--repeat` times. A third run per repeat, "measured, every group" (`placement.clusters`
= the number of tiers), keeps the slow groups in, to show what clustering by tier gives without leaving anyone out.

Throughput is what the job trained: samples of every cluster over the time until the last cluster
finished, from the stages' own reports (startup and the final upload not counted).

    python -m bench.testbed [--repeat 3] [--steps 400] [--tiers 40 10 2.5 2.5 10 40] [--busy] [--no-docs]

`--busy` runs a process burning one core beside it all along (a volunteer's host does other work), and
each run prints what the planner was given of every host (tier: measured Mbit/s, GFLOP/s as its jobs
measured them): which of them split the tiers where a run mixed them.

Prints last `testbed tiers_clustered=<true|false> samples_per_s=<x> vs_equal_split=<r>` (medians);
tiers_clustered: in every run of ours, each tier's hosts are one cluster of their own or left out
together (a slower group that would pace the others).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import command_line, write_section
from scripts.testbed import ShapedTestbed, unavailable

JOB = Path(__file__).resolve().parent.parent / "examples" / "jobs" / "digits-cnn.json"
READING = ("The digits CNN as 2-stage pipelines, ring averaging every 10 steps, on six network namespaces "
           "whose links tbf shapes both ways; one 2-core machine runs all six nodes. Averaging makes every "
           "cluster wait for the slowest, and equal split puts a slow host in most clusters. The planner "
           "clusters hosts by tier, cuts each pipeline where its link costs least (\"every group\": that alone) "
           "and leaves a tier out where its pace would cost the others more than it adds (\"measured\", the "
           "default): which tiers it keeps depends on how fast it measured the nodes' compute in that run. "
           "Throughput: samples of all clusters over the time until the last finished (startup and upload "
           "not counted); test accuracy of the merged model.")
# name -> placement; the first is ours, the second the baseline
VARIANTS = {"measured": {"policy": "measured"}, "equal-split": {"policy": "equal-split"},
            "every group": {"policy": "measured", "clusters": 3}}


def job_spec(variant: str, steps: int) -> dict:
    spec = json.loads(JOB.read_text())
    spec["name"] = f"testbed-{variant.replace(' ', '-')}"
    spec["training"].update(steps=steps, eval_every=0)
    spec["averaging"] = {"strategy": "ring", "every": 10}
    spec["placement"] = {"clusters": "auto", "stages_per_cluster": 2, "min_nodes": 6, **VARIANTS[variant]}
    return spec


def trained_samples_per_s(job: dict, samples_per_step: int) -> float:
    """Samples of all clusters over the longest cluster's training time (its last stage's report)."""
    last = {}
    for stage in job["metrics"]["stages"]:
        if stage["stage"] == len(job["plan"]["clusters"][stage["cluster"]]["stages"]) - 1:
            last[stage["cluster"]] = stage["metrics"]
    return sum(m["step"] * samples_per_step for m in last.values()) / max(m["elapsed_s"] for m in last.values())


def run(testbed: ShapedTestbed, variant: str, steps: int) -> dict:
    spec = job_spec(variant, steps)
    job = testbed.wait_job(testbed.submit(spec), timeout=1200)
    if job["state"] != "completed":
        raise RuntimeError(f"{variant} job {job['state']}: {job['reason']}")
    tier = {n["id"]: testbed.tier_of(n) for n in testbed.alive_nodes()}
    clusters = [[tier[s["node_id"]] for s in c["stages"]] for c in job["plan"]["clusters"]]
    # where each host went: its cluster, or the reason it was left out (which names its group)
    placed = {s["node_id"]: f"cluster {c['cluster']}" for c in job["plan"]["clusters"] for s in c["stages"]}
    where = {node: placed.get(node, job["plan"]["unused"].get(node)) for node in tier}
    testbed.wait_for(lambda: sum(n["state"] == "idle" for n in testbed.alive_nodes()) == len(tier), 120,
                     "every node idle again")
    return {"variant": variant, "samples_per_s": trained_samples_per_s(job, spec["training"]["batch_size"]),
            "predicted": job["plan"]["predicted_samples_per_s"], "accuracy": job["metrics"]["test_accuracy"],
            "clusters": clusters, "spares": len(job["plan"]["unused"]), "reason": job["plan"]["reason"],
            "tiers_apart": tiers_apart(tier, where)}


def planner_figures(testbed: ShapedTestbed) -> str:
    """What the planner had of each host, by tier: Mbit/s as measured (a peer's figure where that was
    below the node's own) and GFLOP/s over the slowdown its cnn stages measured."""
    figures: dict[float, list[str]] = {}
    for node in testbed.alive_nodes():
        profile = node["profile"]
        mbit = min(profile["bandwidth_bytes_per_s"], node.get("measured_bandwidth") or float("inf")) * 8 / 1e6
        slowdown = (node.get("by_model") or {}).get("cnn", {}).get("slowdown") or node.get("slowdown") or 1.0
        flops = (node.get("measured_flops") or profile["flops"]) / slowdown
        figures.setdefault(testbed.tier_of(node), []).append(f"{mbit:.0f}/{flops / 1e9:.0f}")
    return ", ".join(f"{tier:g}: {' '.join(sorted(f))}" for tier, f in sorted(figures.items()))


def burn_one_core() -> subprocess.Popen:
    """Other work on the host: a process spinning on one core until killed."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def tiers_apart(tier: dict[str, float], where: dict[str, str]) -> bool:
    """Whether each tier's hosts went to one place (a cluster, or out as one group) of their own."""
    places = {t: {where[node] for node in tier if tier[node] == t} for t in set(tier.values())}
    return all(len(p) == 1 for p in places.values()) and len({p.pop() for p in places.values()}) == len(places)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--tiers", type=float, nargs="+", default=[40, 10, 2.5, 2.5, 10, 40],
                        help="Mbit/s of each host, in the order they join")
    parser.add_argument("--busy", action="store_true", help="with a process burning one core beside it")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = parser.parse_args(argv)
    reason = unavailable()
    if reason:
        print(f"bench.testbed: {reason}", file=sys.stderr)
        return 2
    busy = burn_one_core() if args.busy else None
    try:
        return bench(args, argv)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()


def bench(args: argparse.Namespace, argv: list[str] | None) -> int:
    runs: list[dict] = []
    lines: list[str] = []
    with tempfile.TemporaryDirectory() as scratch, ShapedTestbed(Path(scratch), args.tiers) as testbed:
        measured = {testbed.tier_of(n): [] for n in testbed.alive_nodes()}
        for node in testbed.alive_nodes():
            measured[testbed.tier_of(node)].append(round(node["profile"]["bandwidth_bytes_per_s"] * 8 / 1e6))
        lines.append(f"hosts (Mbit/s, join order): {' '.join(f'{t:g}' for t in args.tiers)}; the coordinator "
                     f"measured {dict(sorted(measured.items()))}")
        for repeat in range(args.repeat):
            for variant in list(VARIANTS)[::1 if repeat % 2 == 0 else -1]:  # alternate who goes first
                given = planner_figures(testbed)
                figures = run(testbed, variant, args.steps)
                runs.append(figures)
                line = (f"run {repeat + 1} {variant:<11}: {figures['samples_per_s']:7.0f} samples/s trained "
                        f"(predicted {figures['predicted']:,.0f}), accuracy {figures['accuracy']:.4f}, tiers per "
                        f"cluster {figures['clusters']}, {figures['spares']} spare\n"
                        f"  planned from (tier: Mbit/s/GFLOP/s) {given}")
                print(line, flush=True)
                lines.append(line)
    ours, baseline, every = ([r for r in runs if r["variant"] == v] for v in VARIANTS)
    ratios = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(ours, baseline)]
    apart = sum(r["tiers_apart"] for r in ours)
    median = statistics.median(r["samples_per_s"] for r in ours)
    lines += [*(f"plan, {r['variant']}: {r['reason']}" for r in (ours[0], baseline[0], every[0])),
              f"measured / equal-split per run: {', '.join(f'{r:.2f}' for r in ratios)}; every group / equal-split: "
              f"{statistics.median(a['samples_per_s'] / b['samples_per_s'] for a, b in zip(every, baseline)):.2f}",
              f"tiers clustered in {apart} of {len(ours)} runs of ours",
              "accuracy (medians): " + ", ".join(f"{name} {statistics.median(r['accuracy'] for r in rs):.4f}"
                                                 for name, rs in zip(VARIANTS, (ours, baseline, every)))]
    summary = (f"testbed tiers_clustered={str(apart == len(ours)).lower()} samples_per_s={median:.0f} "
               f"vs_equal_split={statistics.median(ratios):.2f}")
    print("\n".join(lines[-6:]))
    if not args.no_docs:
        title = "Shaped testbed: our plan against equal split" + (", beside a busy core" if args.busy else "")
        write_section(title, (
            f"Command (as root): `{command_line('bench.testbed', argv)}`\n\n{READING}\n\n```\n" + "\n".join(lines)
            + f"\n{summary}\n```\n"))
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
