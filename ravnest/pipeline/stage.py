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

Message kinds: "forward" (x, y) and "backward" (grad) carry micro-batch `id`s; "eval" (x, y) and
"eval_end" (tag "final") stream the test set after training (and every `eval_every` steps); "abort"
carries a failed neighbour's reason.
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch
from safetensors.torch import load_file, save_file

from ravnest.averaging.strategy import AveragingStrategy, StageContext, make_strategy
from ravnest.data import load_dataset
from ravnest.models import build_model
from ravnest.partition import RECEIVE_SLACK, SEND_QUEUE
from ravnest.pipeline.inbox import Inbox, PipelineError, TrainedAlone
from ravnest.pipeline.memory import PeakMemory
from ravnest.pipeline.metrics import BackwardRecord, EvalAccumulator, PipelineTrace, StageClock
from ravnest.pipeline.optim import StageOptimizer
from ravnest.pipeline.schedule import (B, F, RECV_B, RECV_F, SEND_B, SEND_F, STEP, W, Action, batch_parts,
                                       prediction_order, stage_actions, staleness, staleness_method,
                                       steps_before_next_forward, warmup)
from ravnest.pipeline.stash import StageCompute
from ravnest.spec import StageAssignment, StagePeer
from ravnest.wire import Message, OutboundStream, PeerError, Router, WireError, require_finite, wait_authorized

FORWARD, BACKWARD, EVAL, EVAL_END, ABORT = "forward", "backward", "eval", "eval_end", "abort"
MESSAGE_KINDS = (FORWARD, BACKWARD, EVAL, EVAL_END, ABORT)
log = logging.getLogger(__name__)
METRICS_EVERY = 10  # optimizer steps between on_metrics reports
ALONE_STEPS = 10  # the fewest steps a stage trains alone before it stops to hand in its state


