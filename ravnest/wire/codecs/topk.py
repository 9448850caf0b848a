"""Chunked top-k with 1-bit signs and error feedback, for what replicas exchange (after SparseLoCo,
arXiv 2508.15706, and "Beyond Top-K": the idea, none of their code).

Cut the tensor into chunks of C values. In each chunk keep the k of largest magnitude, sorted, and send
per chunk: their k positions (int16), their k signs (one bit each), and two float32 magnitudes: the
mean of the larger half and of the smaller half of the kept values. The receiver rebuilds each kept
value as its sign times its half's mean; the rest are zero. The sender keeps what it did not send
(the residual) and adds it to the next tensor of the same name: error feedback, so nothing is lost,
only delayed.

    C = 4096, k = 64 (1.56% kept):  per chunk 2k + k/8 + 8 = 144 bytes  against 4C = 16,384 in float32
                                    = 113.8x fewer bytes

The decoded values are not partial sums a ring can add up hop by hop (`reduces` is False): replicas
all-gather each other's and average them.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from ravnest.wire.codecs import Codec, CodecState, Encoded, chunks_of, register
from ravnest.wire.dtypes import NotFiniteValues, WireError

_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def chunk_bytes(k: int) -> int:
    return 2 * k + k // 8 + 8


@register
class TopK(Codec):
    name, uses, wire_dtype, params, reduces = "topk", frozenset({"averaging"}), "uint8", 2, False
    auto, needs_changes = {"averaging": 2}, True  # error feedback on what replicas changed (diloco)
    chunk, k = 4096, 64

    def payload_numel(self, numel: int, params: Sequence[float]) -> int:
        chunk, k = (int(p) for p in params) if params else (self.chunk, self.k)
        return chunks_of(numel, chunk) * chunk_bytes(k)

    def check(self, params: Sequence[float]) -> str | None:
        chunk, k = params
        if not math.isfinite(chunk) or chunk != int(chunk) or not 64 <= chunk <= 32768:
            return f"topk chunk of {chunk} values: it must be a whole number from 64 to 32768"
        if not math.isfinite(k) or k != int(k) or not 32 <= k <= chunk // 2 or int(k) % 32:
            return f"topk keeps {k} of {chunk}: it must be a multiple of 32 from 32 to half the chunk"
        return None

    def encode(self, t: torch.Tensor, state: CodecState | None = None, key: str = "") -> Encoded:
        chunk, k = self.chunk, self.k
        x = t.reshape(-1).float()
        residual = state.get(key) if state is not None else None
        if residual is not None and residual.shape == x.shape:
            x = x + residual
        n = x.numel()
        rows = chunks_of(n, chunk)
        padded = torch.zeros(rows * chunk)
        padded[:n] = x
        grid = padded.view(rows, chunk)
        magnitude, index = grid.abs().topk(k, dim=1)  # sorted: the first k/2 are the larger half
        scales = torch.stack([magnitude[:, :k // 2].mean(1), magnitude[:, k // 2:].mean(1)], dim=1)
        negative = grid.gather(1, index) < 0
        payload = torch.cat([index.to(torch.int16).reshape(-1).view(torch.uint8),
                             (negative.reshape(-1, 8).to(torch.uint8) * _BITS).sum(1, dtype=torch.uint8),
                             scales.reshape(-1).view(torch.uint8)])
        if state is not None:
            state[key] = x - _rebuild(index, negative, scales, chunk)[:n]
        return payload, [float(chunk), float(k)]

    def decode(self, payload: torch.Tensor, shape: Sequence[int], dtype: torch.dtype,
               params: Sequence[float]) -> torch.Tensor:
        chunk, k = int(params[0]), int(params[1])
        rows = payload.numel() // chunk_bytes(k)
        signs_at, scales_at = rows * k * 2, rows * k * 2 + rows * k // 8
        index = payload[:signs_at].clone().view(torch.int16).view(rows, k).long()
        if rows and (int(index.min()) < 0 or int(index.max()) >= chunk):
            raise WireError(f"topk positions outside a chunk of {chunk}")
        negative = (payload[signs_at:scales_at].unsqueeze(1) & _BITS).ne(0).view(rows, k)
        scales = payload[scales_at:].clone().view(torch.float32).view(rows, 2)
        if not bool(torch.isfinite(scales).all()):
            raise NotFiniteValues("topk magnitudes are not finite")
        n = 1
        for d in shape:
            n *= d
        return _rebuild(index, negative, scales, chunk)[:n].view(tuple(shape)).to(dtype)


def _rebuild(index: torch.Tensor, negative: torch.Tensor, scales: torch.Tensor, chunk: int) -> torch.Tensor:
    """The flat (padded) tensor the receiver sees: each kept value its half's mean with its sign."""
    rows, k = index.shape
    larger = torch.arange(k) < k // 2
    values = torch.where(larger, scales[:, :1], scales[:, 1:]) * (1 - 2 * negative.float())
    return torch.zeros(rows, chunk).scatter_(1, index, values).view(-1)
