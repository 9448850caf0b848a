"""Pipeline speedup and learning: one model trained in one process against the same model cut into
an asynchronous pipeline (one process per stage on loopback gRPC), each process on one torch thread.

Two cuts from the partitioner: 2 stages with K=2 and 4 stages with K=4 micro-batches in flight. The
model is a wide MLP, so compute dominates the activations that cross the cuts. Both sides train on the
same samples for the same number of optimizer steps; throughput and utilization are taken over the
steady state (20%-90% of the steps); test accuracy is compared on the same test set.

    python -m bench.pipeline [--quick] [--repeat N] [--staleness MODE ...] [--no-docs]

With several --staleness modes it also tabulates the test accuracy each reaches (docs/pipeline.md
quotes that table). The last line printed is
`pipeline speedup=<x> utilization=<u> accuracy_gap=<single minus pipeline, worst of the cuts>`
for the first mode (the 2-stage cut's speedup and utilization).
"""
from __future__ import annotations

import argparse
import os
import statistics
import typing

import torch

from ravnest.models import build_model, profile_blocks
from ravnest.partition import NodeCapacity, partition
from ravnest.pipeline import run_local_pipeline, run_single_process
from ravnest.spec import JobSpec, TrainingSettings
from ravnest.wire.transport import keep_freed_buffers

MODEL = {"name": "mlp", "config": {"input_dim": 64, "hidden": 1536, "depth": 6, "num_classes": 10}}
CUTS = (2, 4)  # stages; K = stages
DEFAULT_STALENESS = TrainingSettings.model_fields["staleness"].default
MODES = typing.get_args(TrainingSettings.model_fields["staleness"].annotation)


def make_job(steps: int, batch_size: int, in_flight: int | None = None, staleness: str = DEFAULT_STALENESS,
             seed: int = 0) -> JobSpec:
    return JobSpec.model_validate({
        "model": MODEL, "dataset": {"name": "digits"},
        "training": {"steps": steps, "batch_size": batch_size, "microbatches_in_flight": in_flight, "seed": seed,
                     "staleness": staleness, "optimizer": {"name": "Adam", "kwargs": {"lr": 1e-4}}}})


def balanced_cut(job: JobSpec, stages: int) -> list[tuple[int, int]]:
    """Cut points minimising the slowest stage over identical nodes with a fast link."""
    spec = build_model(job.model.name, job.model.config)
    costs = profile_blocks(spec, job.training.batch_size)
    node = NodeCapacity(flops=1e10, memory_bytes=1 << 40, bandwidth_to_next=1e9)
    return partition(costs, [node] * stages).ranges


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (noisier figures)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per figure, seeds 0, 1, ... (medians quoted)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--staleness", nargs="+", choices=MODES, default=[DEFAULT_STALENESS])
    parser.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    args = parser.parse_args(argv)
    steps = 40 if args.quick else 150
    load = os.getloadavg()[0]  # other work on the machine skews every figure below
    torch.set_num_threads(1)
    keep_freed_buffers()  # the allocator setting every stage process has (via PeerServer): only pipelining differs
    cuts = {stages: balanced_cut(make_job(steps, args.batch_size), stages) for stages in CUTS}
    print(f"model {MODEL['config']}, batch {args.batch_size}, {steps} Adam steps, cuts {list(cuts.values())}",
          flush=True)
    single: dict[int, dict] = {}  # seed -> metrics
    runs: dict[tuple[str, int], list[dict]] = {}  # (staleness, stages) -> per-seed pipeline metrics
    for seed in range(args.repeat):  # alternated, so load changes hit both sides alike
        single[seed] = run_single_process(make_job(steps, args.batch_size, seed=seed))["metrics"]
        print(f"seed {seed} single process: {single[seed]['steady_samples_per_s']:.0f} samples/s, test accuracy "
              f"{single[seed]['test_accuracy']:.4f}", flush=True)
        for mode in args.staleness:
            for stages, ranges in cuts.items():
                piped = run_local_pipeline(make_job(steps, args.batch_size, stages, mode, seed), ranges)
                metrics = {**piped["metrics"], "seed": seed,
                           "utilization": statistics.mean(s["steady_utilization"] for s in piped["stages"]),
                           "staleness": statistics.mean(s["staleness"] for s in piped["stages"])}
                runs.setdefault((mode, stages), []).append(metrics)
                print(f"seed {seed} {mode:12s} {stages} stages K={stages}: {metrics['steady_samples_per_s']:.0f} "
                      f"samples/s (x{metrics['steady_samples_per_s'] / single[seed]['steady_samples_per_s']:.2f}), "
                      f"utilization {metrics['utilization']:.2f}, mean staleness {metrics['staleness']:.2f} steps, "
                      f"test accuracy {metrics['test_accuracy']:.4f}",
                      flush=True)

    def median(mode: str, stages: int, figure: str) -> float:
        if figure == "speedup":
            return statistics.median(r["steady_samples_per_s"] / single[r["seed"]]["steady_samples_per_s"]
                                     for r in runs[(mode, stages)])
        return statistics.median(r[figure] for r in runs[(mode, stages)])

    single_accuracy = statistics.median(m["test_accuracy"] for m in single.values())
    rows = [f"| {mode} | {stages} | {median(mode, stages, 'speedup'):.2f} | {median(mode, stages, 'utilization'):.2f} "
            f"| {1 - median(mode, stages, 'utilization'):.2f} | {median(mode, stages, 'staleness'):.2f} "
            f"| {median(mode, stages, 'test_accuracy'):.4f} | "
            f"{', '.join('%.3f' % r['test_accuracy'] for r in runs[(mode, stages)])} |"
            for mode in args.staleness for stages in CUTS]
    table = ("| staleness | stages (K) | speedup | utilization | bubble | mean staleness (steps) "
             "| test accuracy (median) | runs |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))
    first = args.staleness[0]
    speedup, utilization = median(first, 2, "speedup"), median(first, 2, "utilization")
    gap = max(single_accuracy - median(first, stages, "test_accuracy") for stages in CUTS)
    print(f"single process test accuracy {single_accuracy:.4f} (median)\n{table}")
    if not args.no_docs:
        from bench.common import command_line, write_section
        command = command_line("bench.pipeline", argv)
        write_section("Pipeline", (
            f"`{command.strip()}`\n\n"
            f"MLP {MODEL['config']} on digits, batch {args.batch_size}, {steps} Adam steps (lr 1e-4), cuts "
            f"{list(cuts.values())} from the partitioner; one process on one torch thread against one process "
            f"per stage on one torch thread each (loopback gRPC), the same samples in both; seeds 0-"
            f"{args.repeat - 1}, medians. Speedup and utilization over the steady state (20%-90% of the "
            f"steps); bubble = 1 - utilization; mean staleness = optimizer steps between a micro-batch's "
            f"forward and its weight gradient, averaged over stages. Single process test accuracy "
            f"{single_accuracy:.4f} (median).\n\n{table}\n\n"
            f"Machine: {os.cpu_count()} cores, load average {load:.1f} at the start (other work shares it, "
            f"so figures are noisy).\n"))
    print(f"pipeline speedup={speedup:.2f} utilization={utilization:.2f} accuracy_gap={gap:.4f}")


if __name__ == "__main__":
    main()
