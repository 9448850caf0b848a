"""Averaging across clusters: strategies (`strategy.py`, `strategies/`) on collectives over the peer
wire (`ring.py`): every segment of the model has one group, one member per cluster."""
from ravnest.averaging.layout import FlatLayout, canonical_keys
from ravnest.averaging.reference import reference_average, reference_mean
from ravnest.averaging.ring import RingError, RingHub, RingMember, RingTimeout
from ravnest.averaging.segments import segment_rings
from ravnest.averaging.shares import balanced_shares, ring_link_loads, ring_time_bound, share_bounds
from ravnest.averaging.strategy import (AveragingStrategy, StageContext, StrategyError, available_strategies,
                                        make_strategy, register_strategy)

__all__ = ["AveragingStrategy", "FlatLayout", "RingError", "RingHub", "RingMember", "RingTimeout", "StageContext",
           "StrategyError", "available_strategies", "balanced_shares", "canonical_keys", "make_strategy",
           "reference_average", "reference_mean", "register_strategy", "ring_link_loads", "ring_time_bound",
           "segment_rings", "share_bounds"]
