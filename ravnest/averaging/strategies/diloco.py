"""Strategy "diloco" (DiLoCo, arXiv 2311.08455; OpenDiLoCo and INTELLECT-1 over the internet): clusters
train H = `averaging.every` local steps with their own optimizer, then all-reduce the pseudo-gradient
and take one step of an outer optimizer with it.

Every member of a group starts round r from the same weights theta_r. After H local steps it holds
theta_local; the pseudo-gradient is delta = theta_r - theta_local, its mean over the group is
all-reduced (small values: `averaging.codec` int8 or fp16 loses little on them, where it would on the
weights; `topk` sends 1.56% of them, with error feedback, and the replicas all-gather), and the outer
optimizer, SGD with Nesterov momentum by default, steps from theta_r:

    m <- mu m + mean(delta)          theta_{r+1} = theta_r - lr (mean(delta) + mu m)

(`outer_lr` = 0.7 and `outer_momentum` = 0.9 as in the paper; with lr 1 and mu 0 this is plain
periodic averaging.) Every member computes the same theta_{r+1} (the same mean, start and momentum).
By default the round is synchronous: the stage waits for the all-reduce at the round's end. With
`averaging.streaming` the all-reduce of round r runs while round r + 1's first H // 2 local steps
train, and the stage then adds theta_{r+1} - theta_local(at the round's end), keeping those steps'
progress (as the overlapped "ring" strategy does; Streaming DiLoCo's outer-step overlap).

The inner optimizer's state stays local. `finish` sets every replica to the exact average (raw fp32),
as the other strategies do, so the final model is one model.
"""
from __future__ import annotations

import math

import torch

from ravnest.timeouts import PEER_SILENCE_S
from ravnest.averaging.layout import FlatLayout, canonical_keys
from ravnest.averaging.strategies.ring import RingAveraging, _Outcome, _Segment
from pydantic import Field

from ravnest.averaging.registry import CostInputs, StrategySettings
from ravnest.averaging.runtime import ring_round_s
from ravnest.averaging.strategy import StageContext, register_strategy
from ravnest.wire import codecs


def outer_step(start: torch.Tensor, mean_delta: torch.Tensor, momentum: torch.Tensor, lr: float,
               mu: float, nesterov: bool = True) -> torch.Tensor:
    """SGD (with Nesterov momentum) on the pseudo-gradient: returns theta_{r+1}; updates `momentum`
    in place."""
    momentum.mul_(mu).add_(mean_delta)
    direction = mean_delta.add(momentum, alpha=mu) if nesterov else momentum
    return start.sub(direction, alpha=lr)


class DilocoSettings(StrategySettings):
    outer_lr: float = Field(0.7, gt=0, le=10, description="the outer optimizer's learning rate")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="the outer optimizer's Nesterov momentum")
    streaming: bool = Field(False, description="the all-reduce of a round overlaps the next round's first "
                            "every // 2 local steps instead of blocking")


def diloco_cost(c: CostInputs) -> float:
    """The ring's round, blocking unless streaming."""
    return ring_round_s(c, max(1, c.every // 2) if c.spare_core and c.settings.streaming else 0)


@register_strategy("diloco", settings=DilocoSettings, cost=diloco_cost, averages_changes=True, robust=True,
                   flat_keys={"outer_lr": "outer_lr", "outer_momentum": "outer_momentum", "streaming": "streaming"})
class OuterOptimization(RingAveraging):
    name = "diloco"

    def __init__(self, context: StageContext, *, step_timeout: float = PEER_SILENCE_S):
        super().__init__(context, step_timeout=step_timeout)
        own: DilocoSettings = context.assignment.averaging.of("diloco")
        self.lr, self.mu = own.outer_lr, own.outer_momentum
        self._optimizer_state = None  # the inner optimizer's state stays local
        self.apply_delay = max(1, self.every // 2) if own.streaming else 0
        # theta_r of every segment: the weights all members start the round from (equal at step 0:
        # same seed; equal after every round: same outer step)
        self._round_start: dict[int, torch.Tensor] = {}
        self._momentum: dict[int, torch.Tensor] = {}
        self._delta: dict[int, torch.Tensor] = {}
        # a sparsifying codec delays what it leaves out; running statistics (BatchNorm's buffers) are
        # not changes to delay (a variance pushed part way goes negative), so they stay each
        # replica's own until `finish` averages them exactly
        self._buffers: dict[int, torch.Tensor] = {}
        sparse = not codecs.codec(context.assignment.averaging.sent_codec).reduces
        for segment in self._segments:
            segment.layout = FlatLayout(self.live, canonical_keys(self.live, segment.blocks))
            segment.snapshot, segment.average = torch.empty(segment.layout.numel), torch.empty(segment.layout.numel)
            key = segment.member.segment
            self._round_start[key] = segment.layout.flatten(self.live)
            self._momentum[key] = torch.zeros(segment.layout.numel)
            self._delta[key] = torch.empty(segment.layout.numel)
            if sparse:
                self._buffers[key] = torch.cat([torch.full((math.prod(shape),), not self.live[k].requires_grad)
                                                for k, shape in zip(segment.layout.keys, segment.layout.shapes)])

    def _round_input(self, segment: _Segment) -> torch.Tensor:
        """The pseudo-gradient theta_r - theta_local."""
        key = segment.member.segment
        delta = torch.sub(self._round_start[key], segment.snapshot, out=self._delta[key])
        return delta.masked_fill_(self._buffers[key], 0.0) if key in self._buffers else delta

    def _correction(self, segment: _Segment, outcome: _Outcome) -> torch.Tensor:
        """theta_{r+1} - theta_local(at the round's end); theta_{r+1} starts the next round."""
        key = segment.member.segment
        new = outer_step(self._round_start[key], outcome.average, self._momentum[key], self.lr, self.mu)
        if key in self._buffers:  # kept as they are
            new = torch.where(self._buffers[key], outcome.snapshot, new)
        self._round_start[key].copy_(new)
        return new.sub_(outcome.snapshot)
