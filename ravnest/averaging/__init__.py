"""Averaging across clusters: strategies (`strategy.py`, `registry.py`, `strategies/`) on collectives
over the peer wire (`collectives.py`): every segment of the model has one group, one member per cluster.

The names below load on first use, so the job spec can ask `registry.py` about strategies without
importing the collectives (which import the spec)."""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FlatLayout": "layout", "canonical_keys": "layout",
    "reference_average": "plain_mean", "reference_mean": "plain_mean",
    "RingError": "collectives", "RingHub": "collectives", "RingMember": "collectives", "RingTimeout": "collectives",
    "segment_rings": "segments",
    "balanced_shares": "shares", "ring_link_loads": "shares", "ring_time_bound": "shares", "share_bounds": "shares",
    "AveragingStrategy": "strategy", "StageContext": "strategy", "make_strategy": "strategy",
    "StrategyError": "registry", "available_strategies": "registry", "register_strategy": "registry",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
