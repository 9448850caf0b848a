"""Pipeline speedup and learning: one model trained in one process against the same model cut into
an asynchronous pipeline (one process per stage on loopback gRPC), each process on one torch thread.

Two cuts from the partitioner: 2 stages with K=2 and 4 stages with K=4 micro-batches in flight. The
model is a wide MLP, so compute dominates the activations that cross the cuts, and the batch (256) is
one whose matrix products outweigh the work per parameter that a step adds whatever the batch (the
optimizer step, weight prediction's copy and extrapolation): at 128 that work is an eighth of a stage's
time (docs/pipeline.md). Both sides train on the same samples for the same number of optimizer steps;
throughput and utilization are taken over the steady state (20%-90% of the steps); test accuracy is
compared on the same test set, seed by seed: a seed fixes the initial weights and the order of the
samples, so the accuracy gap is the median over seeds of (single process minus pipeline, same seed).

    python -m bench.pipeline [--quick] [--repeat N] [--staleness MODE ...] [--no-docs]
    python -m bench.pipeline --breakdown [--batch-size N]

`--breakdown` times, in this one process and with nothing else running, a step of the single process
and each action of the 2-stage cut's two stages (stage 0 predicting one step ahead as the default
compensation does with K=2, its forward taking the step's copy of the weights as in the pipeline), so
what the stages add to the single process's work is seen action by action.

Each run's line gives every stage's utilization and mean staleness, first stage first, and the table
their means over the stages. With several --staleness modes it also tabulates the test accuracy each
reaches (docs/pipeline.md quotes that table). The last line printed is
`pipeline speedup=<x> utilization=<u> accuracy_gap=<that median, worst of the cuts>`
for the first mode (the 2-stage cut's speedup and utilization).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
import typing

import torch

from ravnest.models import build_model, profile_blocks
from ravnest.partition import NodeCapacity, partition
from ravnest.pipeline import run_local_pipeline, run_single_process
from ravnest.pipeline.optim import build_optimizer
from ravnest.pipeline.schedule import prediction_order, staleness_method
from ravnest.pipeline.stash import StageCompute
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


def per_stage(run: dict, figure: str) -> str:
    """One figure of every stage of a pipeline run, first stage first: "0.98/0.95"."""
    return "/".join(f"{stage[figure]:.2f}" for stage in run["stages"])


def breakdown(batch_size: int, rounds: int = 20) -> None:
    """Median milliseconds of each action: the single process's step against the 2-stage cut's stages."""
    job = make_job(rounds, batch_size)
    spec = build_model(job.model.name, job.model.config)
    (_, cut), _ = balanced_cut(job, 2)
    x, y = spec.example_input(batch_size), torch.randint(0, MODEL["config"]["num_classes"], (batch_size,))
    full = spec.full_model(seed=0)
    full_optimizer = build_optimizer(full.parameters(), job.training.optimizer)
    stage0 = StageCompute(spec.blocks(0, cut, seed=0), mode="stash", input_grad=False, device=torch.device("cpu"),
                          predict=prediction_order(staleness_method(DEFAULT_STALENESS, 2)))
    stage1 = StageCompute(spec.blocks(cut, seed=0), mode="stash", input_grad=True, device=torch.device("cpu"),
                          snapshots=False)
    optimizers = [build_optimizer(stage.module.parameters(), job.training.optimizer) for stage in (stage0, stage1)]
    activation = stage0.module(x).detach()
    grad = torch.randn_like(activation) * 1e-3

    def step(stage: StageCompute, optimizer: torch.optim.Optimizer) -> None:
        stage.before_step()
        optimizer.step()
        optimizer.zero_grad()
        stage.step_done()

    def single() -> None:
        spec.loss(full(x), y).backward()
        full_optimizer.step()
        full_optimizer.zero_grad()

    actions: dict[str, typing.Callable[[int], object]] = {
        "single process: forward, backward, step": lambda m: single(),
        "stage 0: F (predicting, taking the step's copy)": lambda m: stage0.forward(m, x, lookahead=1, last=True),
        "stage 0: W (its whole backward)": lambda m: (stage0.backward_input(m, grad), stage0.backward_weights(m)),
        "stage 0: step": lambda m: step(stage0, optimizers[0]),
        "stage 1: F (and the loss)": lambda m: stage1.forward(m, activation, loss_fn=lambda out: spec.loss(out, y)),
        "stage 1: B": lambda m: stage1.backward_input(m, None),
        "stage 1: W": lambda m: stage1.backward_weights(m),
        "stage 1: step": lambda m: step(stage1, optimizers[1]),
    }
    times: dict[str, list[float]] = {name: [] for name in actions}
    for m in range(rounds):
        for name, action in actions.items():
            start = time.perf_counter()
            action(m)
            times[name].append(time.perf_counter() - start)
    medians = {name: 1e3 * statistics.median(t[3:]) for name, t in times.items()}  # after a warm-up
    for name, ms in medians.items():
        print(f"{name:48s} {ms:7.1f} ms")
    stages = [sum(ms for name, ms in medians.items() if name.startswith(f"stage {s}")) for s in (0, 1)]
    single_ms = medians["single process: forward, backward, step"]
    print(f"stage 0 {stages[0]:.1f} ms, stage 1 {stages[1]:.1f} ms a step against {single_ms:.1f} for the single "
          f"process: at best a speedup of {single_ms / max(stages):.2f} (batch {batch_size})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (noisier figures)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per figure, seeds 0, 1, ... (medians quoted)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--staleness", nargs="+", choices=MODES, default=[DEFAULT_STALENESS])
    parser.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    parser.add_argument("--breakdown", action="store_true", help="time each stage action alone (no pipeline)")
    args = parser.parse_args(argv)
    steps = 40 if args.quick else 150
    load = os.getloadavg()[0]  # other work on the machine skews every figure below
    torch.set_num_threads(1)
    keep_freed_buffers()  # the allocator setting every stage process has (via PeerServer): only pipelining differs
    if args.breakdown:
        return breakdown(args.batch_size)
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
                      f"utilization {metrics['utilization']:.2f} (stages {per_stage(piped, 'steady_utilization')}), "
                      f"mean staleness {metrics['staleness']:.2f} steps (stages {per_stage(piped, 'staleness')}), "
                      f"test accuracy {metrics['test_accuracy']:.4f}",
                      flush=True)

    def median(mode: str, stages: int, figure: str) -> float:
        """Median over seeds; speedup and accuracy gap against the single process with the same seed."""
        if figure == "speedup":
            return statistics.median(r["steady_samples_per_s"] / single[r["seed"]]["steady_samples_per_s"]
                                     for r in runs[(mode, stages)])
        if figure == "gap":
            return statistics.median(single[r["seed"]]["test_accuracy"] - r["test_accuracy"]
                                     for r in runs[(mode, stages)])
        return statistics.median(r[figure] for r in runs[(mode, stages)])

    single_accuracy = statistics.median(m["test_accuracy"] for m in single.values())
    rows = [f"| {mode} | {stages} | {median(mode, stages, 'speedup'):.2f} | {median(mode, stages, 'utilization'):.2f} "
            f"| {1 - median(mode, stages, 'utilization'):.2f} | {median(mode, stages, 'staleness'):.2f} "
            f"| {median(mode, stages, 'test_accuracy'):.4f} | {median(mode, stages, 'gap'):.4f} | "
            f"{', '.join('%.3f' % r['test_accuracy'] for r in runs[(mode, stages)])} |"
            for mode in args.staleness for stages in CUTS]
    table = ("| staleness | stages (K) | speedup | utilization | bubble | mean staleness (steps) "
             "| test accuracy (median) | accuracy gap | runs |\n|---|---|---|---|---|---|---|---|---|\n"
             + "\n".join(rows))
    first = args.staleness[0]
    speedup, utilization = median(first, 2, "speedup"), median(first, 2, "utilization")
    gap = max(median(first, stages, "gap") for stages in CUTS)
    single_runs = ", ".join("%.3f" % single[seed]["test_accuracy"] for seed in sorted(single))
    print(f"single process test accuracy {single_accuracy:.4f} (median; runs {single_runs})\n{table}")
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
            f"forward and its weight gradient, averaged over stages; accuracy gap = median over seeds of "
            f"single process minus pipeline with the same seed. Single process test accuracy "
            f"{single_accuracy:.4f} (median; runs {single_runs}).\n\n{table}\n\n"
            f"Machine: {os.cpu_count()} cores, load average {load:.1f} at the start (other work shares it, "
            f"so figures are noisy).\n"))
    print(f"pipeline speedup={speedup:.2f} utilization={utilization:.2f} accuracy_gap={gap:.4f}")


if __name__ == "__main__":
    main()
