"""Tensors on the wire: dtype + shape + the payload a codec made of them (ravnest/wire/codecs).

A tensor is described by a `TensorHeader` and followed by exactly `nbytes` payload bytes: the codec
says how many a tensor of that shape takes. Receivers call `validate_header` before allocating
anything, so a hostile or broken peer cannot make us allocate more than the configured limits, nor
build a tensor whose bytes do not match its shape.
"""
from __future__ import annotations

import math
import threading
import warnings
from dataclasses import dataclass

import grpc
import torch

from ravnest.v1 import peer_pb2
from ravnest.wire import codecs
from ravnest.wire.codecs import CodecState
from ravnest.wire.dtypes import DTYPE_NAMES, DTYPES, ITEMSIZES, NotFiniteValues, WireError

__all__ = ["DTYPES", "DTYPE_NAMES", "ITEMSIZES", "WireError", "WireLimits", "ByteBudget", "CodecState", "encode",
           "decode", "validate_header", "allocate", "wrap", "restore", "byte_view", "require_finite"]
# `wrap` views received bytes on purpose (read-only by contract); torch would warn about it once.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def require_finite(tensor: torch.Tensor, what: str) -> None:
    """Refuse NaN or infinite values from a peer: one would spread into every weight it reaches.

    A NaN or an infinity makes the sum NaN or infinite, so a finite sum clears the tensor in one pass
    that allocates nothing (`isfinite().all()` writes a mask first: 25 times as long, 15 ms for 7M
    values); only a sum that overflows from finite values is checked element by element."""
    if not tensor.is_floating_point() or bool(torch.isfinite(tensor.sum())):
        return
    if not bool(torch.isfinite(tensor).all()):
        raise NotFiniteValues(f"{what} holds NaN or infinite values; refused")


@dataclass(frozen=True)
class WireLimits:
    """What a receiver accepts from one peer. Checked before any allocation."""

    max_tensor_bytes: int = 1 << 30       # per tensor, after decoding (what we allocate)
    max_message_bytes: int = 2 << 30      # all tensors of one message, after decoding
    max_tensors_per_message: int = 64
    max_dims: int = 8
    max_chunk_bytes: int = 4 << 20
    max_name_chars: int = 256             # message kind, tensor names, tag keys
    max_note_chars: int = 4096
    max_tags: int = 64
    # over all streams of one server: what messages still being received may hold at once, so three
    # peers each leaving a 1 GiB tensor unfinished cannot take a node's memory
    max_receiving_bytes: int = 2 << 30


