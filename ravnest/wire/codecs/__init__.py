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
    topk       17 bits of 1 in 64 values        error feedback   averaging (all-gather, diloco)

Built-ins register themselves on import; `codec(name)` finds one, `names(use)` lists them.
"""
from __future__ import annotations

import math
from typing import ClassVar, Sequence

import torch

from ravnest.errors import did_you_mean
from ravnest.wire.dtypes import DTYPES, ITEMSIZES

CodecState = dict[str, torch.Tensor]  # per link and direction: what a stateful codec carries over, by tensor name
Encoded = tuple[torch.Tensor, list[float]]  # the flat payload in the codec's wire dtype, the header's parameters


class Codec:
    """One way of sending a float tensor. Subclasses set the class attributes and override what differs."""

    name: ClassVar[str]
    uses: ClassVar[frozenset[str]]          # "pipeline", "averaging": where a job may name it
    wire_dtype: ClassVar[str | None] = None  # the payload's element dtype; None: the tensor's own (raw)
    params: ClassVar[int] = 0               # how many float parameters its header carries
    reduces: ClassVar[bool] = True          # decoded values may be summed as they arrive (a ring's reduce)

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


_CODECS: dict[str, Codec] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make `cls` known by its name."""
    _CODECS[cls.name] = cls()
    return cls


def codec(name: str) -> Codec:
    """The codec called `name`; ValueError naming the known ones otherwise."""
    try:
        return _CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name[:40]!r}{did_you_mean(name, list(_CODECS))}; "
                         f"known: {', '.join(repr(n) for n in sorted(_CODECS))}") from None


def known(name: str) -> bool:
    return name in _CODECS


def names(use: str | None = None) -> list[str]:
    """The codecs a job may name for `use` ("pipeline" or "averaging"), or all."""
    return sorted(n for n, c in _CODECS.items() if use is None or use in c.uses)


def chunks_of(numel: int, size: int) -> int:
    return math.ceil(numel / size) if numel else 0


def wire_dtype_of(c: Codec) -> torch.dtype | None:
    return None if c.wire_dtype is None else DTYPES[c.wire_dtype]


from ravnest.wire.codecs import plain, topk  # noqa: E402,F401  (built-ins register themselves)
