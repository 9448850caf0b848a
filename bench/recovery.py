"""Recovery: how long a job stands still when a node dies, and what the death costs the whole job.

Real processes on loopback: a coordinator and 5 nodes; the README's digits CNN as 2 clusters x 2
stages (placement.max_nodes 4, so one node is spare). Runs alternate between a clean run and one in
which a working node (cluster 1, stage 0: a pipeline neighbour and a ring member) gets SIGKILL at 30%
progress; a fresh node then joins so every run starts with a spare. Reported: the time from the kill
to the first step trained after the re-plan (`recovery_s`), the steps trained twice, the test
accuracy, and the ratio of the job's wall time with a kill against the clean runs.

    python -m bench.recovery [--runs 3] [--steps 600] [--no-docs]

The last line printed is `recovery median_recovery_s=<s> job_time_ratio=<killed/clean>`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import write_section
from scripts.local_cluster import LocalCluster

JOB = Path(__file__).resolve().parent.parent / "examples" / "jobs" / "digits-cnn.json"


def job_spec(steps: int) -> dict:
    spec = json.loads(JOB.read_text())
    spec["training"].update(steps=steps, eval_every=0)
    spec["placement"]["max_nodes"] = 4
    return spec


def run(cluster: LocalCluster, steps: int, kill: bool) -> dict:
    started = time.monotonic()
    job_id = cluster.submit(job_spec(steps))
    if kill:
        def far_enough():
            job = cluster.job(job_id)
            return job if job["state"] == "running" and job["progress"]["fraction"] >= 0.3 else None
        job = cluster.wait_for(far_enough, 300, "30% progress", interval=0.1, ignore_exits=True)
        cluster.kill(cluster.node_process(job["plan"]["clusters"][1]["stages"][0]["node_id"]))
    job = cluster.wait_job(job_id, timeout=900)
    if job["state"] != "completed":
        raise RuntimeError(f"job {job_id} {job['state']}: {job['reason']}")
    figures = {"seconds": time.monotonic() - started, "accuracy": job["metrics"]["test_accuracy"]}
    if kill:
        [recovery] = job["recoveries"]
        figures.update(recovery_s=recovery["recovery_s"], redone=recovery["steps_redone"],
                       resume_step=recovery["resume_step"], reached=recovery["reached_step"])
        cluster.add_nodes(1)  # the next run starts with a spare again
    cluster.wait_for(lambda: sum(n["state"] == "idle" for n in cluster.alive_nodes()) == 5, 60, "5 idle nodes")
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each kind (clean, killed)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--no-docs", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    clean, killed = [], []
    with tempfile.TemporaryDirectory(prefix="ravnest-bench-recovery-") as folder, \
            LocalCluster(Path(folder), nodes=5) as cluster:
        for index in range(args.runs):
            for kill, results in ((False, clean), (True, killed)):
                figures = run(cluster, args.steps, kill)
                results.append(figures)
                print(f"run {index + 1} {'killed' if kill else 'clean '}: " +
                      ", ".join(f"{k} {v:.3g}" for k, v in figures.items()), flush=True)
    median = lambda runs, key: statistics.median(r[key] for r in runs)  # noqa: E731
    ratio = median(killed, "seconds") / median(clean, "seconds")
    rows = "\n".join(f"| {i + 1} | {c['seconds']:.1f} | {k['seconds']:.1f} | {k['reached']} -> {k['resume_step']} | "
                     f"{k['recovery_s']:.1f} | {c['accuracy']:.4f} | {k['accuracy']:.4f} |"
                     for i, (c, k) in enumerate(zip(clean, killed)))
    text = (f"`python -m bench.recovery --runs {args.runs} --steps {args.steps}`: digits CNN, 2 clusters x 2 stages "
            f"+ 1 spare, 5 local node processes; in each killed run a working node gets SIGKILL at 30%.\n\n"
            f"| run | clean job s | killed job s | step reached -> resumed | kill to training again s | "
            f"clean accuracy | killed accuracy |\n|---|---|---|---|---|---|---|\n{rows}\n\n"
            f"Median time from the kill to training again: **{median(killed, 'recovery_s'):.1f} s**; the killed "
            f"job takes **{ratio:.2f}x** the clean job's wall time (medians). The recovery is mostly heartbeat "
            f"round trips (2 s interval): the dead node's pipeline neighbour reports at once, the other nodes "
            f"hear `recover_job` on their next heartbeat, hand in their state and are released on the one "
            f"after; the re-planned assignments go out with heartbeats too.")
    if not args.no_docs:
        write_section("Recovery", text)
    print(f"recovery median_recovery_s={median(killed, 'recovery_s'):.2f} job_time_ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
