"""Averaging across clusters: one ring all-reduce per parameter segment, all rings at once,
overlapped with training."""
from ravnest.averaging.averager import Averager, make_averager
from ravnest.averaging.layout import FlatLayout, canonical_keys
from ravnest.averaging.reference import reference_average, reference_mean
from ravnest.averaging.ring import RingError, RingHub, RingMember, RingTimeout
from ravnest.averaging.segments import segment_rings
from ravnest.averaging.shares import balanced_shares, ring_link_loads, ring_time_bound, share_bounds

__all__ = ["Averager", "FlatLayout", "RingError", "RingHub", "RingMember", "RingTimeout", "balanced_shares",
           "canonical_keys", "make_averager", "reference_average", "reference_mean", "ring_link_loads",
           "ring_time_bound", "segment_rings", "share_bounds"]
