"""The model registry: architecture names -> builders that describe a model as an ordered list of blocks.

A builder returns a `ModelSpec`: a description, not weights. It knows how many blocks the model has
and how to build any one of them alone (`make_block(i)`), so that

- the coordinator profiles and plans on the meta device and never allocates a weight, and
- a node materializes only its own blocks, with initial weights that depend only on (seed, block
  index): every replica and every stage agrees without building the rest of the model.

The builder contract, for built-ins and plug-ins alike (see docs/models.md):
1. `builder(config) -> ModelSpec`: validates `config` (raise ModelError) and allocates nothing.
2. `make_block(i)` builds block i alone, creating tensors with torch's default device and default
   RNG (never a device of its own choosing), so `torch.device("meta")` and seeding apply to it.
3. Block i's output feeds block i+1; `input` describes what block 0 takes.

Built-ins register themselves with `@register_model`; third-party architectures installed on a node
plug in through the entry-point group "ravnest.models" and are loaded only when first looked up.
Only names and JSON configs travel between machines, never code.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from ravnest.errors import RavnestError, did_you_mean
from ravnest.plugins import PluginRegistry

ENTRY_POINT_GROUP = "ravnest.models"
_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: seeds of neighbouring blocks differ in every bit


class ModelError(RavnestError, ValueError):
    """Unknown architecture or an invalid config for it."""


@dataclass(frozen=True)
class InputSpec:
    """One sample of block 0's input: its shape (no batch dimension) and dtype; integer inputs are
    token ids in [0, high)."""
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    high: int | None = None

    def example(self, batch_size: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """A random batch (on "meta": shapes only, nothing allocated)."""
        shape = (batch_size, *self.shape)
        if torch.device(device).type == "meta":
            return torch.empty(shape, dtype=self.dtype, device="meta")
        if self.dtype.is_floating_point:
            return torch.rand(shape, dtype=self.dtype, device=device)
        return torch.randint(0, self.high or 2, shape, dtype=self.dtype, device=device)


def block_seed(seed: int, index: int) -> int:
    """The RNG seed block `index` is initialised with: a function of (seed, index) only."""
    return (seed * _SEED_MIX + index + 1) % (1 << 63)


@dataclass(frozen=True)
class ModelSpec:
    """A model as `num_blocks` blocks: block i's output feeds block i+1; the unit of partitioning,
    memory planning and checkpoints. Holds no weights: blocks are built when asked for."""
    name: str
    config: dict[str, Any]
    num_blocks: int
    make_block: Callable[[int], nn.Module]
    task: str  # "classify": output [B, C], target [B]; "lm": output [B, T, V], target [B, T]
    input: InputSpec
    # (key, tied key) pairs of state-dict keys in different blocks that are one tensor (a language model's
    # tied embeddings): `blocks` makes the second the first, and refuses a range holding only one of them
    tied: tuple[tuple[str, str], ...] = ()
    # what crosses a cut must arrive exactly (a subspace model's token ids, ravnest/models/subspace.py):
    # only float32 and bf16 keep it, so a link of it never gets a blockwise codec
    exact_links: bool = False

    def block(self, index: int, *, seed: int | None = None, device: str | torch.device = "cpu") -> nn.Module:
        """Block `index` alone. With `seed` its initial weights are the same on every machine and
        device: they are drawn on the CPU (at most one block there at a time) and moved at once."""
        if not 0 <= index < self.num_blocks:
            raise ModelError(f"{self.name}: block {index} is outside 0..{self.num_blocks - 1}")
        device = torch.device(device)
        if device.type == "meta":
            with torch.device("meta"):
                return self._checked(index, self.make_block(index), device)
        if seed is None:
            return self._checked(index, self.make_block(index), torch.device("cpu")).to(device)
        with torch.random.fork_rng(devices=[]):  # the caller's RNG state stays untouched
            torch.manual_seed(block_seed(seed, index))
            return self._checked(index, self.make_block(index), torch.device("cpu")).to(device)

    def blocks(self, start: int = 0, end: int | None = None, *, seed: int | None = None,
               device: str | torch.device = "cpu") -> nn.Sequential:
        """Blocks [start, end) as one module whose state-dict keys use global block indices
        ("{index}.<name>"), so stages' state dicts merge into the whole model's."""
        end = self.num_blocks if end is None else end
        if not 0 <= start < end <= self.num_blocks:
            raise ModelError(f"{self.name}: block range [{start}, {end}) is outside the model's "
                             f"{self.num_blocks} blocks")
        module = nn.Sequential(OrderedDict((str(i), self.block(i, seed=seed, device=device))
                                           for i in range(start, end)))
        for key, tied in self.tied:
            held = [start <= int(k.split(".", 1)[0]) < end for k in (key, tied)]
            if held == [True, True]:
                owner, name = tied.rsplit(".", 1)
                setattr(module.get_submodule(owner), name, module.get_parameter(key))
            elif any(held):
                raise ModelError(f"{self.name}: {key} and {tied} are one tensor (tied), so blocks "
                                 f"{key.split('.', 1)[0]} and {tied.split('.', 1)[0]} must be on one stage; blocks "
                                 f"[{start}, {end}) hold only one of them")
        return module

    @property
    def stages_at_most(self) -> int | None:
        """The deepest pipeline the model allows: 1 where the first and last blocks share a tensor."""
        return 1 if any({int(k.split(".", 1)[0]) for k in pair} == {0, self.num_blocks - 1} for pair in self.tied) \
            else None

    def full_model(self, *, seed: int | None = None, device: str | torch.device = "cpu") -> nn.Sequential:
        """Every block (for one machine: tests, single-process baselines, loading a trained model)."""
        return self.blocks(seed=seed, device=device)

    def example_input(self, batch_size: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """A random input for block 0 with the right shape and dtype."""
        return self.input.example(batch_size, device)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy; for language models over every token."""
        if self.task == "lm":
            return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
        return F.cross_entropy(output, target)

    def _checked(self, index: int, block: object, device: torch.device) -> nn.Module:
        if not isinstance(block, nn.Module):
            raise ModelError(f"{self.name}: make_block({index}) returned {type(block).__name__}, not an nn.Module")
        for key, tensor in [*block.named_parameters(), *block.named_buffers()]:
            if tensor.device.type != device.type:  # it would break meta planning and per-device builds
                raise ModelError(f"{self.name}: block {index} put {key!r} on {tensor.device}; builders must "
                                 f"create tensors on torch's default device")
        return block


