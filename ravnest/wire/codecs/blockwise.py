"""Blockwise integer codecs for the pipeline's activations and gradients, for any model: each block of
BLOCK values gets its own scale, so one outlier costs the precision of 64 values, not of the tensor
(llama.cpp's Q8_0 and Q4_0 formats work so; SWARM sends 8-bit blockwise activations).

    codec  bytes per float32 value    vs float32   a block's payload
    q8     1 + 2/64    = 1.03125       3.9x         a bf16 scale, 64 int8 in [-127, 127]
    q4     1/2 + 2/64  = 0.53125       7.5x         a bf16 scale, 64 int4 in [-7, 7], two to a byte
    q3     3/8 + 2/64  = 0.40625       9.8x         a bf16 scale, 64 int3 in [-3, 3], eight to 3 bytes
    q4g3   q4 forward, q3 back         8.5x         (both ways together)

A value is q * scale with scale = max|block| / qmax (bf16, rounded up so that no q is clamped), so its
error is at most scale / 2. q4 and q3 first turn each block by the orthonormal Hadamard matrix H / 8
(TAH-Quant, He et al. 2025): an outlier's energy spreads over the whole block, so the scale fits the
block's typical values, not its largest one; H / 8 is its own inverse, so the receiver turns it back
after dequantizing, and the error's norm per block is what it was before the turn (at most 8 half-steps).
Gaussian values come back with a relative error of 0.6% (q8), 11% (q4) and 25% (q3).

The payload is one byte string: every block's scale (bf16, 2 bytes each), then the codes. Its size
follows from the shape alone (`payload_numel`), as the wire's validate-before-allocate needs. Any bytes
of that size decode to a tensor of the declared shape; scales that are not finite give values that are
not, which the receiving stage refuses naming its sender (ravnest/pipeline/neighbours.py).

No error feedback: in the pipeline each message is another micro-batch of other samples, so what one
left out has no place in the next (AQ-SGD's per-sample deltas would, at a cache of every sample's last
activation: not done). Rounding is to nearest, so a seeded run is reproducible. The math runs where the
tensor is (the sending stage's device); only the packed bytes cross to the host, and a receiving stage
on an accelerator decodes there (`on_device`: the packed bytes are moved, not float32 values).
"""
from __future__ import annotations

import functools
import math
from typing import ClassVar, Sequence

import torch

from ravnest.wire.codecs import GRADIENT, Codec, CodecState, Encoded, register

BLOCK = 64  # values per scale
SCALE_BYTES = 2  # bf16: float32's range in 2 bytes


@functools.cache
def _hadamard(device: torch.device) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard matrix of size BLOCK (Sylvester's construction), H / sqrt(BLOCK)."""
    h = torch.ones(1, 1)
    while h.shape[0] < BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(BLOCK)).to(device)


class _Blockwise(Codec):
    uses = frozenset({"pipeline"})
    wire_dtype = "uint8"
    qmax: ClassVar[int]
    bits: ClassVar[int]
    rotate: ClassVar[bool] = False
    on_device = True

    def payload_numel(self, numel: int, params: Sequence[float]) -> int:
        blocks = math.ceil(numel / BLOCK)
        return blocks * SCALE_BYTES + blocks * BLOCK * self.bits // 8

    def encode(self, t: torch.Tensor, state: CodecState | None = None, key: str = "") -> Encoded:
        flat = t.detach().reshape(-1).float()
        if not flat.numel():
            return torch.empty(0, dtype=torch.uint8, device=flat.device), []
        blocks = torch.nn.functional.pad(flat, (0, -flat.numel() % BLOCK)).view(-1, BLOCK)
        if self.rotate:
            blocks = blocks @ _hadamard(blocks.device)
        low, high = torch.aminmax(blocks, dim=1, keepdim=True)  # one pass, no |blocks| copy
        amax = torch.maximum(high, -low)
        # rounded up to bf16, so that |x| / scale <= qmax; a block below 1e-30 decodes to zeros
        scale = (torch.where(amax > 1e-30, amax, self.qmax) * ((1 + 2 ** -7) / self.qmax)).to(torch.bfloat16)
        wide = scale.float()
        if not bool(torch.isfinite(amax).all() & torch.isfinite(wide).all()):  # (NaN > 1e-30 is False: both)
            raise ValueError(f"the {self.name} codec needs finite values below 3e38")
        q = blocks.mul(wide.reciprocal_()).round_().clamp_(-self.qmax, self.qmax).to(torch.int8)
        codes = self._pack(q)
        return torch.cat([scale.view(torch.uint8).reshape(-1), codes.reshape(-1)]), []

    def decode(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype,
               params: Sequence[float]) -> torch.Tensor:
        numel = math.prod(shape)
        blocks = math.ceil(numel / BLOCK)
        scale = payload[:blocks * SCALE_BYTES].view(torch.bfloat16).float().view(blocks, 1)
        values = self._unpack(payload[blocks * SCALE_BYTES:], blocks).float() * scale
        if self.rotate:
            values = values @ _hadamard(values.device)
        return values.reshape(-1)[:numel].to(dtype).view(tuple(shape))

    def _pack(self, q: torch.Tensor) -> torch.Tensor:
        return q.view(torch.uint8)

    def _unpack(self, codes: torch.Tensor, blocks: int) -> torch.Tensor:
        return codes.view(torch.int8).view(blocks, BLOCK)


