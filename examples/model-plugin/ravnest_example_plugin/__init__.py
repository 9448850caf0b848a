"""A residual MLP as a Ravnest plug-in: a stem, `depth` residual blocks, a head.

What makes it a good citizen (docs/models.md):
- `build_resmlp(config)` validates the config and allocates nothing;
- `make_block(i)` builds block i alone with torch's default device and RNG, so the coordinator can
  profile it on the meta device and every node builds only its own blocks, with weights that depend
  only on (seed, i).
"""
from __future__ import annotations

from typing import Any

from torch import nn

from ravnest.models import InputSpec, ModelSpec
from ravnest.models.registry import require, resolve_config

DEFAULTS: dict[str, Any] = {"input_dim": 64, "width": 128, "depth": 4, "num_classes": 10}


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def build_resmlp(config: dict[str, Any]) -> ModelSpec:
    cfg = resolve_config("resmlp", DEFAULTS, config)
    for key in DEFAULTS:
        require(cfg[key] >= 1, "resmlp", f"{key} must be >= 1")
    width, depth = cfg["width"], cfg["depth"]

    def make_block(index: int) -> nn.Module:
        if index == 0:
            return nn.Sequential(nn.Flatten(), nn.Linear(cfg["input_dim"], width))
        if index <= depth:
            return Residual(width)
        return nn.Sequential(nn.LayerNorm(width), nn.Linear(width, cfg["num_classes"]))

    return ModelSpec("resmlp", cfg, depth + 2, make_block, "classify", InputSpec((cfg["input_dim"],)))
