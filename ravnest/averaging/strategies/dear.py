"""Strategy "dear" (DeAR, arXiv 2302.12445): synchronous data-parallel updates with the all-reduce of
the gradients cut in two and hidden behind computation.

Each step's gradients are averaged over the group (one member per cluster holding the segment) and
every member applies the same update, so the replicas stay equal: the updates are those of
synchronous data-parallel training at the group's total batch. The all-reduce is decoupled:

- reduce-scatter during the backward: the gradients are fused into groups of consecutive parameters
  (`ravnest/averaging/fusion.py`, `averaging.fusion_mb`, searched over [1, 256] MB when
  `averaging.tune_fusion`), and a group's reduce-scatter starts as soon as the backward of the
  step's last micro-batch has produced all of its gradients, while the backward goes on towards the
  first layers;
- all-gather during the next forward: the all-gathers run in forward order, and a block's update is
  applied in its forward pre-hook, once the groups holding its parameters are gathered, so the first
  blocks compute while the last ones' gradients are still on the wire.

That fine-grained overlap needs a stage whose forward reads its live parameters and whose backward
runs whole in W (a cluster of one stage: DeAR's own setting, data parallelism). Inside a deeper
asynchronous pipeline the forward reads weight snapshots taken when it starts: there the
reduce-scatters start at the step and the stage waits for every group before its next forward
(the pipeline's other stages still overlap it). Gradients travel as raw fp32 (`averaging.codec` does
not apply: every member must apply bitwise the same update). `averaging.every` does not apply
either: every step is averaged. Rounds of a segment are numbered by a counter every member advances
identically (one per group per step, one for the tuner's choice, one at `finish`).

With `averaging.robust` each group's gradients take a robust round (robust_round.py) in place of the
reduce-scatter, and its all-gather is part of it: the whole round runs behind the backward, and only
the fine-grained overlap of the all-gather with the next forward is given up. Every member applies
the same robust mean (what each owner sent everyone), so the replicas stay bitwise equal. One step's
gradients are heavy-tailed (the replica whose micro-batch held the sample the model gets wrong sends
far more than the others), so a replica the owners' majority finds far off is clipped at once but
named an outlier only once that happened in STRIKES steps in a row: every member counts the same
votes, so all of them name it in the same round.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ravnest.timeouts import PEER_SILENCE_S
from ravnest.averaging.fusion import MB, FusionTuner, fusion_groups
from ravnest.averaging.layout import FlatLayout, block_index, canonical_keys
from ravnest.averaging.collectives import RingMember
from ravnest.averaging.robust import STRIKES, Strikes
from ravnest.averaging.robust_round import RingOutlier, robust_allreduce
from pydantic import Field

from ravnest.averaging.registry import CostInputs, StrategySettings
from ravnest.averaging.runtime import BACKWARD_SHARE, fusion_count, half_allreduce_s, straggler_s
from ravnest.averaging.strategy import GroupStrategy, StageContext, group_member, register_strategy


@dataclass
class _Group:
    """One fusion group of one step: parameters consecutive in forward order."""
    keys: list[str]
    layout: FlatLayout
    first_block: int
    round: int
    step: int
    flat: torch.Tensor  # reused by the same group in later steps
    views: dict[str, torch.Tensor]  # of `flat`, per parameter
    filled: set[str] = field(default_factory=set)  # keys whose final gradient is in `flat`
    gathered: Future | None = None  # reduce-scatter then all-gather; its result is the mean


@dataclass
class _Segment:
    member: RingMember
    keys: list[str]    # its parameters, forward order
    buffers: list[str]  # its floating buffers (averaged once, at `finish`)
    tuner: FusionTuner
    pool: ThreadPoolExecutor  # one thread: every member runs the segment's rounds in the same order
    rounds: int = 0
    groups: list[_Group] = field(default_factory=list)  # the step being reduced, forward order
    submitted: int = 0  # groups whose reduce-scatter is queued, counted from the last one
    unapplied: list[_Group] = field(default_factory=list)  # gathered or gathering, forward order
    choice: Future | None = None  # the tuner's averaged times
    strikes: Strikes = field(default_factory=Strikes)  # robust: members the owners found far off, by step


class DearSettings(StrategySettings):
    fusion_mb: float = Field(25.0, gt=0, le=1024, description="gradients travel in groups of consecutive "
                             "parameters of up to this many MB (the search's starting point when tune_fusion)")
    tune_fusion: bool = Field(True, description="try each grouping a power-of-two size in [1, 256] MB gives "
                              "over the first steps and keep the fastest")


def dear_cost(c: CostInputs) -> float:
    """With k groups, RS = AG = (n - 1) (P / (n B) + k L). One-stage clusters hide the reduce-scatter
    behind the backward (2/3 of T) except its last group's part, and the all-gather behind the forward
    except its first group's; inside deeper pipelines neither hides: T + RS + AG."""
    t, g = c.step_s, c.group
    k = fusion_count(g.param_bytes, c.settings.fusion_mb * MB)
    half = half_allreduce_s(g, k)
    if not (g.fine_overlap and c.spare_core):
        return t + 2 * half + straggler_s(c)
    return (t + max(half / k, half - BACKWARD_SHARE * t) + max(half / k, half - (1 - BACKWARD_SHARE) * t)
            + straggler_s(c))


