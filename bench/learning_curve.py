"""Training loss per step: the 2-stage pipeline (K=2, `staleness` none, predict, predict2) against synchronous
training, and each against its own arithmetic done in one process (`ravnest.pipeline.single_process`), which
it must match: what the pipeline learns per step is then the algorithm's, not the machinery's.

    python -m bench.learning_curve [--steps 80] [--seed 0] [--batch-size 256]

Prints the mean loss of the last 20 micro-batches every 10 steps (what a stage reports), and the test
accuracy each pipeline reaches. Same model, data and optimizer as bench.pipeline.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from bench.pipeline import balanced_cut, make_job
from ravnest.pipeline import run_local_pipeline
from ravnest.pipeline.single_process import two_stage_reference

WINDOW = 20  # micro-batches a stage's reported loss averages (StageClock's loss window)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    marks = range(10, args.steps + 1, 10)
    job = make_job(args.steps, args.batch_size, seed=args.seed)
    ranges = balanced_cut(job, 2)
    cut = ranges[0][1]
    print(f"step                  {' '.join(f'{s:6d}' for s in marks)}")

    def row(name: str, curve: dict[int, float]) -> None:
        print(f"{name:22s}{' '.join(f'{curve[s]:6.3f}' for s in marks)}", flush=True)

    def reported_like_a_stage(losses: list[float]) -> dict[int, float]:
        return {s: statistics.mean(losses[max(0, s - WINDOW):s]) for s in marks}

    _, losses = two_stage_reference(job, cut, "sync")
    row("synchronous", reported_like_a_stage(losses))
    for staleness, forward_weights in (("none", "stale"), ("predict", "predict"), ("predict2", "predict2")):
        piped_job = make_job(args.steps, args.batch_size, 2, staleness, args.seed)
        piped = run_local_pipeline(piped_job, ranges)
        reported = {int(h["step"]): h["loss"] for h in piped["history"][-1] if "loss" in h}
        _, losses = two_stage_reference(piped_job, cut, forward_weights)
        row(f"pipeline, {staleness}", reported)
        row("  its arithmetic", reported_like_a_stage(losses))
        print(f"  test accuracy {piped['metrics']['test_accuracy']:.4f}", flush=True)


if __name__ == "__main__":
    main()
