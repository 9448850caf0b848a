"""Runs a stage's schedule (schedule.py): its list of actions, one after another, on the worker thread.

Each action does one thing: take a micro-batch (from the data on stage 0, from the inbox elsewhere),
compute a forward, the input half or the weight half of a backward, send, or step the optimizer.
Messages are taken in schedule order, so arrival timing never changes what is computed.

Stopping lives here, in one place every stage shape passes: before each action the executor looks
at the inbox, which a stop, a lost neighbour or a refused message closes. A stage that is both first
and last (plain data parallelism) reads no messages, and stops there all the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ravnest.pipeline.audits import AuditCheck, AuditPicker
from ravnest.pipeline.averaging_hooks import AveragingHooks
from ravnest.pipeline.checkpoint_timing import CheckpointTiming
from ravnest.pipeline.evaluation import StageEvaluation
from ravnest.pipeline.feed import BatchFeed
from ravnest.pipeline.inbox import PipelineError
from ravnest.pipeline.stage_metrics import BackwardRecord, PipelineTrace, StageClock
from ravnest.pipeline.neighbours import BACKWARD, FORWARD, NEXT, PREV, Neighbours
from ravnest.pipeline.optim import StageOptimizer
from ravnest.pipeline.plausibility import ScaleWatch
from ravnest.pipeline.schedule import (B, F, RECV_B, RECV_F, SEND_B, SEND_F, STEP, W, Action,
                                       staleness, steps_before_next_forward)
from ravnest.pipeline.stash import StageCompute
from ravnest.spec import StageAssignment
from ravnest.wire import Message
from ravnest.wire.codecs import GRADIENT

METRICS_EVERY = 10  # optimizer steps between metrics reports


@dataclass(frozen=True)
class StageParts:
    """What a stage is made of (stage.py builds them); the executor runs the schedule over them."""
    compute: StageCompute
    optimizer: StageOptimizer
    neighbours: Neighbours
    averaging: AveragingHooks
    evaluation: StageEvaluation
    checkpoints: CheckpointTiming
    clock: StageClock
    trace: PipelineTrace
    feed: BatchFeed | None  # stage 0's data
    loss: Callable  # the last stage's
    audits: AuditPicker | AuditCheck | None = None  # spot checks (audits.py)


@dataclass(frozen=True)
class Cadence:
    """How the schedule runs: weights predicted `predict` updates ahead, `per_step` micro-batches an
    optimizer step, `window` (K) in flight, `total_micro_batches` in the whole run."""
    predict: int
    per_step: int
    window: int
    total_micro_batches: int


class StageExecutor:
    def __init__(self, assignment: StageAssignment, parts: StageParts, cadence: Cadence, *,
                 on_checkpoint: Callable[[int], None], report: Callable[[dict[str, float]], None]):
        self.assignment, self.training = assignment, assignment.training
        self.compute, self.optimizer, self.neighbours = parts.compute, parts.optimizer, parts.neighbours
        self.inbox, self.averaging, self.evaluation = parts.neighbours.inbox, parts.averaging, parts.evaluation
        self.checkpoints, self.clock, self.trace, self.feed = parts.checkpoints, parts.clock, parts.trace, parts.feed
        self._loss, self.audits = parts.loss, parts.audits
        self.predict, self.per_step, self.window = cadence.predict, cadence.per_step, cadence.window
        self.total_micro_batches = cadence.total_micro_batches
        self.on_checkpoint, self._report = on_checkpoint, report
        self.is_first, self.is_last = assignment.is_first, assignment.is_last
        self.device = parts.compute.device
        self.admitted = self.completed = 0  # stage 0: micro-batches taken from the data, and finished
        self.staleness_sum = 0  # optimizer steps between each micro-batch's forward and its W
        self._forward_versions: dict[int, int] = {}
        # a neighbour's activations or gradients whose scale jumps are refused, naming it (plausibility.py)
        self._scales = ScaleWatch("activations", assignment.prev), ScaleWatch("gradients", assignment.next)
        # what one action hands to the next: (x, y) received, output computed, gradients
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._output: torch.Tensor | None = None
        self._grad: torch.Tensor | None = None
        self._input_grad: torch.Tensor | None = None
        self._act: dict[str, Callable[[int], None]] = {
            RECV_F: self._receive_forward, F: self._forward, SEND_F: self._send_forward,
            RECV_B: self._receive_backward, B: self._backward_input, SEND_B: self._send_backward,
            W: self._backward_weights, STEP: self._step}

    @property
    def peer_timeout(self) -> float:
        return self.neighbours.peer_timeout

    def run(self, actions: Iterable[Action]) -> None:
        """Every action, then the evaluation after the last step; PipelineError once the inbox closes."""
        for action in actions:
            self.inbox.check()  # the one stop path
            self._act[action.kind](action.micro_batch)
        self.evaluation.drain()
        while not self.evaluation.finished:
            self.evaluation.take(self.inbox.next_forward(self.peer_timeout))
        self.neighbours.close()

    # --- the actions -------------------------------------------------------------------------------

    def _receive_forward(self, m: int) -> None:
        if self.feed is not None:
            with self.clock.busy():
                self._pending = self.feed.micro_batch(m)
                if isinstance(self.audits, AuditPicker):
                    self._pending = self.audits.swap(m, self._pending, self.feed.dataset)
            self.admitted += 1
            self.trace.in_flight(self.admitted - self.completed)
            return
        msg = self.inbox.next_forward(self.peer_timeout)
        while msg.kind != FORWARD:  # evaluation passes run in between, on the weights of now
            self.evaluation.take(msg)
            msg = self.inbox.next_forward(self.peer_timeout)
        if msg.id != m:
            raise PipelineError(f"stage {self.assignment.stage} expected micro-batch {m}, got {msg.id}")
        self.checkpoints.heard(msg.tags)
        self._pending = self._scales[0].check(msg.tensors["x"], m), msg.tensors["y"]
        if isinstance(self.audits, AuditCheck):
            self.audits.received(m, *self._pending, msg.tags)

    def _forward(self, m: int) -> None:
        assert self._pending is not None
        self.averaging("before_forward", m)
        x, y = (t.to(self.device) for t in self._pending)
        self._forward_versions[m] = self.optimizer.steps
        a = self.assignment
        # weight prediction: the updates the weights move on by before this micro-batch's gradient lands
        lookahead = staleness(m, a.stage, a.num_stages, self.window, self.per_step) if self.predict else 0
        # the version's last forward takes weight prediction's copy for the step, unless a strategy
        # defers the update (it lands later, in parts)
        last = self.averaging.updates and steps_before_next_forward(
            m, a.stage, a.num_stages, self.window, self.total_micro_batches, self.per_step)
        if self.is_last:
            # this micro-batch's share of the update's mean loss (2bw parts may differ by one row)
            scale = y.shape[0] / (self.training.batch_size * self.training.accumulation)
            with self.clock.busy():
                loss = self.compute.forward(m, x, lookahead, last, loss_fn=lambda out: self._loss(out, y) * scale)
            self.clock.add_loss(float(loss) / scale)
            return
        with self.clock.busy():
            self._output = self.compute.forward(m, x, lookahead, last)
        if not self.is_first:
            self.trace.in_flight(self.compute.in_flight)
        self.inbox.expect_gradient(m, self._output.shape)

    def _send_forward(self, m: int) -> None:
        assert self._pending is not None and self._output is not None
        tags = self.checkpoints.tags(self.optimizer.steps)
        if self.audits is not None:
            tags.update(self.audits.tags(m))
        self.neighbours.send(NEXT, Message(FORWARD, m, {"x": self._output, "y": self._pending[1]}, tags=tags))
        self._output = self._pending = None

    def _receive_backward(self, m: int) -> None:
        # the step's last gradient: no forward comes before the step now, so weight prediction's copy
        # of the weights, unless the last forward took it, can be taken before the wait (the gradient
        # is often not here yet) rather than at the step; not where a strategy defers the update
        if (m + 1) % self.per_step == 0 and self.averaging.updates:
            with self.clock.busy():
                self.compute.versions.save_previous()
        msg = self.inbox.next_backward(self.peer_timeout)
        if msg.id != m:
            raise PipelineError(f"stage {self.assignment.stage} expected the gradient of micro-batch {m}, "
                                f"got {msg.id}")
        self._grad = self._scales[1].check(msg.tensors[GRADIENT], m).to(self.device)

    def _backward_input(self, m: int) -> None:
        with self.clock.busy():
            self._input_grad = self.compute.backward_input(m, self._grad)
        self._grad = None

    def _send_backward(self, m: int) -> None:
        assert self._input_grad is not None
        self.neighbours.send(PREV, Message(BACKWARD, m, {GRADIENT: self._input_grad}))
        self._input_grad = None

    def _backward_weights(self, m: int) -> None:
        self.averaging("weight_gradients", m)
        if self.is_first:  # no B here: W is the whole backward, from the gradient just received
            self.compute.backward_input(m, self._grad)
            self._grad = None
        with self.clock.busy():
            version = self.compute.backward_weights(m)
        forward_version = self._forward_versions.pop(m)
        self.trace.records.append(BackwardRecord(m, forward_version, version, self.optimizer.steps))
        self.staleness_sum += self.optimizer.steps - forward_version
        self.completed += 1

    def _step(self, m: int) -> None:
        self.averaging("gradients_ready", self.optimizer.steps + 1)
        with self.clock.busy():
            self.compute.before_step()
            self.optimizer.step(update=self.averaging.updates)
        self.compute.step_done()
        self.clock.step_done()
        self._after_step(self.optimizer.steps)

    def _after_step(self, step: int) -> None:
        """Averaging, checkpoints, metrics and evaluation that fall due at `step`."""
        steps, every = self.training.steps, self.training.eval_every
        self.averaging("after_step", step)
        self.averaging.check_alone(step)
        if self.checkpoints.due(step):
            self.averaging("flush")  # what the strategy has under way lands in the weights first
            self.on_checkpoint(step)
            self.checkpoints.taken()
        self.checkpoints.plan(step, self.admitted)
        if step % METRICS_EVERY == 0 or step == steps:
            self._report({})
        if step == steps:
            self.averaging("finish")  # final synchronous round before the final evaluation
            if self.is_first:
                self.evaluation.evaluate(final=True)
        elif self.is_first and every and step % every == 0:
            self.evaluation.evaluate(final=False)
        self.evaluation.drain()
