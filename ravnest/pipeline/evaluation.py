"""Evaluation passes through a pipeline that never drains.

Stage 0 streams the whole test set through the pipeline every `eval_every` steps and after the last
step ("eval" messages, then "eval_end"). The other stages get those messages between forwards, in
the same lane, and evaluate each round once they have reached the step stage 0 evaluated at (a stage
may read a round a little before finishing that step: it waits in a backlog). The last stage sums
loss and accuracy and reports them.
"""
from __future__ import annotations

from typing import Callable

import torch

from ravnest.pipeline.averaging_hooks import AveragingHooks
from ravnest.pipeline.feed import BatchFeed
from ravnest.pipeline.stage_metrics import EvalAccumulator, StageClock
from ravnest.pipeline.neighbours import EVAL, EVAL_END, NEXT, Neighbours
from ravnest.pipeline.inbox import PipelineError
from ravnest.pipeline.stash import StageCompute
from ravnest.spec import StageAssignment
from ravnest.wire import Message


class StageEvaluation:
    def __init__(self, assignment: StageAssignment, *, compute: StageCompute, loss: Callable,
                 neighbours: Neighbours, averaging: AveragingHooks, clock: StageClock, steps: Callable[[], int],
                 report: Callable[[dict[str, float]], None], feed: BatchFeed | None):
        self.assignment, self.compute, self._loss = assignment, compute, loss
        self.neighbours, self.averaging, self.clock = neighbours, averaging, clock
        self._steps, self._report, self.feed = steps, report, feed
        self.is_last = assignment.is_last
        self.results: dict[str, float] = {}  # the last stage's latest test_loss and test_accuracy
        self.finished = False  # the final round is done
        self._sums = EvalAccumulator()
        self._round = 0  # stage 0: the next round it starts
        self._current: int | None = None  # the round under way on this stage
        self._backlog: list[Message] = []  # evaluation messages for a step this stage has not reached

    def take(self, msg: Message) -> None:
        """An evaluation message read between forwards (or after the last micro-batch)."""
        if msg.kind not in (EVAL, EVAL_END):
            raise PipelineError(f"stage {self.assignment.stage} got {msg.kind} {msg.id} after its last micro-batch")
        self._backlog.append(msg)
        self.drain()

    def drain(self) -> None:
        """Evaluate, in arrival order, the rounds this stage has reached the step of."""
        while self._backlog and self._steps() >= self.step_of(self._backlog[0].id):
            msg = self._backlog.pop(0)
            if self._current != msg.id:
                self._begin(msg.id)
            if msg.kind == EVAL:
                self._batch(msg.id, msg.tensors["x"].to(self.compute.device), msg.tensors["y"].to(self.compute.device))
            else:
                self._end(msg.id, final=bool(msg.tags.get("final", 0)))

    def step_of(self, round_: int) -> int:
        """The step evaluation round `round_` is taken at: every `eval_every` steps after the resume
        step, then the final one."""
        every, steps = self.assignment.training.eval_every, self.assignment.training.steps
        if every and (step := (self.assignment.resume_step // every + 1 + round_) * every) < steps:
            return step
        return steps

    def evaluate(self, final: bool) -> None:
        """Stage 0: stream the whole test set through the pipeline."""
        assert self.feed is not None, "only stage 0 starts an evaluation"
        round_, self._round = self._round, self._round + 1
        self._begin(round_)
        device = self.compute.device
        for x, y in self.feed.test_batches():
            self._batch(round_, x.to(device), y.to(device))
        self._end(round_, final)

    def _begin(self, round_: int) -> None:
        self.averaging("flush")  # what the strategy has under way lands in the weights first
        self._current = round_
        self.averaging("begin_evaluation", round_)

    def _batch(self, round_: int, x: torch.Tensor, y: torch.Tensor) -> None:
        with self.clock.busy(evaluation=True):
            output = self.compute.evaluate(x)
            if self.is_last:
                self._sums.add(output, y, self._loss(output, y))
        if not self.is_last:
            self.neighbours.send(NEXT, Message(EVAL, round_, {"x": output, "y": y}))

    def _end(self, round_: int, final: bool) -> None:
        self.averaging("end_evaluation", round_)
        self._current = None
        if self.is_last:
            results, self._sums = self._sums.result(), EvalAccumulator()
            self.results.update(results)
            self._report(results)
        else:
            self.neighbours.send(NEXT, Message(EVAL_END, round_, tags={"final": int(final)}))
        self.finished = final
