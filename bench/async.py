"""Asynchronous and communication-light averaging: a slow replica, and 8 replicas on a cycle.

    python -m bench.async [--steps 200] [--cycle-steps 1000] [--repeat 3] [--shards by-label] [--no-docs]
    python -m bench.async --communications [--seeds 3] [--no-docs]

Part 1: 4 replicas of the digits CNN, each its own process (one torch thread, loopback gRPC), one
of them 3x slower (it sleeps twice its own step time after every step). Utilization of the three
fast ones (steady state: the share of their wall time spent computing) with `acid`, which never
makes a step wait, against `dear`, synchronous all-reduce, where every step waits for the slow one;
medians of `--repeat` runs.

Part 2: 8 replicas on a cycle (`topology: ring`), each on its eighth of digits, every replica a
thread of this process (so one thread can watch them all): `dear` (the synchronous all-reduce
reference), `acid` against its eta = 0 baseline at the same number of pairwise averagings (1 and
1/4 per step) and at twice as many, `ada`, and `diloco` with H = 50 and int8 on the wire. For each:
the final test accuracy, the first step at which replica 0 evaluates at or above the target, the
replicas' median relative consensus distance while training, and the model copies each member
sends per step (a ring all-reduce sends 2 (n-1)/n of the vector per round).

Last line: `async fast_replica_utilization=<u> allreduce_utilization=<v>` (target u >= 0.9).

`--communications` (instead): averagings for a given accuracy. 8 replicas on a cycle, shards by label
(each replica sees a few classes, so a replica's own model is only as good as what gossip brings it),
300 steps, acid and its eta = 0 baseline at 1, 1/2, 1/4 and 1/8 averagings per step, seeds 0..n-1.
Measured: each replica's own model (acid evaluates its local weights), the test accuracy averaged over
the 8 replicas and over the evaluations of the second half of training; medians over seeds. For each
accuracy the baseline reaches, the fewest averagings per member with which each reaches it. Last line:
`acid fewer_communications=<true|false>`: true when acid never needs more averagings than eta = 0 for
any of those accuracies, and fewer for at least one.
"""
from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

from ravnest.pipeline.local import run_local_clusters, run_threaded_clusters
from ravnest.spec import JobSpec

TARGET_ACCURACY = 0.95


def job(averaging: dict, steps: int, eval_every: int = 0, seed: int = 0, shards: str = "interleaved") -> JobSpec:
    return JobSpec.model_validate({
        "model": {"name": "cnn"}, "dataset": {"name": "digits", "shards": shards},
        "training": {"steps": steps, "batch_size": 32, "seed": seed, "staleness": "none", "eval_every": eval_every,
                     "optimizer": {"name": "Adam", "kwargs": {"lr": 1e-3}}},
        "averaging": averaging})


SLOW_CLUSTER = 3  # the last of the 4 replicas


def three_times_slower(cluster: int, stage: int, runner) -> None:
    """Run in the slow replica's own process (pickled there by name): every optimizer step is
    followed by a sleep of twice the time since the previous one ended."""
    if cluster != SLOW_CLUSTER:
        return
    optimizer = runner.optimizer
    step, last = optimizer.step, [time.perf_counter()]

    def slow(*args, **kwargs):
        step(*args, **kwargs)
        time.sleep(2 * (time.perf_counter() - last[0]))
        last[0] = time.perf_counter()
    optimizer.step = slow


def fast_utilization(strategy: str, steps: int) -> float:
    clusters = run_local_clusters(job({"strategy": strategy, "every": 1, "topology": "ring"}, steps),
                                  [[(0, 4)]] * (SLOW_CLUSTER + 1), timeout=600, setup=three_times_slower)
    return statistics.mean(c["stages"][0]["steady_utilization"] for c in clusters[:SLOW_CLUSTER])


