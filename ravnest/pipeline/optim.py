"""A stage's optimizer: a torch.optim class (or AccumAdam/AccumAdamW) chosen by name, gradient accumulation
and the LR schedule."""
from __future__ import annotations

import inspect
import math
from typing import Iterable

import torch

from ravnest.errors import did_you_mean
from ravnest.pipeline.accum_adam import OPTIMIZERS
from ravnest.spec import OptimizerRef, TrainingSettings

SWITCHES = ("fused", "foreach", "capturable", "differentiable")  # true, false or unset (None) in torch.optim


def build_optimizer(params: Iterable[torch.nn.Parameter], ref: OptimizerRef) -> torch.optim.Optimizer:
    """`torch.optim.<ref.name>(params, **ref.kwargs)`, or one of ours (AccumAdam, AccumAdamW); any other
    name or bad kwargs is a ValueError.

    A torch optimizer that has a fused implementation (Adam, AdamW, SGD, Adagrad) gets it unless the
    kwargs choose (`fused` or `foreach`): one kernel per step instead of one per operation and
    tensor. On CPU, Adam's default loop over 7M parameters takes 16 ms a step, the fused one 4.7 ms:
    a quarter of a pipeline stage's time went to the optimizer. Where the fused kernel does not apply
    (a dtype, device or option it lacks) the default implementation is used."""
    cls = OPTIMIZERS.get(ref.name) or getattr(torch.optim, ref.name, None)
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
        known = [*OPTIMIZERS, *(name for name, member in vars(torch.optim).items() if inspect.isclass(member)
                                and issubclass(member, torch.optim.Optimizer) and member is not torch.optim.Optimizer)]
        raise ValueError(f"unknown optimizer {ref.name!r}{did_you_mean(ref.name, known)}: expected a torch.optim "
                         f"class such as Adam or SGD, or {', '.join(OPTIMIZERS)}")
    _check_switches(cls, ref.kwargs)
    params = list(params)
    if cls not in OPTIMIZERS.values() and "fused" in inspect.signature(cls).parameters \
            and not {"fused", "foreach"} & ref.kwargs.keys():
        try:
            return cls(params, **ref.kwargs, fused=True)  # type: ignore[call-arg]  # (its signature has it)
        except (TypeError, ValueError, RuntimeError):
            pass  # bad kwargs are reported by the plain construction below
    try:
        return cls(params, **ref.kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"optimizer {ref.name} rejected kwargs {ref.kwargs}: {exc}") from exc


def _check_switches(cls: type, kwargs: dict) -> None:
    """An option that is a switch takes true or false: torch reads any other value by its truth, so
    `"fused": "no"` would turn the fused kernel on."""
    for name, parameter in inspect.signature(cls).parameters.items():
        switch = isinstance(parameter.default, bool) or (parameter.default is None and name in SWITCHES)
        if name in kwargs and switch and not (isinstance(kwargs[name], bool) or kwargs[name] is parameter.default):
            raise ValueError(f"optimizer {cls.__name__}: {name} must be true or false, got {kwargs[name]!r}")


def lr_factor(step: int, training: TrainingSettings) -> float:
    """Multiplier of the base LR for the update after `step` updates: linear warmup, then the schedule."""
    warmup = training.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if training.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, training.steps - warmup))
    if training.lr_schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return max(0.0, 1.0 - progress)  # linear decay to zero


class StageOptimizer:
    """Steps the optimizer once every `training.accumulation` micro-batches and advances the schedule.

    Callers scale each micro-batch loss by 1/accumulation, so an update uses the mean gradient.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], training: TrainingSettings):
        self.params = [p for p in params if p.requires_grad]
        # A stage of parameter-free blocks still counts updates, so versions stay in step.
        self.optimizer = build_optimizer(self.params, training.optimizer) if self.params else None
        self.schedule = None if self.optimizer is None else torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, training))
        self.accumulation, self.training = training.accumulation, training
        self.steps = 0          # optimizer updates done = the weight version
        self._pending = 0       # micro-batches accumulated since the last update

    def resume(self, step: int, state: dict[torch.nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Continue after `step` updates with `state` as the optimizer's per-parameter state (e.g.
        Adam's moments and step); the schedule picks up where it was."""
        self.steps = step
        if self.optimizer is None:
            return
        for param, values in state.items():
            self.optimizer.state[param] = dict(values)
        self._schedule.last_epoch = step
        for group, base_lr in zip(self.optimizer.param_groups, self._schedule.base_lrs):
            group["lr"] = base_lr * lr_factor(step, self.training)

    def micro_batch_done(self) -> bool:
        """Count one micro-batch's gradient; step when enough accumulated. True if it stepped."""
        self._pending += 1
        if self._pending < self.accumulation:
            return False
        self.step()
        return True

    def step(self, update: bool = True) -> None:
        """One update from the gradients gathered so far (pipeline stages call it from their schedule).
        With `update=False` the step is only counted and its gradients dropped: an averaging strategy
        took them and applies the update through `apply_update` (DeAR)."""
        if self.optimizer is not None:
            if update:
                if self.training.grad_clip is not None:
                    torch.nn.utils.clip_grad_norm_(self.params, self.training.grad_clip)
                self.optimizer.step()
                self._schedule.step()
            self.optimizer.zero_grad(set_to_none=True)
        self._pending = 0
        self.steps += 1

    def apply_update(self, grads: dict[torch.nn.Parameter, torch.Tensor], last: bool) -> None:
        """Part of a counted step's update: the parameters in `grads` step with those gradients (at
        the step's learning rate); with `last` the step is complete and the schedule advances."""
        if self.optimizer is None:
            return
        # gradients the next step has gathered already (a pipeline's micro-batches in flight) wait
        others = {param: param.grad for param in self.params if param.grad is not None and param not in grads}
        for param in others:
            param.grad = None
        for param, grad in grads.items():
            param.grad = grad
        if self.training.grad_clip is not None:  # per part: the stage's whole gradient is never here at once
            torch.nn.utils.clip_grad_norm_(list(grads), self.training.grad_clip)
        self.optimizer.step()
        for param in grads:
            param.grad = None
        for param, grad in others.items():
            param.grad = grad
        if last:
            self._schedule.step()

    @property
    def _schedule(self) -> torch.optim.lr_scheduler.LambdaLR:
        assert self.schedule is not None  # (there is one wherever there is an optimizer)
        return self.schedule

    @property
    def lr(self) -> float:
        return 0.0 if self.optimizer is None else self.optimizer.param_groups[0]["lr"]