@register_strategy("dear", settings=DearSettings, cost=dear_cost, auto_rank=0, robust=True,
                   flat_keys={"fusion_mb": "fusion_mb", "tune_fusion": "tune_fusion"})
class DecoupledAllReduce(GroupStrategy):
    name = "dear"
    defers_update = True

    def __init__(self, context: StageContext, *, step_timeout: float = PEER_SILENCE_S):
        a = context.assignment
        own: DearSettings = a.averaging.of("dear")
        if context.apply_update is None or context.module is None:
            raise ValueError("dear applies the updates itself: the stage must give apply_update and its module")
        self.live, self._apply, self._waiting = context.live, context.apply_update, context.waiting
        self.per_step = context.per_step
        self.robust = a.averaging.robust  # '' or the robust mean each group's round takes
        params = {key: p for key, p in context.module.named_parameters() if p.requires_grad}
        self._params = params
        self._segments: list[_Segment] = []
        for ring in a.rings:
            blocks = ring.blocks
            keys = [k for k in canonical_keys(self.live, blocks) if k in params]
            sizes = [params[k].numel() * 4 for k in reversed(keys)]  # fp32 on the wire, backward order
            member = group_member(context, ring, step_timeout=step_timeout)  # raw fp32: see the docstring
            self._segments.append(_Segment(
                member, keys, [k for k in canonical_keys(self.live, blocks) if k not in params],
                FusionTuner(sizes, own.fusion_mb, tune=own.tune_fusion,
                            total_steps=a.training.steps - a.resume_step),
                ThreadPoolExecutor(1, thread_name_prefix=f"ravnest-dear-{ring.segment}")))
        self._segment_of_key = {k: s for s in self._segments for k in s.keys}
        self._group_of_key: dict[str, _Group] = {}
        # the fine-grained overlap (see the module docstring) where the stage allows it
        self._overlap = context.forward_reads_live and a.is_first
        self._hooks = []
        if self._overlap:
            self._hooks += [p.register_hook(self._gradient_hook(key)) for key, p in params.items()]
            self._hooks += [block.register_forward_pre_hook(self._block_hook(int(name)))
                            for name, block in context.module.named_children()]
        self._armed = False
        self._resumed_at = a.resume_step  # the tuner counts steps from here
        self._step = a.resume_step  # the step whose gradients are being produced or reduced
        self._buffers: dict[tuple[str, ...], tuple[FlatLayout, torch.Tensor, dict[str, torch.Tensor]]] = {}
        self._last_ready: float | None = None
        self.steps_averaged = 0
        self.comm_s = 0.0   # seconds of reduce-scatter + all-gather, summed over groups
        self.stall_s = 0.0  # seconds the training thread waited for gathers

    # --- the seam ---------------------------------------------------------------------------------

    def weight_gradients(self, micro_batch: int) -> None:
        """Before the backward of the step's last micro-batch: gradients land in fusion groups as the
        backward produces them (`_gradient_hook`)."""
        if self._overlap and (micro_batch + 1) % self.per_step == 0:
            self._begin_step()
            self._armed = True

    def gradients_ready(self, step: int) -> None:
        now = time.perf_counter()
        if self._last_ready is not None:
            for segment in self._segments:
                segment.tuner.record(step - self._resumed_at, now - self._last_ready)
        self._last_ready = now
        if not self._armed:
            self._begin_step()
        self._armed = False
        for segment in self._segments:
            for group in segment.groups:  # what the hooks did not see (unused parameters, no overlap)
                for key in group.keys:
                    if key not in group.filled:
                        grad = self._params[key].grad
                        group.views[key].copy_(grad) if grad is not None else group.views[key].zero_()
                        group.filled.add(key)
            self._submit_ready(segment)
            for group in segment.groups:  # all-gathers in forward order, after every reduce-scatter
                group.gathered = segment.pool.submit(self._gather, segment.member, group.flat, group.round,
                                                     group.gathered)
            segment.unapplied, segment.groups = segment.groups, []
            if segment.tuner.searching and step - self._resumed_at == segment.tuner.end:
                times = torch.tensor(segment.tuner.means(), dtype=torch.float32)
                segment.choice = segment.pool.submit(segment.member.allreduce, times, self._next_round(segment),
                                                     codec="")
        self.steps_averaged += 1
        self._group_of_key.clear()

    def before_forward(self, micro_batch: int) -> None:
        if not self._overlap:  # the forward reads a snapshot taken now: every update must be in
            self._apply_until(None)

    def flush(self) -> None:
        self._apply_until(None)

    def finish(self) -> None:
        """Apply the last update; the parameters are then equal everywhere. Floating buffers (e.g.
        BatchNorm's running statistics) are local: they are averaged once, here."""
        self.flush()
        with torch.no_grad():
            for segment in self._segments:
                if segment.buffers:
                    layout = FlatLayout(self.live, segment.buffers)
                    flat, round = layout.flatten(self.live), self._next_round(segment)
                    mean = (robust_allreduce(segment.member, flat, round, self.robust, codec="") if self.robust
                            else segment.member.allreduce(flat, round, codec=""))
                    for key, value in layout.views(mean).items():
                        self.live[key].copy_(value)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        for segment in self._segments:
            segment.member.close()
            segment.pool.shutdown(wait=True, cancel_futures=True)

    def metrics(self) -> dict[str, float]:
        figures = {"avg_rounds": float(self.steps_averaged), "avg_stall_s": self.stall_s}
        if self.steps_averaged:
            figures["avg_round_s"] = self.comm_s / self.steps_averaged
        if self._segments:
            figures["avg_fusion_mb"] = self._segments[0].tuner.threshold(self._step - self._resumed_at) / MB
        return figures

    # --- gradients into groups, groups onto the wire ----------------------------------------------

    def _begin_step(self) -> None:
        """The fusion groups of the next step (the tuner's threshold for it)."""
        self._apply_until(None)  # the last step's update is in (normally applied by its forward already)
        self._step += 1
        relative = self._step - self._resumed_at
        for segment in self._segments:
            if segment.choice is not None:  # the search ended: every member keeps the same threshold
                segment.tuner.choose(segment.choice.result().tolist())
                segment.choice = None
            backward = list(reversed(segment.keys))
            sizes = [self._params[k].numel() * 4 for k in backward]
            groups = [sorted((backward[i] for i in span), key=segment.keys.index)
                      for span in fusion_groups(sizes, segment.tuner.threshold(relative))]
            base, segment.rounds = segment.rounds, segment.rounds + len(groups)
            # forward order: group 0 holds the first parameters; rounds rise in the order in which they
            # end (a round's end drops late messages of earlier ones): the all-gathers' forward order, or
            # for robust rounds, whole at the reduce, the backward order
            k = len(groups)
            segment.groups = [self._group(keys, base + (k - 1 - i if self.robust else i))
                              for i, keys in enumerate(reversed(groups))]
            segment.submitted = 0
            self._group_of_key.update((key, group) for group in segment.groups for key in group.keys)
        used = {tuple(group.keys) for segment in self._segments for group in segment.groups}
        self._buffers = {keys: cached for keys, cached in self._buffers.items() if keys in used}

    def _group(self, keys: list[str], round: int) -> _Group:
        cached = self._buffers.get(tuple(keys))
        if cached is None:  # fresh large buffers every step would cost page faults
            layout = FlatLayout(self.live, keys)
            flat = torch.empty(layout.numel)
            cached = self._buffers[tuple(keys)] = layout, flat, layout.views(flat)
        return _Group(keys, cached[0], block_index(keys[0]), round, self._step, cached[1], cached[2])

    def _gradient_hook(self, key: str):
        def hook(grad: torch.Tensor) -> None:
            group = self._group_of_key.get(key) if self._armed else None
            if group is None or key in group.filled:  # not the step's last backward, or seen already
                return
            earlier = self._params[key].grad  # the step's other micro-batches
            view = group.views[key]
            view.copy_(grad if earlier is None else earlier + grad)  # on the parameters' device, then to the CPU
            group.filled.add(key)
            self._submit_ready(self._segment_of_key[key])
        return hook

    def _submit_ready(self, segment: _Segment) -> None:
        """Queue the reduce-scatters of complete groups, strictly from the last group backwards: every
        member must run the rounds in the same order."""
        while segment.submitted < len(segment.groups):
            group = segment.groups[len(segment.groups) - 1 - segment.submitted]
            if len(group.filled) < len(group.keys):
                return
            group.gathered = segment.pool.submit(self._reduce, segment, group)
            segment.submitted += 1

    def _reduce(self, segment: _Segment, group: _Group) -> float:
        started = time.perf_counter()
        if not self.robust:
            segment.member.reduce_scatter(group.flat, group.round, codec="", out=group.flat)
            return time.perf_counter() - started
        try:  # the whole round, all-gather included (the module docstring)
            robust_allreduce(segment.member, group.flat, group.round, self.robust, codec="", out=group.flat,
                             changes=True)
        except RingOutlier as named:  # `flat` holds the robust mean
            if not named.by_vote:
                raise
            struck = [address for address in named.addresses if segment.strikes.record(address, group.step)]
            if struck:
                raise RingOutlier(f"{named}, in {STRIKES} steps in a row", address=struck[0], by_vote=True,
                                  also=tuple(struck[1:])) from None
        return time.perf_counter() - started

    def _gather(self, member: RingMember, flat: torch.Tensor, round: int, reduced: Future | None) -> torch.Tensor:
        assert reduced is not None  # (its reduce-scatter was submitted before it)
        seconds = reduced.result()  # done: the pool runs one task at a time, in order
        started = time.perf_counter()
        if not self.robust:
            member.all_gather(flat, round, codec="")
        self.comm_s += seconds + time.perf_counter() - started
        return flat

    # --- updates, applied before the forward reads them -------------------------------------------

    def _block_hook(self, block: int):
        def hook(module: torch.nn.Module, args: object) -> None:
            self._apply_until(block)
        return hook

    def _apply_until(self, block: int | None) -> None:
        """Apply the gathered updates of every group starting at or before `block` (all with None)."""
        for segment in self._segments:
            while segment.unapplied and (block is None or segment.unapplied[0].first_block <= block):
                group = segment.unapplied.pop(0)
                waited = time.perf_counter()
                assert group.gathered is not None  # (every unapplied group's all-gather was submitted)
                with self._waiting():
                    group.gathered.result()  # re-raises the round's error, naming peer and round
                self.stall_s += time.perf_counter() - waited
                self._apply(group.views, not any(s.unapplied for s in self._segments))

    def _next_round(self, segment: _Segment) -> int:
        segment.rounds += 1
        return segment.rounds - 1
