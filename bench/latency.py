"""What a round trip costs a job: the same jobs on 100 Mbit/s links at several round trips.

Four nodes in network namespaces (scripts/testbed.py, needs root), each behind a line of its own
(deploy/testbed/linedelay.py) that adds half the asked round trip, +-10% jitter: a path between two
nodes crosses both of theirs, so nodes are the asked round trip apart (and half of it from the
coordinator). At each round trip a fresh testbed (the coordinator probes the links as they are) runs
the README's digits CNN as 2 clusters x 2 stages and the text gpt as one 2-stage pipeline, in turn.

Throughput: samples the job trained over the time until its last cluster finished (the stages' own
reports: startup and the final upload not counted), against the same job at 0 ms in the same run;
the held-out loss against the 0 ms run's.

    python -m bench.latency [--rtts 0 50 100 200] [--steps 200] [--no-docs]

Prints last `latency gpt_100ms=<x> gpt_200ms=<y> cnn_100ms=<z> cnn_200ms=<w> loss_gap_max=<g>`.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.common import command_line, write_section
from bench.testbed import trained_samples_per_s
from scripts.testbed import Line, ShapedTestbed, unavailable

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "jobs"
TEXT = Path(argparse.__file__)  # pure ASCII and stays put (bench.memory's reason)
MBIT, NODES, JITTER = 100, 4, 0.1
READING = """The planner keeps K micro-batches in flight for the links' probed round trips (docs/pipeline.md,
"Round trips"), up to a step's micro-batches: hence the jobs' accumulation. Targets are 0.9 at 100 ms and
0.8 at 200 ms; throughput is over the whole run, start-up with its round trips included. Held-out loss
differs a little between round trips: K differs with them."""
# job -> (example, placement, accumulation): a step of `accumulation` batches is what lets the pipeline keep
# that many whole batches in flight across a round trip with at most one update of staleness
JOBS = {"cnn": ("digits-cnn", {"clusters": 2, "stages_per_cluster": 2, "min_nodes": 4}, 32),
        "gpt": ("text-gpt", {"clusters": 1, "stages_per_cluster": 2, "min_nodes": 2}, 8)}


def job_spec(job: str, steps: int) -> dict:
    example, placement, accumulation = JOBS[job]
    spec = json.loads((EXAMPLES / f"{example}.json").read_text())
    spec["training"].update(steps=steps, eval_every=0, accumulation=accumulation)
    spec["placement"] = placement
    return spec


def run(testbed: ShapedTestbed, job: str, steps: int) -> dict:
    spec = job_spec(job, steps)
    done = testbed.wait_job(testbed.submit(spec), timeout=1800)
    if done["state"] != "completed":
        raise RuntimeError(f"{job} job {done['state']}: {done['reason']}")
    testbed.wait_for(lambda: all(n["state"] == "idle" for n in testbed.alive_nodes()), 120, "every node idle again")
    training = spec["training"]
    return {"samples_per_s": trained_samples_per_s(done, training["batch_size"] * training["accumulation"]),
            "predicted": done["plan"]["predicted_samples_per_s"], "loss": done["metrics"]["test_loss"],
            "in_flight": [c["in_flight"] for c in done["plan"]["clusters"]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rtts", type=float, nargs="+", default=[0, 50, 100, 200], help="ms between nodes")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps of each job")
    parser.add_argument("--jobs", nargs="+", choices=sorted(JOBS), default=list(JOBS))
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = parser.parse_args(argv)
    if (reason := unavailable()) is not None:
        print(f"bench.latency: {reason}", file=sys.stderr)
        return 2
    rtts = sorted(set(args.rtts) | {0.0})
    figures: dict[tuple[str, float], dict] = {}
    lines = []
    for rtt in rtts:
        line = Line(rtt / 2, JITTER * rtt / 2)
        with tempfile.TemporaryDirectory() as scratch, \
                ShapedTestbed(Path(scratch), [MBIT] * NODES, lines={i: line for i in range(NODES)},
                              node_args=["--dataset", f"gpl3={TEXT}"]) as testbed:
            for job in args.jobs:
                got = figures[job, rtt] = run(testbed, job, args.steps)
                base = figures[job, 0.0]
                text = (f"{job} at {rtt:g} ms: {got['samples_per_s']:.0f} samples/s "
                        f"({got['samples_per_s'] / base['samples_per_s']:.2f} of 0 ms; predicted "
                        f"{got['predicted']:.0f}; K {'/'.join(map(str, got['in_flight']))}), held-out loss {got['loss']:.4f} ({got['loss'] - base['loss']:+.4f})")
                print(text, flush=True)
                lines.append(text)
    ratio = {(job, rtt): figures[job, rtt]["samples_per_s"] / figures[job, 0.0]["samples_per_s"]
             for job, rtt in figures}
    gap = max(abs(figures[k]["loss"] - figures[k[0], 0.0]["loss"]) for k in figures)
    summary = "latency " + " ".join(f"{job}_{rtt:g}ms={ratio[job, rtt]:.2f}" for job in ("gpt", "cnn")
                                    for rtt in (100.0, 200.0) if (job, rtt) in ratio) + f" loss_gap_max={gap:.4f}"
    if not args.no_docs:
        write_section("Round trips", (
            f"Command (as root): `{command_line('bench.latency', argv)}`\n\n"
            f"{NODES} nodes on {MBIT} Mbit/s links, the round trip between nodes as given (+-{JITTER:.0%} "
            f"jitter), packet by packet (deploy/testbed/linedelay.py); {args.steps} steps of each job.\n\n"
            f"{READING}\n\n```\n" + "\n".join(lines) + f"\n{summary}\n```\n"))
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
