"""Strategy "ring": periodic multi-ring all-reduce of the parameters, overlapped with training.

Keeps one stage's segments close to the other clusters' copies, without draining the pipeline.

When a round is due the stage snapshots each segment it holds and averages the snapshots in the
background, one thread per ring. Training goes on meanwhile; when a segment's round is done the stage
applies x += avg(snapshot) - snapshot, so the local progress made during the round is kept.

Every member of a ring must run the same rounds in the same order, whatever the clusters' speeds:
- `averaging.every` steps: round number = step // every. All clusters train the same number of steps,
  so they agree on the rounds by construction. The round started after step s is applied after step
  s + max(1, every // 2) (waiting there only if the network is slower than that much compute), not
  whenever it happens to finish: then every stage of a cluster, and every cluster, takes the
  correction at the same step. Applying "when done" let one stage of a pipeline take it several
  steps before its neighbour, feeding averaged blocks from unaveraged ones; with Adam that made
  training unstable now and then (loss rising tenfold), which the fixed delay does not.
- `averaging.every_seconds`: rounds 0, 1, 2, ... are *committed*: round k+1 is decided when round k
  ends, identically on every member, and a member starts it once `every_seconds` have passed since
  it started round k. Each round also all-reduces a flag "this member has finished training"; a
  member that finishes runs the committed round at once with the flag set, and once a round carried
  a set flag no further periodic round is committed. So nobody waits for a round a peer will never
  start, although clusters run different numbers of steps within the same time.
Rings are scheduled independently (each has its own members), so one ring's round never waits on
another's. The final round (`finish`) runs in raw fp32 and sets every replica to exactly the same
average. With `average_optimizer_state` the optimizer's per-parameter state (e.g. Adam's moments)
travels with the parameters.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from ravnest.timeouts import PEER_SILENCE_S
from ravnest.averaging.layout import FlatLayout, canonical_keys
from ravnest.averaging.collectives import RingMember
from ravnest.averaging.registry import CostInputs, strategy_info
from ravnest.averaging.robust_round import robust_allreduce
from ravnest.averaging.runtime import ring_round_s
from ravnest.averaging.strategy import GroupStrategy, StageContext, group_member, register_strategy

FINAL_ROUND = 1 << 40  # above every periodic round's wire number
Tensors = dict[str, torch.Tensor]


@dataclass
class RoundRecord:
    """One periodic round of one segment, timed on the perf_counter clock (for metrics and tests)."""
    segment: int
    number: int
    started: float
    ended: float
    sent_bytes: int = 0  # what this member put on the wire for it (payloads, as its codec encodes them)


@dataclass
class _Outcome:
    snapshot: torch.Tensor
    average: torch.Tensor
    ended: float
    anyone_finished: bool = False  # time mode: a member had finished training when it joined
    sent_bytes: int = 0


@dataclass
class _Segment:
    member: RingMember
    blocks: tuple[int, int]
    layout: FlatLayout | None = None  # built at the first round: optimizer state appears at the first step
    # reused every round (rounds of one segment never overlap): fresh large buffers cost page faults
    snapshot: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    average: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    running: Future | None = None
    running_round: int = 0
    apply_at: int = 0  # step mode: the step after which the running round is applied
    started: float = 0.0
    pending: list[int] = field(default_factory=list)  # step mode: rounds due but not started yet
    committed: int | None = 0  # time mode: the next round every member will run; None: no more
    due_at: float = 0.0        # time mode: when this member starts the committed round


def ring_cost(c: CostInputs) -> float:
    """The round started after step s is applied after step s + D, D = max(1, E // 2): it stalls only
    past D steps of compute (nothing hides without a spare core)."""
    return ring_round_s(c, max(1, c.every // 2) if c.spare_core else 0)


@register_strategy("ring", by_seconds=True, cost=ring_cost, auto_rank=1, robust=True)
class RingAveraging(GroupStrategy):
    """Periodic, overlapped averaging of the segments `assignment.rings` names (one ring each).

    The context's tensors (see `StageContext`) are only read and written on the caller's thread,
    inside `after_step`/`flush`/`finish`; the optimizer's state travels too with
    `averaging.average_optimizer_state`.
    """

    name = "ring"

    def __init__(self, context: StageContext, *, step_timeout: float = PEER_SILENCE_S):
        assignment = context.assignment
        settings = assignment.averaging
        self._companions = context.companions
        self.every, self.every_seconds = settings.every, settings.every_seconds
        self.robust = settings.robust  # '' or the robust mean every round takes (ravnest/averaging/robust.py)
        self.live = context.live
        self._optimizer_state = context.optimizer_state if settings.average_optimizer_state else None
        self.device = torch.device(context.device)
        for ring in assignment.rings:  # check them all before joining any
            if not (assignment.blocks[0] <= ring.blocks[0] < ring.blocks[1] <= assignment.blocks[1]):
                raise ValueError(f"ring of segment {ring.segment} covers blocks {ring.blocks}, outside "
                                 f"this stage's {assignment.blocks}")
            if len(ring.members) != assignment.num_clusters:
                raise ValueError(f"ring of segment {ring.segment} has {len(ring.members)} members for "
                                 f"{assignment.num_clusters} clusters")
        now = time.perf_counter()
        self._segments = [
            _Segment(group_member(context, ring, codec=settings.sent_codec, step_timeout=step_timeout),
                     (ring.blocks[0], ring.blocks[1]), due_at=now + (self.every_seconds or 0.0))
            for ring in assignment.rings]
        # one thread per ring: a node serves all its rings at once
        self._pool = ThreadPoolExecutor(max(1, len(self._segments)), thread_name_prefix="ravnest-avg")
        self.history: list[RoundRecord] = []
        self.stall_s = 0.0  # time the training thread spent in here, outside `finish`
        self.apply_delay = max(1, self.every // 2)  # step mode: steps between a round's start and its use

    def after_step(self, step: int) -> None:
        """Call right after optimizer step number `step` (1 after the first step). Cheap unless a
        round is to be applied or due (snapshot and start it); blocks only when a round (step mode)
        is not done `every // 2` steps after it started."""
        entered = time.perf_counter()
        for segment in self._segments:
            if self.every_seconds is None:
                if segment.running is not None and step >= segment.apply_at:
                    self._apply(segment)  # waits if the round is not done yet
                if step > 0 and step % self.every == 0:
                    segment.pending.append(step // self.every)
                if segment.running is None and segment.pending:
                    self._start(segment, segment.pending.pop(0))
                    segment.apply_at = step + self.apply_delay
                    if self.apply_delay == 0:  # synchronous: the round lands before the next step
                        self._apply(segment)
            else:
                if segment.running is not None and segment.running.done():
                    self._apply(segment)
                if segment.running is None and segment.committed is not None and entered >= segment.due_at:
                    self._start(segment, segment.committed)
        self.stall_s += time.perf_counter() - entered

    def flush(self) -> None:
        """Block until every started or due round has run and been applied (e.g. before a
        checkpoint). Every ring's next round starts before any is waited for: a peer may be
        waiting on one ring for us while we wait on another for it."""
        entered = time.perf_counter()
        self._drain(finishing=False)
        self.stall_s += time.perf_counter() - entered

    def finish(self) -> None:
        """After the last step: run what is due or committed, then one synchronous raw-fp32 round
        that sets the live tensors exactly to the average (equal in every cluster)."""
        self._drain(finishing=True)
        final = [(segment, self._submit(segment, FINAL_ROUND, codec="")) for segment in self._segments]
        with torch.no_grad():
            for segment, future in final:
                average = future.result().average.to(self.device)
                tensors = self._tensors()
                for key, value in segment.layout.views(average).items():
                    tensors[key].copy_(value)

    def metrics(self) -> dict[str, float]:
        """Rounds applied (summed over this node's rings), their mean duration, and the seconds the
        training thread spent in the averager: with overlap, a small fraction of the run."""
        figures = {"avg_rounds": float(len(self.history)), "avg_stall_s": self.stall_s}
        if self.history:
            figures["avg_round_s"] = sum(r.ended - r.started for r in self.history) / len(self.history)
            figures["avg_round_bytes"] = sum(r.sent_bytes for r in self.history) / len(self.history)
        return figures

    # --- internals ------------------------------------------------------------------------------

    def _tensors(self) -> Tensors:
        if self._optimizer_state is None:
            return self.live
        return {**self.live, **self._optimizer_state()}

    def _drain(self, finishing: bool) -> None:
        while True:
            for segment in self._segments:
                if segment.running is not None:
                    continue
                if self.every_seconds is None and segment.pending:
                    self._start(segment, segment.pending.pop(0))
                elif self.every_seconds is not None and finishing and segment.committed is not None:
                    self._start(segment, segment.committed, finishing=True)
            running = [s for s in self._segments if s.running is not None]
            if not running:
                return
            wait([s.running for s in running])
            for segment in running:
                self._apply(segment)

    def _start(self, segment: _Segment, number: int, finishing: bool = False) -> None:
        segment.started = time.perf_counter()
        segment.running_round = number
        segment.running = self._submit(segment, number, finishing=finishing)
        if self.every_seconds is not None:
            segment.due_at = segment.started + self.every_seconds

    def _submit(self, segment: _Segment, number: int, codec: str | None = None,
                finishing: bool = False) -> Future:
        """Snapshot the segment (on the caller's thread) and average it on the segment's thread."""
        tensors = self._tensors()
        keys = canonical_keys(tensors, segment.blocks)
        if segment.layout is None or segment.layout.keys != keys:
            segment.layout = FlatLayout(tensors, keys)
            segment.snapshot, segment.average = torch.empty(segment.layout.numel), torch.empty(segment.layout.numel)
        segment.layout.flatten(tensors, out=segment.snapshot)
        timed = self.every_seconds is not None and number != FINAL_ROUND
        vector = segment.snapshot if number == FINAL_ROUND else self._round_input(segment)
        robust = (self.robust, strategy_info(self.name).averages_changes and number != FINAL_ROUND)
        return self._pool.submit(_average, segment, vector, number, codec, finishing if timed else None, robust)

    def _round_input(self, segment: _Segment) -> torch.Tensor:
        """What a periodic round all-reduces: the snapshot itself."""
        return segment.snapshot

    def _correction(self, segment: _Segment, outcome: _Outcome) -> torch.Tensor:
        """What a finished round adds to the segment: avg(snapshot) - snapshot."""
        return outcome.average.sub_(outcome.snapshot)

    def _apply(self, segment: _Segment) -> None:
        """x += avg(snapshot) - snapshot for every tensor of the segment's finished round."""
        future, segment.running = segment.running, None
        assert future is not None and segment.layout is not None  # (a round ran, so there is a layout)
        outcome: _Outcome = future.result()  # re-raises the ring's error, naming peer and step
        self.history.append(RoundRecord(segment.member.segment, segment.running_round, segment.started,
                                        outcome.ended, outcome.sent_bytes))
        if self.every_seconds is not None:
            segment.committed = None if outcome.anyone_finished else segment.running_round + 1
        delta = self._correction(segment, outcome).to(self.device)
        segment.layout.add_into(delta, self._tensors(), *self._companions())


def _average(segment: _Segment, vector: torch.Tensor, number: int, codec: str | None,
             finishing: bool | None, robust: tuple[str, bool] = ("", False)) -> _Outcome:
    """The ring work of one round: the mean of `vector` (the snapshot, or what the strategy derives
    from it), robust where the job asked (`robust`: the rule, and whether `vector` holds changes; the
    final round too: a liar's last word counts no more).
    Time mode (`finishing` not None) also all-reduces the finished flag, exactly (raw fp32), under the
    odd wire round next to the data's even one."""
    wire_round = number if finishing is None else 2 * number
    sent_before = getattr(segment.member, "sent_bytes", 0)  # (gloo's members do not count)
    rule, changes = robust
    if rule:
        average = robust_allreduce(segment.member, vector, wire_round, rule, codec=codec, out=segment.average,
                                   changes=changes)
    else:
        average = segment.member.allreduce(vector, wire_round, codec=codec, out=segment.average)
    sent = getattr(segment.member, "sent_bytes", 0) - sent_before
    anyone_finished = False
    if finishing is not None:
        flag = torch.tensor([1.0 if finishing else 0.0])
        anyone_finished = bool(segment.member.allreduce(flag, wire_round + 1, codec="")[0] > 0)
    return _Outcome(segment.snapshot, average, time.perf_counter(), anyone_finished, sent)

