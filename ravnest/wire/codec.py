"""Tensors on the wire: dtype + shape + raw bytes, with optional lossy codecs.

A tensor is described by a `TensorHeader` and followed by exactly `nbytes` raw bytes. Receivers call
`validate_header` before allocating anything, so a hostile or broken peer cannot make us allocate
more than the configured limits, nor build a tensor whose bytes do not match its shape.
"""
from __future__ import annotations

import math
import threading
import warnings
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from ravnest.errors import RavnestError
from ravnest.v1 import peer_pb2

# Every dtype we are willing to put on the wire, by its wire name. Nothing else is accepted.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ITEMSIZES = {name: torch.empty((), dtype=dt).element_size() for name, dt in DTYPES.items()}
CODECS = ("", "fp16", "bf16", "int8")
_CODEC_WIRE_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "int8": "int8"}
# `wrap` views received bytes on purpose (read-only by contract); torch would warn about it once.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


class WireError(RavnestError):
    """A malformed or oversized message. Carries the gRPC status the receiver answers with."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


def require_finite(tensor: torch.Tensor, what: str) -> None:
    """Refuse NaN or infinite values from a peer: one would spread into every weight it reaches.

    A NaN or an infinity makes the sum NaN or infinite, so a finite sum clears the tensor in one pass
    that allocates nothing (`isfinite().all()` writes a mask first: 25 times as long, 15 ms for 7M
    values); only a sum that overflows from finite values is checked element by element."""
    if not tensor.is_floating_point() or bool(torch.isfinite(tensor.sum())):
        return
    if not bool(torch.isfinite(tensor).all()):
        raise WireError(f"{what} holds NaN or infinite values; refused")


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


def itemsize(dtype_name: str) -> int:
    return ITEMSIZES[dtype_name]


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
    if h.codec not in CODECS:
        raise WireError(f"{where}: unknown codec {h.codec[:40]!r}")
    if h.decoded_dtype and h.decoded_dtype not in DTYPES:
        raise WireError(f"{where}: unknown decoded dtype {h.decoded_dtype[:40]!r}")
    if h.codec:
        if h.dtype != _CODEC_WIRE_DTYPE[h.codec]:
            raise WireError(f"{where}: codec {h.codec} needs wire dtype "
                            f"{_CODEC_WIRE_DTYPE[h.codec]}, got {h.dtype}")
        if not DTYPES[decoded_dtype(h)].is_floating_point:
            raise WireError(f"{where}: codec {h.codec} decodes only to a float dtype, "
                            f"not {decoded_dtype(h)}")
        if h.codec == "int8" and not math.isfinite(h.scale):
            raise WireError(f"{where}: int8 scale {h.scale} is not finite")
    elif h.decoded_dtype not in ("", h.dtype):
        raise WireError(f"{where}: decoded dtype {h.decoded_dtype} without a codec")
    if len(h.shape) > limits.max_dims:
        raise WireError(f"{where}: {len(h.shape)} dims exceed the limit of {limits.max_dims}")
    if any(d < 0 for d in h.shape):
        raise WireError(f"{where}: negative dimension in shape {list(h.shape)}")
    # Bound every dimension, zero-sized tensors included: torch overflows on shapes like [0, 2**62, 2**62].
    largest = max(ITEMSIZES[h.dtype], ITEMSIZES[decoded_dtype(h)])
    if math.prod(max(d, 1) for d in h.shape) * largest > limits.max_tensor_bytes:
        raise WireError(f"{where}: shape {list(h.shape)} of {decoded_dtype(h)} exceeds the limit of "
                        f"{limits.max_tensor_bytes} bytes", grpc.StatusCode.RESOURCE_EXHAUSTED)
    expected = math.prod(h.shape) * ITEMSIZES[h.dtype]
    if h.nbytes != expected:
        raise WireError(f"{where}: declares {h.nbytes} bytes but {h.dtype}{list(h.shape)} "
                        f"needs {expected}")


def decoded_nbytes(h: peer_pb2.TensorHeader) -> int:
    """Bytes the receiver allocates for a validated header once decoded."""
    return math.prod(h.shape) * ITEMSIZES[decoded_dtype(h)]


def encode(name: str, tensor: torch.Tensor, codec: str = "") -> tuple[peer_pb2.TensorHeader, memoryview]:
    """Return the header and a memoryview over the bytes to send (CPU, contiguous).

    The view may alias `tensor` itself when no conversion was needed.
    """
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {CODECS}")
    t = tensor.detach()
    if t.dtype not in DTYPE_NAMES:
        raise ValueError(f"tensor {name!r}: dtype {t.dtype} cannot go on the wire")
    decoded = DTYPE_NAMES[t.dtype]
    scale = 0.0
    if codec and t.is_floating_point():
        if codec == "fp16":
            t = t.to(torch.float16)
        elif codec == "bf16":
            t = t.to(torch.bfloat16)
        else:
            t, scale = _quantize_int8(name, t)
    else:
        codec = ""  # lossy codecs only apply to floats; integers travel raw
    t = t.to("cpu").contiguous()
    header = peer_pb2.TensorHeader(
        name=name, dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape), nbytes=t.numel() * t.element_size(),
        codec=codec, decoded_dtype=decoded if codec else "", scale=scale)
    return header, byte_view(t)


def _quantize_int8(name: str, t: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Symmetric per-tensor int8: value ≈ q * scale, |error| <= scale / 2. Receivers accumulate in fp32."""
    amax = float(t.abs().max()) if t.numel() else 0.0
    if not math.isfinite(amax):
        raise ValueError(f"tensor {name!r}: int8 codec needs finite values")
    # The header carries the scale as float32; quantize with exactly that value.
    scale = float(np.float32(amax / 127.0)) if amax > 0 else 1.0
    if not 0 < scale < math.inf:
        raise ValueError(f"tensor {name!r}: magnitude {amax} does not fit an int8 scale")
    q = torch.round(t.to(torch.float64 if t.dtype == torch.float64 else torch.float32) / scale)
    return q.clamp_(-127, 127).to(torch.int8), scale