class StageRunner:
    """Runs one stage of one cluster's pipeline. `averager`, the averaging strategy (usually built by
    `attach_averaging` once the live tensors exist), is called at the points `AveragingStrategy`
    names, on the worker thread.

    Training alone: when averaging fails (a member of another cluster is gone) or the node is told to
    (`train_alone`: the job is being re-planned around a loss elsewhere), a stage whose optimizer applies
    its own updates leaves its averaging and trains on: its cluster is intact, and it keeps training
    while the job is re-planned, until the node stops it to hand in its state. `on_alone(reason)` tells
    the node. Replicas are kept close by averaging, and a replica that trains alone too long drifts from
    the others (whose blocks may continue from its state): after as many steps as the averaging lets
    replicas train between rounds (`averaging.every`, at least ALONE_STEPS) it stops by itself,
    raising TrainedAlone, and its node hands in its state. A strategy that applies the update itself
    (DeAR) cannot be left: the stage fails instead."""

    def __init__(self, assignment: StageAssignment, router: Router, *,
                 device: str | torch.device = "cpu",
                 on_metrics: Callable[[dict[str, float]], None] = lambda m: None,
                 averager: AveragingStrategy | None = None,
                 peer_timeout: float = 300.0,
                 initial_state: str | Path | None = None,
                 on_checkpoint: Callable[[int], None] = lambda step: None,
                 on_alone: Callable[[str], None] = lambda reason: None,
                 datasets: Mapping[str, str | Path] | None = None):
        a, training = assignment, assignment.training
        if not 0 <= a.stage < a.num_stages:
            raise ValueError(f"stage {a.stage} is outside 0..{a.num_stages - 1}")
        self.assignment, self.training = a, training
        self.is_first, self.is_last = a.stage == 0, a.stage == a.num_stages - 1
        for needed, peer, side in ((not self.is_first, a.prev, "prev"), (not self.is_last, a.next, "next")):
            if needed and peer is None:
                raise ValueError(f"stage {a.stage} of {a.num_stages} needs a '{side}' peer")
        self.device = torch.device(device)
        self.on_metrics, self.averager, self.peer_timeout = on_metrics, averager, peer_timeout

        self.memory = PeakMemory(self.device)
        spec = build_model(a.model.name, a.model.config)
        start, end = a.blocks
        if not 0 <= start < end <= spec.num_blocks:
            raise ValueError(f"block range {a.blocks} is outside the model's {spec.num_blocks} blocks")
        if not self.is_first and a.input_shape is None:
            raise ValueError(f"stage {a.stage} needs the shape of its input activations (input_shape)")
        self.task, self._loss = spec.task, spec.loss  # the spec holds a config, never another block
        self._input_dtype = getattr(torch, a.input_dtype, None)
        if not isinstance(self._input_dtype, torch.dtype):
            raise ValueError(f"unknown input dtype {a.input_dtype!r}")
        # only this stage's blocks, built on its device; weights depend on (seed, block index) alone
        self.module = spec.blocks(start, end, seed=training.seed, device=self.device)
        self.window = training.microbatches_in_flight or a.num_stages  # K, the staleness bound
        stale = warmup(a.stage, a.num_stages, self.window) > 1  # can a step fall between F and W here?
        method = staleness_method(training.staleness, self.window)
        self.predict = prediction_order(method)
        self.compute = StageCompute(self.module, mode=training.weight_stash, input_grad=not self.is_first,
                                    device=self.device, snapshots=stale, predict=self.predict,
                                    split=a.split_backward)
        self.optimizer = StageOptimizer(self.module.parameters(), training)
        if a.resume_step:
            if initial_state is None:
                raise ValueError(f"stage {a.stage} resumes at step {a.resume_step} but was given no state")
            if not 0 < a.resume_step < training.steps:
                raise ValueError(f"resume step {a.resume_step} is outside 1..{training.steps - 1}")
            self._load_state(initial_state, a.resume_step)
        self.on_checkpoint = on_checkpoint  # called on the worker thread at each checkpoint step
        self.on_alone = on_alone
        self.alone = ""  # why this stage trains without its averaging, once it does
        self._alone_until: int | None = None  # having left its averaging: the step it stops at to hand in
        self._alone_steps = max(ALONE_STEPS, a.averaging.every)
        self._alone_asked = ""  # `train_alone` was called (from another thread) with this reason
        self._stopping = False
        # by seconds: stage 0 picks the step and tags forwards with it (see `_plan_timed_checkpoint`)
        self._checkpoint_at = 0
        self._last_checkpoint = time.monotonic()
        # "2bw" (PipeDream-2BW): stage 0 cuts every batch into K parts, whose gradients make one update
        self.parts = batch_parts(method, self.window, training.batch_size)
        self.per_step = training.accumulation * self.parts  # micro-batches per optimizer step
        self.total_micro_batches = (training.steps - a.resume_step) * self.per_step
        self.actions = stage_actions(a.stage, a.num_stages, self.window, self.total_micro_batches, self.per_step)
        self.trace = PipelineTrace()
        self.clock = StageClock(training.batch_size * training.accumulation)
        self.final_metrics: dict[str, float] = {}
        if self.is_first:  # clusters train on disjoint shards, each in its own order
            self._dataset = load_dataset(a.dataset, datasets)  # only files the volunteer offers
            self._batches: Iterator[tuple[torch.Tensor, torch.Tensor]] = self._dataset.shard(
                a.cluster, a.num_clusters, by_label=a.dataset.shards == "by-label").batches(
                training.batch_size, seed=data_seed(training.seed, a))

        self.inbox = Inbox(forward_capacity=self.window + RECEIVE_SLACK)  # bounds what the planner counts
        self._streams: dict[str, OutboundStream] = {}
        self._closing = False  # streams ending from now on are ours closing them
        self._forward_versions: dict[int, int] = {}
        self._next_forward_id = 0
        self._forward_lock = threading.Lock()
        self._admitted = self._completed = 0
        self._staleness_sum = 0  # optimizer steps between each micro-batch's forward and its W
        # what one action hands to the next: (x, y) received, output computed, gradients
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._output = self._grad = self._input_grad = None
        self._parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # stage 0: the rest of a batch cut in parts
        self._eval = EvalAccumulator()
        self._eval_round = 0
        self._evaluating: int | None = None  # the evaluation round under way on this stage
        self._eval_backlog: list[Message] = []  # evaluation messages for a step this stage has not reached
        self._finished = False
        self.router = router
        self._register(router)

    def _register(self, router: Router) -> None:
        """The message kinds this stage takes; the others stay unknown here (UNIMPLEMENTED)."""
        router.route(ABORT, self._on_abort)
        if not self.is_first:
            router.route(FORWARD, self._on_forward)
            router.route(EVAL, self._on_eval)
            router.route(EVAL_END, lambda msg, peer: self.inbox.put_forward(msg))
        if not self.is_last:
            router.route(BACKWARD, lambda msg, peer: self.inbox.put_backward(msg))

    # --- the node-facing API ----------------------------------------------------------------------

    def run(self, stop: threading.Event | None = None) -> dict[str, float]:
        """Train `training.steps` optimizer steps, then evaluate; returns this stage's final metrics
        (the last stage's include test_loss and test_accuracy). Raises PipelineError if a neighbour
        fails, peers stay silent for `peer_timeout` seconds, or `stop` is set."""
        done = threading.Event()
        if stop is not None:
            threading.Thread(target=self._watch, args=(stop, done), daemon=True,
                             name=f"stage{self.assignment.stage}-stop").start()
        self.clock = StageClock(self.clock.samples_per_step)
        try:
            for action in self.actions:
                self._act(action)
            self._drain_eval_backlog()
            while not self._finished:  # the evaluation after the last step
                self._handle_forward_lane(self.inbox.next_forward(self.peer_timeout))
            self._close_streams()
        except BaseException as exc:
            reason = str(exc) if isinstance(exc, PipelineError) else f"stage {self.assignment.stage} failed: {exc}"
            self.inbox.fail(reason)
            self._abort_neighbours(reason)
            if isinstance(exc, PipelineError):
                raise
            raise PipelineError(reason) from exc
        finally:
            done.set()
            self.inbox.fail(f"stage {self.assignment.stage} has finished its run")
        self.final_metrics = {**self._metrics(), **self.clock.steady_state(), **self.final_metrics,
                              "max_in_flight": float(self.trace.max_in_flight)}
        self.on_metrics(self.final_metrics)
        return self.final_metrics

    def stop(self, reason: str = "stopped") -> None:
        """Make `run` raise PipelineError(reason) promptly, from any thread (also out of a ring round)."""
        self._stopping = True
        self.inbox.fail(reason)
        if self.averager is not None:
            self.averager.abort()

    def train_alone(self, reason: str) -> bool:
        """From any thread: leave the averaging and train on (see the class docstring); False where the
        strategy applies the update itself and cannot be left."""
        averager = self.averager
        if averager is None:  # nothing to leave: it trains alone already
            self.alone = self.alone or reason
            return True
        if averager.defers_update:
            return False
        self._alone_asked = reason
        averager.abort()  # out of any round it waits in; the worker then leaves it
        return True

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers on the CPU, keyed "{global block index}.<name>"."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}

    def save_weights(self, path: str | Path) -> None:
        """Parameters and buffers as a safetensors file (no pickle). On the CPU the live tensors are
        written in place, without a second copy of the stage in memory."""
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.module.state_dict().items()}
        save_file(state, str(path))

    def save_state(self, path: str | Path) -> int:
        """Parameters, buffers and optimizer state (keys "{parameter key}:{state name}") as safetensors,
        to continue from later; returns the step it holds. Call between steps (the worker thread)."""
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.module.state_dict().items()}
        state.update((key, value.detach().to("cpu").contiguous()) for key, value in self._optimizer_state().items())
        step = self.optimizer.steps
        save_file(state, str(path), metadata={"step": str(step)})
        return step

    def _optimizer_state(self) -> dict[str, torch.Tensor]:
        """Every tensor of the optimizer's per-parameter state, keyed "{parameter key}:{state name}"."""
        optimizer = self.optimizer.optimizer
        if optimizer is None:
            return {}
        return {f"{key}:{name}": value for key, param in self.module.named_parameters()
                for name, value in sorted(optimizer.state.get(param, {}).items()) if torch.is_tensor(value)}

    def _load_state(self, path: str | Path, step: int) -> None:
        """The inverse of `save_state`: this stage's blocks exactly, their optimizer state if any."""
        state = load_file(str(path), device=str(self.device))
        model = {k: v for k, v in state.items() if ":" not in k}
        self.module.load_state_dict(model, strict=True)  # names any missing or unexpected key
        params = dict(self.module.named_parameters())
        by_param: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
        # Adam and friends keep `step` on the CPU unless fused or capturable
        defaults = self.optimizer.optimizer.defaults if self.optimizer.optimizer is not None else {}
        scalars_on_cpu = not (defaults.get("fused") or defaults.get("capturable"))
        for key, value in state.items():
            if ":" in key:
                name, entry = key.split(":", 1)
                if name not in params:
                    raise ValueError(f"optimizer state for {name}, which is not a parameter of this stage")
                by_param.setdefault(params[name], {})[entry] = value.cpu() if value.dim() == 0 and scalars_on_cpu \
                    else value
        self.optimizer.resume(step, by_param)

    def live_tensors(self) -> dict[str, torch.Tensor]:
        """The live parameters and floating buffers (same keys); writing them changes the model."""
        tensors = {k: p.detach() for k, p in self.module.named_parameters()}
        tensors.update((k, b) for k, b in self.module.named_buffers() if b.is_floating_point())
        return tensors

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

    def _average(self, hook: str, *args: int) -> None:
        """Call the averaging strategy's `hook` (worker thread); leave it to train alone where it fails
        or `train_alone` asked, unless the stage is stopping or the strategy cannot be left."""
        averager = self.averager
        if averager is None:
            return
        try:
            if not self._alone_asked:
                getattr(averager, hook)(*args)
                return
            reason = self._alone_asked
        except Exception as exc:
            if self._stopping or averager.defers_update:
                raise
            reason = self._alone_asked or f"averaging failed: {exc}"  # the first: our own abort failed it
        self.averager, self.alone = None, reason
        self._alone_until = self.optimizer.steps + self._alone_steps
        try:
            averager.close()
        except Exception:  # noqa: BLE001 -- it failed already; training goes on without it
            log.exception("closing the averaging strategy after it failed")
        log.warning("stage %d of cluster %d trains alone from step %d: %s", self.assignment.stage,
                    self.assignment.cluster, self.optimizer.steps, reason)
        self.on_alone(reason)

    def _apply_update(self, grads: dict[str, torch.Tensor], last: bool) -> None:
        params = self.compute.params
        self.optimizer.apply_update({params[key]: grad.to(self.device) for key, grad in grads.items()}, last)

    def prediction_history(self) -> list[dict[str, torch.Tensor]]:
        """What weight prediction extrapolates from (the weights before the last one or two steps, keyed
        like `live_tensors`; none without prediction): averaging corrects them with the live weights."""
        return self.compute.versions.history()

    def optimizer_tensors(self) -> dict[str, torch.Tensor]:
        """The optimizer's live per-parameter floating state (e.g. Adam's exp_avg, exp_avg_sq), keyed
        "{parameter key}:{state name}" so every cluster names it alike; empty before the first step.
        Only tensors shaped like their parameter: scalars such as Adam's `step` stay local."""
        params = dict(self.module.named_parameters())
        return {key: value for key, value in self._optimizer_state().items()
                if value.is_floating_point() and value.shape == params[key.split(":", 1)[0]].shape}

    # --- gRPC handler threads: validate, then queue ------------------------------------------------

    def _on_forward(self, msg: Message, peer: str) -> None:
        self._check_activation(msg)
        with self._forward_lock:  # the one previous stage sends micro-batches 0, 1, 2, ... in order
            if msg.id != self._next_forward_id or msg.id >= self.total_micro_batches:
                raise WireError(f"forward for micro-batch {msg.id}, expected {self._next_forward_id} "
                                f"(of {self.total_micro_batches})")
            self._next_forward_id += 1
        self.inbox.put_forward(msg)

    def _on_eval(self, msg: Message, peer: str) -> None:
        self._check_activation(msg)
        self.inbox.put_forward(msg)

    def _on_abort(self, msg: Message, peer: str) -> None:
        """Only planned neighbours reach here (the node's gate); what one says is its own account, so it
        is logged in full and passed on shortened to one printable line."""
        log.warning("stage %d: neighbour %s reports a failure: %r", self.assignment.stage, peer, msg.note)
        first_line = msg.note.strip().splitlines()[0] if msg.note.strip() else "no reason given"
        said = "".join(ch if ch.isprintable() else " " for ch in first_line)[:500]
        self.inbox.fail(f"stage {self.assignment.stage}: its neighbour at {peer} reported a failure ({said!r})")

    def _check_activation(self, msg: Message) -> None:
        """Reject activations this stage's first block cannot take, before they reach the worker."""
        x, y, expected = msg.tensors.get("x"), msg.tensors.get("y"), self.assignment.input_shape
        where = f"stage {self.assignment.stage} (blocks [{self.assignment.blocks[0]}, {self.assignment.blocks[1]}))"
        if x is None or y is None:
            raise WireError(f"{where}: {msg.kind} message {msg.id} needs tensors 'x' and 'y'")
        free = 2 if self.task == "lm" else 1  # batch (and sequence) dimensions may be smaller
        ok = (x.dtype == self._input_dtype and x.dim() == len(expected) and list(x.shape[free:]) == expected[free:]
              and all(1 <= n <= limit for n, limit in zip(x.shape[:free], expected[:free])))
        if not ok:
            shape = ["B", *(["T"] if free == 2 else []), *expected[free:]]
            limits = ", ".join(f"{name} <= {limit}" for name, limit in zip(shape, expected[:free]))
            raise WireError(f"{where} expects activations {self.assignment.input_dtype} of shape {shape} with "
                            f"{limits}, got {str(x.dtype).removeprefix('torch.')}{list(x.shape)}")
        if y.dtype != torch.int64 or y.shape != x.shape[:free]:
            raise WireError(f"{where}: targets must be int64 of shape {list(x.shape[:free])}, "
                            f"got {y.dtype}{list(y.shape)}")
        require_finite(x, f"{where}: activations of {msg.kind} message {msg.id}")

    # --- the worker thread -------------------------------------------------------------------------

    def _act(self, action: Action) -> None:
        """One action of this stage's schedule (schedule.py); messages are taken in schedule order."""
        kind, m = action.kind, action.micro_batch
        if kind == RECV_F:
            if self.is_first:
                if m % self.parts == 0:
                    with self.clock.busy():
                        x, y = next(self._batches)
                    self._parts = list(zip(x.tensor_split(self.parts), y.tensor_split(self.parts)))
                self._pending = self._parts.pop(0)
                self._admitted += 1
                self.trace.in_flight(self._admitted - self._completed)
            else:
                msg = self.inbox.next_forward(self.peer_timeout)
                while msg.kind != FORWARD:  # evaluation passes run in between, on the weights of now
                    self._handle_forward_lane(msg)
                    msg = self.inbox.next_forward(self.peer_timeout)
                if msg.id != m:
                    raise PipelineError(f"stage {self.assignment.stage} expected micro-batch {m}, got {msg.id}")
                self._checkpoint_at = max(self._checkpoint_at, msg.tags.get("checkpoint_at", 0))
                self._pending = msg.tensors["x"], msg.tensors["y"]
        elif kind == F:
            self._average("before_forward", m)
            self._forward(m, *(t.to(self.device) for t in self._pending))
        elif kind == SEND_F:
            tags = {"checkpoint_at": self._checkpoint_at} if self._checkpoint_at > self.optimizer.steps else {}
            self._send("next", Message(FORWARD, m, {"x": self._output, "y": self._pending[1]}, tags=tags))
            self._output = self._pending = None
        elif kind == RECV_B:
            # the step's last gradient: no forward comes before the step now, so weight prediction's copy
            # of the weights, unless the last forward took it, can be taken before the wait (the gradient
            # is often not here yet) rather than at the step; not where a strategy defers the update
            if (m + 1) % self.per_step == 0 and self._optimizer_updates:
                with self.clock.busy():
                    self.compute.versions.save_previous()
            msg = self.inbox.next_backward(self.peer_timeout)
            if msg.id != m:
                raise PipelineError(f"stage {self.assignment.stage} expected the gradient of micro-batch {m}, "
                                    f"got {msg.id}")
            self._grad = msg.tensors["grad"].to(self.device)
        elif kind == B:
            with self.clock.busy():
                self._input_grad = self.compute.backward_input(m, self._grad)
            self._grad = None
        elif kind == SEND_B:
            self._send("prev", Message(BACKWARD, m, {"grad": self._input_grad}))
            self._input_grad = None
        elif kind == W:
            self._average("weight_gradients", m)
            if self.is_first:  # no B here: W is the whole backward, from the gradient just received
                self.compute.backward_input(m, self._grad)
                self._grad = None
            with self.clock.busy():
                version = self.compute.backward_weights(m)
            forward_version = self._forward_versions.pop(m)
            self.trace.records.append(BackwardRecord(m, forward_version, version, self.optimizer.steps))
            self._staleness_sum += self.optimizer.steps - forward_version
            self._completed += 1
        elif kind == STEP:
            self._average("gradients_ready", self.optimizer.steps + 1)
            with self.clock.busy():
                self.compute.before_step()
                self.optimizer.step(update=self._optimizer_updates)
            self._step_done()
        else:
            raise PipelineError(f"unknown action {action}")

    @property
    def _optimizer_updates(self) -> bool:
        """Whether the optimizer's step applies the update (not a strategy later, in parts: DeAR)."""
        return self.averager is None or not self.averager.defers_update

    def _flush_averaging(self) -> None:
        """Whatever the averaging strategy has under way lands in the weights now (before they are
        evaluated or saved)."""
        self._average("flush")

    def _handle_forward_lane(self, msg: Message) -> None:
        """An evaluation message between forwards: evaluated once this stage has reached the step stage 0
        evaluated at (a stage may read it a little before finishing that step), in arrival order."""
        if msg.kind not in (EVAL, EVAL_END):
            raise PipelineError(f"stage {self.assignment.stage} got {msg.kind} {msg.id} after its last micro-batch")
        self._eval_backlog.append(msg)
        self._drain_eval_backlog()

    def _drain_eval_backlog(self) -> None:
        while self._eval_backlog and self.optimizer.steps >= self._eval_step(self._eval_backlog[0].id):
            msg = self._eval_backlog.pop(0)
            if self._evaluating != msg.id:
                self._begin_evaluation(msg.id)
            if msg.kind == EVAL:
                self._eval_batch(msg.id, msg.tensors["x"].to(self.device), msg.tensors["y"].to(self.device))
            else:
                self._eval_end(msg.id, final=bool(msg.tags.get("final", 0)))

    def _eval_step(self, round_: int) -> int:
        """The step evaluation round `round_` is taken at: every `eval_every` steps after the resume
        step, then the final one."""
        every, steps = self.training.eval_every, self.training.steps
        if every and (step := (self.assignment.resume_step // every + 1 + round_) * every) < steps:
            return step
        return steps

    def _begin_evaluation(self, round_: int) -> None:
        self._flush_averaging()
        self._evaluating = round_
        self._average("begin_evaluation", round_)

    def _forward(self, micro_batch: int, x: torch.Tensor, y: torch.Tensor) -> None:
        self._forward_versions[micro_batch] = self.optimizer.steps
        lookahead = self._lookahead(micro_batch)
        a = self.assignment
        # the version's last forward takes weight prediction's copy for the step, unless a strategy
        # defers the update (it lands later, in parts)
        last = self._optimizer_updates and steps_before_next_forward(
            micro_batch, a.stage, a.num_stages, self.window, self.total_micro_batches, self.per_step)
        if self.is_last:
            # this micro-batch's share of the update's mean loss (2bw parts may differ by one row)
            scale = y.shape[0] / (self.training.batch_size * self.training.accumulation)
            with self.clock.busy():
                loss = self.compute.forward(micro_batch, x, lookahead, last,
                                            loss_fn=lambda out: self._loss(out, y) * scale)
            self.clock.add_loss(float(loss) / scale)
            return
        with self.clock.busy():
            self._output = self.compute.forward(micro_batch, x, lookahead, last)
        if not self.is_first:
            self.trace.in_flight(self.compute.in_flight)
        self.inbox.expect_gradient(micro_batch, self._output.shape)

    def _lookahead(self, micro_batch: int) -> int:
        """Updates the weights will have moved on by the time this micro-batch's gradient is applied
        (weight prediction only; 0 otherwise)."""
        if not self.predict:
            return 0
        a = self.assignment
        return staleness(micro_batch, a.stage, a.num_stages, self.window, self.per_step)

    def _step_done(self) -> None:
        self.compute.step_done()
        self.clock.step_done()
        step = self.optimizer.steps
        self._average("after_step", step)
        if self._alone_until is not None and self._alone_until <= step < self.training.steps:
            raise TrainedAlone(f"stage {self.assignment.stage} trained alone for {self._alone_steps} steps, as far "
                               f"as replicas may drift apart; it stops to hand in its state")
        every = self.assignment.checkpoint_every
        if ((every and step % every == 0) or step == self._checkpoint_at) and step < self.training.steps:
            self._flush_averaging()
            self.on_checkpoint(step)
            self._last_checkpoint = time.monotonic()  # by steps or by seconds, whichever came first
        self._plan_timed_checkpoint(step)
        if step % METRICS_EVERY == 0 or step == self.training.steps:
            self.on_metrics(self._metrics())
        if step == self.training.steps:
            self._average("finish")  # final synchronous round before the final evaluation
            if self.is_first:
                self._evaluate(final=True)
        elif self.is_first and self.training.eval_every and step % self.training.eval_every == 0:
            self._evaluate(final=False)
        self._drain_eval_backlog()

    def _plan_timed_checkpoint(self, step: int) -> None:
        """`checkpoint_every_s`: every stage of the pipeline must checkpoint at the same step, so stage 0
        alone watches the clock and, when it is time, names a step; each forward from then on carries
        it. The step is the first one that needs a micro-batch not admitted yet (up to K are already on
        their way untagged): no stage can finish it before hearing which step it is. A named step is
        never replaced before it is taken."""
        every_s = self.assignment.checkpoint_every_s
        pending = self._checkpoint_at > step
        if self.is_first and every_s and not pending and time.monotonic() - self._last_checkpoint >= every_s:
            untagged = self._admitted + 1  # micro-batches (since the resume) that carry no tag
            first_tagged_step = self.assignment.resume_step + -(-untagged // self.per_step)
            self._checkpoint_at = max(step + 1, first_tagged_step)

    def _evaluate(self, final: bool) -> None:
        """Stage 0: stream the whole test set through the pipeline."""
        round_, self._eval_round = self._eval_round, self._eval_round + 1
        self._begin_evaluation(round_)
        for x, y in self._dataset.test_batches(self.training.batch_size):
            self._eval_batch(round_, x.to(self.device), y.to(self.device))
        self._eval_end(round_, final)

    def _eval_batch(self, round_: int, x: torch.Tensor, y: torch.Tensor) -> None:
        with self.clock.busy():
            output = self.compute.evaluate(x)
            if self.is_last:
                self._eval.add(output, y, self._loss(output, y))
        if not self.is_last:
            self._send("next", Message(EVAL, round_, {"x": output, "y": y}))

    def _eval_end(self, round_: int, final: bool) -> None:
        self._average("end_evaluation", round_)
        self._evaluating = None
        if self.is_last:
            results, self._eval = self._eval.result(), EvalAccumulator()
            self.final_metrics.update(results)
            self.on_metrics({**self._metrics(), **results})
        else:
            self._send("next", Message(EVAL_END, round_, tags={"final": int(final)}))
        self._finished = final

    def _metrics(self) -> dict[str, float]:
        in_flight = self._admitted - self._completed if self.is_first else self.compute.in_flight
        peak = self.memory.peak_bytes()
        clock = self.clock.snapshot()
        return {**clock, "step": float(self.optimizer.steps),  # counted from 0, resumed or not
                "bubble": max(0.0, 1.0 - clock["utilization"]),  # the share of wall time spent waiting
                "staleness": self._staleness_sum / max(1, self._completed),  # mean updates, forward to W
                "stage": float(self.assignment.stage), "in_flight": float(in_flight),
                "lr": self.optimizer.lr, **({"memory_peak_bytes": float(peak)} if peak is not None else {}),
                **({"training_alone": 1.0} if self.alone else {}),
                **(self.averager.metrics() if self.averager is not None else {})}

    # --- outbound streams --------------------------------------------------------------------------

    def _peer(self, side: str) -> StagePeer:
        return self.assignment.prev if side == "prev" else self.assignment.next

    def _send(self, side: str, msg: Message) -> None:
        stream = self._streams.get(side)
        if stream is None:  # opened on first use, then kept for the whole run
            wait_authorized(self._peer(side).address, self.assignment.token)
            stream = self._streams[side] = OutboundStream(
                self._peer(side).address, token=self.assignment.token, codec=self.training.codec,
                max_pending=SEND_QUEUE)
            # A send only queues, so a stream the peer failed must wake the worker by itself.
            stream.add_done_callback(lambda ended: self._stream_ended(side, ended))
        # copy=False: frames are cut on gRPC's thread; nothing writes to sent tensors afterwards
        stream.send(msg, timeout=self.peer_timeout, copy=False)

    def _stream_ended(self, side: str, stream: OutboundStream) -> None:
        if self._closing:
            return
        try:
            stream.close(timeout=1.0)
            reason = "it closed the stream"
        except PeerError as exc:
            reason = str(exc)
        self.inbox.fail(f"stage {self.assignment.stage} lost its {side} stage: {reason}")

    def _close_streams(self) -> None:
        """Wait until every neighbour has received everything we sent."""
        self._closing = True
        for stream in self._streams.values():
            stream.close(timeout=self.peer_timeout)
        self._streams.clear()

    def _abort_neighbours(self, reason: str) -> None:
        """Best effort: tell both neighbours why we stop, so they fail fast with the reason."""
        self._closing = True
        for side in ("prev", "next"):
            peer = self._peer(side)
            if peer is None:
                continue
            try:
                stream = self._streams.pop(side, None)
                if stream is None or stream.ended:  # e.g. the neighbour refused what we sent: it is alive
                    stream = OutboundStream(peer.address, token=self.assignment.token, wait_ready=2.0)
                stream.send(Message(ABORT, note=reason[:1000]), timeout=2.0)
                stream.close(timeout=2.0)
            except PeerError:
                pass  # the neighbour is gone or failing already
        for stream in self._streams.values():
            stream.cancel()
        self._streams.clear()

    def _watch(self, stop: threading.Event, done: threading.Event) -> None:
        # threading.Event has no callbacks: wake once a second to see which of the two came first
        while not done.is_set():
            if stop.wait(timeout=1.0):
                self.stop("the run was stopped")
                return


def data_seed(seed: int, a: StageAssignment) -> int:
    """Each cluster draws its own order; a run continued at step s draws a fresh one (the same for the
    same seed, cluster and step), not the order the first run began with."""
    return seed + a.cluster + 1_000_003 * a.resume_step
