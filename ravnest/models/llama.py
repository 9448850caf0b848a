"""Llama-family decoder (RMSNorm, rotary positions, SwiGLU, grouped-query attention), configured with
Hugging Face `LlamaConfig`'s keys and holding its tensors under its names, so a trained model loads
in `transformers` as it is (ravnest/models/hf.py maps the keys).

Blocks: 0 is the token embedding, 1..num_hidden_layers the decoder layers, the last the final norm
with the head. The rotary angles depend only on a token's position, so each layer computes them from
its input's length: no block reads another's state.

`residual_rank: k` (0: off) is for slow links (subspace.py): the residual stream between blocks is a
fixed token embedding plus k trained coordinates, so what crosses a cut is k numbers per token (and
the token id) instead of hidden_size. The model stays a Llama: export folds the subspace into the
embedding and the layers' output projections.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .profile import KERNEL_BYTES
from .registry import InputSpec, ModelSpec, register_model, require, resolve_config
from .subspace import Subspace

# a small model's defaults; the names are Hugging Face LlamaConfig's (head_dim 0: hidden_size / heads)
DEFAULTS: dict[str, Any] = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 688,
                            "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
                            "head_dim": 0, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                            "max_position_embeddings": 256, "tie_word_embeddings": False,
                            "initializer_range": 0.02, "residual_rank": 0}


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 whatever the input's dtype (as Llama does)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rotary(length: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, head_dim] of the rotation angle position * theta^(-2i/head_dim), each angle
    used for the two halves of a head (Llama's layout, not interleaved pairs)."""
    inverse = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inverse)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] rotated: (a, b) halves -> (a cos - b sin, b cos + a sin)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class Attention(nn.Module):
    """Causal self-attention where groups of query heads share one key/value head."""

    def __init__(self, cfg: dict[str, Any], head_dim: int) -> None:
        super().__init__()
        width, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.heads, self.kv_heads, self.head_dim, self.theta = heads, kv_heads, head_dim, cfg["rope_theta"]
        self.q_proj = nn.Linear(width, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary(length, self.head_dim, self.theta, x.device, q.dtype)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(attended.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim))


# A llama layer's first forward and backward on a thread (attention, RMSNorm, SiLU set up their kernels'
# state) took 6.5 MiB above a Linear's, whatever the batch (seq_len 64: 6.5 at batch 4 and 16)
KERNEL_BYTES[Attention] = KERNEL_BYTES[nn.Linear] + (13 << 19)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, width: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, inner, bias=False)
        self.up_proj = nn.Linear(width, inner, bias=False)
        self.down_proj = nn.Linear(inner, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], head_dim: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = Attention(cfg, head_dim)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.mlp = MLP(cfg["hidden_size"], cfg["intermediate_size"])

        self.subspace = Subspace.of(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.subspace is not None:  # x is packed: k coordinates and the token ids (subspace.py)
            residual = self.subspace.unpack(x)
            residual.add(self.self_attn(self.input_layernorm(residual.full())))
            residual.add(self.mlp(self.post_attention_layernorm(residual.full())))
            return residual.packed()
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Embedding(nn.Module):
    """Token ids [B, T] (T <= max_position_embeddings) -> [B, T, hidden_size]."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.subspace = Subspace.of(cfg)
        # with a subspace, the trained part of the embedding is its k coordinates (the rest is fixed)
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], self.subspace.rank if self.subspace else cfg["hidden_size"])
        self.max_length = cfg["max_position_embeddings"]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.max_length:
            raise ValueError(f"sequence of {ids.shape[1]} tokens is longer than max_position_embeddings="
                             f"{self.max_length}")
        if self.subspace is not None:
            return self.subspace.embedded(ids, self.embed_tokens(ids))
        return self.embed_tokens(ids)


class Head(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
        self.subspace = Subspace.of(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.subspace is not None:
            x = self.subspace.unpack(x).full()
        return self.lm_head(self.norm(x))


def _initialise(block: nn.Module, std: float) -> nn.Module:
    """Llama's initialisation: normal(0, initializer_range) for every matrix, RMSNorm weights at one."""
    for module in block.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
    return block


@register_model("llama")
def build_llama(config: dict[str, Any]) -> ModelSpec:
    cfg = resolve_config("llama", DEFAULTS, config)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings"):
        require(isinstance(cfg[key], int) and cfg[key] >= 1, "llama", f"{key} must be an integer >= 1")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    require(heads % kv_heads == 0, "llama", f"num_attention_heads ({heads}) must be a multiple of "
                                            f"num_key_value_heads ({kv_heads}): each key/value head serves a group")
    head_dim = cfg["head_dim"] or cfg["hidden_size"] // heads
    require(cfg["head_dim"] > 0 or cfg["hidden_size"] % heads == 0, "llama",
            f"hidden_size ({cfg['hidden_size']}) must be divisible by num_attention_heads ({heads}), or set head_dim")
    require(head_dim % 2 == 0, "llama", f"the head dimension ({head_dim}) must be even: rotary positions rotate pairs")
    require(cfg["rms_norm_eps"] > 0 and cfg["rope_theta"] > 0 and cfg["initializer_range"] > 0, "llama",
            "rms_norm_eps, rope_theta and initializer_range must be positive")
    Subspace.validate(cfg)
    layers = cfg["num_hidden_layers"]

    def make_block(index: int) -> nn.Module:
        if index == 0:
            block: nn.Module = Embedding(cfg)
        elif index <= layers:
            block = DecoderLayer(cfg, head_dim)
        else:
            block = Head(cfg)
        return _initialise(block, cfg["initializer_range"])

    tokens = InputSpec((cfg["max_position_embeddings"],), torch.int64, high=cfg["vocab_size"])
    # tied embeddings: the head's weight is the embedding's, so the two blocks share one stage (the
    # planner then plans one-stage pipelines; several would have to sum the tensor's gradients across
    # the first and last stage every step, as Megatron does, which Ravnest does not)
    tied = (("0.embed_tokens.weight", f"{layers + 1}.lm_head.weight"),) if cfg["tie_word_embeddings"] else ()
    return ModelSpec("llama", cfg, layers + 2, make_block, "lm", tokens, tied, exact_links=bool(cfg["residual_rank"]))
