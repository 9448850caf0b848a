"""What a neighbouring stage sends that cannot be honest: a scale that jumps.

While a pipeline trains, the activations one stage sends the next change their scale slowly, and so
do the gradients that come back: the RMS of one micro-batch's stays within a small factor of the last
ones'. A neighbour that starts sending noise of 1000 times their RMS (tests/attacks.py,
`garbage_activations`) had the job complete at 0.975 with nothing noticed. Now the receiving stage
refuses the first such micro-batch and names its sender an outlier (PipelineError, kind `outlier`):
the job re-plans without it, as for a replica most of a robust round found far off.

The bound: more than JUMP times the median RMS of the last WINDOW micro-batches, once WARMUP have
come. No honest pipeline of the test suite tripped it (digits, gpt on text, Llama pre-training and
fine-tuning over compressed links, models larger than a node). What this cannot see: noise of the
honest scale, values wrong in direction only, and garbage sent from the very first micro-batch (it
is the only scale the stage knows); catching those needs a stage's work recomputed elsewhere (spot
checks), not built yet (docs/security.md).
"""
from __future__ import annotations

import statistics
from collections import deque

import torch

from ravnest.failures import FailureKind
from ravnest.pipeline.inbox import PipelineError
from ravnest.spec import StagePeer

JUMP = 100.0
WINDOW = 32
WARMUP = 8


class ScaleWatch:
    """The RMS of what one neighbour sent lately; `check` refuses a jump (see the module docstring)."""

    def __init__(self, what: str, sender: StagePeer | None):
        self.what, self.sender = what, sender
        self._seen: deque[float] = deque(maxlen=WINDOW)

    def check(self, tensor: torch.Tensor, micro_batch: int) -> None:
        if self.sender is None or tensor.numel() == 0:
            return
        rms = float(torch.linalg.vector_norm(tensor.detach(), dtype=torch.float32)) / tensor.numel() ** 0.5
        if len(self._seen) >= WARMUP:
            typical = statistics.median(self._seen)
            if typical > 0 and rms > JUMP * typical:  # (all zeros so far: no scale to judge by)
                raise PipelineError(
                    f"the {self.what} of micro-batch {micro_batch} from node {self.sender.node_id} at "
                    f"{self.sender.address} had an RMS of {rms:.3g}, {rms / typical:.0f} times the "
                    f"median of its last {len(self._seen)} ({typical:.3g}); refused as an outlier",
                    FailureKind.OUTLIER, self.sender.address)
        self._seen.append(rms)