Builder = Callable[[dict[str, Any]], ModelSpec]
_BUILDERS: PluginRegistry[Builder] = PluginRegistry(ENTRY_POINT_GROUP, "model", ModelError)


def register_model(name: str) -> Callable[[Builder], Builder]:
    """Decorator registering `builder(config) -> ModelSpec` under `name`."""
    def decorate(builder: Builder) -> Builder:
        return _BUILDERS.register(name, builder)
    return decorate


def available_models() -> list[str]:
    """Names of built-in and installed (entry-point) architectures."""
    return _BUILDERS.names()


def build_model(name: str, config: dict[str, Any] | None = None) -> ModelSpec:
    """The description of architecture `name` with `config`; allocates no weights."""
    spec = _BUILDERS.get(name)(dict(config or {}))
    if not isinstance(spec, ModelSpec) or spec.num_blocks < 1:
        raise ModelError(f"builder for {name!r} did not return a ModelSpec with blocks")
    return spec


# the names nanoGPT and Hugging Face configs give what our builders call otherwise (a hint, not an alias)
_THEIR_NAMES = {"n_embd": "d_model", "hidden_size": "d_model", "n_layer": "n_layers", "num_hidden_layers": "n_layers",
                "n_head": "n_heads", "num_attention_heads": "n_heads", "block_size": "seq_len",
                "n_positions": "seq_len", "max_position_embeddings": "seq_len"}


def _hint(key: str, allowed: list[str]) -> str:
    ours = _THEIR_NAMES.get(key)
    return f" (did you mean {ours!r}?)" if ours in allowed else did_you_mean(key, allowed)


def resolve_config(name: str, defaults: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Defaults overlaid with `config`; unknown keys and values of the wrong type raise ModelError."""
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        keys = ", ".join(f"{key!r}{_hint(key, sorted(defaults))}" for key in unknown)
        raise ModelError(f"{name}: unknown config key{'s' if len(unknown) > 1 else ''} {keys}; "
                         f"allowed: {', '.join(map(repr, sorted(defaults)))}")
    resolved = dict(defaults)
    for key, value in config.items():
        expected = type(defaults[key])
        ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True  # JSON writes 0.0 as 0
        if expected is list and isinstance(value, tuple):
            value, ok = list(value), True
        if not ok:
            raise ModelError(f"{name}: config {key!r} must be {expected.__name__}, got {value!r}")
        resolved[key] = value
    return resolved


def require(condition: bool, name: str, reason: str) -> None:
    """Raise ModelError(`name`: `reason`) unless `condition`."""
    if not condition:
        raise ModelError(f"{name}: {reason}")
