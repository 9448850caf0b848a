"""What a neighbouring stage sends that cannot be honest: a scale that jumps.

While a pipeline trains, the activations one stage sends the next change their scale slowly, and so
do the gradients that come back: the RMS of one micro-batch's stays within a small factor of the last
ones'. A neighbour that starts sending noise of 1000 times their RMS (tests/attacks.py,
`garbage_activations`) had the job complete at 0.975 with nothing noticed. Now the receiving stage
refuses the third such micro-batch in a row and names its sender an outlier (PipelineError, kind
`outlier`): the job re-plans without it, as for a replica most of a robust round found far off.

The bound: more than JUMP times the median RMS of the last WINDOW micro-batches, and more than
PEAK_SLACK times the largest RMS accepted so far, once WARMUP have come. Both, because gradients are
heavy-tailed: once a classifier is confident most micro-batches give almost none, and the one it gets
wrong gives thousands of times the median (the digits CNN in micro-batches of 4: up to 3,500 times),
but never much above the largest seen early on, when every answer was wrong (at most 1.4 times it,
3 seeds). A check on the median alone refused such an honest micro-batch in CI.

A micro-batch beyond the bound is scaled down to it (its direction kept, as gradient clipping does)
and left out of the scale's history; STRIKES of them in a row are refused. Not the first one alone:
a stage that resumed from a checkpoint starts a new history, of a model already confident, and CI
once saw an honest neighbour refused 3 s after such a resume. Noise sent on every micro-batch is
refused at the third; what came before it reached the stage's weights only at the bound's scale.

No honest pipeline of the test suite tripped it (digits, gpt on text, Llama pre-training and
fine-tuning over compressed links, models larger than a node). What this cannot see: noise of the
honest scale, values wrong in direction only, garbage sent from the very first micro-batch (it is
the only scale the stage knows), and garbage sent in fewer than STRIKES micro-batches in a row (it
is clipped, no more); catching those needs a stage's work compared elsewhere: audits.py, where 3 or
more clusters cut the model alike.
"""
from __future__ import annotations

import logging
import statistics
from collections import deque

import torch

from ravnest.failures import FailureKind
from ravnest.pipeline.inbox import PipelineError
from ravnest.spec import StagePeer

JUMP = 100.0
PEAK_SLACK = 4.0
WINDOW = 32
WARMUP = 8
STRIKES = 3

log = logging.getLogger(__name__)


class ScaleWatch:
    """The RMS of what one neighbour sent lately; `check` clips a jump and refuses STRIKES in a row
    (see the module docstring)."""

    def __init__(self, what: str, sender: StagePeer | None):
        self.what, self.sender = what, sender
        self._seen: deque[float] = deque(maxlen=WINDOW)
        self._peak = 0.0
        self._strikes = 0

    def check(self, tensor: torch.Tensor, micro_batch: int) -> torch.Tensor:
        """`tensor`, or a copy scaled down to the bound; PipelineError at the STRIKES-th jump in a row."""
        if self.sender is None or tensor.numel() == 0:
            return tensor
        rms = float(torch.linalg.vector_norm(tensor.detach(), dtype=torch.float32)) / tensor.numel() ** 0.5
        if len(self._seen) >= WARMUP:
            typical = statistics.median(self._seen)
            bound = max(JUMP * typical, PEAK_SLACK * self._peak)
            if typical > 0 and rms > bound:  # (all zeros so far: no scale to judge by)
                self._strikes += 1
                what = (f"the {self.what} of micro-batch {micro_batch} from node {self.sender.node_id} at "
                        f"{self.sender.address} had an RMS of {rms:.3g}, {rms / typical:.0f} times the "
                        f"median of its last {len(self._seen)} ({typical:.3g}) and {rms / self._peak:.0f} times "
                        f"the largest before")
                if self._strikes >= STRIKES:
                    raise PipelineError(f"{what}, the {STRIKES}th such in a row; refused as an outlier",
                                        FailureKind.OUTLIER, self.sender.address)
                log.warning("%s; scaled down to %.3g (%d of %d in a row before it is refused)",
                            what, bound, self._strikes, STRIKES)
                return tensor * (bound / rms)
        self._strikes = 0
        self._seen.append(rms)
        self._peak = max(self._peak, rms)
        return tensor
