"""The model registry: architecture names -> builders that return a model as an ordered list of blocks.

Built-ins register themselves with `@register_model`; third-party architectures installed on a node
plug in through the entry-point group "ravnest.models" and are loaded only when first looked up.
Only names and JSON configs travel between machines, never code.
"""
from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

ENTRY_POINT_GROUP = "ravnest.models"


class ModelError(ValueError):
    """Unknown architecture or an invalid config for it."""


@dataclass
class ModelSpec:
    """A model as blocks: block i's output feeds block i+1; the unit of partitioning and checkpoints."""
    name: str
    config: dict[str, Any]
    blocks: list[nn.Module]
    task: str  # "classify": output [B, C], target [B]; "lm": output [B, T, V], target [B, T]
    input_fn: Callable[[int], torch.Tensor] | None = field(default=None, repr=False, compare=False)

    def example_input(self, batch_size: int) -> torch.Tensor:
        """A random input for block 0 with the right shape and dtype."""
        if self.input_fn is None:
            raise ModelError(f"model {self.name!r} does not describe its input (ModelSpec.input_fn)")
        return self.input_fn(batch_size)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy; for language models over every token."""
        if self.task == "lm":
            return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
        return F.cross_entropy(output, target)

    def full_model(self) -> nn.Sequential:
        """All blocks as one module; state-dict keys are "{block index}.<param>"."""
        return nn.Sequential(*self.blocks)


Builder = Callable[[dict[str, Any]], ModelSpec]
_BUILDERS: dict[str, Builder] = {}


def register_model(name: str) -> Callable[[Builder], Builder]:
    """Decorator registering `builder(config) -> ModelSpec` under `name`."""
    def decorate(builder: Builder) -> Builder:
        _BUILDERS[name] = builder
        return builder
    return decorate


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available_models() -> list[str]:
    """Names of built-in and installed (entry-point) architectures."""
    return sorted(set(_BUILDERS) | set(_entry_points()))


def _lookup(name: str) -> Builder:
    if name in _BUILDERS:
        return _BUILDERS[name]
    entry_point = _entry_points().get(name)
    if entry_point is None:
        raise ModelError(f"unknown model {name!r}; known models: {', '.join(available_models())}")
    try:
        builder = entry_point.load()
    except Exception as exc:  # a broken plugin must not look like an unknown name
        raise ModelError(f"model plugin {name!r} ({entry_point.value}) failed to load: {exc}") from exc
    if not callable(builder):
        raise ModelError(f"model plugin {name!r} ({entry_point.value}) is not callable")
    _BUILDERS[name] = builder
    return builder


def build_model(name: str, config: dict[str, Any] | None = None, *, seed: int | None = None) -> ModelSpec:
    """Build architecture `name`; with `seed`, initial weights are identical on every machine."""
    builder = _lookup(name)
    if seed is None:
        spec = builder(dict(config or {}))
    else:
        # fork_rng keeps the caller's global RNG state untouched
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            spec = builder(dict(config or {}))
    if not isinstance(spec, ModelSpec) or not spec.blocks:
        raise ModelError(f"builder for {name!r} did not return a ModelSpec with blocks")
    return spec


def resolve_config(name: str, defaults: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Defaults overlaid with `config`; unknown keys and values of the wrong type raise ModelError."""
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        raise ModelError(f"{name}: unknown config keys {unknown}; allowed: {sorted(defaults)}")
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
