"""Averaging strategies side by side: the runtime model's prediction, the measured step time and the
accuracy of each, on the same data-parallel job.

    python -m bench.strategies [--replicas 4 8] [--repeat 3] [--quick] [--no-docs]

For each group size n: n replicas of an MLP on digits, one process each with one torch thread
(loopback gRPC), every replica averaging every step (`every` = 1, the like-for-like setting: dear is
per step by nature). First the inputs of the model are measured in the same run: the compute
seconds per step T and the standard deviation of single steps with strategy "none" (all n processes
training at once, so T carries the same sharing of the machine's cores as every strategy after it;
rounds wait for their slowest member), and the ring links' bandwidth and
latency from our ring all-reduce over n processes at two sizes (4 KiB and the model's size; the
fit is exact at both). Then each strategy runs and its step time is measured over the steady state
(20%-90% of the steps). Medians over `--repeat` runs.

Prints a table (strategy, topology, predicted ms, measured ms, error, test accuracy) and last
`strategies auto_pick_ok=<true|false> max_pred_error=<x>`: auto_pick_ok when the strategy the
runtime model picks (ravnest/averaging/runtime.py `pick`) measures within 5% of the fastest one
measured, for every n; max_pred_error = max |predicted - measured| / measured.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess

import torch

from bench.allreduce import TESTBED, run_ring
from ravnest.averaging import runtime
from ravnest.averaging.registry import strategy_info
from ravnest.models import build_model, profile_blocks
from ravnest.pipeline.local import run_local_clusters
from ravnest.spec import JobSpec

MODEL = {"name": "mlp", "config": {"hidden": 256, "depth": 4}}
BATCH = 64
GOSSIP_TOPOLOGIES = ("one-peer-exp", "alternating-exp-ring", "ring", "exponential", "complete")
SMALL = 1024  # fp32 elements of the latency probe


def job(strategy: str, steps: int, seed: int, topology: str = "one-peer-exp") -> JobSpec:
    averaging = {"strategy": strategy, "every": 1}
    if strategy_info(strategy).gossip:  # paced as a planner would on slow links (no planner runs here)
        averaging.update(topology=topology, paced=True)
    return JobSpec.model_validate({
        "model": MODEL, "dataset": {"name": "digits"},
        "training": {"steps": steps, "batch_size": BATCH, "seed": seed, "staleness": "none",
                     "optimizer": {"name": "Adam", "kwargs": {"lr": 1e-3}}},
        "averaging": averaging})


def measured(spec: JobSpec, replicas: int, blocks: int, places: list[tuple[str, str]] | None) -> dict[str, float]:
    """Median seconds per step (steady state) over the replicas, and cluster 0's test accuracy."""
    clusters = run_local_clusters(spec, [[(0, blocks)]] * replicas, timeout=900, places=places)
    samples_per_step = spec.training.batch_size * spec.training.accumulation
    step_s = statistics.median(samples_per_step / c["stages"][0]["steady_samples_per_s"] for c in clusters)
    return {"step_s": step_s, "step_sd_s": statistics.median(c["stages"][0]["steady_step_sd_s"] for c in clusters),
            "accuracy": clusters[0]["metrics"]["test_accuracy"]}


