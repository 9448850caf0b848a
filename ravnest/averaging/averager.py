"""Keeps one stage's segments close to the other clusters' copies, without draining the pipeline.

Every `averaging.every` optimizer steps the stage snapshots each segment it holds and averages the
snapshots in the background, all its rings at once. Training goes on meanwhile; when the round is
done the stage applies x += avg(snapshot) - snapshot, so the local progress made during the round is
kept. Rounds are numbered by the step that triggered them (step // every), so every member of a ring
runs the same rounds in the same order even when clusters train at different speeds; the final round
(`finish`) runs in raw fp32 and sets every replica to exactly the same average.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from ravnest.averaging.layout import FlatLayout, canonical_keys
from ravnest.averaging.ring import RingMember
from ravnest.spec import StageAssignment
from ravnest.wire import Router

FINAL_ROUND = 1 << 40  # above every periodic round number (step // every)


@dataclass
class _Segment:
    member: RingMember
    layout: FlatLayout
    # reused every round (rounds of one segment never overlap): fresh large buffers cost page faults
    snapshot: torch.Tensor
    average: torch.Tensor


@dataclass
class _Round:
    number: int
    futures: list[Future]  # per segment: (snapshot, average), views of the segment's buffers

    def done(self) -> bool:
        return all(f.done() for f in self.futures)


class Averager:
    """Periodic, overlapped averaging of the segments `assignment.rings` names.

    `live` maps "{i}.<name>" (global block index i) to the stage's live parameters and floating
    buffers; they are only read and written on the caller's thread, inside `after_step`/`finish`.
    """

    def __init__(self, assignment: StageAssignment, router: Router, live: dict[str, torch.Tensor], *,
                 device: str | torch.device = "cpu", step_timeout: float = 300.0):
        self.every = assignment.averaging.every
        self.live = live
        self.device = torch.device(device)
        for ring in assignment.rings:  # check them all before joining any
            if not (assignment.blocks[0] <= ring.blocks[0] < ring.blocks[1] <= assignment.blocks[1]):
                raise ValueError(f"ring of segment {ring.segment} covers blocks {ring.blocks}, outside "
                                 f"this stage's {assignment.blocks}")
            if len(ring.members) != assignment.num_clusters:
                raise ValueError(f"ring of segment {ring.segment} has {len(ring.members)} members for "
                                 f"{assignment.num_clusters} clusters")
        self._segments: list[_Segment] = []
        for ring in assignment.rings:
            member = RingMember(assignment.cluster, [m.address for m in ring.members], router,
                                assignment.token, segment=ring.segment, codec=assignment.averaging.codec,
                                step_timeout=step_timeout)
            layout = FlatLayout(live, canonical_keys(live, ring.blocks))
            buffers = torch.empty(layout.numel), torch.empty(layout.numel)
            self._segments.append(_Segment(member, layout, *buffers))
        # one thread per ring: a node serves all its rings at once
        self._pool = ThreadPoolExecutor(max(1, len(self._segments)), thread_name_prefix="ravnest-avg")
        self._running: _Round | None = None
        self._pending: list[int] = []  # rounds triggered while another was still running

    def after_step(self, step: int) -> None:
        """Call right after optimizer step number `step` (1 after the first step). Cheap unless a
        round finished (apply it) or is due (snapshot and start it); blocks only when the network
        is so slow that two rounds are already waiting."""
        if self._running is not None and self._running.done():
            self._apply_running()
        if step > 0 and step % self.every == 0:
            self._pending.append(step // self.every)
        if self._running is not None and len(self._pending) > 1:
            wait(self._running.futures)
            self._apply_running()
        if self._running is None and self._pending:
            self._running = self._start(self._pending.pop(0))

    def flush(self) -> None:
        """Block until every started or due round has run and been applied (e.g. before a checkpoint)."""
        while self._running is not None or self._pending:
            if self._running is None:
                self._running = self._start(self._pending.pop(0))
            wait(self._running.futures)
            self._apply_running()

    def finish(self) -> None:
        """After the last step: `flush`, then one synchronous raw-fp32 round that sets the live
        tensors exactly to the average (equal in every cluster)."""
        self.flush()
        final = self._start(FINAL_ROUND, codec="")
        with torch.no_grad():
            for segment, future in zip(self._segments, final.futures):
                _, average = future.result()
                for key, value in segment.layout.views(average.to(self.device)).items():
                    self.live[key].copy_(value)

    def close(self) -> None:
        """Leave every ring; a round still running is abandoned (its thread ends at once)."""
        for segment in self._segments:
            segment.member.close()
        self._pool.shutdown(wait=True, cancel_futures=True)

    # --- internals ------------------------------------------------------------------------------

    def _start(self, number: int, codec: str | None = None) -> _Round:
        futures = []
        for segment in self._segments:
            segment.layout.flatten(self.live, out=segment.snapshot)
            futures.append(self._pool.submit(_average, segment, number, codec))
        return _Round(number, futures)

    def _apply_running(self) -> None:
        """x += avg(snapshot) - snapshot for every tensor of the finished round."""
        running, self._running = self._running, None
        with torch.no_grad():
            for segment, future in zip(self._segments, running.futures):
                snapshot, average = future.result()  # re-raises the ring's error, naming peer and step
                delta = average.sub_(snapshot).to(self.device)
                for key, value in segment.layout.views(delta).items():
                    target = self.live[key]
                    target.add_(value.to(device=target.device, dtype=target.dtype))


def _average(segment: _Segment, number: int, codec: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    average = segment.member.allreduce(segment.snapshot, number, codec=codec, out=segment.average)
    return segment.snapshot, average


def make_averager(assignment: StageAssignment, router: Router, live: dict[str, torch.Tensor],
                  device: str | torch.device = "cpu") -> Averager | None:
    """The averager this assignment asks for, or None when there is nothing to average."""
    if assignment.averaging.strategy == "none" or assignment.num_clusters == 1 or not assignment.rings:
        return None
    return Averager(assignment, router, live, device=device)
