"""Recovery: how long a job stands still when a node dies, and what the death costs the whole job.

Real processes on loopback: a coordinator and 5 nodes; the README's digits CNN as 2 clusters x 2
stages (placement.max_nodes 4, so one node is spare). Runs alternate between a clean run and one in
which a working node (cluster 1, stage 0: a pipeline neighbour and a ring member) gets SIGKILL at 30%
progress; a fresh node then joins so every run starts with a spare. Reported: the time from the kill
to the first step trained after the re-plan (`recovery_s`), the steps the intact cluster trained on
alone meanwhile and the longest it stood still (the largest gap between its reports on the job's
curve, one every 10 steps), the steps trained twice, the test accuracy, and the ratio of the job's
wall time with a kill against the clean runs.

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
        times = [point["at"] for point in cluster.http.get(f"/v1/jobs/{job_id}/curve").json() if point["cluster"] == 0]
        figures.update(recovery_s=recovery["recovery_s"], trained_on=recovery["steps_trained_on"],
                       intact_still_s=max(b - a for a, b in zip(times, times[1:])), redone=recovery["steps_redone"],
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
                     f"{k['recovery_s']:.1f} | {k['trained_on']} | {k['intact_still_s']:.1f} | "
                     f"{c['accuracy']:.4f} | {k['accuracy']:.4f} |"
                     for i, (c, k) in enumerate(zip(clean, killed)))
    text = (f"`python -m bench.recovery --runs {args.runs} --steps {args.steps}`: digits CNN, 2 clusters x 2 stages "
            f"+ 1 spare, 5 local node processes; in each killed run a working node gets SIGKILL at 30%.\n\n"
            f"| run | clean job s | killed job s | step reached -> resumed | kill to training again s | "
            f"intact cluster trained on, steps | intact cluster stood still s | clean accuracy | killed accuracy |\n"
            f"|---|---|---|---|---|---|---|---|---|\n{rows}\n\n"
            f"Median time from the kill to training again: **{median(killed, 'recovery_s'):.1f} s**; the intact "
            f"cluster trained on {median(killed, 'trained_on'):.0f} steps alone meanwhile and stood still "
            f"**{median(killed, 'intact_still_s'):.1f} s** at most; the killed job takes **{ratio:.2f}x** the clean "
            f"job's wall time (medians). The recovery is mostly heartbeat round trips (2 s interval): the dead "
            f"node's pipeline neighbour reports at once; the intact cluster's averaging fails and leaves it "
            f"training alone (or it hears `train_alone` on its next heartbeat) until the lost cluster's "
            f"survivors have handed in their state and the dead node has been silent for two intervals, or "
            f"until it trained `averaging.every` steps alone (50 here, less than a second of this small job, "
            f"so it usually stops there and hands in its state); the re-planned assignments go out with "
            f"heartbeats too.")
    if not args.no_docs:
        write_section("Recovery", text)
    print(f"recovery median_recovery_s={median(killed, 'recovery_s'):.2f} job_time_ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