def ring_link(replicas: int, param_bytes: int, rounds: int,
              places: list[tuple[str, str]] | None) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) that make the runtime model's all-reduce time match ours over
    `replicas` processes at 4 KiB and at `param_bytes`."""
    where = {"netns": [n for n, _ in places], "hosts": [h for _, h in places]} if places else {}
    small = statistics.median(run_ring(replicas, SMALL, rounds=rounds, **where)["times"])
    large = statistics.median(run_ring(replicas, param_bytes // 4, rounds=rounds, **where)["times"])
    steps = 2 * (replicas - 1)
    bandwidth = (param_bytes - 4 * SMALL) / (replicas * max(large - small, 1e-9) / steps)
    latency = max(small / steps - 4 * SMALL / (replicas * bandwidth), 0.0)
    return bandwidth, latency


def run(replicas: int, steps: int, repeat: int, shaped_mbit: float | None = None) -> list[dict]:
    model = build_model(MODEL["name"], MODEL["config"])
    costs = profile_blocks(model, BATCH)
    param_bytes = sum(c.param_bytes for c in costs)
    places = None
    if shaped_mbit:
        subprocess.run([str(TESTBED), "up", *[str(shaped_mbit)] * replicas], check=True)
        places = [(f"rvn-m{i}", f"10.77.0.{i + 1}") for i in range(replicas)]
    try:
        return _run(replicas, steps, repeat, costs, param_bytes, places)
    finally:
        if shaped_mbit:
            subprocess.run([str(TESTBED), "down"], check=True)


def _run(replicas: int, steps: int, repeat: int, costs: list, param_bytes: int,
         places: list[tuple[str, str]] | None) -> list[dict]:
    bandwidth, latency = ring_link(replicas, param_bytes, 5, places)
    group = runtime.Group(replicas, param_bytes, bandwidth, latency, fine_overlap=True)
    print(f"{replicas} replicas: model {param_bytes / 2**20:.2f} MiB; ring link {bandwidth / 2**20:.0f} MiB/s, "
          f"latency {latency * 1e3:.2f} ms", flush=True)
    configs = [("ring", ""), ("dear", ""), *(("dadam", t) for t in GOSSIP_TOPOLOGIES)]
    rows: dict[tuple[str, str], list[dict]] = {}
    compute: list[dict] = []
    for seed in range(repeat):  # alternated, so load changes hit every strategy alike
        compute.append(measured(job("none", steps, seed), replicas, len(costs), places))
        print(f"  seed {seed} none: {compute[-1]['step_s'] * 1e3:.2f} ms/step (sd of a step "
              f"{compute[-1]['step_sd_s'] * 1e3:.2f} ms)", flush=True)
        for strategy, topology in configs:
            figures = measured(job(strategy, steps, seed, topology or "one-peer-exp"), replicas, len(costs), places)
            rows.setdefault((strategy, topology), []).append(figures)
            print(f"  seed {seed} {strategy} {topology}: {figures['step_s'] * 1e3:.2f} ms/step, "
                  f"accuracy {figures['accuracy']:.4f}", flush=True)
    t, sd = (statistics.median(c[figure] for c in compute) for figure in ("step_s", "step_sd_s"))
    results = []
    for (strategy, topology), runs in rows.items():
        predicted = {spare: runtime.strategy_step_s(strategy, t, [group], every=1, topology=topology or "one-peer-exp",
                                                    spare_core=spare, step_sd_s=sd, paced=True)
                     for spare in (False, True)}
        results.append({"replicas": replicas, "strategy": strategy, "topology": topology,
                        "predicted_s": predicted[spare_core(replicas)], "predicted_spare_s": predicted[True],
                        "predicted_busy_s": predicted[False],
                        "step_s": statistics.median(r["step_s"] for r in runs),
                        "accuracy": statistics.median(r["accuracy"] for r in runs), "compute_s": t, "compute_sd_s": sd})
    return results


def spare_core(replicas: int) -> bool:
    """Whether each replica process (one torch thread) has a core beside its compute for communication."""
    return (os.cpu_count() or 1) >= 2 * replicas


def auto_pick_ok(results: list[dict]) -> bool:
    table = {(f"{r['strategy']}:{r['topology']}" if r["topology"] else r["strategy"]): r["predicted_s"]
             for r in results}
    strategy, topology = runtime.pick(table)
    picked = next(r for r in results if (r["strategy"], r["topology"]) == (strategy, topology))
    return picked["step_s"] <= 1.05 * min(r["step_s"] for r in results)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeat", type=int, default=1, help="runs per figure, seeds 0, 1, ... (medians quoted)")
    parser.add_argument("--quick", action="store_true", help="fewer steps (noisier figures)")
    parser.add_argument("--shaped", type=float, default=None, metavar="MBIT",
                        help="each replica in its own network namespace, links tbf-shaped to MBIT (root, ip, tc)")
    parser.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    args = parser.parse_args(argv)
    steps = 60 if args.quick else 200
    load = os.getloadavg()[0]
    torch.set_num_threads(1)
    results = [row for n in args.replicas for row in run(n, steps, args.repeat, args.shaped)]
    lines = []
    for r in results:
        error = (r["predicted_s"] - r["step_s"]) / r["step_s"]
        lines.append(f"| {r['replicas']} | {r['strategy']} | {r['topology'] or '-'} | {r['predicted_s'] * 1e3:.2f} "
                     f"| {r['step_s'] * 1e3:.2f} | {error:+.0%} | {r['accuracy']:.4f} | "
                     f"{r['predicted_busy_s'] * 1e3:.2f} / {r['predicted_spare_s'] * 1e3:.2f} |")
    table = ("| replicas | strategy | topology | predicted ms/step | measured ms/step | error | test accuracy "
             "| predicted without / with a spare core |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(lines))
    ok = all(auto_pick_ok([r for r in results if r["replicas"] == n]) for n in args.replicas)
    worst = max(abs(r["predicted_s"] - r["step_s"]) / r["step_s"] for r in results)
    measured = {r["replicas"]: r for r in results}  # T and its sd: measured once per group size, in every row
    computes = ", ".join(f"{n} replicas {measured[n]['compute_s'] * 1e3:.2f} ms, sd of a step "
                         f"{measured[n]['compute_sd_s'] * 1e3:.2f} ms" for n in args.replicas)
    print(table)
    cores_note = (f"with {os.cpu_count()} cores for the replicas' processes no core is spare, so the model charges "
                  f"each strategy all its communication (`spare_core=False`)"
                  if not all(spare_core(n) for n in args.replicas) else "every replica has a core to spare")
    if not args.no_docs:
        from bench.common import command_line, write_section
        command = command_line("bench.strategies", argv)
        where = (f"in its own network namespace, links tbf-shaped to {args.shaped:g} Mbit/s each way "
                 f"(deploy/testbed/netns.sh)" if args.shaped else "on loopback gRPC")
        write_section("Averaging strategies" + (" on shaped links" if args.shaped else ""), (
            f"`{command.strip()}`\n\n"
            f"MLP {MODEL['config']} on digits, batch {BATCH} per replica, {steps} Adam steps (lr 1e-3), every "
            f"replica one process with one torch thread {where}, averaging every step. Predicted: the "
            f"runtime model (`ravnest/averaging/runtime.py`) from the compute time per step measured with "
            f"strategy none ({computes}: rounds wait for their slowest member) and the ring link fitted to our "
            f"all-reduce at 4 KiB and the model's size; {cores_note}. Measured: steady state (20%-90% of the "
            f"steps), median over replicas and {args.repeat} run(s). Test accuracy: cluster 0 after the run (dear "
            f"is the synchronous all-reduce reference).\n\n"
            f"{table}\n\nauto picks within 5% of the fastest measured: {str(ok).lower()}. Machine: "
            f"{os.cpu_count()} cores, load average {load:.1f} at the start.\n"))
    print(f"strategies auto_pick_ok={str(ok).lower()} max_pred_error={worst:.2f}")


if __name__ == "__main__":
    main()
