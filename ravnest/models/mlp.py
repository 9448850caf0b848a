"""Multi-layer perceptron: input layer, `depth` hidden blocks, classification head."""
from __future__ import annotations

from typing import Any

from torch import nn

from .registry import InputSpec, ModelSpec, register_model, require, resolve_config

DEFAULTS: dict[str, Any] = {"input_dim": 64, "hidden": 128, "depth": 4, "num_classes": 10, "dropout": 0.0}


def _dense(in_features: int, out_features: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(nn.Linear(in_features, out_features), nn.ReLU(), nn.Dropout(dropout))


@register_model("mlp")
def build_mlp(config: dict[str, Any]) -> ModelSpec:
    cfg = resolve_config("mlp", DEFAULTS, config)
    for key in ("input_dim", "hidden", "num_classes"):
        require(cfg[key] >= 1, "mlp", f"{key} must be >= 1")
    require(cfg["depth"] >= 0, "mlp", "depth must be >= 0")
    require(0.0 <= cfg["dropout"] < 1.0, "mlp", "dropout must be in [0, 1)")
    hidden, dropout, depth = cfg["hidden"], cfg["dropout"], cfg["depth"]

    def make_block(index: int) -> nn.Module:
        if index == 0:  # flatten first so image batches [B, C, H, W] work as well as [B, input_dim]
            return nn.Sequential(nn.Flatten(), *_dense(cfg["input_dim"], hidden, dropout))
        if index <= depth:
            return _dense(hidden, hidden, dropout)
        return nn.Linear(hidden, cfg["num_classes"])

    return ModelSpec("mlp", cfg, depth + 2, make_block, "classify", InputSpec((cfg["input_dim"],)))
