"""Strategy "dsgd": decentralized training by gossip, each round mixing with the round's neighbours.

Every `averaging.every` steps, round t = step // every: each stage snapshots each segment it holds
and, in the background, exchanges the snapshot with the neighbours of W(t) (`averaging.topology`,
see `ravnest/averaging/topology.py`) and mixes, x_i <- sum_j W_ij(t) x_j. The mixing overlaps the
next forward and backward; before the next optimizer step (`gradients_ready`) the stage applies
x += mixed - snapshot, so the gradient computed meanwhile is kept, and then takes its local step.
Each member talks to its neighbours only: one or a few messages of its segment per round, however
many clusters there are, where a ring all-reduce moves 2 (n - 1) / n of it through everyone.

W(t) is doubly stochastic, so the replicas' mean is exactly what synchronous training with the same
gradients would give; the replicas themselves differ by a spread the topology keeps bounded. What is
evaluated is that mean, the model the run stands for: at every evaluation step (`eval_every`) each
stage all-reduces its segments exactly (raw fp32) and the evaluation runs on the average, swapped in
for it and out again; `finish` sets every replica to the exact average, so the final evaluation and
the final model are the global average, equal in every cluster.

With `averaging.robust` (any rule) each neighbour's difference is clipped (robust.clipped_gossip),
and a neighbour beyond OUTLIER_RATIO times the others in STRIKES rounds in a row is named an outlier
by this replica; the evaluation averages and the final one are robust rounds (robust_round.py).

Wire rounds (a member's must rise): gossip round t travels as round 4t; the collectives a step s
adds before the gossip round it may start, as 4 ceil(s / every) - slot, after the gossip round
before them: the evaluation average (slot 3) and subclasses' measurements (slot 2, `_wire`).
"""
from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ravnest.timeouts import PEER_SILENCE_S
from ravnest.averaging.layout import FlatLayout, canonical_keys
from ravnest.averaging.robust import OUTLIER_RATIO, STRIKES, Strikes, clipped_gossip
from ravnest.averaging.robust_round import RingOutlier, robust_allreduce
from ravnest.averaging.collectives import RingMember
from ravnest.averaging.registry import CostInputs
from ravnest.averaging.runtime import mean_degree, slowest_of
from ravnest.averaging.strategy import GroupStrategy, StageContext, group_member, register_strategy
from ravnest.averaging.topology import circulant, mixing_row, sends_to

FINAL_ROUND = 1 << 40  # above every gossip round's number


@dataclass
class _Segment:
    member: RingMember
    blocks: tuple[int, int]
    layout: FlatLayout | None = None
    snapshot: torch.Tensor | None = None
    running: Future | None = None
    strikes: Strikes = field(default_factory=Strikes)  # robust: neighbours found far off, by round


def gossip_cost(c: CostInputs) -> float:
    """Round t: d(t) messages each way, one at a time, (P / B + 2 L) each where paced and circulant
    (asked for, then sent), else (P / B + L); applied before the next step, so one step hides it."""
    g = c.group
    degree = mean_degree(c.topology, g.members)
    latencies = 2 if c.paced and circulant(c.topology, g.members) else 1
    exchange = (degree * (g.param_bytes / g.bandwidth + latencies * g.latency)
                + c.step_sd_s * slowest_of(1 + degree) * math.sqrt(c.every))
    return c.step_s + max(0.0, exchange - (c.step_s if c.spare_core else 0.0)) / c.every


@register_strategy("dsgd", gossip=True, cost=gossip_cost, auto_rank=2, robust=True,
                   fits=lambda optimizer: "adam" not in optimizer.lower())
