"""Weight versioning for the async pipeline: a micro-batch's backward uses exactly the weights its
forward used, although the stage's optimizer may have stepped several times in between.

Every weight version that still has micro-batches in flight keeps one snapshot of the parameters
(detached clones, shared by all micro-batches forwarded at that version). Forwards run through
`torch.func.functional_call` on the snapshot; backwards take gradients w.r.t. the snapshot and add
them to the live parameters' `.grad`, which the optimizer then steps. In "recompute" mode a
micro-batch keeps only its input, its version and the RNG state, and redoes its forward at backward
time (activations are not held while the micro-batch is in flight).
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn
from torch.func import functional_call

Tensors = dict[str, torch.Tensor]
RngState = tuple[torch.Tensor, torch.Tensor | None]
# observer(micro_batch, version, snapshot, inputs, grad_output, param_grads), a hook for tests;
# it must copy what it keeps
BackwardObserver = Callable[[int, int, Tensors, torch.Tensor, torch.Tensor, Tensors], None]


class WeightVersions:
    """Reference-counted parameter snapshots, one per weight version with micro-batches in flight.

    With `snapshots=False` every version is the live parameters themselves: right when no optimizer
    step can fall between a micro-batch's forward and its backward (one micro-batch in flight), and
    it saves a parameter-sized copy."""

    def __init__(self, module: nn.Module, snapshots: bool = True):
        self.snapshots = snapshots
        self._live = dict(module.named_parameters())
        self._snapshots: dict[int, Tensors] = {}
        self._users: Counter[int] = Counter()
        self._spare: list[Tensors] = []  # retired snapshots, refilled in place: no allocation per step
        self.current = 0

    @torch.no_grad()
    def acquire(self) -> tuple[int, Tensors]:
        """The current version and its snapshot (taken on first use), held until `release`."""
        snapshot = self._snapshots.get(self.current) if self.snapshots else self._live
        if snapshot is None:
            if self._spare:
                snapshot = self._spare.pop()
                for name, p in self._live.items():
                    snapshot[name].copy_(p)
            else:
                snapshot = {name: p.detach().clone().requires_grad_(p.requires_grad)
                            for name, p in self._live.items()}
            self._snapshots[self.current] = snapshot
        self._users[self.current] += 1
        return self.current, snapshot

    def release(self, version: int) -> None:
        self._users[version] -= 1
        if self._users[version] == 0:
            del self._users[version]
            if version != self.current:
                self._retire(version)

    def advance(self) -> None:
        """The optimizer stepped: later forwards use a new version; retire the old one if unused."""
        if self._users[self.current] == 0:
            self._users.pop(self.current, None)
            if self.current in self._snapshots:
                self._retire(self.current)
        self.current += 1

    def _retire(self, version: int) -> None:
        # Its micro-batches are all done, so no autograd graph still holds these tensors.
        snapshot = self._snapshots.pop(version, None)
        if snapshot is not None:
            self._spare.append(snapshot)

    def __len__(self) -> int:
        return len(self._snapshots)


@dataclass
class BackwardResult:
    input_grad: torch.Tensor | None
    version: int  # the weight version the gradient was computed with


@dataclass
class _InFlight:
    version: int
    weights: Tensors
    inputs: torch.Tensor
    output: torch.Tensor | None  # "stash": the output, still attached to its graph
    rng: RngState | None         # "recompute": RNG state to replay dropout exactly


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


class StageCompute:
    """Forward and backward of one stage's blocks with weight versioning ("stash" or "recompute")."""

    def __init__(self, module: nn.Module, *, mode: str, input_grad: bool, device: torch.device,
                 snapshots: bool = True):
        if mode not in ("stash", "recompute"):
            raise ValueError(f"unknown weight_stash mode {mode!r}")
        self.module = module
        self.mode = mode
        self.input_grad = input_grad  # False on stage 0: its input is data
        self.device = device
        self.versions = WeightVersions(module, snapshots)
        self._params = dict(module.named_parameters())
        self._buffers = dict(module.named_buffers())
        self._in_flight: dict[int, _InFlight] = {}
        self.observer: BackwardObserver | None = None

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_grad and x.is_floating_point():
            return x.detach().requires_grad_(True)
        return x

    def forward(self, micro_batch: int, x: torch.Tensor) -> torch.Tensor:
        """Forward at the current version; returns the detached output, keeps what backward needs."""
        version, weights = self.versions.acquire()
        if self.mode == "stash":
            inputs = self._prepare(x)
            # The graph keeps copies of the buffers (BatchNorm saves its running stats for backward):
            # the averager rewrites the live ones in place while this micro-batch is in flight.
            buffers = {name: b.clone() for name, b in self._buffers.items()}
            output = functional_call(self.module, {**weights, **buffers}, (inputs,))
            for name, b in buffers.items():
                self._buffers[name].copy_(b)
            self._in_flight[micro_batch] = _InFlight(version, weights, inputs, output, None)
            return output.detach()
        rng = _capture_rng(self.device)
        with torch.no_grad():
            output = functional_call(self.module, {**weights, **self._buffers}, (x,))
        self._in_flight[micro_batch] = _InFlight(version, weights, x, None, rng)
        return output

    def backward(self, micro_batch: int, grad_output: torch.Tensor) -> BackwardResult:
        """Gradients of a forwarded micro-batch w.r.t. its own weight version, added to the live
        parameters' grads; returns the input gradient for the previous stage."""
        entry = self._in_flight.pop(micro_batch)
        inputs, output = entry.inputs, entry.output
        if output is None:  # recompute with the same weights and RNG; throwaway buffer copies keep
            inputs = self._prepare(inputs)  # BatchNorm from counting this batch twice
            buffers = {name: b.clone() for name, b in self._buffers.items()}
            with _replayed_rng(entry.rng, self.device):
                output = functional_call(self.module, {**entry.weights, **buffers}, (inputs,))
        names = [name for name, w in entry.weights.items() if w.requires_grad]
        wants_input = inputs.requires_grad
        targets = ([inputs] if wants_input else []) + [entry.weights[name] for name in names]
        grads = torch.autograd.grad(output, targets, grad_output, allow_unused=True)
        input_grad = grads[0] if wants_input else None
        param_grads = {name: g for name, g in zip(names, grads[int(wants_input):]) if g is not None}
        if self.observer is not None:  # before accumulating: grads may become live .grad tensors
            self.observer(micro_batch, entry.version, entry.weights, entry.inputs, grad_output, param_grads)
        for name, grad in param_grads.items():
            live = self._params[name]
            if live.grad is None:
                live.grad = grad
            else:
                live.grad.add_(grad)
        self.versions.release(entry.version)
        return BackwardResult(input_grad, entry.version)

    def forward_backward(self, x: torch.Tensor, loss_fn: Callable[[torch.Tensor], torch.Tensor],
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward, loss and backward at once on the live weights (the last stage: nothing to stash).
        Returns the loss (detached) and the input gradient."""
        inputs = self._prepare(x)
        loss = loss_fn(self.module(inputs))
        loss.backward()
        return loss.detach(), inputs.grad if inputs.requires_grad else None

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor) -> torch.Tensor:
        """Inference on the live weights in eval mode (BatchNorm uses its running statistics)."""
        self.module.eval()
        try:
            return self.module(x)
        finally:
            self.module.train()

    def step_done(self) -> None:
        self.versions.advance()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)
