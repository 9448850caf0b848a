"""Multi-layer perceptron: input layer, `depth` hidden blocks, classification head."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .registry import ModelSpec, register_model, require, resolve_config

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
    hidden, dropout = cfg["hidden"], cfg["dropout"]
    # Flatten first so image batches [B, C, H, W] work as well as [B, input_dim].
    blocks: list[nn.Module] = [nn.Sequential(nn.Flatten(), *_dense(cfg["input_dim"], hidden, dropout))]
    blocks += [_dense(hidden, hidden, dropout) for _ in range(cfg["depth"])]
    blocks.append(nn.Linear(hidden, cfg["num_classes"]))
    input_dim = cfg["input_dim"]

    def example_input(batch_size: int) -> torch.Tensor:
        return torch.rand(batch_size, input_dim)

    return ModelSpec("mlp", cfg, blocks, "classify", input_fn=example_input)
