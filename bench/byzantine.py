"""Replicas that lie in what they send, with and without robust averaging (issue 43).

    python -m bench.byzantine [--replicas 8] [--steps 200] [--every 10] [--runs 1] [--attacks ...] [--liars 1 2 3]
                              [--no-docs]

8 data-parallel replicas of an MLP on digits, each on its own shard, averaging their weights every
`every` steps through our real collectives: RingMember over loopback peer servers, the plain ring
all-reduce (undefended) or robust_allreduce with centered_clip (defended). The replicas train in turn
on one thread; rounds run concurrently, one thread per member. For each attack of tests/attacks.py that
a data-parallel replica can make (garbage activations need a pipeline: tests/test_byzantine.py), with
f = 0..3 attackers lying from round 2 on: the final test accuracy of replica 0 (an honest one), and,
defended, the step at which each attacker was named an outlier. A named attacker is removed as the
coordinator would (the job re-plans without it): the others go on in a new ring. An undefended run
that stops on values that are not finite counts as accuracy 0.

Time per step, defended against plain, is one replica's compute per step plus its share of a round,
T + R / every: T measured in the clean runs (the replicas take turns here, but on a volunteer's
machine each computes alone), R with each member in its own process on loopback (bench.allreduce's
members: in one process, the members' messages would queue on one interpreter lock).

Last line: `byzantine worst_defended_gap=<clean - defended accuracy, worst over attacks and f <= 3>
undefended_worst=<the same, undefended> detect_steps_median=<steps from the first lie to removal>
detected=<attackers named>/<attackers that lied> honest_named=<honest replicas named: 0>
overhead=<defended / plain time per step>`.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn

from bench.allreduce import run_ring
from bench.common import command_line, write_section
from ravnest.averaging.collectives import RingMember
from ravnest.averaging.robust_round import RingOutlier, robust_allreduce
from ravnest.averaging.signatures import public_key
from ravnest.averaging.robust import OUTLIER_RATIO
from ravnest.data import load_dataset
from ravnest.wire import PeerServer, Router
from tests.attacks import AVERAGING, TRAINING, Attack

ATTACKS = AVERAGING + TRAINING
FROM_ROUND = 2
TOKEN = "bench-byzantine"
BATCH = 32


@dataclass
class Outcome:
    accuracy: float
    detected_at: dict[int, int] = field(default_factory=dict)  # replica -> step it was removed at
    step_s: list[float] = field(default_factory=list)


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def load(m: nn.Module, vector: torch.Tensor) -> None:
    with torch.no_grad():
        offset = 0
        for p in m.parameters():
            p.copy_(vector[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def run(replicas: int, attackers: list[int], attack: str | None, defended: bool, steps: int, every: int,
        seed: int, by_label: bool = False) -> Outcome:
    data = load_dataset({"name": "digits"})
    models = [model(seed) for _ in range(replicas)]
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in models]
    liars = {i: Attack(attack, FROM_ROUND, every) for i in attackers} if attack else {}
    generators = [torch.Generator().manual_seed(seed * 1000 + i) for i in range(replicas)]
    parts = [data.shard(i, replicas, by_label=by_label) for i in range(replicas)]
    shards = [(part.train_x.reshape(-1, 64).float(), part.train_y) for part in parts]
    routers = [Router() for _ in range(replicas)]
    servers = [PeerServer(r, token=TOKEN) for r in routers]
    alive = list(range(replicas))
    outcome = Outcome(0.0)
    segment = 0
    members = _ring(alive, routers, servers, segment)
    try:
        with ThreadPoolExecutor(replicas) as pool:
            for step in range(1, steps + 1):
                for i in alive:
                    began = time.perf_counter()
                    x, y = shards[i]
                    rows = torch.randint(len(x), (BATCH,), generator=generators[i])
                    labels = liars[i].labels(y[rows], 10, step // every) if i in liars else y[rows]
                    loss = nn.functional.cross_entropy(models[i](x[rows]), labels)
                    optimizers[i].zero_grad()
                    loss.backward()
                    optimizers[i].step()
                    outcome.step_s.append(time.perf_counter() - began)
                if step % every:
                    continue
                round = step // every
                sent = {i: (liars[i].contribution(flat(models[i]), round) if i in liars else flat(models[i]))
                        for i in alive}
                futures = {i: pool.submit(robust_allreduce, members[i], sent[i], round, "centered_clip")
                           if defended else pool.submit(members[i].allreduce, sent[i], round) for i in alive}
                results = {i: _outcome(f) for i, f in futures.items()}
                honest = [i for i in alive if i not in liars]
                if any(isinstance(results[i], BaseException) and not isinstance(results[i], RingOutlier)
                       for i in honest):
                    return outcome  # (undefended: values that are not finite stopped the job)
                named = {a for i in honest if isinstance(results[i], RingOutlier) for a in results[i].addresses}
                if named:  # the re-plan: without the named member, from the weights before this round
                    gone = [i for i in alive if servers[i].address in named]
                    outcome.detected_at.update({i: step for i in gone})
                    alive = [i for i in alive if i not in gone]
                    for member in members.values():
                        member.close()
                    segment += 1
                    members = _ring(alive, routers, servers, segment)
                    continue
                for i in alive:
                    if isinstance(results[i], torch.Tensor) and torch.isfinite(results[i]).all():
                        load(models[i], results[i])
        honest_one = next(i for i in range(replicas) if i not in liars)
        with torch.no_grad():
            predicted = models[honest_one](data.test_x.reshape(-1, 64).float()).argmax(dim=1)
        outcome.accuracy = float((predicted == data.test_y).float().mean())
        return outcome
    finally:
        for member in members.values():
            member.close()
        for server in servers:
            server.stop(0)


def _ring(alive: list[int], routers: list[Router], servers: list[PeerServer], segment: int) -> dict[int, RingMember]:
    addresses = [servers[i].address for i in alive]
    return {i: RingMember(rank, addresses, routers[i], TOKEN, segment=segment, step_timeout=60.0,
                          keys=[public_key(TOKEN)] * len(alive))
            for rank, i in enumerate(alive)}


def _outcome(future):
    try:
        return future.result()
    except BaseException as e:  # noqa: BLE001  (what the round raised is the result here)
        return e


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--runs", type=int, default=1, help="seeds per configuration (medians)")
    parser.add_argument("--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS))
    parser.add_argument("--liars", nargs="+", type=int, default=[1, 2, 3], help="values of f")
    parser.add_argument("--shards", choices=("interleaved", "by-label"), default="interleaved",
                        help="by-label: each replica holds few classes (non-iid), as `dataset.shards` does")
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    def median_run(attackers: list[int], attack: str | None, defended: bool) -> tuple[float, list[Outcome]]:
        outcomes = [run(args.replicas, attackers, attack, defended, args.steps, args.every, seed,
                        by_label=args.shards == "by-label") for seed in range(args.runs)]
        return statistics.median(o.accuracy for o in outcomes), outcomes

    rows, gaps, undefended_gaps, detect_steps, lied, named, honest_named = [], [], [], [], 0, 0, 0
    clean = {defended: median_run([], None, defended) for defended in (False, True)}
    honest_named += sum(len(o.detected_at) for o in clean[True][1])
    compute_s = statistics.median(s for _, outcomes in clean.values() for o in outcomes for s in o.step_s)
    numel = sum(p.numel() for p in model(0).parameters())
    rounds: dict[bool, list[float]] = {False: [], True: []}
    for defended in (False, True) * 3:  # alternating: the machine's load drifts
        robust = "centered_clip" if defended else ""
        rounds[defended] += run_ring(args.replicas, numel, rounds=10, robust=robust)["times"]
    round_s = {defended: statistics.median(times) for defended, times in rounds.items()}
    per_step = {defended: compute_s + round_s[defended] / args.every for defended in (False, True)}
    rows.append(f"| none | 0 | {clean[False][0]:.4f} | {clean[True][0]:.4f} | - |")
    for attack, f in itertools.product(args.attacks, args.liars):
        attackers = list(range(args.replicas - f, args.replicas))  # the last f replicas
        plain, _ = median_run(attackers, attack, False)
        defended, outcomes = median_run(attackers, attack, True)
        first_lie = FROM_ROUND * args.every
        steps = [o.detected_at[a] - first_lie for o in outcomes for a in attackers if a in o.detected_at]
        honest_named += sum(1 for o in outcomes for i in o.detected_at if i not in attackers)
        lied += len(attackers) * len(outcomes)
        named += len(steps)
        detect_steps += steps
        gaps.append(clean[True][0] - defended)
        undefended_gaps.append(clean[False][0] - plain)
        rows.append(f"| {attack} | {f} | {plain:.4f} | {defended:.4f} | "
                    f"{', '.join(map(str, steps)) if steps else 'not named'} |")
        print(rows[-1], flush=True)
    overhead = per_step[True] / per_step[False]
    summary = (f"byzantine worst_defended_gap={max(gaps):.4f} undefended_worst={max(undefended_gaps):.4f} "
               f"detect_steps_median={statistics.median(detect_steps) if detect_steps else 'none'} "
               f"detected={named}/{lied} honest_named={honest_named} overhead={overhead:.2f}")
    table = "\n".join(["| attack | f | plain ring accuracy | centered_clip accuracy | steps to removal |",
                       "|---|---|---|---|---|", *rows])
    timing = (f"time per step, one replica's compute T = {compute_s * 1e3:.2f} ms plus its share of a round "
              f"R / {args.every} ({numel:,} values, {args.replicas} member processes): plain ring "
              f"{per_step[False] * 1e3:.2f} ms (R = {round_s[False] * 1e3:.1f} ms), centered_clip "
              f"{per_step[True] * 1e3:.2f} ms (R = {round_s[True] * 1e3:.1f} ms)")
    print(table, timing, summary, sep="\n")
    if not args.no_docs:
        by_label = args.shards == "by-label"
        write_section("Lying replicas" + (" on shards by label" if by_label else "") + " (bench.byzantine)", f"""
`{command_line("bench.byzantine", argv)}`: {args.replicas} replicas of an MLP on digits{
            " (each holding one or two digits' examples)" if by_label else ""}, averaging every
{args.every} steps for {args.steps} steps, f attackers lying from round {FROM_ROUND} (tests/attacks.py);
accuracy of an honest replica, medians of {args.runs} seed(s). An attacker is named an outlier when more
than half of the other share owners found its share more than {OUTLIER_RATIO:g} median distances from
the robust mean; it is then removed (the others go on in a new ring).

{table}

{timing}.

    {summary}
""")


if __name__ == "__main__":
    main()
