"""Weight versioning for the async pipeline: a micro-batch's backward uses exactly the weights its
forward used, although the stage's optimizer may have stepped several times in between.

Every weight version that still has micro-batches in flight keeps one snapshot of the parameters
(detached clones, shared by all micro-batches forwarded at that version). Forwards run through
`torch.func.functional_call` on the snapshot; backwards take gradients w.r.t. the snapshot and add
them to the live parameters' `.grad`, which the optimizer then steps. In "recompute" mode a
micro-batch keeps only its input, its version and the RNG state, and redoes its forward at backward
time (activations are not held while the micro-batch is in flight). The backward comes in two
halves, input gradient (B) and weight gradient (W), and forwards may use predicted weights
(`StageCompute`; the versions themselves: weight_versions.py).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from .precision import LossScale, all_finite, autocast_for, wide
from .weight_versions import WeightVersions

log = logging.getLogger(__name__)
Tensors = dict[str, torch.Tensor]
RngState = tuple[torch.Tensor, torch.Tensor | None]
# observer(micro_batch, version, snapshot, inputs, grad_output, param_grads), a hook for tests;
# it must copy what it keeps
BackwardObserver = Callable[[int, int, Tensors, torch.Tensor, torch.Tensor | None, Tensors], None]


@dataclass
class _InFlight:
    version: int
    lookahead: int
    weights: Tensors
    inputs: torch.Tensor
    output: torch.Tensor | None  # "stash": the output (the loss on the last stage), with its graph
    rng: RngState | None         # "recompute": RNG state to replay dropout exactly
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
    grad_output: torch.Tensor | None = None
    captured: list[tuple[int, torch.Tensor]] | None = None  # parameter owners' outputs (split backward)
    # between B and W: the gradient of each parameter owner's output (split backward), or the
    # parameters' gradients themselves (backward not split)
    owner_grads: list[tuple[int, torch.Tensor, torch.Tensor]] | None = None
    param_grads: Tensors | None = None
    scale: float | None = None  # fp16: the loss scale its backward ran under
    overflow: bool = False      # fp16: its input gradient overflowed (its weight gradients are dropped)


def _fingerprint(grad: torch.Tensor) -> torch.Tensor:
    """The sums of four stripes of a gradient: additive over the calls of a module used twice, and
    different when a gradient is missing or wrong; allocates nothing the size of the gradient."""
    stripes = grad.detach().flatten().tensor_split(4)
    return torch.stack([stripe.sum() for stripe in stripes])


def _capture_rng(device: torch.device) -> RngState:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextmanager
def _replayed_rng(state: RngState, device: torch.device) -> Iterator[None]:
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def _unscaled_input(entry: _InFlight, grad: torch.Tensor | None) -> torch.Tensor | None:
    """fp16: the input gradient divided by the scale; zero where it overflowed (nothing is learned
    upstream from this micro-batch rather than inf)."""
    if entry.scale is None or grad is None:
        return grad
    grad = grad / entry.scale
    if all_finite([grad]):
        return grad
    entry.overflow = True
    return torch.zeros_like(grad)

def _unscaled_weights(loss_scale: LossScale | None, entry: _InFlight, grads: Tensors) -> Tensors:
    """fp16: the weight gradients divided by the scale, or none where they (or the input's) overflowed;
    the scale learns either way."""
    assert loss_scale is not None and entry.scale is not None
    unscaled = {name: g / entry.scale for name, g in grads.items()}
    finite = not entry.overflow and all_finite(list(unscaled.values()))
    loss_scale.update(finite)
    return unscaled if finite else {}


class StageCompute:
    """Forward and the two halves of backward of one stage's blocks, with weight versioning ("stash"
    or "recompute") and optionally weight prediction.

    The backward is split as in zero-bubble pipelines: `backward_input` (B) gives the input gradient
    and `backward_weights` (W) the weight gradients afterwards. B asks autograd for the gradients of
    the input and of every parameter owner's output (a module with parameters of its own), which
    skips every weight-gradient kernel; W then differentiates each owner's output with respect to its
    own parameters only, which runs just those kernels. That is exact when a parameter is used only
    inside its owner's forward; the first micro-batch checks it against a plain backward and, if a
    model breaks the rule (e.g. weights tied by reading another module's tensor), falls back to the
    plain backward in B for the rest of the run.
    """

    def __init__(self, module: nn.Module, *, mode: str, input_grad: bool, device: torch.device,
                 snapshots: bool = True, predict: int = 0, split: bool = True, precision: str = "fp32",
                 checkpoint_blocks: bool = False):
        if mode not in ("stash", "recompute"):
            raise ValueError(f"unknown weight_stash mode {mode!r}")
        self.module = module
        # bf16, fp16: autocast, float32 weights and what leaves the stage; fp16 scales its gradients
        self._autocast = autocast_for(precision, device)
        self.loss_scale = LossScale() if precision == "fp16" else None
        self.mode = mode
        self.input_grad = input_grad  # False on stage 0: its input is data
        self.device = device
        self.versions = WeightVersions(module, snapshots, predict)
        self.params = dict(module.named_parameters())
        self._buffers = dict(module.named_buffers())
        self._in_flight: dict[int, _InFlight] = {}
        self.observer: BackwardObserver | None = None
        # parameter owners, and the outputs they produce while a forward is being captured
        owners = [(name, m) for name, m in module.named_modules()
                  if any(p.requires_grad for p in m.parameters(recurse=False))]
        self._owner_params = [[f"{name}.{p}" if name else p for p, q in m.named_parameters(recurse=False)
                               if q.requires_grad] for name, m in owners]
        self._captured: list[tuple[int, torch.Tensor]] | None = None
        for index, (_, owner) in enumerate(owners):
            owner.register_forward_hook(self._capture_hook(index))
        # activation checkpointing drops the owners' outputs a deferred W would differentiate: no split
        self.split = split and input_grad and bool(owners) and not checkpoint_blocks
        # blocks (children "0", "1", ...) and their keys, to run each under torch.utils.checkpoint; a tied
        # parameter is named once in the weights and again, by its alias, in the block that shares it
        self._blocks = [(block, f"{name}.") for name, block in module.named_children()] if checkpoint_blocks else []
        named = {id(p): name for name, p in module.named_parameters()}
        self._aliases = {alias: named[id(p)] for alias, p in module.named_parameters(remove_duplicate=False)
                         if named[id(p)] != alias}
        self._split_checked = False

    def _capture_hook(self, index: int) -> Callable:
        def capture(module: nn.Module, args: Any, output: Any) -> None:
            if self._captured is not None:
                outputs = output if isinstance(output, (tuple, list)) else (output,)
                self._captured.extend((index, t) for t in outputs if torch.is_tensor(t) and t.grad_fn is not None)
        return capture

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_grad and x.is_floating_point():
            return x.detach().requires_grad_(True)
        return x

    def _run(self, weights: Tensors, inputs: torch.Tensor, loss_fn: Callable | None,
             ) -> tuple[torch.Tensor, Tensors, list[tuple[int, torch.Tensor]] | None]:
        """A forward that builds its graph: (output or loss, the buffers it ran on, the parameter owners'
        outputs when the backward is split). The graph keeps copies of the buffers (BatchNorm saves its
        running stats for backward): the averager rewrites the live ones in place meanwhile."""
        buffers = {name: b.clone() for name, b in self._buffers.items()}
        self._captured = [] if self.split else None
        try:
            with self._autocast():
                output = wide(self._call({**weights, **buffers}, inputs))
        finally:
            captured, self._captured = self._captured, None
        return (output if loss_fn is None else loss_fn(output)), buffers, captured

    def _call(self, tensors: Tensors, x: torch.Tensor) -> torch.Tensor:
        """The stage's blocks on `x` with these weights and buffers; with activation checkpointing each
        block keeps only its input, and its backward recomputes it (same RNG, same autocast)."""
        if not self._blocks:
            return functional_call(self.module, tensors, (x,))
        tensors = {**tensors, **{alias: tensors[name] for alias, name in self._aliases.items() if name in tensors}}
        for block, prefix in self._blocks:
            own = {key.removeprefix(prefix): t for key, t in tensors.items() if key.startswith(prefix)}
            x = checkpoint(functional_call, block, own, (x,), use_reentrant=False)
        return x

    def forward(self, micro_batch: int, x: torch.Tensor, lookahead: int = 0, last: bool = False,
                loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Forward at the current version (predicted `lookahead` updates on; `last`: the version's last
        forward, see `WeightVersions.acquire`); returns the detached output, or with `loss_fn` (the last
        stage) the detached loss; keeps what backward needs."""
        version, weights = self.versions.acquire(lookahead, last)
        if self.mode == "stash":
            inputs = self._prepare(x)
            output, buffers, captured = self._run(weights, inputs, loss_fn)
            for name, b in buffers.items():  # the batch counts once in the running statistics
                self._buffers[name].copy_(b)
            self._in_flight[micro_batch] = _InFlight(version, lookahead, weights, inputs, output, None, loss_fn,
                                                     captured=captured)
            return output.detach()
        rng = _capture_rng(self.device)
        with torch.no_grad():
            with self._autocast():
                output = wide(functional_call(self.module, {**weights, **self._buffers}, (x,)))
            if loss_fn is not None:
                output = loss_fn(output)
        self._in_flight[micro_batch] = _InFlight(version, lookahead, weights, x, None, rng, loss_fn)
        return output

    def _graph(self, entry: _InFlight) -> torch.Tensor:
        """The micro-batch's output with its graph: kept ("stash") or redone now ("recompute", with the
        same weights and RNG; throwaway buffer copies keep BatchNorm from counting it twice)."""
        if entry.output is None:
            assert entry.rng is not None  # (recompute keeps the RNG state, stash the output)
            entry.inputs = self._prepare(entry.inputs)
            with _replayed_rng(entry.rng, self.device):
                entry.output, _, entry.captured = self._run(entry.weights, entry.inputs, entry.loss_fn)
        return entry.output

    def backward_input(self, micro_batch: int, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """B: the input gradient for the previous stage (None on stage 0). `grad_output` is None on the
        last stage (its output is the loss)."""
        entry = self._in_flight[micro_batch]
        entry.grad_output = grad_output
        if not self.input_grad:
            return None
        output = self._graph(entry)
        if not self.split:
            grads = self._plain_backward(entry, output, keep_graph=False)
            entry.param_grads = grads[1]
            return _unscaled_input(entry, grads[0])
        captured = entry.captured or []
        split = torch.autograd.grad(output, [entry.inputs, *(t for _, t in captured)], self._seed(entry, output),
                                    retain_graph=True, allow_unused=True)
        entry.owner_grads = [(index, t, g) for (index, t), g in zip(captured, split[1:]) if g is not None]
        return _unscaled_input(entry, split[0])

    def backward_weights(self, micro_batch: int) -> int:
        """W: the weight gradients of a micro-batch whose B has run, added to the live parameters'
        grads; releases its weights. Returns the weight version they were computed with."""
        entry = self._in_flight.pop(micro_batch)
        if entry.param_grads is None and entry.owner_grads is None:  # stage 0: the whole backward
            entry.param_grads = self._plain_backward(entry, self._graph(entry), keep_graph=False)[1]
        if entry.owner_grads is not None:
            param_grads = self._split_weight_grads(entry)
        else:
            assert entry.param_grads is not None  # (just computed, or by B)
            param_grads = entry.param_grads
        if entry.scale is not None:
            param_grads = _unscaled_weights(self.loss_scale, entry, param_grads)
        if self.observer is not None:  # before accumulating: grads may become live .grad tensors
            self.observer(micro_batch, entry.version, entry.weights, entry.inputs.detach(), entry.grad_output,
                          param_grads)
        for name, grad in param_grads.items():
            live = self.params[name]
            if live.grad is None:
                live.grad = grad
            else:
                live.grad.add_(grad)
        self.versions.release(entry.version, entry.lookahead)
        return entry.version

    def _plain_backward(self, entry: _InFlight, output: torch.Tensor,
                        keep_graph: bool) -> tuple[torch.Tensor | None, Tensors]:
        names = [name for name, w in entry.weights.items() if w.requires_grad]
        wants_input = entry.inputs.requires_grad
        targets = ([entry.inputs] if wants_input else []) + [entry.weights[name] for name in names]
        grads = torch.autograd.grad(output, targets, self._seed(entry, output), allow_unused=True,
                                    retain_graph=keep_graph)
        param_grads = {name: g for name, g in zip(names, grads[int(wants_input):]) if g is not None}
        return (grads[0] if wants_input else None), param_grads

    def _seed(self, entry: _InFlight, output: torch.Tensor) -> torch.Tensor | None:
        """The gradient to backpropagate: the one received (None on the last stage: the loss's own 1),
        times the loss scale under fp16 (precision.py)."""
        if self.loss_scale is None:
            return entry.grad_output
        if entry.scale is None:
            entry.scale = self.loss_scale.scale
        received = entry.grad_output if entry.grad_output is not None else torch.ones_like(output)
        return received * entry.scale

    def _split_weight_grads(self, entry: _InFlight) -> Tensors:
        if not self._split_checked:
            return self._checked_weight_grads(entry)
        param_grads: Tensors = {}
        owner_grads = entry.owner_grads
        assert owner_grads is not None  # (B split the backward)
        last = len(owner_grads) - 1
        for i, (index, output, grad) in enumerate(owner_grads):
            for name, g in self._owner_weight_grads(entry, index, output, grad, keep_graph=i < last):
                param_grads[name] = g if name not in param_grads else param_grads[name] + g
        entry.output = None  # the graph is no longer needed
        return param_grads

    def _checked_weight_grads(self, entry: _InFlight) -> Tensors:
        """Once per stage: a plain backward gives the weight gradients, and the split ones are checked
        against them owner by owner through linear fingerprints, so the check never holds a
        second copy of the stage's gradients. A model that fails it is not split again."""
        assert entry.output is not None and entry.owner_grads is not None  # (B split the backward, graph kept)
        _, plain = self._plain_backward(entry, entry.output, keep_graph=True)
        if not all_finite(list(plain.values())):  # fp16 overflowed: no comparison; this micro-batch is dropped
            entry.output = None
            return plain
        self._split_checked = True
        split: dict[str, torch.Tensor] = {}
        last = len(entry.owner_grads) - 1
        for i, (index, output, grad) in enumerate(entry.owner_grads):
            for name, g in self._owner_weight_grads(entry, index, output, grad, keep_graph=i < last):
                split[name] = _fingerprint(g) + split.get(name, 0)
        agree = split.keys() == plain.keys() and all(
            torch.allclose(split[k], _fingerprint(g), rtol=0, atol=1e-5 * float(g.abs().sum()) + 1e-8)
            for k, g in plain.items())
        if not agree:
            log.warning("this model uses parameters outside the module that owns them: the backward is "
                        "not split into input and weight halves on this stage")
            self.split = False
        entry.output = None
        return plain

    def _owner_weight_grads(self, entry: _InFlight, index: int, output: torch.Tensor, grad: torch.Tensor,
                            keep_graph: bool) -> Iterator[tuple[str, torch.Tensor]]:
        names = self._owner_params[index]
        grads = torch.autograd.grad(output, [entry.weights[n] for n in names], grad, allow_unused=True,
                                    retain_graph=keep_graph)
        return ((name, g) for name, g in zip(names, grads) if g is not None)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor) -> torch.Tensor:
        """Inference on the live weights in eval mode (BatchNorm uses its running statistics)."""
        self.module.eval()
        try:
            with self._autocast():
                return wide(self.module(x))
        finally:
            self.module.train()

    def before_step(self) -> None:
        self.versions.before_step()

    def step_done(self) -> None:
        self.versions.advance()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)
