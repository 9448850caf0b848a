"""Jobs of many nodes on one machine: 8, 16, 32 and 64 real `ravnest-node join` processes in one job.

Each size is a fresh coordinator and N nodes on loopback, each node a fresh interpreter with one torch
thread (as volunteers start them), the README's digits MLP as N/2 clusters x 2 stages, ring averaging.
At 40% of the job's steps one working node (cluster 1, stage 0) gets SIGKILL. Per size: whether the
job completed, its test accuracy (against the 8-node run's), its re-plans, the seconds from submitting
to every stage training ("place"), the coordinator's CPU seconds per node-minute over the job, and a
node's memory: resident (VmRSS) and proportional (Pss, what N of them take together) at the job's
middle, medians over the nodes. A size whose nodes would not fit in the memory available (by the
last size's Pss, with a tenth spare) is not run: the bench says what one node needs.

    python -m bench.jobscale [--sizes 8 16 32 64] [--steps 800] [--keep-logs DIR] [--no-docs]

Last line: `jobscale max_completed=<n> replans_at_64=<k> coord_cpu_per_node_min=<s> node_rss_mib=<m>`
(the last two at the largest size run; replans_at_64 is "-" where 64 did not run).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import command_line, write_section
from node.profiler import free_memory_bytes
from scripts.local_cluster import TERMINAL_STATES, LocalCluster, cpu_seconds, rss_bytes

JOB = Path(__file__).resolve().parent.parent / "examples" / "jobs" / "digits-mlp.json"
MIB = 1 << 20
SPARE = 1.1  # a size runs where its nodes' memory, by the last size's Pss, fits with this much to spare


def job_spec(nodes: int, steps: int) -> dict:
    spec = json.loads(JOB.read_text())
    spec["training"].update(steps=steps, eval_every=0)
    spec["averaging"]["every"] = 25
    spec["placement"] = {"clusters": nodes // 2, "stages_per_cluster": 2, "max_nodes": nodes}
    return spec


def pss_bytes(pid: int) -> int:
    """A process's proportional share of resident memory (pages shared with k processes count 1/k)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/smaps_rollup has no Pss")


