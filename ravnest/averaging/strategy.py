"""The averaging-strategy seam: where a strategy acts on a stage, and the registry of strategies.

A strategy keeps one stage's blocks close to the copies other clusters hold of the same segment.
The stage calls it at fixed points of its schedule, all on its worker thread (except `abort`):

    before_forward(m)    a micro-batch is about to run forward (e.g. wait for a gathered group)
    weight_gradients(m)  micro-batch m's weight gradients are about to be computed (W)
    gradients_ready(s)   the weight gradients of step s are complete, the optimizer has not stepped
    after_step(s)        optimizer step s (1-based) is done (or only counted: `defers_update`)
    flush()              everything started must be applied now (before a checkpoint or evaluation)
    begin_evaluation(k)  evaluation round k is about to run on this stage (e.g. swap in the global
                         average); end_evaluation(k) after it
    finish()             after the last step: leave every replica with the same final weights
    abort()              from any thread: the job stops, fail what is running or awaited
    close()              release the strategy's streams and threads, however the job ended
    metrics()            figures for the job view, prefixed "avg_"

A strategy with `defers_update` takes the gradients at `gradients_ready` and applies the update
itself later, in parts, through `StageContext.apply_update` (DeAR: each part once its all-gather is
in, before the forward that reads it); the stage then only counts the step.

Strategies register under a name, with their settings and what the planner and the runtime model
need to know about them, in `registry.py`.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch import nn

from ravnest.averaging.collectives import RingMember
from ravnest.averaging.registry import (AUTO, NO_AVERAGING, StrategyError, available_strategies, is_strategy,
                                        register_strategy, strategy_info)
from ravnest.spec import Ring, StageAssignment
from ravnest.wire import Router

__all__ = ["AUTO", "NO_AVERAGING", "AveragingStrategy", "GroupStrategy", "StageContext", "StrategyError",
           "available_strategies", "group_member", "is_strategy", "make_strategy", "register_strategy"]
Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class StageContext:
    """What a strategy is built from: the stage's assignment (its groups: `rings`), its node's router,
    and the tensors it may read and write on the worker thread.

    `live` maps parameter and floating buffer keys to the live tensors; `optimizer_state()` returns
    the optimizer's per-parameter floating state keyed "<parameter key>:<state name>";
    `companions()` returns dicts of tensors keyed like `live` that must take every correction `live`
    takes (weight prediction's earlier weights, one dict per version). `apply_update(grads, last)`
    steps the optimizer on the parameters named in `grads` (keyed like `live`) with those gradients;
    `last` ends the step (the learning-rate schedule advances). `module` holds the stage's blocks as
    children named by their global index; `forward_reads_live`: its forwards read the live parameters
    (no weight snapshots), so a block's parameters may still change until its forward pre-hook runs.
    `per_step` micro-batches make one step. `waiting()` wraps a wait for the network inside the stage's
    computation (it is not counted as busy)."""
    assignment: StageAssignment
    router: Router
    live: Tensors
    device: torch.device = torch.device("cpu")
    optimizer_state: Callable[[], Tensors] = dict
    companions: Callable[[], Sequence[Tensors]] = tuple
    apply_update: Callable[[Tensors, bool], None] | None = None
    module: nn.Module | None = None
    forward_reads_live: bool = False
    per_step: int = 1
    waiting: Callable[[], ContextManager[None]] = contextlib.nullcontext


def group_member(context: StageContext, ring: Ring, *, step_timeout: float, codec: str = "") -> RingMember:
    """This stage's member of `ring`'s group: collectives over the peer wire, or over gloo where the
    job chose `averaging.backend: "torch"` (ravnest/averaging/torch_group.py; same interface)."""
    a = context.assignment
    member: Any = RingMember  # or TorchMember: the same interface, no common base
    if a.averaging.backend == "torch":
        from ravnest.averaging.torch_group import TorchMember  # torch.distributed loads on demand
        member = TorchMember
    keys = [m.signing_key for m in ring.members if m.signing_key]
    return member(a.cluster, [m.address for m in ring.members], context.router, a.token, segment=ring.segment,
                  weights=ring.weights, order=ring.order, codec=codec, step_timeout=step_timeout,
                  keys=keys if len(keys) == len(ring.members) else None)


class AveragingStrategy:
    """The points where a strategy acts (see the module docstring); each does nothing by default."""

    name = "base"
    defers_update = False

    def before_forward(self, micro_batch: int) -> None:
        pass

    def weight_gradients(self, micro_batch: int) -> None:
        pass

    def gradients_ready(self, step: int) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass

    def flush(self) -> None:
        pass

    def begin_evaluation(self, round: int) -> None:
        pass

    def end_evaluation(self, round: int) -> None:
        pass

    def finish(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}


class GroupStrategy(AveragingStrategy):
    """A strategy holding one group member per segment of the stage (`_segments`, each with a
    `member`) and a thread pool for their rounds."""

    _segments: list
    _pool: ThreadPoolExecutor

    def abort(self) -> None:
        """From any thread: leave every group, so a round running or awaited fails at once (the job is
        stopping); `close` still follows."""
        for segment in self._segments:
            segment.member.close()

    def close(self) -> None:
        """Leave every group; a round still running is abandoned (its thread ends at once)."""
        self.abort()
        self._pool.shutdown(wait=True, cancel_futures=True)


def make_strategy(context: StageContext) -> AveragingStrategy | None:
    """The strategy the stage's assignment asks for, or None when there is nothing to average (one
    cluster, no groups planned, or "none")."""
    a = context.assignment
    if a.averaging.strategy == NO_AVERAGING or a.num_clusters == 1 or not a.rings:
        return None
    if a.averaging.strategy == AUTO:
        raise StrategyError("averaging strategy 'auto' is chosen by the coordinator's planner; a stage must be "
                            "given the strategy it picked")
    return strategy_info(a.averaging.strategy).factory(context)