class GossipMixing(GroupStrategy):
    """See the module docstring; the optimizer is the job's (with Adam-type optimizers this is
    decentralized Adam: strategy "dadam")."""

    name = "dsgd"

    def __init__(self, context: StageContext, *, step_timeout: float = PEER_SILENCE_S):
        a, settings = context.assignment, context.assignment.averaging
        self.every, self.topology = settings.every, settings.topology
        self.paced = bool(settings.paced)  # None (no planner ran): push each vector at once
        self.robust = settings.robust
        self.live, self.device, self._companions = context.live, torch.device(context.device), context.companions
        self.rank, self.size = a.cluster, a.num_clusters
        self._eval_every, self._steps, self._resumed_at = a.training.eval_every, a.training.steps, a.resume_step
        self._eval_averages: dict[int, list[torch.Tensor]] = {}  # evaluation round -> average per segment
        self._eval_backup: list[torch.Tensor] | None = None
        self._segments = [_Segment(group_member(context, ring, codec=settings.sent_codec, step_timeout=step_timeout),
                                   (ring.blocks[0], ring.blocks[1])) for ring in a.rings]
        self._pool = ThreadPoolExecutor(max(1, len(self._segments)), thread_name_prefix="ravnest-gossip")
        self.rounds = 0
        self.mix_s = 0.0    # seconds the exchanges took, summed
        self.stall_s = 0.0  # seconds the training thread waited for them

    def after_step(self, step: int) -> None:
        if self._eval_every and step % self._eval_every == 0 and step < self._steps:
            self._average_for_evaluation(step)
        self._between_rounds(step)
        if step % self.every == 0:
            for segment in self._segments:
                self._start(segment, step // self.every)

    def _between_rounds(self, step: int) -> None:
        """Subclasses' own collectives after `step`, before the gossip round it may start (wire slot 2)."""

    def _topology_of(self, segment: _Segment) -> str:
        """The graph `segment` mixes over (subclasses may change it between rounds)."""
        return self.topology

    def gradients_ready(self, step: int) -> None:
        self._apply_all()

    def flush(self) -> None:
        self._apply_all()

    def finish(self) -> None:
        """Apply what is running, then set every replica to the exact average (raw fp32)."""
        self._apply_all()
        self._write([self._exact_average(segment.member, self._flatten(segment), FINAL_ROUND)
                     for segment in self._segments])

    def begin_evaluation(self, round: int) -> None:
        """Evaluate the global average of `round`'s step (kept by `_average_for_evaluation`)."""
        averages = self._eval_averages.get(round)
        if averages is not None:
            self._eval_backup = [self._flatten(segment).clone() for segment in self._segments]
            self._write(averages)

    def end_evaluation(self, round: int) -> None:
        self._eval_averages.pop(round, None)
        if self._eval_backup is not None:
            self._write(self._eval_backup)
            self._eval_backup = None

    def metrics(self) -> dict[str, float]:
        figures = {"avg_rounds": float(self.rounds), "avg_stall_s": self.stall_s}
        if self.rounds:
            figures["avg_round_s"] = self.mix_s / self.rounds
        return figures

    # --- internals ------------------------------------------------------------------------------

    def _flatten(self, segment: _Segment) -> torch.Tensor:
        keys = canonical_keys(self.live, segment.blocks)
        if segment.layout is None or segment.layout.keys != keys:
            segment.layout = FlatLayout(self.live, keys)
            segment.snapshot = torch.empty(segment.layout.numel)
        return segment.layout.flatten(self.live, out=segment.snapshot)

    def _average_for_evaluation(self, step: int) -> None:
        """The exact global average of every segment at `step`, kept for the evaluation round that
        stage 0 runs at this step (every stage reaches it, in every cluster)."""
        self._apply_all()
        averages = [self._exact_average(segment.member, self._flatten(segment), self._wire(step, 3))
                    for segment in self._segments]
        every = self._eval_every
        self._eval_averages[step // every - self._resumed_at // every - 1] = averages

    def _exact_average(self, member: RingMember, flat: torch.Tensor, round: int) -> torch.Tensor:
        """Every replica's average (raw fp32): robust where the job asked."""
        if self.robust:
            return robust_allreduce(member, flat, round, self.robust, codec="")
        return member.allreduce(flat, round, codec="")

    def _wire(self, step: int, slot: int) -> int:
        """The wire round of an extra collective at `step` (see the module docstring)."""
        return 4 * -(-step // self.every) - slot

    def _write(self, flats: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for segment, flat in zip(self._segments, flats):
                for key, value in segment.layout.views(flat).items():
                    self.live[key].copy_(value)

    def _start(self, segment: _Segment, round: int) -> None:
        if segment.running is not None:  # at most one round in flight per segment
            self._apply(segment)
        snapshot = self._flatten(segment)
        segment.running = self._pool.submit(self._mix, segment, snapshot, round, self._topology_of(segment))

    def _mix(self, segment: _Segment, snapshot: torch.Tensor, round: int,
             topology: str) -> tuple[torch.Tensor, float]:
        started = time.perf_counter()
        row = mixing_row(topology, self.rank, self.size, round)
        paced = self.paced and circulant(topology, self.size, round)
        member = segment.member
        heard = member.exchange(snapshot, 4 * round, sends_to(topology, self.rank, self.size, round),
                                [j for j in row if j != self.rank], paced=paced)
        if self.robust:
            return self._clipped(segment, snapshot, row, heard, round), time.perf_counter() - started
        mixed = snapshot * row[self.rank]
        for j, weight in row.items():  # in the row's order, whatever order the vectors came in
            if j != self.rank:
                mixed.add_(heard[j], alpha=weight)
        return mixed, time.perf_counter() - started

    def _clipped(self, segment: _Segment, snapshot: torch.Tensor, row: dict[int, float],
                 heard: dict[int, torch.Tensor], round: int) -> torch.Tensor:
        """The robust mix (the module docstring), naming a neighbour far off STRIKES rounds in a row."""
        neighbours = [j for j in row if j != self.rank]
        mixed, far = clipped_gossip(snapshot, [heard[j] for j in neighbours], [row[j] for j in neighbours])
        # every neighbour struck out this round is named at once, as a ring's round names every outlier
        struck = [j for j, off in zip(neighbours, far) if off and segment.strikes.record(j, round)]
        if struck:
            named = ", ".join(f"{segment.member.addresses[j]} (rank {j})" for j in struck)
            raise RingOutlier(f"ring segment {segment.member.segment} round {round}: the values of {named} were "
                              f"more than {OUTLIER_RATIO:g} times as far from this replica's as its other "
                              f"neighbours' in {STRIKES} rounds in a row", address=segment.member.addresses[struck[0]],
                              also=tuple(segment.member.addresses[j] for j in struck[1:]))
        return mixed

    def _apply_all(self) -> None:
        entered = time.perf_counter()
        for segment in self._segments:
            if segment.running is not None:
                self._apply(segment)
        self.stall_s += time.perf_counter() - entered

    def _apply(self, segment: _Segment) -> None:
        """x += mixed - snapshot: the mixing, keeping what the stage trained meanwhile."""
        future, segment.running = segment.running, None
        assert future is not None and segment.layout is not None  # (a round ran, so there is a layout)
        mixed, seconds = future.result()  # re-raises the exchange's error, naming peer and round
        self.rounds += 1
        self.mix_s += seconds
        segment.layout.add_into(mixed.sub_(segment.snapshot).to(self.device), self.live, *self._companions())