def number(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def run(nodes: int, steps: int, keep_logs: Path | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="ravnest-bench-jobscale-") as folder:
        started = time.monotonic()
        with LocalCluster(Path(folder), nodes=nodes, join_timeout=1800) as cluster:
            joined_s = time.monotonic() - started
            idle = [rss_bytes(p.pid) for p in cluster.procs[1:]]
            coordinator = cluster.procs[0].pid
            cpu_before, submitted = cpu_seconds(coordinator), time.monotonic()
            job_id = cluster.submit(job_spec(nodes, steps))
            seen: dict = {"place_s": None, "rss": None}

            def furthest(job: dict) -> int:  # (the job's progress fraction lags behind its clusters' steps)
                return max((c["steps_done"] for c in job["progress"]["clusters"]), default=0)

            def watch(job: dict) -> None:
                if seen["place_s"] is None and job["state"] == "running" and furthest(job) > 0:
                    seen["place_s"] = time.monotonic() - submitted
                if seen["rss"] is None and furthest(job) >= 0.5 * steps:
                    live = [p.pid for p in cluster.procs[1:] if p.poll() is None]
                    seen["rss"], seen["pss"] = [rss_bytes(p) for p in live], [pss_bytes(p) for p in live]

            def far_enough() -> dict | None:
                job = cluster.job(job_id)
                watch(job)
                return job if job["state"] in TERMINAL_STATES or furthest(job) >= 0.4 * steps else None
            job = cluster.wait_for(far_enough, 3600, "40% of the steps", interval=0.5)
            killed_at = None if job["state"] in TERMINAL_STATES else furthest(job)
            if killed_at is not None:
                cluster.kill(cluster.node_process(job["plan"]["clusters"][1]["stages"][0]["node_id"]))
                job = cluster.wait_job(job_id, 3600, on_update=watch)
            job_s = time.monotonic() - submitted
            cpu = cpu_seconds(coordinator) - cpu_before
        if keep_logs is not None:
            shutil.copytree(Path(folder) / "logs", keep_logs / f"{nodes}-nodes", dirs_exist_ok=True)
    rss, pss = seen["rss"] or idle, seen.get("pss") or [0]
    return {"nodes": nodes, "state": job["state"], "reason": job.get("reason") or "",
            "accuracy": (job.get("metrics") or {}).get("test_accuracy"), "replans": len(job.get("recoveries") or []),
            "killed_at": killed_at,
            "why": [f"{r['kind']}: {r['reason'][:160]}" for r in job.get("recoveries") or []],
            "join_s": joined_s, "place_s": seen["place_s"], "job_s": job_s,
            "coord_cpu_per_node_min": cpu / (nodes * job_s / 60), "idle_rss_mib": statistics.median(idle) / MIB,
            "rss_mib": statistics.median(rss) / MIB, "pss_mib": statistics.median(pss) / MIB}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--keep-logs", type=Path, help="copy every process's log here, a folder per size")
    parser.add_argument("--no-docs", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    results: list[dict] = []
    for nodes in args.sizes:
        need = results[-1]["pss_mib"] * MIB * nodes * SPARE if results else 0
        available = free_memory_bytes(torch.device("cpu"))
        if need > available:
            print(f"{nodes} nodes: not run; one node needs {results[-1]['pss_mib']:.0f} MiB (Pss), {nodes} "
                  f"need {need / (1 << 30):.1f} GiB with {SPARE - 1:.0%} spare, {available / (1 << 30):.1f} "
                  f"GiB available", flush=True)
            break
        r = run(nodes, args.steps, args.keep_logs)
        results.append(r)
        print(f"{nodes} nodes: {r['state']} {r['reason'][:200]} accuracy {r['accuracy']}, killed a node at step "
              f"{number(r['killed_at'], 'd')}, re-plans {r['replans']}, "
              f"joined in {r['join_s']:.0f} s, placed in {r['place_s'] or float('nan'):.1f} s, job {r['job_s']:.0f} s, "
              f"coordinator {r['coord_cpu_per_node_min']:.3f} CPU s per node-minute, node RSS idle "
              f"{r['idle_rss_mib']:.0f} MiB, in the job {r['rss_mib']:.0f} MiB (Pss {r['pss_mib']:.0f})" +
              "".join(f"\n  re-plan {i + 1}: {why}" for i, why in enumerate(r["why"])), flush=True)
    completed = [r for r in results if r["state"] == "completed"]
    at_64 = next((r["replans"] for r in results if r["nodes"] == 64), "-")
    last = results[-1]
    summary = (f"jobscale max_completed={max((r['nodes'] for r in completed), default=0)} replans_at_64={at_64} "
               f"coord_cpu_per_node_min={last['coord_cpu_per_node_min']:.3f} node_rss_mib={last['rss_mib']:.0f}")
    print(summary)
    if not args.no_docs:
        base = results[0]["accuracy"]
        rows = "\n".join(
            f"| {r['nodes']} | {r['state']} | {number(r['accuracy'], '.4f')} | "
            f"{number(None if r['accuracy'] is None or base is None else r['accuracy'] - base, '+.4f')} | "
            f"{number(r['killed_at'], 'd')} | {r['replans']} | {r['join_s']:.0f} | {number(r['place_s'], '.1f')} | "
            f"{r['job_s']:.0f} | "
            f"{r['coord_cpu_per_node_min']:.3f} | {r['idle_rss_mib']:.0f} | {r['rss_mib']:.0f} | {r['pss_mib']:.0f} |"
            for r in results)
        write_section("Jobs of many nodes", f"""
Command: `{command_line("bench.jobscale", argv)}`

The digits MLP as N/2 clusters x 2 stages on N real node processes (one torch thread each) on this
machine, {args.steps} steps, one working node (cluster 1, stage 0) killed once its furthest cluster
is 40% through (a job that ends before the loss is noticed needs no re-plan). Memory per node: medians at
the job's middle.

| nodes | state | accuracy | against the first | killed at step | re-plans | join s | place s | job s | coordinator CPU s per node-minute | node RSS idle MiB | node RSS MiB | node Pss MiB |
|---|---|---|---|---|---|---|---|---|---|---|---|---|
{rows}

    {summary}
""")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
