"""The element-wise codecs: raw, half precision, and int8 with one scale per tensor."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from ravnest.wire.codecs import Codec, CodecState, Encoded, register


@register
class Raw(Codec):
    """The tensor's own bytes, any dtype (integers always travel so)."""

    name, uses = "", frozenset({"pipeline", "averaging"})
    auto = {"pipeline": 0, "averaging": 0}

    def encode(self, t: torch.Tensor, state: CodecState | None = None, key: str = "") -> Encoded:
        return t.reshape(-1), []

    def decode(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype,
               params: Sequence[float]) -> torch.Tensor:
        return payload.view(tuple(shape))


class _Cast(Codec):
    """Rounded to a 2-byte float: relative error 2^-11 (fp16, whose range ends at 65504) or 2^-8 (bf16)."""

    uses = frozenset({"pipeline", "averaging"})

    def encode(self, t: torch.Tensor, state: CodecState | None = None, key: str = "") -> Encoded:
        assert self.wire_dtype is not None
        return t.reshape(-1).to(getattr(torch, self.wire_dtype)), []

    def decode(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype,
               params: Sequence[float]) -> torch.Tensor:
        return payload.view(tuple(shape)).to(dtype)


@register
class Fp16(_Cast):
    name, wire_dtype = "fp16", "float16"


@register
class Bf16(_Cast):
    name, wire_dtype = "bf16", "bfloat16"
    auto = {"pipeline": 1}  # float32's range: what `auto` compresses activations and gradients to


@register
class Int8(Codec):
    """Symmetric per-tensor int8: value ≈ q * scale with |error| <= scale / 2, scale = max|x| / 127 (the
    header's one parameter, a float32: quantized with exactly that value). Receivers sum in fp32."""

    name, uses, wire_dtype, params = "int8", frozenset({"averaging"}), "int8", 1
    auto = {"averaging": 1}

    def check(self, params: Sequence[float]) -> str | None:
        return None if math.isfinite(params[0]) else f"int8 scale {params[0]} is not finite"

    def encode(self, t: torch.Tensor, state: CodecState | None = None, key: str = "") -> Encoded:
        amax = float(t.abs().max()) if t.numel() else 0.0
        if not math.isfinite(amax):
            raise ValueError("the int8 codec needs finite values")
        scale = float(np.float32(amax / 127.0)) if amax > 0 else 1.0
        if not 0 < scale < math.inf:
            raise ValueError(f"a magnitude of {amax} does not fit an int8 scale")
        q = torch.round(t.reshape(-1).to(torch.float64 if t.dtype == torch.float64 else torch.float32) / scale)
        return q.clamp_(-127, 127).to(torch.int8), [scale]

    def decode(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype,
               params: Sequence[float]) -> torch.Tensor:
        # scale in fp32 (fp64 for fp64), then round once to the decoded dtype
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        return (payload.to(wide) * params[0]).to(dtype).view(tuple(shape))
