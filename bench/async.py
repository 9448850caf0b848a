"""Asynchronous and communication-light averaging: a slow replica, and 8 replicas on a cycle.

    python -m bench.async [--steps 200] [--no-docs]

Part 1: 4 replicas of the digits CNN, one of them 3x slower (it sleeps twice its own step time
after every step). Utilization of the three fast ones (steady state: the share of their wall time
spent computing) with `acid`, which never makes a step wait, against `dear`, synchronous
all-reduce, where every step waits for the slow one.

Part 2: 8 replicas on a cycle (`topology: ring`), each on its eighth of digits, against `dear`
(the synchronous all-reduce reference): `acid` and its eta = 0 baseline (steps, hence pairwise
averagings, until the local replica first evaluates at or above the target accuracy), `ada`, and
`diloco` with H = 50 and int8 on the wire (final accuracy, and bytes each member sends: a ring
all-reduce sends 2 (n-1)/n of the vector per round). Every stage is a thread of this process on
loopback gRPC, one torch thread each.

Last line: `async fast_replica_utilization=<u> allreduce_utilization=<v>` (target u >= 0.9).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ravnest.pipeline.local import run_threaded_clusters
from ravnest.spec import JobSpec

TARGET_ACCURACY = 0.95


def job(averaging: dict, steps: int, eval_every: int = 0, seed: int = 0) -> JobSpec:
    return JobSpec.model_validate({
        "model": {"name": "cnn"}, "dataset": {"name": "digits"},
        "training": {"steps": steps, "batch_size": 32, "seed": seed, "staleness": "none", "eval_every": eval_every,
                     "optimizer": {"name": "Adam", "kwargs": {"lr": 1e-3}}},
        "averaging": averaging})


def three_times_slower(runners) -> None:
    optimizer = runners[-1][0].optimizer
    step, last = optimizer.step, [time.perf_counter()]

    def slow(*args, **kwargs):
        step(*args, **kwargs)
        time.sleep(2 * (time.perf_counter() - last[0]))
        last[0] = time.perf_counter()
    optimizer.step = slow


def fast_utilization(strategy: str, steps: int) -> float:
    clusters = run_threaded_clusters(job({"strategy": strategy, "every": 1, "topology": "ring"}, steps),
                                     [[(0, 4)]] * 4, timeout=600, setup=three_times_slower)
    return statistics.mean(c["stages"][0]["steady_utilization"] for c in clusters[:-1])


def cycle_run(averaging: dict, steps: int) -> dict:
    clusters = run_threaded_clusters(job({"topology": "ring", **averaging}, steps, eval_every=10), [[(0, 4)]] * 8,
                                     timeout=900)
    history = clusters[0]["history"][0]
    evaluations = [(h["step"], h["test_accuracy"]) for h in history if "test_accuracy" in h]
    reached = next((int(step) for step, accuracy in evaluations if accuracy >= TARGET_ACCURACY), None)
    return {"accuracy": clusters[0]["metrics"]["test_accuracy"], "reached": reached,
            "rounds": clusters[0]["stages"][0]["avg_rounds"],
            "losses": [round(h["loss"], 3) for h in history if "loss" in h][:: max(1, len(history) // 8)]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    torch.set_num_threads(1)
    utilization = {strategy: fast_utilization(strategy, args.steps) for strategy in ("acid", "dear")}
    print(f"one replica 3x slower: fast replicas' utilization acid {utilization['acid']:.2f}, "
          f"dear {utilization['dear']:.2f}", flush=True)

    runs = {
        "dear (all-reduce)": ({"strategy": "dear"}, 2 * 7 / 8),
        "acid": ({"strategy": "acid"}, 1.0),
        "acid eta=0": ({"strategy": "acid", "acid_eta": 0.0}, 1.0),
        "ada": ({"strategy": "ada", "every": 1}, None),  # 1 to 7 copies per step, as its graph moves
        "diloco H=50 int8": ({"strategy": "diloco", "every": 50, "codec": "int8"}, 2 * 7 / 8 / 4 / 50),
    }
    rows, results = [], {}
    for name, (averaging, vectors_per_step) in runs.items():
        result = results[name] = cycle_run(averaging, args.steps)
        sent = "-" if vectors_per_step is None else f"{vectors_per_step:.4f}"
        rows.append(f"| {name} | {result['accuracy']:.4f} | {result['reached'] or '-'} | {result['rounds']:.0f} "
                    f"| {sent} | {result['losses']} |")
        print(rows[-1], flush=True)
    table = ("| strategy | test accuracy | first step at >= %.2f | averaging rounds | model copies sent per step "
             "per member | training loss (every few reports) |\n|---|---|---|---|---|---|\n" % TARGET_ACCURACY
             + "\n".join(rows))
    print(table)
    if not args.no_docs:
        from bench.common import command_line, write_section
        command = command_line("bench.async", argv)
        write_section("Asynchronous and communication-light averaging", (
            f"`{command.strip()}`\n\n"
            f"Digits CNN, batch 32 per replica, {args.steps} Adam steps (lr 1e-3); every stage a thread of one "
            f"process on loopback gRPC, one torch thread each.\n\n"
            f"One of 4 replicas 3x slower (it sleeps twice its step time after each step): the fast replicas' "
            f"steady utilization is {utilization['acid']:.2f} with acid and {utilization['dear']:.2f} with dear "
            f"(synchronous all-reduce: every step waits for the slow one).\n\n"
            f"8 replicas on a cycle; the first step at which cluster 0's replica evaluates at or above "
            f"{TARGET_ACCURACY} (every 10 steps) counts the pairwise averagings acid needed (one per step per "
            f"member at acid_rate 1); model copies sent per step per member: a ring all-reduce sends 2 (n-1)/n "
            f"per round, diloco one round every 50 steps at a quarter of the bytes (int8).\n\n{table}\n\n"
            f"Machine: {os.cpu_count()} cores, load average {load:.1f} at the start.\n"))
    print(f"async fast_replica_utilization={utilization['acid']:.2f} allreduce_utilization={utilization['dear']:.2f}")


if __name__ == "__main__":
    main()
