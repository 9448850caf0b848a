"""Small convolutional net for 1x8x8 (sklearn digits) up to 1x28x28 (MNIST-like) images.

Blocks: one per entry of `channels` (3x3 conv + BatchNorm + ReLU + 2x2 max-pool), then a
flatten + dense block, then the linear head. BatchNorm is on by default on purpose: its running
statistics are buffers, which averaging across clusters must carry along with the parameters.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from .registry import InputSpec, ModelSpec, register_model, require, resolve_config

DEFAULTS: dict[str, Any] = {"in_channels": 1, "image_size": 8, "channels": [32, 64], "num_classes": 10,
                            "batch_norm": True}
HIDDEN = 128  # width of the dense layer before the head


def _conv_block(in_channels: int, out_channels: int, batch_norm: bool, pool: bool) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=not batch_norm)]
    if batch_norm:
        layers.append(nn.BatchNorm2d(out_channels))
    layers.append(nn.ReLU())
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


@register_model("cnn")
def build_cnn(config: dict[str, Any]) -> ModelSpec:
    cfg = resolve_config("cnn", DEFAULTS, config)
    channels = cfg["channels"]
    require(len(channels) >= 1 and all(isinstance(c, int) and not isinstance(c, bool) and c >= 1
                                       for c in channels), "cnn", "channels must be a non-empty list of ints >= 1")
    for key in ("in_channels", "image_size", "num_classes"):
        require(cfg[key] >= 1, "cnn", f"{key} must be >= 1")
    # (in_channels, out_channels, pool) per conv block; pooling stops once the map is one pixel
    convs, size, in_channels = [], cfg["image_size"], cfg["in_channels"]
    for out_channels in channels:
        pool = size >= 2
        convs.append((in_channels, out_channels, pool))
        size, in_channels = (size // 2 if pool else size), out_channels
    flat = in_channels * size * size

    def make_block(index: int) -> nn.Module:
        if index < len(convs):
            return _conv_block(*convs[index][:2], cfg["batch_norm"], convs[index][2])
        if index == len(convs):
            return nn.Sequential(nn.Flatten(), nn.Linear(flat, HIDDEN), nn.ReLU())
        return nn.Linear(HIDDEN, cfg["num_classes"])

    shape = (cfg["in_channels"], cfg["image_size"], cfg["image_size"])
    return ModelSpec("cnn", cfg, len(convs) + 2, make_block, "classify", InputSpec(shape))
