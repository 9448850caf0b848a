"""A stage's memory, predicted and measured.

Predicted: `training_load` turns a job's training settings into the `partition.Load` the planner's
memory model (`partition.stage_memory_bytes`) needs; the optimizer's share is found by stepping the
optimizer once on a small parameter, so any torch.optim class is counted as it really behaves.

Measured: `PeakMemory` reports how far memory rose above where it was when the stage started:
peak RSS (VmHWM, reset through /proc/self/clear_refs) on the CPU, torch's peak allocation on CUDA.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import json
from pathlib import Path

import torch

from ravnest.partition import Load
from ravnest.pipeline.optim import build_optimizer
from ravnest.pipeline.schedule import batch_parts, prediction_order, staleness_method
from ravnest.spec import OptimizerRef, TrainingSettings

RING_COPIES = 2.0  # a ring averager keeps a snapshot and an average of its segment
# what any stage adds to a node (its computing thread's heap and stack, stream buffers, Python objects):
# the last stage of the digits MLP, 0.3 MiB of tensors, measured a median 2.3 MiB (bench.memory --small)
STAGE_BASE = 3 << 19
# Per parameter byte, what a stage holds at its peak beyond the tensors the model counts. The last stage
# of a 4-stage gpt with Adam (tests/test_big_models.py, P = 48 MiB) held 4.15 P of live tensors at a
# weight gradient, as modelled, but peaked between 220 and 266 MiB over five identical runs: up to
# 0.9 P more, the allocator's and autograd's temporaries at the moment of the peak.
TRANSIENT = 0.4
# Bytes the allocator takes per byte of activations, their gradients and backward workspace: a
# middle stage of a gpt held 34 MiB after a forward that saves 20.6 MiB (glibc's heap keeps holes
# between the forward's short-lived and saved tensors), 1.65x; whole stages measured 1.0-1.3x of a
# prediction without it, under 1.0 with it.
HEAP_SLACK = 1.5
_PROBE_SHAPE = (8, 8)


def optimizer_state_factor(ref: OptimizerRef) -> float:
    """Bytes of per-parameter optimizer state per parameter byte: SGD 0, SGD with momentum 1, Adam 2."""
    return _state_factor(ref.name, json.dumps(ref.kwargs, sort_keys=True))


@functools.lru_cache(maxsize=64)
def _state_factor(name: str, kwargs_json: str) -> float:
    param = torch.nn.Parameter(torch.zeros(_PROBE_SHAPE))
    optimizer = build_optimizer([param], OptimizerRef(name=name, kwargs=json.loads(kwargs_json)))
    param.grad = torch.ones_like(param)
    try:
        optimizer.step()
    except TypeError:  # optimizers that need a closure (LBFGS) keep history; count Adam's two moments
        return 2.0
    state = optimizer.state.get(param, {})
    held = sum(t.nelement() * t.element_size() for t in state.values()
               if torch.is_tensor(t) and t.is_floating_point() and t.dim() > 0)
    return held / (param.nelement() * param.element_size())


def training_load(training: TrainingSettings, num_stages: int, *, averaging: bool = False,
                  in_flight: int | None = None) -> Load:
    """The memory-relevant facts of a job's training on a pipeline of `num_stages` stages, with K the
    job's, else `in_flight` (the planner's, for the links' round trips), else the number of stages."""
    k = training.microbatches_in_flight or in_flight or num_stages
    method = staleness_method(training.staleness, k)
    return Load(in_flight=k, optimizer_state=optimizer_state_factor(training.optimizer),
                recompute=training.weight_stash == "recompute",
                averaging_copies=RING_COPIES if averaging else 0.0, stage_base=STAGE_BASE, transient=TRANSIENT,
                parts=batch_parts(method, k, training.batch_size, training.accumulation),
                predict=prediction_order(method),
                heap_slack=HEAP_SLACK, checkpoint_blocks=training.activation_checkpointing,
                cast_weights=0.5 if training.precision in ("bf16", "fp16") else 0.0,
                split_backward=not training.activation_checkpointing)


_STATUS = Path("/proc/self/status")


def release_free_memory() -> None:
    """Collect garbage and hand the C heap's free pages back to the OS (glibc's malloc_trim): the
    wire keeps up to 256 MiB of freed buffers for speed, which an idle volunteer should get back,
    and a job's baseline must not contain the previous job's leftovers. A no-op without glibc."""
    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """Only the malloc_trim half of `release_free_memory`: cheap enough for an idle node's every
    heartbeat (what peers' probes made the wire buffer goes back), no garbage collection."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")  # (find_library runs ldconfig: once)


def status_bytes(field: str) -> int | None:
    """A byte figure of this process from /proc/self/status (VmRSS, VmHWM), where Linux has one."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class PeakMemory:
    """Peak memory above the level at construction: the RSS high-water mark on the CPU (the whole
    process: a node runs one stage at a time), torch's peak allocation on CUDA."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            release_free_memory()
            try:  # "5" resets VmHWM to the current RSS (Linux >= 4.0)
                Path("/proc/self/clear_refs").write_text("5")
            except OSError:
                pass
            self._base = status_bytes("VmRSS") or 0

    def peak_bytes(self) -> int | None:
        """Bytes above the starting level at the peak so far; None where it cannot be measured."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self._base
        peak = status_bytes("VmHWM")
        return None if peak is None else max(0, peak - self._base)
