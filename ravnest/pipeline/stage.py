"""One stage of the zero-bubble asynchronous pipeline (PipeDream-style 1F1B, never flushed).

A stage owns a contiguous range of the model's blocks, one worker thread (the caller of `run`) and
the message kinds it registers on its node's Router (the gRPC handler threads only validate and
queue). Stage 0 draws micro-batches from its data shard and sends activations plus targets forward;
middle stages forward; the last stage computes the loss and sends the input gradient back. The
worker runs its schedule (schedule.py): a fixed list of forwards, input-gradient and weight-gradient
halves of backwards, sends, receives and optimizer steps, so at most K micro-batches are in flight,
weights are at most K-1 updates stale, and which weights each computation uses never depends on
timing. Backwards use the weight version their forward used (stash.py); `training.staleness` may cut
batches into K parts (PipeDream-2BW) and predict the weights forwards use (schedule.staleness_method).

The runner puts the stage together from its parts and is what the node talks to:

    StageRunner ── run / stop / train_alone / save_state ... (the node's side)
      ├─ StageExecutor     executor.py          the schedule's actions, and the one stop path
      ├─ Neighbours        neighbours.py        inbound validation + inbox, outbound streams, abort
      ├─ BatchFeed         feed.py              stage 0's data shard and test set
      ├─ StageEvaluation   evaluation.py        evaluation rounds through a pipeline that never drains
      ├─ CheckpointTiming  checkpoint_timing.py when to checkpoint (by steps, or by seconds)
      ├─ AveragingHooks    averaging_hooks.py   the averaging strategy's hooks, the train-alone policy
      ├─ StageCompute      stash.py             forward, B and W on versioned weights
      └─ state.py, stage_metrics.py  state in and out; what the stage measures
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Mapping

import torch

from ravnest.timeouts import PEER_SILENCE_S
from ravnest.averaging.strategy import AveragingStrategy, StageContext, make_strategy
from ravnest.data.tokens import tokenizer_json
from ravnest.models import ModelError, ModelSpec, build_model
from ravnest.models.weights import load_starting_weights
from ravnest.pipeline import state, throughput
from ravnest.pipeline.audits import AuditCheck, audits_for
from ravnest.pipeline.averaging_hooks import AveragingHooks
from ravnest.pipeline.checkpoint_timing import CheckpointTiming
from ravnest.pipeline.evaluation import StageEvaluation
from ravnest.pipeline.executor import Cadence, StageExecutor, StageParts
from ravnest.pipeline.feed import BatchFeed
from ravnest.pipeline.inbox import Inbox, PipelineError
from ravnest.pipeline.memory import PeakMemory
from ravnest.pipeline.stage_metrics import PipelineTrace, StageClock, link_figures
from ravnest.pipeline.neighbours import MESSAGE_KINDS, Neighbours
from ravnest.pipeline.optim import StageOptimizer
from ravnest.pipeline.schedule import (batch_parts, check_stage_schedule, prediction_order, stage_actions,
                                       staleness_method, warmup)
from ravnest.pipeline.precision import usable_precision, wire_codec
from ravnest.pipeline.stash import StageCompute
from ravnest.spec import StageAssignment
from ravnest.wire import Router

__all__ = ["MESSAGE_KINDS", "StageRunner"]


class StageRunner:
    """Runs one stage of one cluster's pipeline. Its averaging strategy (usually built by
    `attach_averaging` once the live tensors exist) is called at the points `AveragingStrategy` names,
    on the worker thread; where averaging fails or the node asks, the stage trains alone
    (averaging_hooks.py) and `on_alone(reason)` tells the node."""

    def __init__(self, assignment: StageAssignment, router: Router, *,
                 device: str | torch.device = "cpu",
                 on_metrics: Callable[[dict[str, float]], None] = lambda m: None,
                 averager: AveragingStrategy | None = None,
                 peer_timeout: float = PEER_SILENCE_S,
                 initial_state: str | Path | None = None,
                 on_checkpoint: Callable[[int], None] = lambda step: None,
                 on_alone: Callable[[str], None] = lambda reason: None,
                 datasets: Mapping[str, str | Path] | None = None):
        a, training = assignment, assignment.training
        if not 0 <= a.stage < a.num_stages:
            raise ValueError(f"stage {a.stage} is outside 0..{a.num_stages - 1}")
        self.assignment, self.training, self.router = a, training, router
        self.is_first, self.is_last = a.is_first, a.is_last
        self.device = torch.device(device)
        self.on_metrics, self.on_checkpoint, self.on_alone = on_metrics, on_checkpoint, on_alone
        self.window = training.microbatches_in_flight or a.num_stages  # K, the staleness bound
        method = staleness_method(training.staleness, self.window)
        # "2bw" (PipeDream-2BW): stage 0 cuts every batch into K parts, whose gradients make one update
        self.parts = batch_parts(method, self.window, training.batch_size, training.accumulation)
        self.per_step = training.accumulation * self.parts  # micro-batches per optimizer step
        self.total_micro_batches = (training.steps - a.resume_step) * self.per_step
        spec = build_model(a.model.name, a.model.config)
        self.neighbours = Neighbours(a, task=spec.task, window=self.window,
                                     total_micro_batches=self.total_micro_batches, peer_timeout=peer_timeout,
                                     codec=wire_codec(training.codec, training.precision),
                                     target_limit=spec.input.high if spec.task == "lm" else None)
        start, end = a.blocks
        if not 0 <= start < end <= spec.num_blocks:
            raise ValueError(f"block range {a.blocks} is outside the model's {spec.num_blocks} blocks")
        self.task, self._loss = spec.task, spec.loss  # the spec holds a config, never another block
        self.memory = PeakMemory(self.device)
        # only this stage's blocks, built on its device; weights depend on (seed, block index) alone
        self.module = spec.blocks(start, end, seed=training.seed, device=self.device)
        if a.model.weights is not None and not a.resume_step:  # fine-tuning: from the weights the job names
            self._start_from(spec, a.model.weights.source, datasets or {})
        self.predict = prediction_order(method)
        precision = usable_precision(training.precision, self.device)
        self.compute = self._stage_compute(precision)
        # tokens/s and MFU (throughput.py): this stage's model FLOPs per sample, the hardware's peak
        self.tokens_per_sample = a.dataset.seq_len if spec.task == "lm" else None
        self.flops_per_sample = throughput.training_flops_per_sample(spec, start, end, self.tokens_per_sample)
        self.peak_flops = throughput.peak_flops(self.device, precision)
        self.optimizer = StageOptimizer(self.module.parameters(), training)
        if a.resume_step:
            self._resume(initial_state, a.resume_step)
        self.averaging = AveragingHooks(a, steps=lambda: self.optimizer.steps,
                                        on_alone=lambda reason: self.on_alone(reason))
        self.averaging.strategy = averager
        check_stage_schedule(a.stage, a.num_stages, self.window, self.total_micro_batches, self.per_step)
        self.actions = stage_actions(a.stage, a.num_stages, self.window, self.total_micro_batches, self.per_step)
        self.trace = PipelineTrace()
        self.clock = StageClock(training.batch_size * training.accumulation)
        self.final_metrics: dict[str, float] = {}
        self.feed = BatchFeed(a, self.parts, datasets, token_limit=spec.input.high) if self.is_first else None
        self._token_file = (datasets or {}).get(a.dataset.source or "") \
            if self.is_first and a.dataset.name == "tokens" else None
        self._executor: StageExecutor | None = None  # while and after `run`
        self._stop_reason = ""
        self.audits = audits_for(a, router, self.window, self.parts)  # spot checks of pipeline stages
        self.neighbours.listen(router)  # last: a stage that could not be built takes no messages

    def _stage_compute(self, precision: str) -> StageCompute:
        a, training = self.assignment, self.training
        stale = warmup(a.stage, a.num_stages, self.window) > 1  # can a step fall between F and W here?
        return StageCompute(self.module, mode=training.weight_stash, input_grad=not self.is_first,
                            device=self.device, snapshots=stale, predict=self.predict, split=a.split_backward,
                            precision=precision, checkpoint_blocks=training.activation_checkpointing)

    def _start_from(self, spec: ModelSpec, source: str, offered: Mapping[str, str | Path]) -> None:
        label = f"model file {source!r}"
        if source not in offered:
            raise ModelError(f"this node does not offer {label} (`ravnest-node join --model-file NAME=PATH`)")
        load_starting_weights(self.module, spec, offered[source], label)

    def _resume(self, initial_state: str | Path | None, step: int) -> None:
        if initial_state is None:
            raise ValueError(f"stage {self.assignment.stage} resumes at step {step} but was given no state")
        if not 0 < step < self.training.steps:
            raise ValueError(f"resume step {step} is outside 1..{self.training.steps - 1}")
        state.load_state(self.module, self.optimizer, initial_state, step, self.device)

    @property
    def inbox(self) -> Inbox:
        return self.neighbours.inbox

    @property
    def averager(self) -> AveragingStrategy | None:
        return self.averaging.strategy

    @averager.setter
    def averager(self, strategy: AveragingStrategy | None) -> None:
        self.averaging.strategy = strategy

    @property
    def alone(self) -> str:
        """Why this stage trains without its averaging, once it does ("" before)."""
        return self.averaging.alone

    @property
    def alone_cause(self) -> BaseException | None:
        """What failed the averaging, when it failed (not when the node asked it to train alone)."""
        return self.averaging.alone_cause

    # --- the node-facing API ----------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None) -> dict[str, float]:
        """Train `training.steps` optimizer steps, then evaluate; returns this stage's final metrics
        (the last stage's include test_loss and test_accuracy). Raises PipelineError if a neighbour
        fails, peers stay silent for `peer_timeout` seconds, or `stop` is set."""
        done = threading.Event()
        if stop is not None:
            threading.Thread(target=self._watch, args=(stop, done), daemon=True,
                             name=f"stage{self.assignment.stage}-stop").start()
        self.clock.restart()
        executor = self._executor = self._build_executor()
        try:
            executor.run(self.actions)
        except BaseException as exc:
            if isinstance(exc, PipelineError):
                reason = str(exc)
            else:  # after a stop, what failed (a stream we cut, a round we aborted) is its consequence
                reason = self._stop_reason or f"stage {self.assignment.stage} failed: {exc}"
            self.inbox.fail(reason)
            self.neighbours.abort(reason)
            if isinstance(exc, PipelineError):
                raise
            raise PipelineError(reason) from exc
        finally:
            done.set()
            self.inbox.fail(f"stage {self.assignment.stage} has finished its run")
            if self.audits is not None:
                self.audits.close()
        self.final_metrics = {**self.metrics(), **self.clock.steady_state(), **executor.evaluation.results,
                              "max_in_flight": float(self.trace.max_in_flight)}
        self.on_metrics(self.final_metrics)
        return self.final_metrics

    def _build_executor(self) -> StageExecutor:
        """Built when the run starts, from the parts as they are then (a test may swap one in)."""
        def report(extra: dict[str, float]) -> None:
            self.on_metrics({**self.metrics(), **extra})

        evaluation = StageEvaluation(self.assignment, compute=self.compute, loss=self._loss,
                                     neighbours=self.neighbours, averaging=self.averaging, clock=self.clock,
                                     steps=lambda: self.optimizer.steps, report=report, feed=self.feed)
        parts = StageParts(self.compute, self.optimizer, self.neighbours, self.averaging, evaluation,
                           CheckpointTiming(self.assignment, self.per_step), self.clock, self.trace, self.feed,
                           self._loss, self.audits)
        return StageExecutor(self.assignment, parts,
                             Cadence(self.predict, self.per_step, self.window, self.total_micro_batches),
                             on_checkpoint=lambda step: self.on_checkpoint(step), report=report)

    def stop(self, reason: str = "stopped") -> None:
        """Make `run` raise PipelineError(reason) within an action, from any thread: the inbox closes
        (the executor looks before every action), an averaging round under way is aborted, and a send
        blocked on a neighbour is cut."""
        self._stop_reason = self._stop_reason or reason
        self.inbox.fail(reason)
        self.averaging.stop()
        self.neighbours.cut()

    def train_alone(self, reason: str) -> bool:
        """From any thread: leave the averaging and train on (averaging_hooks.py); False where the
        strategy applies the update itself and cannot be left."""
        return self.averaging.train_alone(reason)

    def _watch(self, stop: threading.Event, done: threading.Event) -> None:
        # threading.Event has no callbacks: wake once a second to see which of the two came first
        while not done.is_set():
            if stop.wait(timeout=1.0):
                self.stop("the run was stopped")
                return

    def metrics(self) -> dict[str, float]:
        ex = self._executor
        admitted, completed, staleness_sum = (ex.admitted, ex.completed, ex.staleness_sum) if ex else (0, 0, 0)
        peak, busy, wall = self.memory.peak_bytes(), self.clock.recent_training_s(), self.clock.recent_step_s()
        clock = self.clock.snapshot()
        return {**clock, "step": float(self.optimizer.steps),  # counted from 0, resumed or not
                "bubble": max(0.0, 1.0 - clock["utilization"]),  # the share of wall time spent waiting
                "staleness": staleness_sum / max(1, completed),  # mean updates, forward to W
                "stage": float(self.assignment.stage),
                "in_flight": float(admitted - completed if self.is_first else self.compute.in_flight),
                "lr": self.optimizer.lr, **({"memory_peak_bytes": float(peak)} if peak is not None else {}),
                # computing, not waiting: what the coordinator compares with the plan (failure_rules/slow_stage.py)
                **({"compute_s": busy / self.per_step} if busy is not None else {}),
                **({"step_wall_s": wall} if wall is not None else {}),  # ... and the pace that compute keeps
                **throughput.figures(clock["samples_per_s"], self.flops_per_sample, self.tokens_per_sample,
                                     self.peak_flops),
                **link_figures(self.neighbours, self.optimizer.steps, self.is_first, self.is_last),
                **({"audits_passed": float(self.audits.passed)} if isinstance(self.audits, AuditCheck) else {}),
                **self.averaging.metrics()}

    # --- state in and out (state.py) ------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers on the CPU, keyed "{global block index}.<name>"."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    def save_weights(self, path: str | Path) -> None:
        """The final weights; stage 0 of a job on a token file adds its tokenizer, which the coordinator
        records so the model's Hugging Face form carries it."""
        tokenizer = tokenizer_json(self._token_file) if self._token_file is not None else None
        state.save_weights(self.module, path, {"tokenizer": tokenizer} if tokenizer else None)

    def save_state(self, path: str | Path) -> int:
        """Weights and optimizer state, to continue from later; returns the step it holds. Call between
        steps (the worker thread)."""
        return state.save_state(self.module, self.optimizer, path)

    def live_tensors(self) -> dict[str, torch.Tensor]:
        return state.live_tensors(self.module)

    def optimizer_tensors(self) -> dict[str, torch.Tensor]:
        return state.optimizer_tensors(self.module, self.optimizer)

    def prediction_history(self) -> list[dict[str, torch.Tensor]]:
        """What weight prediction extrapolates from (the weights before the last one or two steps, keyed
        like `live_tensors`; none without prediction): averaging corrects them with the live weights."""
        return self.compute.versions.history()

    def attach_averaging(self) -> AveragingStrategy | None:
        """Build the averaging strategy the assignment asks for on this stage's tensors (None: nothing
        to average, or it was told to train alone already); call before `run`."""
        if self.alone:
            return None
        self.averager = make_strategy(StageContext(
            self.assignment, self.router, self.live_tensors(), self.device, self.optimizer_tensors,
            self.prediction_history, apply_update=self._apply_update, module=self.module,
            forward_reads_live=not self.compute.versions.snapshots, per_step=self.per_step,
            waiting=lambda: self.clock.waiting()))
        return self.averager

    def _apply_update(self, grads: dict[str, torch.Tensor], last: bool) -> None:
        params = self.compute.params
        self.optimizer.apply_update({params[key]: grad.to(self.device) for key, grad in grads.items()}, last)