def byte_view(t: torch.Tensor) -> memoryview:
    """A flat unsigned-byte memoryview sharing memory with a contiguous CPU tensor (writable)."""
    if t.numel() == 0:
        return memoryview(bytearray())
    # numpy has no bfloat16: reinterpret the bits; the receiver restores the dtype from the header.
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def allocate(h: peer_pb2.TensorHeader) -> torch.Tensor:
    """Uninitialised wire-dtype tensor for a validated header; fill it through `byte_view`."""
    return torch.empty(tuple(h.shape), dtype=DTYPES[h.dtype])


def wrap(h: peer_pb2.TensorHeader, buffer: bytes | memoryview) -> torch.Tensor | None:
    """A tensor sharing memory with exactly `h.nbytes` bytes of a validated header, without copying,
    or None when the bytes are not aligned for its dtype. It must be treated as read-only."""
    if len(buffer) != h.nbytes or not h.nbytes:
        return None
    raw = torch.frombuffer(buffer, dtype=torch.uint8)
    if raw.data_ptr() % ITEMSIZES[h.dtype]:
        return None
    return raw.view(DTYPES[h.dtype]).view(tuple(h.shape))


def restore(h: peer_pb2.TensorHeader, wire: torch.Tensor) -> torch.Tensor:
    """Undo the header's codec on a tensor that holds the wire bytes."""
    if h.codec == "int8":  # scale in fp32 (fp64 for fp64), then round once to the decoded dtype
        target = DTYPES[decoded_dtype(h)]
        return (wire.to(torch.float64 if target == torch.float64 else torch.float32) * h.scale).to(target)
    if h.codec:
        return wire.to(DTYPES[decoded_dtype(h)])
    return wire


def decode(h: peer_pb2.TensorHeader, buffer: bytes | bytearray | memoryview) -> torch.Tensor:
    """Build the tensor from a validated header and exactly `h.nbytes` bytes (copied)."""
    if len(buffer) != h.nbytes:
        raise WireError(f"tensor {h.name!r}: got {len(buffer)} bytes, header declares {h.nbytes}")
    wire = allocate(h)
    if h.nbytes:
        byte_view(wire)[:] = buffer
    return restore(h, wire)
