"""What a relay costs: a 2-stage pipeline between a reachable host and one behind NAT, through a
volunteer's relay, against the same pipeline between two reachable hosts, on the same shaped links.

    python -m bench.relay [--repeat 3] [--steps 150] [--batch-size 256] [--rate 100] [--relay-rate 5] [--no-docs]

Network namespaces (scripts/testbed.py), every link shaped with tbf both ways. Direct: two hosts at
`--rate` Mbit/s. Relayed: the same two, the second behind a NAT router of its own (no inbound
connection reaches it), and a third host at `--relay-rate` that only relays (`ravnest-node join --relay
--max-memory 1MiB`: no stage fits there); the coordinator relays nothing (`--no-relay`). The README's
digits CNN, one cluster of 2 stages, through the whole system: the coordinator finds the natted host
unreachable, hands it the relay, measures the links and plans. The reachable host runs with
`--no-peer-relay`: else the natted one would listen at its relay for peers and take no relay hop at
all (node/relaying.py), and this measures the hop that links between two natted hosts take.

Only what goes to the natted host takes the relay: it dials its peer directly to send the gradients
back. The activations cross the relay's link twice, in on its download and out on its upload, each
direction shaped to the relay's rate. So the extra hop allows at most `relay-rate / (activation bytes
per step)` steps/s, bytes as the first stage reports them; the relayed run can be no faster than
that, nor than the direct run.

A third run has the same natted host with its peer's relay for peers on (the default): it listens
there, and the reachable host sends to it over that connection, so it should train as fast as direct.

Prints per run samples/s (steady state, the last stage's) and bytes per step, then
`relay natted_with_peer_relay_over_direct=<d>`, then last:
`relay natted_job=<completed|its state> relayed_over_direct=<r> vs_bound=<b>`: r = relayed samples/s
over direct (medians); b = relayed samples/s over min(direct, the relay hop's bound) (median of runs).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.common import command_line, write_section
from scripts.testbed import ShapedTestbed, unavailable

JOB = Path(__file__).resolve().parent.parent / "examples" / "jobs" / "digits-cnn.json"
READING = ("Two stages of the digits CNN, each on its own network namespace with its link shaped both ways; "
           "relayed: the second behind a NAT router, reached through a third host that only relays (the "
           "gradients go back directly: the natted host dials out). The bound: the activations cross the "
           "relay's link in and out, so it allows relay rate / (activation bytes per step) steps/s; vs_bound "
           "is the relayed run's samples/s over the lower of that bound and the direct run's (the reachable "
           "host runs with --no-peer-relay, so that the link takes the relay as between two natted hosts). "
           "Natted with its peer's relay: the default, where the natted host listens at the reachable one's "
           "relay for its peers and is sent to over that connection, with no relay hop. One 2-core "
           "machine runs every process.")


def job_spec(steps: int, batch_size: int) -> dict:
    spec = json.loads(JOB.read_text())
    spec["name"] = "relay-bench"
    spec["training"].update(steps=steps, eval_every=0, batch_size=batch_size)
    spec["averaging"] = {"strategy": "none"}
    spec["placement"] = {"clusters": 1, "stages_per_cluster": 2, "min_nodes": 2}
    return spec


def run(scratch: Path, rates: list[float], natted: list[int], args_of: dict[int, list[str]], steps: int,
        batch_size: int) -> dict:
    testbed = ShapedTestbed(scratch, rates, natted=natted, args_of=args_of, relay=False)
    with testbed:
        if natted:  # the natted host listens on the relay before the job is placed
            testbed.wait_for(lambda: all(n["reachable"] for n in testbed.alive_nodes()) and any(
                n["relayed_by"] for n in testbed.alive_nodes()), 90, "the natted host to be reachable via the relay")
        spec = job_spec(steps, batch_size)
        job = testbed.wait_job(testbed.submit(spec), timeout=1800)
    if job["state"] != "completed":
        return {"state": job["state"], "reason": job["reason"]}
    stages = {s["stage"]: s["metrics"] for s in job["metrics"]["stages"]}
    if len(stages) != 2:
        raise RuntimeError(f"planned {job['plan']['reason']}; left out {job['plan']['unused']}: not 2 stages")
    return {"state": "completed", "samples_per_s": stages[1]["steady_samples_per_s"],
            "bytes_per_step": stages[0]["next_bytes_per_step"],  # to the second stage: what a relay carries
            "batch_size": spec["training"]["batch_size"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=256, help="samples per step: big enough that the "
                                                                    "link's bandwidth, not its latency, bounds it")
    parser.add_argument("--rate", type=float, default=100, help="Mbit/s of the two stages' hosts")
    parser.add_argument("--relay-rate", type=float, default=5, help="Mbit/s of the relay's host")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/benchmarks.md")
    args = parser.parse_args(argv)
    reason = unavailable(nat=True)
    if reason:
        print(f"bench.relay: {reason}", file=sys.stderr)
        return 2
    relay_only = {2: ["--relay", "--max-memory", "1MiB"]}
    # the reachable host opens no relay for its peers, or it would send to the natted one with no relay hop
    no_peer_relay = {0: ["--no-peer-relay"], **relay_only}
    lines, ratios, against_bound, states, dialled_back = [], [], [], [], []
    direct_runs, relayed_runs = [], []
    for repeat in range(args.repeat):
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b, \
                tempfile.TemporaryDirectory() as c:
            direct = run(Path(a), [args.rate, args.rate], [], {}, args.steps, args.batch_size)
            relayed = run(Path(b), [args.rate, args.rate, args.relay_rate], [1], no_peer_relay, args.steps,
                          args.batch_size)
            natted = run(Path(c), [args.rate, args.rate, args.relay_rate], [1], relay_only, args.steps,
                         args.batch_size)
        states.extend([relayed["state"], natted["state"]])
        if "completed" != direct["state"] or {relayed["state"], natted["state"]} != {"completed"}:
            lines.append(f"run {repeat + 1}: direct {direct['state']}, relayed {relayed['state']}, natted with "
                         f"its peer's relay {natted['state']}: "
                         f"{relayed.get('reason') or natted.get('reason') or direct.get('reason')}")
            print(lines[-1], flush=True)
            continue
        hop = args.relay_rate * 1e6 / 8 / relayed["bytes_per_step"] * relayed["batch_size"]  # samples/s
        bound = min(direct["samples_per_s"], hop)
        direct_runs.append(direct["samples_per_s"])
        relayed_runs.append(relayed["samples_per_s"])
        ratios.append(relayed["samples_per_s"] / direct["samples_per_s"])
        against_bound.append(relayed["samples_per_s"] / bound)
        dialled_back.append(natted["samples_per_s"] / direct["samples_per_s"])
        lines.append(f"run {repeat + 1}: direct {direct['samples_per_s']:.0f} samples/s "
                     f"({direct['bytes_per_step'] / 1e3:.1f} kB/step to stage 1), "
                     f"relayed {relayed['samples_per_s']:.0f} "
                     f"({relayed['bytes_per_step'] / 1e3:.1f} kB/step); the relay hop allows {hop:.0f}: "
                     f"relayed / direct {ratios[-1]:.2f}, / bound {against_bound[-1]:.2f}; natted, sent to over "
                     f"the connection it opened to its peer: {natted['samples_per_s']:.0f}, "
                     f"/ direct {dialled_back[-1]:.2f}")
        print(lines[-1], flush=True)
    job_state = "completed" if states and all(s == "completed" for s in states) else next(
        (s for s in states if s != "completed"), "not run")
    no_hop = f"relay natted_with_peer_relay_over_direct={statistics.median(dialled_back) if dialled_back else 0:.2f}"
    summary = (f"relay natted_job={job_state} relayed_over_direct={statistics.median(ratios) if ratios else 0:.2f} "
               f"vs_bound={statistics.median(against_bound) if against_bound else 0:.2f}")
    if not args.no_docs and ratios:
        write_section("Relayed links", (
            f"Command (as root): `{command_line('bench.relay', argv)}`\n\n{READING}\n\n```\n"
            f"hosts {args.rate:g} Mbit/s, the relay's {args.relay_rate:g} Mbit/s, {args.steps} steps\n"
            + "\n".join(lines) + f"\n{no_hop}\n{summary}\n```\n"))
    print(no_hop)
    print(summary)
    return 0 if job_state == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
