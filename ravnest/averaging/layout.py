"""How a segment's state tensors are laid out as one flat fp32 vector, identically on every member.

State keys are "{i}.<name>" with i the GLOBAL block index (the keys of
`nn.Sequential(*blocks).state_dict()`), so every cluster names a tensor the same way whatever its cut
points. The canonical order is by block index, then the module's own state-dict order within a block.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch


def block_index(key: str) -> int:
    """The global block index of a state key "{i}.<name>"."""
    head, dot, _ = key.partition(".")
    if not dot or not head.isdigit():
        raise ValueError(f"state key {key!r} is not of the form '<block index>.<name>'")
    return int(head)


def canonical_keys(state: Mapping[str, torch.Tensor], blocks: tuple[int, int] | None = None) -> list[str]:
    """The floating-point keys of `state` (within the half-open block range, if given), in canonical
    order: sorted by block index; within a block the mapping's order, which is the module's
    state-dict order for any mapping built from `state_dict()` or `named_parameters()`/`buffers()`.
    Integer buffers (e.g. BatchNorm's num_batches_tracked) are not averaged."""
    keys = [k for k, t in state.items() if t.is_floating_point()
            and (blocks is None or blocks[0] <= block_index(k) < blocks[1])]
    return sorted(keys, key=block_index)  # stable: keeps the state-dict order inside a block


class FlatLayout:
    """Offsets of a fixed list of tensors inside one flat fp32 vector."""

    def __init__(self, state: Mapping[str, torch.Tensor], keys: list[str]):
        self.keys = keys
        self.shapes = [tuple(state[k].shape) for k in keys]
        self.offsets = [0]
        for shape in self.shapes:
            self.offsets.append(self.offsets[-1] + math.prod(shape))

    @property
    def numel(self) -> int:
        return self.offsets[-1]

    def flatten(self, state: Mapping[str, torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
        """An fp32 CPU vector (`out`, or a new one) holding the tensors in layout order: a snapshot."""
        flat = torch.empty(self.numel, dtype=torch.float32) if out is None else out
        with torch.no_grad():
            for key, view in self.views(flat).items():
                view.copy_(state[key].detach())
        return flat

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of `flat` shaped like each tensor (no copies)."""
        if flat.numel() != self.numel:
            raise ValueError(f"flat vector has {flat.numel()} elements, layout needs {self.numel}")
        return {k: flat[a:b].view(shape) for k, shape, a, b
                in zip(self.keys, self.shapes, self.offsets, self.offsets[1:])}

    def add_into(self, delta: torch.Tensor, *states: Mapping[str, torch.Tensor], alpha: float = 1.0) -> None:
        """Add each tensor's part of `alpha` x `delta` to the tensor of the same key in every state that
        has one (a correction to the live weights and to what must move with them), in place."""
        with torch.no_grad():
            for key, value in self.views(delta).items():
                for state in states:
                    target = state.get(key)
                    if target is not None:
                        target.add_(value.to(device=target.device, dtype=target.dtype), alpha=alpha)
