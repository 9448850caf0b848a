"""A residual stream in a fixed subspace, so that what crosses a slow link between two pipeline stages
is a few numbers per token (a llama's `residual_rank`).

Between two blocks a Llama's residual stream is x [B, T, d]: the token embedding plus every layer's
output so far. Here the embedding is a fixed part plus a trained part in a fixed k-dimensional
subspace, and every layer's output is projected onto that subspace:

    x = F[ids] + c U^T      F [V, d] fixed (seeded, the same on every machine; rows of norm about 1)
                            U [d, k] a fixed orthonormal basis, c [B, T, k] the trained coordinates
    a layer:  c <- c + attention(norm(x)) U,   then  c <- c + mlp(norm(x)) U

So a block hands on (c, ids) and the next one rebuilds x exactly. Packed as one tensor, that is k + 2
numbers per token: the coordinates, and the id as two numbers below 256, which even bf16 holds
exactly. For d = 256 and k = 14 in bf16, 1024 bytes of fp32 activation become 32: 32x smaller. The
gradient going back is c's (autograd computes g U from x's gradient g), exact and as small.

Worked example, d = 4, k = 1, U = [1, 0, 0, 0]^T: an attention output [0.5, 0.2, 0, 0] adds 0.5 to c;
its 0.2 is projected away, as if o_proj's rows were multiplied by U U^T. That is the whole trick:
the model *is* a Llama whose o_proj and down_proj weights are U U^T W and whose embedding table is
F + E U^T (E [V, k] the trained embedding). `fold` writes those, so a Hugging Face export loads in
transformers as a plain LlamaForCausalLM and computes the same logits.

The cost is capacity: every layer writes into k dimensions. The token identity keeps all d (F is
full rank), which is what early training leans on most. docs/links.md measures the loss against the
full model. The idea is the one of Pluralis' "Protocol Models" (subspace-constrained residuals).
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from .registry import require

FRAME_SEED = 0x5EB5_ACE  # F and U depend on (vocab, width, rank) only: every stage draws the same
ID_BASE = 256            # an id travels as (id // 256, id % 256): integers below 256 are exact in bf16
MAX_VOCAB = ID_BASE * ID_BASE


@functools.lru_cache(maxsize=2)
def _frame(vocab: int, width: int, rank: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(F [vocab, width], U [width, rank]), drawn on the CPU from FRAME_SEED, never from torch's RNG."""
    if torch.device(device).type == "meta":
        return torch.empty(vocab, width, device="meta"), torch.empty(width, rank, device="meta")
    generator = torch.Generator().manual_seed(FRAME_SEED)
    basis, _ = torch.linalg.qr(torch.randn(width, rank, generator=generator, dtype=torch.float64))
    fixed = torch.randn(vocab, width, generator=generator, dtype=torch.float64) / width ** 0.5
    return fixed.float().to(device), basis.float().to(device)


class Subspace:
    def __init__(self, vocab: int, width: int, rank: int) -> None:
        self.vocab, self.width, self.rank = vocab, width, rank

    @staticmethod
    def of(cfg: dict[str, Any]) -> Subspace | None:
        rank = cfg.get("residual_rank") or 0
        return Subspace(cfg["vocab_size"], cfg["hidden_size"], rank) if rank else None

    @staticmethod
    def validate(cfg: dict[str, Any]) -> None:
        rank = cfg.get("residual_rank", 0)
        require(isinstance(rank, int) and 0 <= rank < cfg["hidden_size"], "llama",
                f"residual_rank must be an integer from 0 (off) to below hidden_size ({cfg['hidden_size']})")
        if rank:
            require(cfg["vocab_size"] <= MAX_VOCAB, "llama",
                    f"residual_rank needs vocab_size <= {MAX_VOCAB} (token ids travel as two numbers below 256)")
            require(not cfg["tie_word_embeddings"], "llama",
                    "residual_rank and tie_word_embeddings cannot be combined: the embedding is partly fixed")

    def frame(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return _frame(self.vocab, self.width, self.rank, str(device))

    def embedded(self, ids: torch.Tensor, coordinates: torch.Tensor) -> torch.Tensor:
        """Block 0's output: the trained embedding's coordinates, packed with the ids."""
        return Residual(self, coordinates, ids).packed()

    def unpack(self, packed: torch.Tensor) -> Residual:
        """(c, ids) from a packed [B, T, k + 2]; ids are clamped into the vocabulary (a peer's bytes)."""
        high, low = packed[..., self.rank].detach(), packed[..., self.rank + 1].detach()
        ids = (high.float() * ID_BASE + low.float()).round().long().clamp_(0, self.vocab - 1)
        return Residual(self, packed[..., :self.rank], ids)

    def folded(self, key: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """A trained tensor in plain Llama form, or None where it is one already: the embedding becomes
        F + E U^T, each layer's o_proj and down_proj U U^T W (one tensor at a time: a model of any size)."""
        fixed, basis = self.frame(torch.device("cpu"))
        if key == "0.embed_tokens.weight":
            return (fixed + tensor.float() @ basis.T).to(tensor.dtype)
        if key.endswith((".self_attn.o_proj.weight", ".mlp.down_proj.weight")):
            return (basis @ (basis.T @ tensor.float())).to(tensor.dtype)
        return None

    def fold(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A whole state dict in plain Llama form (`folded`)."""
        return {key: t if (f := self.folded(key, t)) is None else f for key, t in tensors.items()}


class Residual:
    """One micro-batch's residual stream inside a block: coordinates c and token ids."""

    def __init__(self, subspace: Subspace, coordinates: torch.Tensor, ids: torch.Tensor) -> None:
        self.subspace, self.coordinates, self.ids = subspace, coordinates, ids
        self._fixed: torch.Tensor | None = None  # F[ids], looked up once per block

    def full(self) -> torch.Tensor:
        """x = F[ids] + c U^T [B, T, d]."""
        fixed, basis = self.subspace.frame(self.coordinates.device)
        if self._fixed is None:
            self._fixed = fixed[self.ids]
        return self._fixed + self.coordinates @ basis.T.to(self.coordinates.dtype)

    def add(self, output: torch.Tensor) -> None:
        """A layer's output [B, T, d], projected onto the subspace, joins the stream."""
        _, basis = self.subspace.frame(output.device)
        self.coordinates = self.coordinates + output @ basis.to(output.dtype)

    def packed(self) -> torch.Tensor:
        """[B, T, k + 2]: the coordinates, then each id as (id // 256, id % 256)."""
        dtype = self.coordinates.dtype
        high, low = torch.div(self.ids, ID_BASE, rounding_mode="floor"), torch.remainder(self.ids, ID_BASE)
        return torch.cat((self.coordinates, high.unsqueeze(-1).to(dtype), low.unsqueeze(-1).to(dtype)), dim=-1)
