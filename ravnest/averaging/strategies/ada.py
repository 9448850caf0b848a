"""Strategy "ada" (after "Scaling Up Data Parallelism in Decentralized Deep Learning", Ada/DBench):
gossip whose communication graph follows the replicas' spread.

The paper finds that decentralized training loses accuracy as the replicas drift apart (the
cross-replica variance of the parameters), and that denser graphs keep them together at the cost of
more messages. Ada therefore mixes like "dsgd" but moves along a ladder of graphs, sparse to dense
by messages per member per round:

    one-peer-exp (1)  alternating-exp-ring (1.5)  ring (2)  exponential (log2 n)  complete (n - 1)

starting at `averaging.topology`. Every `ada_check_every` steps each stage measures, per segment,
the relative consensus distance rho = mean_i ||x_i - x_bar||^2 / ||x_bar||^2 on a sample of m = 4096
coordinates (the same on every member: drawn from the step number), from ONE all-reduce of m + 1
floats (the sample and its squared norm): mean_i ||s_i - s_bar||^2 = mean_i ||s_i||^2 - ||s_bar||^2.
A uniform sample estimates rho without bias, for 16 KiB on the wire where the model may be gigabytes.
If rho > `ada_high` the segment's group moves one graph denser, if rho < `ada_low` one sparser; every
member computes the same rho from the same all-reduce, so all switch at the same round. Each change
is logged and the job view shows the current graph (`avg_graph`, its index on the ladder) and rho.

The defaults (high 1e-5, low 4e-6) come from measuring rho on digits (CNN, 4 replicas, Adam at lr
1e-3, mixing every step): with one-peer-exp rho is 1-1.6e-5 over the first 60 steps and 3-8e-6
after; with complete, 4-8e-6 and then 1-4e-6. So a run starts denser while the replicas move fast
and returns to one message per round as they settle. They are relative to the learning rate and to
`every` (fewer mixing rounds, larger rho): set them from the `avg_spread` a job reports.
"""
from __future__ import annotations

import logging

import torch

from ravnest.timeouts import PEER_SILENCE_S
from ravnest.averaging.strategies.dsgd import GossipMixing, _Segment
from pydantic import Field, PositiveInt, model_validator

from ravnest.averaging.registry import StrategySettings
from ravnest.averaging.strategy import StageContext, register_strategy

log = logging.getLogger(__name__)
LADDER = ("one-peer-exp", "alternating-exp-ring", "ring", "exponential", "complete")
SAMPLE = 4096


def consensus_distance(mean_sample: torch.Tensor, mean_square: float) -> float:
    """rho from the all-reduced sample mean s_bar and mean squared norm mean_i ||s_i||^2."""
    center = float(mean_sample.dot(mean_sample))
    return max(mean_square - center, 0.0) / max(center, 1e-30)


class AdaSettings(StrategySettings):
    check_every: PositiveInt = Field(10, le=10_000_000, description="steps between measurements of the "
                                     "replicas' spread")
    high: float = Field(1e-5, gt=0, description="a denser graph above this relative consensus distance")
    low: float = Field(4e-6, ge=0, description="a sparser graph below this relative consensus distance")

    @model_validator(mode="after")
    def _thresholds_ordered(self) -> AdaSettings:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low:g}) must be below high ({self.high:g})")
        return self


@register_strategy("ada", settings=AdaSettings, gossip=True, robust=True,
                   flat_keys={"ada_check_every": "check_every", "ada_high": "high", "ada_low": "low"})
class AdaptiveGossip(GossipMixing):
    name = "ada"

    def __init__(self, context: StageContext, *, step_timeout: float = PEER_SILENCE_S):
        super().__init__(context, step_timeout=step_timeout)
        settings = context.assignment.averaging
        own: AdaSettings = settings.of("ada")
        self.check_every, self.high, self.low = own.check_every, own.high, own.low
        start = LADDER.index(settings.topology) if settings.topology in LADDER else LADDER.index("ring")
        self._levels = [start] * len(self._segments)
        self.spread = [0.0] * len(self._segments)
        self.changes = 0

    def _topology_of(self, segment: _Segment) -> str:
        return LADDER[self._levels[self._segments.index(segment)]]

    def _between_rounds(self, step: int) -> None:
        if step % self.check_every or step >= self._steps:
            return
        self._apply_all()  # measure the weights as they are, mixing included
        for i, segment in enumerate(self._segments):
            flat = self._flatten(segment)
            index = torch.randint(flat.numel(), (min(SAMPLE, flat.numel()),),
                                  generator=torch.Generator().manual_seed(step))
            sample = flat[index]
            mean = segment.member.allreduce(torch.cat([sample, sample.dot(sample).reshape(1)]),
                                            self._wire(step, 2), codec="")
            self.spread[i] = rho = consensus_distance(mean[:-1], float(mean[-1]))
            level = self._levels[i]
            if rho > self.high and level + 1 < len(LADDER):
                self._levels[i] = level + 1
            elif rho < self.low and level > 0:
                self._levels[i] = level - 1
            if self._levels[i] != level:
                self.changes += 1
                log.info("ada: segment %d at step %d: rho %.2e (thresholds %.1e/%.1e): %s -> %s",
                         segment.member.segment, step, rho, self.low, self.high, LADDER[level],
                         LADDER[self._levels[i]])

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), "avg_graph": float(max(self._levels, default=0)),
                "avg_spread": max(self.spread, default=0.0), "avg_graph_changes": float(self.changes)}
