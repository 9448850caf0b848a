"""The precision a stage computes in (`training.precision`), and fp16's loss scaling.

bf16 and fp16 run a stage's forward under autocast: matmuls and their activations in 16 bits,
while the weights, their gradients and the optimizer's state stay float32, and what leaves the
stage (activations forward, gradients back) is float32.

fp16 has bf16's speed but 5 exponent bits: gradients below 6e-8 flush to zero. So each stage
scales the gradient it backpropagates by S before its fp16 ops and divides what comes out (its
weights' gradients, its input's gradient) by S in float32. The scale is the stage's own: the
boundary gradients are float32 and unscaled, so stages never agree on a scale, and no message or
barrier is needed for it (a single-process GradScaler keeps one for the whole model). Dynamic, as
GradScaler's: a micro-batch whose gradients overflow (inf or NaN) is dropped from its stage's
update, sends a zero gradient upstream, and halves S; every `GROWTH_INTERVAL` good micro-batches
double it.

    S = 65536, micro-batch 7 overflows  ->  its gradients are dropped, S = 32768
    2000 good micro-batches later         ->  S = 65536
"""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Callable, ContextManager

import torch

from ravnest.wire import codecs

log = logging.getLogger(__name__)
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
FORCE_ENV = "RAVNEST_PRECISION_ANYWAY"  # "1": compute in bf16/fp16 even where it is emulated (to measure it)
INITIAL_SCALE, GROWTH_INTERVAL = 2.0**16, 2000
# what crosses the wire when the job names no codec: bf16's activations and gradients in bf16 (its
# range is float32's); fp16's stay float32, as its boundary gradients are unscaled and would underflow
WIRE_CODEC = {"bf16": "bf16"}


def wire_codec(asked: str, precision: str) -> str:
    """The pipeline codec of a link whose job asked for `asked`: the precision's default where it named
    none, or left the choice to a planner that did not make one ("auto" run outside the coordinator)."""
    return WIRE_CODEC.get(precision, "") if asked in ("", codecs.AUTO) else asked


def usable_precision(asked: str, device: torch.device) -> str:
    """The precision a stage computes in: bf16 or fp16 only where the hardware has that arithmetic (a
    GPU that supports it; a CPU with AVX512-BF16/AMX, or AVX512-FP16). On a CPU without it, autocast
    emulates it and a llama layer ran 8x slower than in float32 (measured on this project's AVX2
    machine), so the stage computes in float32 and says so. RAVNEST_PRECISION_ANYWAY=1 forces it."""
    if asked not in HALF or os.environ.get(FORCE_ENV) == "1":
        return asked
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported() if asked == "bf16" else True  # fp16: every CUDA GPU in use
    else:
        try:
            flags = Path("/proc/cpuinfo").read_text()
        except OSError:
            flags = ""
        wanted = (" avx512_bf16", " amx_bf16") if asked == "bf16" else (" avx512_fp16", " amx_fp16")
        native = any(flag in flags for flag in wanted)
    if not native:
        log.warning("training.precision is %s, but this %s has no %s arithmetic: computing in float32 (emulated, "
                    "it is several times slower)", asked, "GPU" if device.type == "cuda" else "CPU", asked)
        return "fp32"
    return asked


def autocast_for(precision: str, device: torch.device) -> Callable[[], ContextManager]:
    """A context factory: autocast to the precision's 16-bit type, or nothing for fp32."""
    if precision not in HALF:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=HALF[precision])


def wide(output: torch.Tensor) -> torch.Tensor:
    """A stage's output in float32 (from 16 bits under autocast): the next stage and the loss take it."""
    return output.float() if output.dtype in (torch.bfloat16, torch.float16) else output


class LossScale:
    """One stage's dynamic fp16 gradient scale (the module docstring)."""

    def __init__(self, scale: float = INITIAL_SCALE, growth_interval: int = GROWTH_INTERVAL):
        self.scale, self.growth_interval = scale, growth_interval
        self.good = 0        # micro-batches since the last overflow or growth
        self.overflows = 0   # micro-batches dropped, in all

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale, self.good = max(self.scale / 2, 1.0), 0
            self.overflows += 1
            log.info("fp16 gradients overflowed: the micro-batch is dropped, the loss scale is now %g", self.scale)
            return
        self.good += 1
        if self.good >= self.growth_interval:
            self.scale, self.good = self.scale * 2, 0


def all_finite(tensors: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)
