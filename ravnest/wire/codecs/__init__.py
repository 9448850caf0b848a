"""Codecs: how one link puts a float tensor into fewer bytes. A codec is a class registered here by
name; a job names it (`training.codec` for the pipeline's activations and gradients, `averaging.codec`
for what replicas exchange) and the frame's header names it again, so the receiver knows how to decode.

A codec says, from the header alone, how many payload bytes a tensor of that shape takes
(`payload_numel`) and whether the header's parameters make sense (`check`), so a receiver refuses a
frame whose sizes do not match before it allocates anything (validate-before-allocate). It may keep
state across messages of one link and one direction (error feedback: what it left out last time is
added to the next tensor of the same name), held by the sender in a dict it passes to `encode`.

    codec      sends per float32 value          state            where
    ""         4 bytes (the tensor as it is)    -                anything
    fp16/bf16  2 bytes                          -                pipeline, averaging
    int8       1 byte + a scale per tensor      -                averaging
    q8/q4/q3   8, 4 or 3 bits + a bf16 scale    -                pipeline (blockwise.py: any model's
               per 64 values                                     activations and gradients)
    q4g3       q4 forward, q3 back              -                pipeline
    topk       17 bits of 1 in 64 values        error feedback   averaging (all-gather, diloco)

A codec declares where `auto` may choose it (`auto`: per use, its loss rank there, 0 lossless): the
planners choose among the registered codecs that say so (coordinator/codec_choice.py), least lossy first.

Built-ins are the modules of this package, found by listing it (as averaging strategies are); installed
packages add codecs through the entry-point group "ravnest.codecs" (a `Codec` subclass). Every codec is
known from the first lookup on, so a name read off the wire never loads code. `codec(name)` finds one,
`names(use)` lists them.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar, Sequence

import torch

from ravnest.errors import RavnestError, did_you_mean
from ravnest.plugins import PluginRegistry
from ravnest.wire.dtypes import ITEMSIZES

AUTO = "auto"  # a job's codec: the planner picks (coordinator/codec_choice.py)
# the name of the tensor a pipeline's backward message carries: a codec may encode it otherwise than
# the activations (q4g3), since `encode` is given each tensor's name
GRADIENT = "grad"
CodecState = dict[str, torch.Tensor]  # per link and direction: what a stateful codec carries over, by tensor name
Encoded = tuple[torch.Tensor, list[float]]  # the flat payload in the codec's wire dtype, the header's parameters


class Codec:
    """One way of sending a float tensor. Subclasses set the class attributes and override what differs."""

    name: ClassVar[str]
    uses: ClassVar[frozenset[str]]          # "pipeline", "averaging": where a job may name it
    wire_dtype: ClassVar[str | None] = None  # the payload's element dtype; None: the tensor's own (raw)
    params: ClassVar[int] = 0               # how many float parameters its header carries
    reduces: ClassVar[bool] = True          # decoded values may be summed as they arrive (a ring's reduce)
    auto: ClassVar[dict[str, int]] = {}     # use -> its loss rank there, where `auto` may choose it (0: lossless)
    needs_changes: ClassVar[bool] = False   # averaging: only for strategies that average changes (diloco)
    on_device: ClassVar[bool] = False       # decoded on the receiver's accelerator, not its CPU: its payload
                                            # is far smaller than what it decodes to, and decoding is math

    def payload_numel(self, numel: int, params: Sequence[float]) -> int:
        """Elements of `wire_dtype` that a tensor of `numel` values takes on the wire."""
        return numel

    def check(self, params: Sequence[float]) -> str | None:
        """Why these header parameters cannot be decoded, or None."""
        return None

    def encode(self, t: torch.Tensor, state: CodecState | None = None, key: str = "") -> Encoded:
        """(the 1-D payload in `wire_dtype`, the header's parameters) for a float tensor."""
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype,
               params: Sequence[float]) -> torch.Tensor:
        """The tensor of `shape` and `dtype` from a payload whose size `payload_numel` checked."""
        raise NotImplementedError

    def wire_bytes(self, numel: int, itemsize: int = 4) -> int:
        """Bytes this codec sends for `numel` values of `itemsize` bytes (what a planner prices)."""
        wire = itemsize if self.wire_dtype is None else ITEMSIZES[self.wire_dtype]
        return self.payload_numel(numel, ()) * wire


class CodecError(RavnestError, ValueError):
    """An unknown codec name, or a codec plug-in that failed to load."""


def _adapt(name: str, loaded: Any) -> Codec | None:
    """A plug-in's entry point: a Codec subclass (or instance) whose name is the entry point's."""
    codec = loaded() if isinstance(loaded, type) and issubclass(loaded, Codec) else loaded
    return codec if isinstance(codec, Codec) and codec.name == name else None


_REGISTRY: PluginRegistry[Codec] = PluginRegistry("ravnest.codecs", "codec", CodecError, package=__name__,
                                                  adapt=_adapt, eager=True)


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make `cls` known by its name."""
    _REGISTRY.register(cls.name, cls())
    return cls


def codec(name: str) -> Codec:
    """The codec called `name`; CodecError (a ValueError) naming the known ones otherwise."""
    if not _REGISTRY.known(name):
        raise CodecError(f"unknown codec {name[:40]!r}{did_you_mean(name, names())}; "
                         f"known: {', '.join(repr(n) for n in names())}")
    return _REGISTRY.get(name)


def known(name: str) -> bool:
    return _REGISTRY.known(name)


def names(use: str | None = None) -> list[str]:
    """The codecs a job may name for `use` ("pipeline" or "averaging"), or all."""
    return sorted(c.name for c in _REGISTRY.items() if use is None or use in c.uses)


def auto_candidates(use: str, averages_changes: bool = False) -> list[Codec]:
    """The codecs `auto` chooses among for `use`, least lossy first; for averaging, those that need a
    strategy averaging changes only where it does."""
    found = [c for c in _REGISTRY.items() if use in c.auto and (averages_changes or not c.needs_changes)]
    return sorted(found, key=lambda c: (c.auto[use], c.name))


def chunks_of(numel: int, size: int) -> int:
    return math.ceil(numel / size) if numel else 0