@register
class Q8(_Blockwise):
    name, qmax, bits = "q8", 127, 8
    auto = {"pipeline": 2}


@register
class Q4(_Blockwise):
    name, qmax, bits, rotate = "q4", 7, 4, True
    auto = {"pipeline": 3}

    def _pack(self, q: torch.Tensor) -> torch.Tensor:
        nibbles = (q + 8).to(torch.uint8).view(-1, 2)  # 1..15: two to a byte, the first in the low half
        return nibbles[:, 0] | (nibbles[:, 1] << 4)

    def _unpack(self, codes: torch.Tensor, blocks: int) -> torch.Tensor:
        both = torch.stack([codes & 15, codes >> 4], dim=1)
        return (both.to(torch.int8) - 8).view(blocks, BLOCK)


@register
class Q3(_Blockwise):
    name, qmax, bits, rotate = "q3", 3, 3, True
    auto = {"pipeline": 5}

    def _pack(self, q: torch.Tensor) -> torch.Tensor:
        eights = (q + 4).to(torch.int32).view(-1, 8)  # 1..7: eight to three bytes, the first in the low bits
        word = (eights << torch.arange(0, 24, 3, dtype=torch.int32, device=q.device)).sum(dim=1, dtype=torch.int32)
        return torch.stack([(word >> shift) & 255 for shift in (0, 8, 16)], dim=1).to(torch.uint8)

    def _unpack(self, codes: torch.Tensor, blocks: int) -> torch.Tensor:
        triples = codes.view(-1, 3).to(torch.int32)
        word = triples[:, 0] | (triples[:, 1] << 8) | (triples[:, 2] << 16)
        shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=codes.device)
        return (((word.unsqueeze(1) >> shifts) & 7) - 4).to(torch.int8).view(blocks, BLOCK)


@register
class Q4G3(Codec):
    """Activations as q4, the gradients that come back as q3: 3.5 bits and a scale per 64 values on
    average, 8.5x fewer bytes than float32 both ways together. A fine-tuned Llama lost 2.9% of its
    held-out loss to q3 both ways but 1.0% to this (docs/links.md): the gradients tolerate the
    coarser code better. A frame's one parameter says which (its bits); a planner pricing a link
    takes the mean of the two directions."""
    name = "q4g3"
    uses = frozenset({"pipeline"})
    wire_dtype = "uint8"
    params = 1
    on_device = True
    auto = {"pipeline": 4}
    forward, backward = Q4(), Q3()

    def _of(self, params: Sequence[float]) -> _Blockwise:
        return self.forward if params[0] == self.forward.bits else self.backward

    def check(self, params: Sequence[float]) -> str | None:
        bits = (self.forward.bits, self.backward.bits)
        return None if params[0] in bits else f"q4g3 frames are of {bits[0]} or {bits[1]} bits, not {params[0]:g}"

    def payload_numel(self, numel: int, params: Sequence[float]) -> int:
        if not params:  # priced: one message each way
            return (self.forward.payload_numel(numel, ()) + self.backward.payload_numel(numel, ())) // 2
        return self._of(params).payload_numel(numel, params)

    def encode(self, t: torch.Tensor, state: CodecState | None = None, key: str = "") -> Encoded:
        chosen = self.backward if key == GRADIENT else self.forward
        return chosen.encode(t, state, key)[0], [float(chosen.bits)]

    def decode(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype,
               params: Sequence[float]) -> torch.Tensor:
        return self._of(params).decode(payload, shape, dtype, params)
