"""Tensors on the wire: dtype + shape + raw bytes, with optional lossy codecs.

A tensor is described by a `TensorHeader` and followed by exactly `nbytes` raw bytes. Receivers call
`validate_header` before allocating anything, so a hostile or broken peer cannot make us allocate
more than the configured limits, nor build a tensor whose bytes do not match its shape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import grpc
import torch

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
CODECS = ("", "fp16", "bf16", "int8")
_CODEC_WIRE_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "int8": "int8"}


class WireError(Exception):
    """A malformed or oversized message. Carries the gRPC status the receiver answers with."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class WireLimits:
    """What a receiver accepts from one peer. Checked before any allocation."""

    max_tensor_bytes: int = 1 << 30
    max_message_bytes: int = 2 << 30
    max_tensors_per_message: int = 64
    max_dims: int = 8
    max_chunk_bytes: int = 4 << 20


def itemsize(dtype_name: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype_name]).element_size()


def validate_header(h: peer_pb2.TensorHeader, limits: WireLimits) -> None:
    """Raise WireError unless the header is self-consistent and within limits."""
    if h.dtype not in DTYPES:
        raise WireError(f"tensor {h.name!r}: unknown dtype {h.dtype!r}")
    if h.codec not in CODECS:
        raise WireError(f"tensor {h.name!r}: unknown codec {h.codec!r}")
    if h.codec and h.dtype != _CODEC_WIRE_DTYPE[h.codec]:
        raise WireError(f"tensor {h.name!r}: codec {h.codec} needs wire dtype "
                        f"{_CODEC_WIRE_DTYPE[h.codec]}, got {h.dtype}")
    if h.decoded_dtype and h.decoded_dtype not in DTYPES:
        raise WireError(f"tensor {h.name!r}: unknown decoded dtype {h.decoded_dtype!r}")
    if h.codec and not DTYPES.get(h.decoded_dtype or h.dtype, torch.int8).is_floating_point:
        raise WireError(f"tensor {h.name!r}: codec {h.codec} decodes only to a float dtype")
    if len(h.shape) > limits.max_dims:
        raise WireError(f"tensor {h.name!r}: {len(h.shape)} dims exceed the limit of {limits.max_dims}")
    if any(d < 0 for d in h.shape):
        raise WireError(f"tensor {h.name!r}: negative dimension in shape {list(h.shape)}")
    numel = math.prod(h.shape)
    expected = numel * itemsize(h.dtype)
    if h.nbytes != expected:
        raise WireError(f"tensor {h.name!r}: declares {h.nbytes} bytes but {h.dtype}{list(h.shape)} "
                        f"needs {expected}")
    if expected > limits.max_tensor_bytes:
        raise WireError(f"tensor {h.name!r}: {expected} bytes exceed the limit of "
                        f"{limits.max_tensor_bytes}", grpc.StatusCode.RESOURCE_EXHAUSTED)
    if h.codec == "int8" and not math.isfinite(h.scale):
        raise WireError(f"tensor {h.name!r}: int8 scale is not finite")


def encode(name: str, tensor: torch.Tensor, codec: str = "") -> tuple[peer_pb2.TensorHeader, memoryview]:
    """Return the header and a memoryview over the bytes to send (CPU, contiguous)."""
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
        else:  # int8: symmetric per-tensor scale, receivers accumulate in fp32
            amax = float(t.abs().max()) if t.numel() else 0.0
            scale = amax / 127.0 if amax > 0 else 1.0
            t = torch.round(t.float() / scale).clamp_(-127, 127).to(torch.int8)
    else:
        codec = ""  # lossy codecs only apply to floats; integers travel raw
    t = t.to("cpu").contiguous()
    header = peer_pb2.TensorHeader(
        name=name, dtype=DTYPE_NAMES[t.dtype], shape=list(t.shape), nbytes=t.numel() * t.element_size(),
        codec=codec, decoded_dtype=decoded if codec else "", scale=scale)
    return header, _byte_view(t)


def _byte_view(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    # numpy has no bfloat16: reinterpret the bits; the receiver restores the dtype from the header.
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()).cast("B")


def decode(h: peer_pb2.TensorHeader, buffer: bytearray) -> torch.Tensor:
    """Build the tensor from a validated header and exactly `h.nbytes` bytes (no copy)."""
    wire_dtype = DTYPES[h.dtype]
    if h.nbytes == 0:
        t = torch.empty(tuple(h.shape), dtype=wire_dtype)
    else:
        t = torch.frombuffer(buffer, dtype=torch.uint8).view(wire_dtype).reshape(tuple(h.shape))
    if h.codec == "int8":
        return t.to(DTYPES[h.decoded_dtype or "float32"]) * h.scale
    if h.codec:
        return t.to(DTYPES[h.decoded_dtype])
    return t