class Consensus:
    """How far apart the replicas are: at every `every`-th step, each replica's weights as that step
    left them (after its averaging), and per step the mean over replicas of ||x_i - x||^2 / ||x||^2,
    x their mean (relative consensus distance: what gossip keeps small and A2CiD2's momentum is
    built to shrink)."""

    def __init__(self, every: int = 10):
        self.every = every
        self._weights: dict[int, dict[int, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def attach(self, runners) -> None:
        if runners[0][0].assignment.averaging.strategy == "dear":
            return  # its all-gather lands the step's update just before the next forward, not after the step
        for rank, (runner, *_) in enumerate(runners):
            self._watch(rank, runner)

    def _watch(self, rank: int, runner) -> None:
        live, averager = runner.live_tensors(), runner.averager
        keys = sorted(k for k, t in live.items() if t.is_floating_point())
        after_step = averager.after_step

        def recorded(step: int) -> None:
            after_step(step)
            if step % self.every == 0:
                weights = torch.cat([live[k].flatten() for k in keys])
                with self._lock:
                    self._weights.setdefault(step, {})[rank] = weights
        averager.after_step = recorded

    def median(self) -> float:
        distances = []
        for by_rank in self._weights.values():
            stacked = torch.stack(list(by_rank.values()))
            mean = stacked.mean(0)
            distances.append(float((stacked - mean).pow(2).sum(1).mean() / mean.pow(2).sum()))
        return statistics.median(distances) if distances else None


def cycle_run(averaging: dict, steps: int, shards: str = "interleaved") -> dict:
    consensus = Consensus()
    clusters = run_threaded_clusters(job({"topology": "ring", **averaging}, steps, eval_every=10, shards=shards),
                                     [[(0, 4)]] * 8, timeout=1800, setup=consensus.attach)
    history = clusters[0]["history"][0]
    evaluations = [(h["step"], h["test_accuracy"]) for h in history if "test_accuracy" in h]
    reached = next((int(step) for step, accuracy in evaluations if accuracy >= TARGET_ACCURACY), None)
    return {"accuracy": clusters[0]["metrics"]["test_accuracy"], "reached": reached,
            "rounds": clusters[0]["stages"][0]["avg_rounds"], "consensus": consensus.median(),
            "losses": [round(h["loss"], 3) for h in history if "loss" in h][:: max(1, len(history) // 8)]}


RUNS = {  # name: (averaging, model copies each member sends per step; None where it varies)
    "dear (all-reduce)": ({"strategy": "dear"}, 2 * 7 / 8),
    "acid": ({"strategy": "acid"}, 1.0),
    "acid eta=0": ({"strategy": "acid", "acid": {"eta": 0.0}}, 1.0),
    "acid rate 1/4": ({"strategy": "acid", "acid": {"rate": 0.25}}, 0.25),
    "acid eta=0 rate 1/4": ({"strategy": "acid", "acid": {"rate": 0.25, "eta": 0.0}}, 0.25),
    "acid eta=0 rate 1/2": ({"strategy": "acid", "acid": {"rate": 0.5, "eta": 0.0}}, 0.5),
    "ada": ({"strategy": "ada", "every": 1}, None),  # 1 to 7 copies per step, as its graph moves
    "diloco H=50 int8": ({"strategy": "diloco", "every": 50, "codec": "int8"}, 2 * 7 / 8 / 4 / 50),
}


RATES = (1.0, 0.5, 0.25, 0.125)
COMMUNICATION_STEPS = 300


def replicas_accuracy(averaging: dict, seed: int) -> float:
    """The mean over replicas and over the second half's evaluations of each replica's own accuracy."""
    spec = job({"topology": "ring", **averaging}, COMMUNICATION_STEPS, eval_every=10, seed=seed, shards="by-label")
    by_step: dict[int, list[float]] = {}
    for cluster in run_threaded_clusters(spec, [[(0, 4)]] * 8, timeout=1800):
        for report in cluster["history"][0]:
            if "test_accuracy" in report and COMMUNICATION_STEPS // 2 <= report["step"] < COMMUNICATION_STEPS:
                by_step.setdefault(int(report["step"]), []).append(report["test_accuracy"])
    return statistics.mean(statistics.mean(accuracies) for accuracies in by_step.values())


def communications(seeds: int, docs: bool, argv: list[str] | None) -> None:
    load = os.getloadavg()[0]
    measured: dict[tuple[str, float], list[float]] = {}
    for seed in range(seeds):
        for rate in RATES:
            for name, eta in (("acid", {}), ("acid eta=0", {"eta": 0.0})):
                runs = measured.setdefault((name, rate), [])
                runs.append(replicas_accuracy({"strategy": "acid", "acid": {"rate": rate, **eta}}, seed))
                print(f"seed {seed} {name} rate {rate:g}: {runs[-1]:.4f}", flush=True)
    median = {key: statistics.median(runs) for key, runs in measured.items()}
    rows = [f"| {rate:g} | {rate * COMMUNICATION_STEPS:.0f} | {median['acid', rate]:.4f} "
            f"({', '.join(f'{a:.3f}' for a in measured['acid', rate])}) | {median['acid eta=0', rate]:.4f} "
            f"({', '.join(f'{a:.3f}' for a in measured['acid eta=0', rate])}) |" for rate in RATES]

    def fewest(name: str, accuracy: float) -> float | None:  # averagings per member to reach `accuracy`
        rates = [rate for rate in RATES if median[name, rate] >= accuracy]
        return min(rates) * COMMUNICATION_STEPS if rates else None
    targets = [(median["acid eta=0", rate], fewest("acid", median["acid eta=0", rate]), rate * COMMUNICATION_STEPS)
               for rate in RATES]
    never_more = all(a is not None and a <= e for _, a, e in targets)
    fewer = never_more and any(a < e for _, a, e in targets)
    reach = "; ".join(f"{accuracy:.4f}: acid {'never' if a is None else f'{a:.0f}'}, eta=0 {e:.0f}"
                      for accuracy, a, e in targets)
    table = ("| averagings per step | averagings per member | acid: replicas' accuracy (median; runs) | "
             "eta=0: replicas' accuracy (median; runs) |\n|---|---|---|---|\n" + "\n".join(rows))
    print(table)
    print(f"averagings per member to reach each accuracy eta=0 reaches: {reach}")
    if docs:
        from bench.common import command_line, write_section
        write_section("A2CiD2: averagings for a given accuracy", (
            f"`{command_line('bench.async', argv).strip()}`\n\n"
            f"8 replicas of the digits CNN on a cycle (`topology: ring`), shards by label (each replica sees a "
            f"few classes), {COMMUNICATION_STEPS} steps, batch 32, Adam (lr 1e-3), each replica a thread of one "
            f"process. Accuracy: each replica's own model on the test set (what acid evaluates: its local "
            f"weights), the mean over the 8 replicas and over the evaluations (every 10 steps) of the second "
            f"half of training; medians over seeds 0-{seeds - 1}. acid's momentum keeps each replica closer to "
            f"the others, which is what a replica's own model shows; the final model (the exact average "
            f"`finish` takes) varies too much from seed to seed on this split to compare (0.50-0.94 in a "
            f"sweep of ours).\n\n{table}\n\n"
            f"Averagings per member each needs to reach each accuracy the eta = 0 baseline reaches: {reach}. "
            f"acid never needs more, and fewer for at least one: {str(fewer).lower()}.\n\n"
            f"Machine: {os.cpu_count()} cores, load average {load:.1f} at the start.\n"))
    print(f"acid fewer_communications={str(fewer).lower()}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="part 1's steps")
    parser.add_argument("--cycle-steps", type=int, default=1000, help="part 2's steps (diloco H=50: 20 rounds)")
    parser.add_argument("--repeat", type=int, default=3, help="part 1's runs per strategy (medians)")
    parser.add_argument("--shards", choices=("interleaved", "by-label"), default="interleaved",
                        help="part 2's data split (by-label: each replica sees a few classes)")
    parser.add_argument("--communications", action="store_true",
                        help="instead: averagings for a given accuracy, acid against eta = 0 (by-label shards)")
    parser.add_argument("--seeds", type=int, default=3, help="--communications: seeds per setting (medians)")
    parser.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    torch.set_num_threads(1)
    if args.communications:
        communications(args.seeds, not args.no_docs, argv)
        return
    measured: dict[str, list[float]] = {"acid": [], "dear": []}
    for _ in range(args.repeat):
        for strategy, runs in measured.items():
            runs.append(fast_utilization(strategy, args.steps))
    utilization = {strategy: statistics.median(runs) for strategy, runs in measured.items()}
    part1 = ", ".join(f"{strategy} {utilization[strategy]:.2f} ({', '.join(f'{u:.2f}' for u in runs)})"
                      for strategy, runs in measured.items())
    print(f"one replica 3x slower: fast replicas' utilization {part1}", flush=True)

    rows, results = [], {}
    for name, (averaging, vectors_per_step) in RUNS.items():
        result = results[name] = cycle_run(averaging, args.cycle_steps, args.shards)
        sent = "-" if vectors_per_step is None else f"{vectors_per_step:.4f}"
        rows.append(f"| {name} | {result['accuracy']:.4f} | {result['reached'] or '-'} | {result['rounds']:.0f} "
                    f"| {sent} | {'-' if result['consensus'] is None else format(result['consensus'], '.2e')} "
                    f"| {result['losses']} |")
        print(rows[-1], flush=True)
    table = ("| strategy | test accuracy | first step at >= %.2f | averaging rounds | model copies sent per step "
             "per member | consensus distance (median) | training loss (every few reports) |\n"
             "|---|---|---|---|---|---|---|\n" % TARGET_ACCURACY + "\n".join(rows))
    print(table)
    closer = {rate: results[f"acid eta=0{rate}"]["consensus"] / results[f"acid{rate}"]["consensus"]
              for rate in ("", " rate 1/4")}
    diloco_gap = results["dear (all-reduce)"]["accuracy"] - results["diloco H=50 int8"]["accuracy"]
    print(f"consensus distance of eta=0 over acid's: {closer['']:.2f} at 1 averaging per step, "
          f"{closer[' rate 1/4']:.2f} at 1/4; diloco H=50 int8 is {100 * diloco_gap:.2f} points below all-reduce")
    if not args.no_docs:
        from bench.common import command_line, write_section
        command = command_line("bench.async", argv)
        write_section("Asynchronous and communication-light averaging", (
            f"`{command.strip()}`\n\n"
            f"Digits CNN, batch 32 per replica, Adam (lr 1e-3), one torch thread per replica, loopback gRPC.\n\n"
            f"**One of 4 replicas 3x slower** (it sleeps twice its step time after each step; {args.steps} steps; "
            f"each replica its own process): the fast replicas' steady utilization is {utilization['acid']:.2f} "
            f"with acid and {utilization['dear']:.2f} with dear (synchronous all-reduce: every step waits for the "
            f"slow one); medians of {args.repeat} runs: {part1}.\n\n"
            f"**8 replicas on a cycle**, {args.cycle_steps} steps, shards {args.shards}, each replica a thread of "
            f"one process; the first step at which replica 0 evaluates at or above {TARGET_ACCURACY} (every 10 "
            f"steps); consensus distance: the median over every 10th step of the mean over replicas of "
            f"||x_i - x||^2 / ||x||^2 (each replica's weights as the step and its averaging left them, x their "
            f"mean; none for dear, whose replicas are equal whenever they compute); model copies sent per step "
            f"per member: a ring "
            f"all-reduce sends 2 (n-1)/n per round, diloco one round every 50 steps at a quarter of the bytes "
            f"(int8). The consensus distance of acid's eta = 0 baseline over acid's, with the same averagings: "
            f"{closer['']:.2f} at one per step, {closer[' rate 1/4']:.2f} at one per 4 steps; diloco is "
            f"{100 * diloco_gap:.2f} points below all-reduce while sending {2 * 7 / 8 / (2 * 7 / 8 / 4 / 50):.0f}x "
            f"fewer bytes.\n\n{table}\n\n"
            f"Machine: {os.cpu_count()} cores, load average {load:.1f} at the start.\n"))
    print(f"async fast_replica_utilization={utilization['acid']:.2f} allreduce_utilization={utilization['dear']:.2f}")


if __name__ == "__main__":
    main()
