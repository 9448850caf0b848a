"""What a stage measures about itself: busy time, step timeline, losses, evaluation, and a trace of
weight versions for tests."""
from __future__ import annotations

import statistics
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ravnest.pipeline.neighbours import NEXT, PREV, Neighbours


class StageClock:
    """Wall time, time spent computing, and the time of every optimizer step."""

    def __init__(self, samples_per_step: int, loss_window: int = 20):
        self.samples_per_step = samples_per_step
        self._losses: deque[float] = deque(maxlen=loss_window)
        self.restart()

    def restart(self) -> None:
        """Count from now (a run starts some time after its stage was built)."""
        self.started = time.perf_counter()
        self.busy_s = 0.0
        self.evaluating_s = 0.0  # the part of busy_s spent on evaluation passes
        self.steps: list[tuple[float, float]] = []  # (wall time, busy time) after each optimizer step
        self._training_busy: list[float] = []  # busy time less evaluation, after each optimizer step
        self._losses.clear()

    @contextmanager
    def busy(self, evaluation: bool = False) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self.busy_s += spent
            if evaluation:
                self.evaluating_s += spent

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Time waited inside a busy section (for the network, not computing) does not count as busy."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.busy_s -= time.perf_counter() - start

    def step_done(self) -> None:
        self.steps.append((time.perf_counter(), self.busy_s))
        self._training_busy.append(self.busy_s - self.evaluating_s)

    def add_loss(self, loss: float) -> None:
        self._losses.append(loss)

    def snapshot(self) -> dict[str, float]:
        """Figures since the start; `loss` is the mean of the last few micro-batch losses."""
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        figures = {"step": float(len(self.steps)), "elapsed_s": elapsed, "utilization": self.busy_s / elapsed,
                   "samples_per_s": len(self.steps) * self.samples_per_step / elapsed}
        if self.steps:
            figures["step_s"] = elapsed / len(self.steps)
        if self._losses:
            figures["loss"] = sum(self._losses) / len(self._losses)
        return figures

    def recent_training_s(self, window: int = 10) -> float | None:
        """Seconds spent computing per optimizer step over the last `window` steps, evaluation passes left
        out (None before there were that many steps)."""
        if len(self._training_busy) <= window:
            return None
        return (self._training_busy[-1] - self._training_busy[-1 - window]) / window

    def recent_step_s(self, window: int = 10) -> float | None:
        """Wall seconds per optimizer step over the last `window` steps, evaluation passes left out (None
        before there were that many steps): the pace the pipeline keeps, waits and messages included."""
        if len(self.steps) <= window:
            return None
        (t0, b0), (t1, b1) = self.steps[-1 - window], self.steps[-1]
        evaluating = (b1 - self._training_busy[-1]) - (b0 - self._training_busy[-1 - window])
        return max(0.0, t1 - t0 - evaluating) / window

    def steady_state(self) -> dict[str, float]:
        """Utilization, throughput and the spread of single steps' wall times (the runtime model's
        stragglers) between 20% and 90% of the steps: no start-up, no drain."""
        if len(self.steps) < 10:
            return {}
        first, last = len(self.steps) // 5, len(self.steps) * 9 // 10
        (t0, b0), (t1, b1) = self.steps[first], self.steps[last]
        span = max(t1 - t0, 1e-9)
        durations = [b[0] - a[0] for a, b in zip(self.steps[first:last], self.steps[first + 1:last + 1])]
        return {"steady_utilization": (b1 - b0) / span,
                "steady_samples_per_s": (last - first) * self.samples_per_step / span,
                "steady_step_sd_s": statistics.pstdev(durations)}


class EvalAccumulator:
    """Loss and accuracy (top-1; per token for language models) summed over an evaluation pass."""

    def __init__(self) -> None:
        self.loss_sum = 0.0
        self.correct = 0
        self.count = 0

    def add(self, output: torch.Tensor, target: torch.Tensor, mean_loss: torch.Tensor) -> None:
        n = target.numel()
        self.loss_sum += float(mean_loss) * n
        self.correct += int((output.argmax(dim=-1) == target).sum())
        self.count += n

    def result(self) -> dict[str, float]:
        if self.count == 0:
            return {}
        return {"test_loss": self.loss_sum / self.count, "test_accuracy": self.correct / self.count}


@dataclass
class BackwardRecord:
    micro_batch: int
    forward_version: int   # stage's weight version when the forward ran
    backward_version: int  # version of the weights the backward differentiated
    stage_version: int     # stage's live version when the backward ran (> forward: staleness)


TRACE_LIMIT = 100_000  # records kept: enough for tests, bounded for long runs


@dataclass
class PipelineTrace:
    """Instrumentation for tests: recent backwards' versions and the most micro-batches in flight."""
    records: deque[BackwardRecord] = field(default_factory=lambda: deque(maxlen=TRACE_LIMIT))
    max_in_flight: int = 0

    def in_flight(self, count: int) -> None:
        self.max_in_flight = max(self.max_in_flight, count)


def link_figures(neighbours: Neighbours, steps: int, is_first: bool, is_last: bool) -> dict[str, float]:
    """Per neighbour: bytes per optimizer step this stage sent (activations to the next stage,
    gradients to the previous one, as the pipeline's codec encoded them), and the share of time its
    stream had something to send (near 1: the link, not the compute, sets the pace)."""
    figures = {}
    for side, present in ((NEXT, not is_last), (PREV, not is_first)):
        busy = neighbours.busy(side) if present else None
        if busy is not None:
            figures[f"{side}_bytes_per_step"] = neighbours.sent_bytes(side) / max(1, steps)
            figures[f"{side}_link_busy"] = busy
    return figures
