"""Pipeline speedup: one model trained in one process against the same model cut into a 2-stage
asynchronous pipeline (two processes on loopback gRPC), each process on one torch thread.

The model is a wide MLP, so compute dominates the activations that cross the cut; the cut comes from
the partitioner over the model's per-block cost profile. Both runs train the same number of samples;
throughput and utilization are taken over the steady state (20%-90% of the steps).

    python -m bench.pipeline [--quick] [--repeat N] [--no-docs]

The last line printed is `pipeline speedup=<x> utilization=<u>`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from ravnest.models import build_model, profile_blocks
from ravnest.partition import NodeCapacity, partition
from ravnest.pipeline import run_local_pipeline, run_single_process
from ravnest.spec import JobSpec
from ravnest.wire.transport import keep_freed_buffers

MODEL = {"name": "mlp", "config": {"input_dim": 64, "hidden": 1536, "depth": 6, "num_classes": 10}}


def make_job(steps: int, batch_size: int, in_flight: int | None = None) -> JobSpec:
    return JobSpec.model_validate({
        "model": MODEL, "dataset": {"name": "digits"},
        "training": {"steps": steps, "batch_size": batch_size, "microbatches_in_flight": in_flight,
                     "optimizer": {"name": "Adam", "kwargs": {"lr": 1e-4}}}})


def balanced_cut(job: JobSpec, stages: int) -> list[tuple[int, int]]:
    """Cut points minimising the slowest stage over identical nodes with a fast link."""
    spec = build_model(job.model.name, job.model.config)
    costs = profile_blocks(spec, job.training.batch_size)
    node = NodeCapacity(flops=1e10, memory_bytes=1 << 40, bandwidth_to_next=1e9)
    return partition(costs, [node] * stages).ranges


def measure_once(job: JobSpec, ranges: list[tuple[int, int]]) -> tuple[float, float, float, list[float]]:
    """(single samples/s, pipeline samples/s, pipeline test accuracy, per-stage utilization)."""
    single = run_single_process(job)["metrics"]
    piped = run_local_pipeline(job, ranges, threads_per_stage=1)
    utilizations = [stage["steady_utilization"] for stage in piped["stages"]]
    print(f"single process {single['steady_samples_per_s']:.0f} samples/s (test accuracy "
          f"{single['test_accuracy']:.3f}); 2-stage pipeline {piped['metrics']['steady_samples_per_s']:.0f} "
          f"samples/s (test accuracy {piped['metrics']['test_accuracy']:.3f}), stage utilization "
          f"{', '.join(f'{u:.2f}' for u in utilizations)}, max in flight "
          f"{[int(s['max_in_flight']) for s in piped['stages']]}", flush=True)
    return (single["steady_samples_per_s"], piped["metrics"]["steady_samples_per_s"],
            piped["metrics"]["test_accuracy"], utilizations)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (noisier figures)")
    parser.add_argument("--repeat", type=int, default=1, help="alternate the two runs this many times")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--in-flight", type=int, default=None, help="staleness bound K (default: stages)")
    parser.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    args = parser.parse_args(argv)
    steps = 40 if args.quick else 150
    load = os.getloadavg()[0]  # other work on the machine skews every figure below
    job = make_job(steps, args.batch_size, args.in_flight)
    ranges = balanced_cut(job, 2)
    print(f"model {MODEL['config']}, batch {args.batch_size}, {steps} steps, cut {ranges}", flush=True)
    torch.set_num_threads(1)
    keep_freed_buffers()  # the allocator setting every stage process has (via PeerServer): only pipelining differs
    runs = [measure_once(job, ranges) for _ in range(args.repeat)]
    speedups = [piped / single for single, piped, _, _ in runs]
    utilizations = [statistics.mean(stages) for *_, stages in runs]
    speedup, utilization = statistics.median(speedups), statistics.median(utilizations)
    summary = (f"single {statistics.median(r[0] for r in runs):.0f} samples/s, pipeline "
               f"{statistics.median(r[1] for r in runs):.0f} samples/s, **speedup {speedup:.2f}** "
               f"(runs: {', '.join(f'{x:.2f}' for x in speedups)}), mean stage utilization "
               f"**{utilization:.2f}** (runs: {', '.join(f'{u:.2f}' for u in utilizations)})")
    print(summary)
    if not args.no_docs:
        from bench.common import write_section
        command = "python -m bench.pipeline " + " ".join(sys.argv[1:] if argv is None else argv)
        write_section("Pipeline", (
            f"`{command.strip()}`\n\n"
            f"MLP {MODEL['config']} on digits, batch {args.batch_size}, {steps} Adam steps, cut {ranges} from "
            f"the partitioner; one process on one torch thread against two stage processes on one torch "
            f"thread each (loopback gRPC, K={args.in_flight or len(ranges)} micro-batches in flight), the same "
            f"samples in both. Steady "
            f"state (20%-90% of the steps), medians over {args.repeat} alternated run(s): {summary}. "
            f"Machine: {os.cpu_count()} cores, load average {load:.1f} at the start "
            f"(other work shares it, so figures are noisy).\n"))
    print(f"pipeline speedup={speedup:.2f} utilization={utilization:.2f}")


if __name__ == "__main__":
    main()