class ByteBudget:
    """Bytes that may be held at once, shared by threads: `take` never waits, it says no."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.used + n > self.capacity:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n


def decoded_dtype(h: peer_pb2.TensorHeader) -> str:
    """The dtype the receiver hands out: `decoded_dtype`, or the wire dtype when it is empty."""
    return h.decoded_dtype or h.dtype


def validate_header(h: peer_pb2.TensorHeader, limits: WireLimits) -> None:
    """Raise WireError unless the header is self-consistent and within limits."""
    if len(h.name) > limits.max_name_chars:
        raise WireError(f"tensor {h.name[:40]!r}...: name longer than {limits.max_name_chars} chars")
    where = f"tensor {h.name!r}"
    if h.dtype not in DTYPES:
        raise WireError(f"{where}: unknown dtype {h.dtype[:40]!r}")
    if not codecs.known(h.codec):
        raise WireError(f"{where}: unknown codec {h.codec[:40]!r}")
    if h.decoded_dtype and h.decoded_dtype not in DTYPES:
        raise WireError(f"{where}: unknown decoded dtype {h.decoded_dtype[:40]!r}")
    codec = codecs.codec(h.codec)
    if h.codec:
        if h.dtype != codec.wire_dtype:
            raise WireError(f"{where}: codec {h.codec} needs wire dtype {codec.wire_dtype}, got {h.dtype}")
        if not DTYPES[decoded_dtype(h)].is_floating_point:
            raise WireError(f"{where}: codec {h.codec} decodes only to a float dtype, "
                            f"not {decoded_dtype(h)}")
    elif h.decoded_dtype not in ("", h.dtype):
        raise WireError(f"{where}: decoded dtype {h.decoded_dtype} without a codec")
    if len(h.params) != codec.params:
        raise WireError(f"{where}: codec {h.codec or 'raw'} takes {codec.params} parameters, got {len(h.params)}")
    if codec.params and (problem := codec.check(list(h.params))):
        raise WireError(f"{where}: {problem}")
    if len(h.shape) > limits.max_dims:
        raise WireError(f"{where}: {len(h.shape)} dims exceed the limit of {limits.max_dims}")
    if any(d < 0 for d in h.shape):
        raise WireError(f"{where}: negative dimension in shape {list(h.shape)}")
    # Bound every dimension, zero-sized tensors included: torch overflows on shapes like [0, 2**62, 2**62].
    largest = max(ITEMSIZES[h.dtype], ITEMSIZES[decoded_dtype(h)])
    if math.prod(max(d, 1) for d in h.shape) * largest > limits.max_tensor_bytes:
        raise WireError(f"{where}: shape {list(h.shape)} of {decoded_dtype(h)} exceeds the limit of "
                        f"{limits.max_tensor_bytes} bytes", grpc.StatusCode.RESOURCE_EXHAUSTED)
    expected = codec.payload_numel(math.prod(h.shape), list(h.params)) * ITEMSIZES[h.dtype]
    if h.nbytes != expected:
        coded = f" as {h.codec}" if h.codec else ""
        raise WireError(f"{where}: declares {h.nbytes} bytes but {decoded_dtype(h)}{list(h.shape)}{coded} "
                        f"needs {expected}")
    if expected > limits.max_tensor_bytes:
        raise WireError(f"{where}: {expected} bytes on the wire exceed the limit of {limits.max_tensor_bytes}",
                        grpc.StatusCode.RESOURCE_EXHAUSTED)


def decoded_nbytes(h: peer_pb2.TensorHeader) -> int:
    """Bytes the receiver allocates for a validated header once decoded."""
    return math.prod(h.shape) * ITEMSIZES[decoded_dtype(h)]


def encode(name: str, tensor: torch.Tensor, codec: str = "", state: CodecState | None = None,
           ) -> tuple[peer_pb2.TensorHeader, memoryview]:
    """Return the header and a memoryview over the bytes to send (CPU, contiguous). `state` is the
    link's (one direction's) for a codec that keeps some, by tensor name.

    The view may alias `tensor` itself when no conversion was needed.
    """
    chosen = codecs.codec(codec)
    t = tensor.detach()
    if t.dtype not in DTYPE_NAMES:
        raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot go on the wire")
    decoded = DTYPE_NAMES[t.dtype]
    if not t.is_floating_point():
        chosen, codec = codecs.codec(""), ""  # lossy codecs only apply to floats; integers travel raw
    try:
        payload, params = chosen.encode(t, state, name)
    except ValueError as exc:
        raise ValueError(f"tensor {name!r}: {exc}") from None
    payload = payload.to("cpu").contiguous()
    header = peer_pb2.TensorHeader(
        name=name, dtype=DTYPE_NAMES[payload.dtype], shape=list(t.shape),
        nbytes=payload.numel() * payload.element_size(), codec=codec, decoded_dtype=decoded if codec else "",
        params=params)
    return header, byte_view(payload)


def byte_view(t: torch.Tensor) -> memoryview:
    """A flat unsigned-byte memoryview sharing memory with a contiguous CPU tensor (writable)."""
    if t.numel() == 0:
        return memoryview(bytearray())
    # numpy has no bfloat16: reinterpret the bits; the receiver restores the dtype from the header.
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def allocate(h: peer_pb2.TensorHeader) -> torch.Tensor:
    """Uninitialised flat payload for a validated header; fill it through `byte_view`."""
    return torch.empty(h.nbytes // ITEMSIZES[h.dtype], dtype=DTYPES[h.dtype])


def wrap(h: peer_pb2.TensorHeader, buffer: bytes | memoryview) -> torch.Tensor | None:
    """A flat payload sharing memory with exactly `h.nbytes` bytes of a validated header, without
    copying, or None when the bytes are not aligned for its dtype. It must be treated as read-only."""
    if len(buffer) != h.nbytes or not h.nbytes:
        return None
    raw = torch.frombuffer(buffer, dtype=torch.uint8)
    if raw.data_ptr() % ITEMSIZES[h.dtype]:
        return None
    return raw.view(DTYPES[h.dtype])


def restore(h: peer_pb2.TensorHeader, payload: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """The tensor a validated header describes, from its flat payload (the codec decodes it); a codec that
    decodes `on_device` does so on `device` (the receiving stage's accelerator), where the tensor then is."""
    codec = codecs.codec(h.codec)
    if device is not None and codec.on_device:
        payload = payload.to(device)
    return codec.decode(payload, list(h.shape), DTYPES[decoded_dtype(h)], list(h.params))


def decode(h: peer_pb2.TensorHeader, buffer: bytes | bytearray | memoryview) -> torch.Tensor:
    """Build the tensor from a validated header and exactly `h.nbytes` bytes (copied)."""
    if len(buffer) != h.nbytes:
        raise WireError(f"tensor {h.name!r}: got {len(buffer)} bytes, header declares {h.nbytes}")
    payload = allocate(h)
    if h.nbytes:
        byte_view(payload)[:] = buffer
    return restore(h, payload)
