"""What a stage's throughput means in the field's units: tokens per second, and the model FLOPs it
does per second against its hardware's peak (model FLOPs utilization, MFU, as in PaLM's paper).

Model FLOPs are the training FLOPs of the stage's blocks: forward + backward = 3 x the forward's,
counted on the meta device for one sample of the job's sequence length (`profile_blocks`);
recomputation (activation checkpointing, weight_stash "recompute") does not count, as MFU defines.
The peak is the GPU's dense 16-bit tensor-core figure from its datasheet (fp32 jobs report no MFU:
their peak depends on TF32 settings), or RAVNEST_PEAK_FLOPS where the table does not know the GPU.

    a stage of 2 llama layers, 40 MFLOP per sample forward, at 500 samples/s:
    model FLOP/s = 3 x 40e6 x 500 = 6e10;  on an L4 (121 TFLOP/s bf16): MFU = 0.0005
"""
from __future__ import annotations

import dataclasses
import os

import torch

from ravnest.models import InputSpec, ModelSpec, profile_blocks

PEAK_ENV = "RAVNEST_PEAK_FLOPS"
# dense bf16/fp16 tensor FLOP/s by a substring of torch.cuda.get_device_name (first match wins)
PEAK_16BIT = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12), ("L40S", 362e12),
              ("L40", 181e12), ("L4", 121e12), ("A10", 125e12), ("RTX 4090", 165e12), ("RTX 3090", 71e12),
              ("V100", 125e12), ("T4", 65e12))


def training_flops_per_sample(spec: ModelSpec, start: int, end: int, tokens: int | None = None) -> float:
    """Model FLOPs of training blocks [start, end) on one sample; `tokens`: a language model's
    sequence length when it is not the model's longest."""
    if tokens is not None and spec.input.shape and tokens != spec.input.shape[0]:
        spec = dataclasses.replace(spec, input=InputSpec((tokens,), spec.input.dtype, spec.input.high))
    return 3 * sum(cost.flops for cost in profile_blocks(spec, 1, fake=False)[start:end])


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The device's peak for `precision`, where known (see the module docstring)."""
    if (given := os.environ.get(PEAK_ENV)) is not None:
        return float(given)
    if device.type != "cuda" or precision == "fp32":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_16BIT if key in name), None)


def figures(samples_per_s: float, flops_per_sample: float, tokens_per_sample: int | None,
            peak: float | None) -> dict[str, float]:
    """The stage's tokens_per_s (language models), model_flops_per_s and mfu (where the peak is known)."""
    done = samples_per_s * flops_per_sample
    return {"model_flops_per_s": done,
            **({"tokens_per_s": samples_per_s * tokens_per_sample} if tokens_per_sample else {}),
            **({"mfu": done / peak} if peak else {})}
