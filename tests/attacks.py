"""What a volunteer who lies in what it sends can do, as code the tests and bench.byzantine inject.

Each attack is a function of what an honest node would send. They live in tests/, which no installed
package ships (pyproject: ravnest, coordinator, node): a production node has no way to run one. A real
node process takes them through `python -m tests.attacker_node join --attack NAME ...`.

    sign_flip            its averaging contribution times -1000
    large_norm           plus a random direction 100 times its own norm
    stale_replay         the contribution it sent STALE_STEPS steps before, again
    label_flip           trains on label c - 1 - y (c classes): honest arithmetic on wrong data
    garbage_activations  a pipeline stage's outputs (on the last stage, the gradients it sends back)
                         replaced by noise of 1000 times their RMS
    noise_activations    ... by noise of their own RMS: what the scale check cannot see (audits can)

Any of them may start mid-job: from averaging round `from_round` on (a step // every), before which the
node is honest.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

AVERAGING = ("sign_flip", "large_norm", "stale_replay")
TRAINING = ("label_flip",)
PIPELINE = ("garbage_activations", "noise_activations")
ATTACKS = AVERAGING + TRAINING + PIPELINE
STALE_STEPS = 100


@dataclass
class Attack:
    """One liar's attack and what it remembers (its past contributions, for a replay)."""
    name: str
    from_round: int = 0
    every: int = 1  # steps between averaging rounds, to count STALE_STEPS in rounds
    _sent: dict[int, deque] = field(default_factory=dict)  # segment -> its last contributions

    def __post_init__(self) -> None:
        if self.name not in ATTACKS:
            raise ValueError(f"unknown attack {self.name!r}; known: {', '.join(ATTACKS)}")

    def on(self, round: int) -> bool:
        return round >= self.from_round

    def contribution(self, flat: torch.Tensor, round: int, segment: int = 0) -> torch.Tensor:
        """What it sends in averaging round `round` where an honest node sends `flat`."""
        history = self._sent.setdefault(segment, deque(maxlen=max(1, -(-STALE_STEPS // self.every)) + 1))
        history.append(flat.detach().clone())
        if self.name not in AVERAGING or not self.on(round):
            return flat
        if self.name == "sign_flip":
            return -1000.0 * flat
        if self.name == "large_norm":
            direction = torch.randn(flat.shape, generator=torch.Generator().manual_seed(round))
            return flat + direction * (100.0 * float(flat.norm()) / max(1.0, float(direction.norm())))
        return history[0]  # stale_replay: the oldest it kept, STALE_STEPS back once it has that many

    def labels(self, y: torch.Tensor, num_classes: int, round: int) -> torch.Tensor:
        return num_classes - 1 - y if self.name == "label_flip" and self.on(round) else y

    def activations(self, output: torch.Tensor, round: int) -> torch.Tensor:
        if self.name not in PIPELINE or not self.on(round):
            return output
        rms = float(output.float().pow(2).mean().sqrt()) or 1.0
        scale = 1000.0 if self.name == "garbage_activations" else 1.0
        return (torch.randn_like(output.float()) * scale * rms).to(output.dtype)
