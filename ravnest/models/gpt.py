"""Decoder-only transformer (GPT-style): embedding block, `n_layers` pre-LN blocks, head block."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .registry import InputSpec, ModelSpec, register_model, require, resolve_config

DEFAULTS: dict[str, Any] = {"vocab_size": 128, "seq_len": 64, "d_model": 128, "n_layers": 4, "n_heads": 4,
                            "dropout": 0.0}


class Embedding(nn.Module):
    """Token + learned positional embedding; input int64 [B, T] with T <= seq_len."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, dropout: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(seq_len, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        seq_len = self.positions.num_embeddings
        if ids.shape[1] > seq_len:
            raise ValueError(f"sequence of {ids.shape[1]} tokens is longer than seq_len={seq_len}")
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.dropout(self.tokens(ids) + self.positions(positions))


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.proj_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        # [B, T, 3, H, D] -> three [B, H, T, D]
        q, k, v = self.qkv(x).view(batch, length, 3, self.n_heads, width // self.n_heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.proj_dropout(self.proj(attended.transpose(1, 2).reshape(batch, length, width)))


class TransformerBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


@register_model("gpt")
def build_gpt(config: dict[str, Any]) -> ModelSpec:
    cfg = resolve_config("gpt", DEFAULTS, config)
    for key in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads"):
        require(cfg[key] >= 1, "gpt", f"{key} must be >= 1")
    require(cfg["d_model"] % cfg["n_heads"] == 0, "gpt",
            f"d_model ({cfg['d_model']}) must be divisible by n_heads ({cfg['n_heads']})")
    require(0.0 <= cfg["dropout"] < 1.0, "gpt", "dropout must be in [0, 1)")
    d_model, dropout, n_layers = cfg["d_model"], cfg["dropout"], cfg["n_layers"]

    def make_block(index: int) -> nn.Module:
        if index == 0:
            return Embedding(cfg["vocab_size"], cfg["seq_len"], d_model, dropout)
        if index <= n_layers:
            return TransformerBlock(d_model, cfg["n_heads"], dropout)
        return nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, cfg["vocab_size"]))

    tokens = InputSpec((cfg["seq_len"],), torch.int64, high=cfg["vocab_size"])
    return ModelSpec("gpt", cfg, n_layers + 2, make_block, "lm", tokens)
