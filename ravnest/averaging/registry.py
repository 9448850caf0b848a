"""Averaging strategies by name, and what each says about itself: the one source of truth.

A strategy module declares everything about its strategy where it registers it:

    @register_strategy("acid", settings=AcidSettings, gossip=True, waits_for_peers=False,
                       flat_keys={"acid_rate": "rate", ...})
    class AsyncPairwiseMomentum(GroupStrategy): ...

- `settings`: a pydantic model of its own options, given in a job under the strategy's name,
  `"averaging": {"strategy": "acid", "acid": {"rate": 0.25}}`; read with `averaging.of("acid")`;
- `gossip`: it mixes with the neighbours of `averaging.topology` (and may be paced);
- `by_seconds`: it may average every `averaging.every_seconds` instead of every `every` steps;
- `waits_for_peers`: replicas wait for each other at its rounds, so the slowest sets everyone's pace
  (False for asynchronous strategies: the planner then adds the replicas' rates);
- `averages_changes`: what it averages are changes that error feedback may delay (diloco's pseudo-
  gradient), not weights, so a sparsifying codec (`topk`) may carry them;
- `cost`: its runtime-model figure, seconds per optimizer step (`runtime.py`); None: the model has none,
  the planner takes it as free and `auto` never picks it;
- `flat_keys`: the flat names its options had in job specs before they were nested, still read;
- `robust`: it runs `averaging.robust` rounds, a robust mean in place of the plain one (robust.py).

The spec's validator, the planner, the runtime model and the stage all ask `strategy_info(name)`.
Built-ins are the modules of `ravnest.averaging.strategies`, found by listing the package; plug-ins
are entry points of the group "ravnest.averaging" pointing at a `StrategyInfo` (or at a bare factory,
which gets no settings). "none" (no averaging) and "auto" (the planner picks) are reserved.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict

from ravnest.errors import RavnestError
from ravnest.plugins import PluginRegistry

ENTRY_POINT_GROUP = "ravnest.averaging"
NO_AVERAGING = "none"
AUTO = "auto"


class StrategyError(RavnestError, ValueError):
    """An unknown strategy name or a strategy that failed to load."""


class StrategySettings(BaseModel):
    """Base of a strategy's own settings: strict (a misspelt option is refused, not ignored)."""
    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Group:
    """One averaging group as the runtime model sees it (runtime.py)."""
    members: int
    param_bytes: float
    bandwidth: float  # bytes/s, the slowest link around the group
    latency: float    # seconds
    fine_overlap: bool = False  # every member's stage is a whole replica (dear's own setting)


@dataclass(frozen=True)
class CostInputs:
    """What the runtime model knows when it prices one averaging group's rounds (runtime.py)."""
    step_s: float  # T: compute seconds of one optimizer step of the slowest replica
    group: Group
    every: int
    topology: str
    spare_core: bool  # a core is free for communication, so it can hide behind compute
    step_sd_s: float  # spread of one step's compute time (stragglers)
    paced: bool  # gossip is paced (one neighbour at a time, each asked for first)
    settings: Any  # the strategy's own settings model


@dataclass(frozen=True)
class StrategyInfo:
    name: str
    factory: Callable[[Any], Any]  # (StageContext) -> AveragingStrategy
    settings: type[StrategySettings] = StrategySettings
    gossip: bool = False
    by_seconds: bool = False
    waits_for_peers: bool = True
    cost: Callable[[CostInputs], float] | None = None
    flat_keys: dict[str, str] = field(default_factory=dict)
    averages_changes: bool = False
    # `auto`: the planner may choose it (it needs a `cost`), preferring the lower rank (the more
    # synchronous) within 5% (runtime.py), for the optimizers `fits` accepts (by name)
    auto_rank: int | None = None
    fits: Callable[[str], bool] = lambda optimizer: True
    robust: bool = False  # it runs `averaging.robust` rounds (collectives.RingMember.robust_allreduce)


def _adapt(name: str, loaded: Any) -> StrategyInfo | None:
    """A plug-in's entry point: a StrategyInfo, or a bare factory (no settings of its own)."""
    if isinstance(loaded, StrategyInfo):
        return loaded
    return StrategyInfo(name, loaded) if callable(loaded) else None


_REGISTRY: PluginRegistry[StrategyInfo] = PluginRegistry(
    ENTRY_POINT_GROUP, "averaging strategy", StrategyError, package="ravnest.averaging.strategies", adapt=_adapt)
# what "none" and "auto" declare: no settings, no cost; "none" never waits
_RESERVED = {NO_AVERAGING: StrategyInfo(NO_AVERAGING, lambda context: None, waits_for_peers=False),
             AUTO: StrategyInfo(AUTO, lambda context: None)}


def register_strategy(name: str, *, settings: type[StrategySettings] = StrategySettings, gossip: bool = False,
                      by_seconds: bool = False, waits_for_peers: bool = True,
                      cost: Callable[[CostInputs], float] | None = None,
                      flat_keys: dict[str, str] | None = None, averages_changes: bool = False,
                      auto_rank: int | None = None, fits: Callable[[str], bool] = lambda optimizer: True,
                      robust: bool = False) -> Callable:
    """Decorator registering `factory(context) -> AveragingStrategy` (a class will do) under `name`,
    with what the strategy declares about itself (the module docstring)."""
    if name in _RESERVED:
        raise StrategyError(f"{name!r} is reserved: it means {'no averaging' if name == NO_AVERAGING else 'pick one'}")

    def decorate(factory: Callable) -> Callable:
        _REGISTRY.register(name, StrategyInfo(name, factory, settings, gossip, by_seconds, waits_for_peers, cost,
                                              dict(flat_keys or {}), averages_changes, auto_rank, fits, robust))
        return factory
    return decorate


def strategy_info(name: str) -> StrategyInfo:
    """What strategy `name` declares; StrategyError (naming the known ones) if there is none."""
    return _RESERVED[name] if name in _RESERVED else _REGISTRY.get(name)


def available_strategies() -> list[str]:
    """"none", "auto", the built-in strategies and the installed (entry-point) ones."""
    return sorted({*_RESERVED, *_REGISTRY.names()})


def is_strategy(name: str) -> bool:
    return name in _RESERVED or _REGISTRY.known(name)


def registered() -> list[StrategyInfo]:
    """Every strategy registered so far, built-ins included (plug-ins once looked up)."""
    return _REGISTRY.items()


def auto_candidates(optimizer: str) -> list[StrategyInfo]:
    """The strategies `auto` chooses among for `optimizer`, most synchronous (lowest rank) first: every
    one registered or installed that declares an `auto_rank` and a cost, and fits the optimizer."""
    found = []
    for name in _REGISTRY.names():
        try:
            info = _REGISTRY.get(name)
        except StrategyError:  # a broken plug-in is named where a job asks for it, never chosen
            continue
        if info.auto_rank is not None and info.cost is not None and info.fits(optimizer):
            found.append(info)
    return sorted(found, key=lambda info: (info.auto_rank, info.name))
