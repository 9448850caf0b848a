"""Where a stage calls its averaging strategy, and the train-alone policy.

Training alone: when averaging fails (a member of another cluster is gone) or the node is told to
(`train_alone`: the job is being re-planned around a loss elsewhere), a stage whose optimizer applies
its own updates leaves its averaging and trains on: its cluster is intact, and it keeps training
while the job is re-planned, until the node stops it to hand in its state. Replicas are kept close by
averaging, and a replica that trains alone too long drifts from the others (whose blocks may continue
from its state): after as many steps as the averaging lets replicas train between rounds
(`averaging.every`, at least ALONE_STEPS) it stops by itself, raising TrainedAlone, and its node hands
in its state. A strategy that applies the update itself (DeAR) cannot be left: the stage fails instead.
"""
from __future__ import annotations

import logging
from typing import Callable

from ravnest.averaging.strategy import AveragingStrategy
from ravnest.pipeline.inbox import TrainedAlone
from ravnest.spec import StageAssignment

log = logging.getLogger(__name__)
ALONE_STEPS = 10  # the fewest steps a stage trains alone before it stops to hand in its state


class AveragingHooks:
    """Calls `strategy`'s hooks on the worker thread; `on_alone(reason)` tells the node it left."""

    def __init__(self, assignment: StageAssignment, steps: Callable[[], int],
                 on_alone: Callable[[str], None]):
        self.assignment, self._steps, self._on_alone = assignment, steps, on_alone
        self.strategy: AveragingStrategy | None = None
        self.alone = ""  # why this stage trains without its averaging, once it does
        self.alone_until: int | None = None  # having left its averaging: the step it stops at to hand in
        self.alone_steps = max(ALONE_STEPS, assignment.averaging.every)
        self._asked = ""  # `train_alone` was called (from another thread) with this reason
        self.alone_cause: BaseException | None = None  # what failed the averaging, when it failed
        self._stopping = False

    @property
    def updates(self) -> bool:
        """Whether the optimizer's step applies the update (not a strategy later, in parts: DeAR)."""
        return self.strategy is None or not self.strategy.defers_update

    def __call__(self, hook: str, *args: int) -> None:
        """Call the strategy's `hook`; leave it to train alone where it fails or `train_alone` asked,
        unless the stage is stopping or the strategy cannot be left."""
        strategy = self.strategy
        if strategy is None:
            return
        try:
            if not self._asked:
                getattr(strategy, hook)(*args)
                return
            reason = self._asked
        except Exception as exc:
            if self._stopping or strategy.defers_update:
                raise
            reason = self._asked or f"averaging failed: {exc}"  # the first: our own abort failed it
            self.alone_cause = None if self._asked else exc
        self._leave(strategy, reason)

    def _leave(self, strategy: AveragingStrategy, reason: str) -> None:
        self.strategy, self.alone = None, reason
        self.alone_until = self._steps() + self.alone_steps
        try:
            strategy.close()
        except Exception:  # noqa: BLE001 -- it failed already; training goes on without it
            log.exception("closing the averaging strategy after it failed")
        log.warning("stage %d of cluster %d trains alone from step %d: %s", self.assignment.stage,
                    self.assignment.cluster, self._steps(), reason)
        self._on_alone(reason)

    def check_alone(self, step: int) -> None:
        """After `step`: raise TrainedAlone once the stage trained alone as far as replicas may drift."""
        if self.alone_until is not None and self.alone_until <= step < self.assignment.training.steps:
            raise TrainedAlone(f"stage {self.assignment.stage} trained alone for {self.alone_steps} steps, as far "
                               f"as replicas may drift apart; it stops to hand in its state")

    def train_alone(self, reason: str) -> bool:
        """From any thread: leave the averaging and train on; False where the strategy applies the
        update itself and cannot be left."""
        strategy = self.strategy
        if strategy is None:  # nothing to leave: it trains alone already
            self.alone = self.alone or reason
            return True
        if strategy.defers_update:
            return False
        self._asked = reason
        strategy.abort()  # out of any round it waits in; the worker then leaves it
        return True

    def stop(self) -> None:
        """From any thread: out of any round under way; the failure it raises stops the stage."""
        self._stopping = True
        if self.strategy is not None:
            self.strategy.abort()

    def metrics(self) -> dict[str, float]:
        return {**({"training_alone": 1.0} if self.alone else {}),
                **(self.strategy.metrics() if self.strategy is not None else {})}
