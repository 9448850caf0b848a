"""When a stage checkpoints: every `checkpoint_every` steps, and with `checkpoint_every_s` at a step
stage 0 names by the clock and tags every forward with, so all stages of a pipeline take the same step.
The named step is the first one that needs a micro-batch not admitted yet (up to K are already on
their way untagged): no stage can finish it before hearing which step it is.
"""
from __future__ import annotations

import time
from typing import Mapping

from ravnest.spec import StageAssignment


class CheckpointTiming:
    def __init__(self, assignment: StageAssignment, per_step: int):
        self.assignment, self.per_step = assignment, per_step
        self.steps = assignment.training.steps
        self.at = 0  # the step named by the clock (0: none pending)
        self._last = time.monotonic()

    def heard(self, tags: Mapping[str, int]) -> None:
        """A forward from the previous stage: the step stage 0 named, if any."""
        self.at = max(self.at, tags.get("checkpoint_at", 0))

    def tags(self, step: int) -> dict[str, int]:
        """What a forward sent at `step` carries on to the next stage."""
        return {"checkpoint_at": self.at} if self.at > step else {}

    def due(self, step: int) -> bool:
        every = self.assignment.checkpoint_every
        return ((every and step % every == 0) or step == self.at) and step < self.steps

    def taken(self) -> None:
        self._last = time.monotonic()  # by steps or by seconds, whichever came first

    def plan(self, step: int, admitted: int) -> None:
        """Stage 0, after `step`, having admitted `admitted` micro-batches since the resume: name the
        step to checkpoint at when the time has come (the module's docstring). A named step is never
        replaced before it is taken."""
        every_s = self.assignment.checkpoint_every_s
        if self.assignment.stage != 0 or not every_s or self.at > step or time.monotonic() - self._last < every_s:
            return
        untagged = admitted + 1  # micro-batches (since the resume) that carry no tag
        first_tagged_step = self.assignment.resume_step + -(-untagged // self.per_step)
        self.at = max(step + 1, first_tagged_step)
