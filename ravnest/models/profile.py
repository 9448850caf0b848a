"""Per-block cost profiles: parameters, FLOPs, activation shapes and bytes and, optionally, timings.

The planner partitions blocks over nodes and predicts each stage's memory from these numbers. They
come from running every block once on the meta device, so profiling a 10 B-parameter model
allocates nothing: shapes, FLOPs (counted per op from shapes) and what autograd saves for backward
are all known without data.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from .registry import ModelSpec


@dataclass
class BlockCost:
    params: int            # number of parameters
    param_bytes: int       # parameters + floating-point buffers, in bytes
    flops: float           # forward FLOPs for one micro-batch; backward is about 2x
    activation_bytes: int  # bytes of this block's output for one micro-batch (crosses a stage boundary)
    saved_bytes: int = 0   # bytes autograd keeps from forward to backward for one micro-batch (not weights)
    owner_output_bytes: int = 0  # outputs of the modules owning parameters: their gradients wait from B to W
    kernel_bytes: int = 0  # state its kernels keep per computing thread, paid once per stage (see KERNEL_BYTES)
    feed_bytes: int = 0    # block 0 only: what the job's data feed keeps in memory (set by the coordinator)
    output_shape: tuple[int, ...] = ()  # for one micro-batch, batch dimension first
    output_dtype: str = "float32"
    forward_seconds: float | None = None   # measured on the local device when measure=True
    backward_seconds: float | None = None


# A kernel's first use in a node's process sets up its library's state (oneDNN's for convolutions, the
# BLAS's for matrix products), which later jobs reuse: a digits CNN stage measured 8.6-11.8 MiB above
# idle on a CPU node, of 3.1 MiB for its tensors; a digits MLP stage, 0.3 MiB of tensors, measured
# 5.5-6.1 MiB on a node's first job and 2-3.5 MiB on later ones (bench.memory --small). A stage pays
# the largest of its blocks' (`kernel_bytes`): the prediction is a bound for a node's first job.
KERNEL_BYTES = {nn.modules.conv._ConvNd: 5 << 20, nn.Linear: 3 << 20}


def kernel_bytes(block: nn.Module) -> int:
    return max((size for kind, size in KERNEL_BYTES.items() for m in block.modules() if isinstance(m, kind)), default=0)


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.nelement() * tensor.element_size()


def input_bytes(spec: ModelSpec, batch_size: int) -> int:
    """Bytes of one micro-batch of model input (what block 0 receives)."""
    return tensor_bytes(spec.example_input(batch_size, device="meta"))


def _state_bytes(block: nn.Module) -> int:
    buffers = (b for b in block.buffers() if b.is_floating_point())
    return sum(tensor_bytes(t) for t in [*block.parameters(), *buffers])


def _cpu_attention_flops(query_shape: torch.Size, key_shape: torch.Size, value_shape: torch.Size,
                         *args: object, **kwargs: object) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


# FlopCounterMode knows the CUDA attention kernels but not the CPU one scaled_dot_product_attention
# dispatches to; count it the same way so profiles agree across devices.
_EXTRA_FLOP_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops}


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata  # one StorageImpl per allocation, meta tensors included


def _trace(block: nn.Module, x: torch.Tensor) -> tuple[float, int, int, torch.Tensor]:
    """Forward FLOPs, bytes saved for backward (each storage once, weights excluded), bytes output by
    the modules that own parameters (what a split backward holds gradients of) and the output, for a
    block on the meta device in training mode."""
    weights = {_storage_key(t) for t in [*block.parameters(), *block.buffers()]}
    saved: dict[int, int] = {}
    owner_outputs: list[int] = []

    def count(module: nn.Module, args: object, output: object) -> None:
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        owner_outputs.extend(tensor_bytes(t) for t in outputs if torch.is_tensor(t) and t.requires_grad)

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in weights:
            saved[key] = tensor.untyped_storage().nbytes()
        return tensor

    x = x.detach().requires_grad_(x.is_floating_point())  # a pipeline stage sends the input gradient back
    counter = FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOP_FORMULAS)
    hooks = [m.register_forward_hook(count) for m in block.modules() if any(True for _ in m.parameters(recurse=False))]
    try:
        with counter, torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            out = block(x)
    finally:
        for hook in hooks:
            hook.remove()
    return float(counter.get_total_flops()), sum(saved.values()), sum(owner_outputs), out.detach()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_block(block: nn.Module, x: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Median forward and backward seconds of `block` on `x` (both on the same device)."""
    device = x.device
    if x.is_floating_point():
        x.requires_grad_(True)  # a pipeline stage also sends the input gradient back
    forward_times, backward_times = [], []
    for attempt in range(repeats + 1):  # the first run warms up kernels and allocators
        _synchronize(device)
        start = time.perf_counter()
        out = block(x)
        _synchronize(device)
        middle = time.perf_counter()
        if out.requires_grad:
            out.backward(torch.ones_like(out))
        _synchronize(device)
        end = time.perf_counter()
        block.zero_grad(set_to_none=True)
        x.grad = None
        if attempt:
            forward_times.append(middle - start)
            backward_times.append(end - middle)
    return statistics.median(forward_times), statistics.median(backward_times)


def profile_blocks(spec: ModelSpec, batch_size: int, *, measure: bool = False,
                   device: str | torch.device = "cpu", repeats: int = 3) -> list[BlockCost]:
    """Cost of every block of `spec` for micro-batches of `batch_size`, in block order. Shapes,
    FLOPs and bytes come from the meta device; `measure=True` also times each block on `device`
    (built there one at a time, with random weights)."""
    if batch_size < 1 or repeats < 1:
        raise ValueError("batch_size and repeats must be >= 1")
    device = torch.device(device)
    costs = []
    x = spec.example_input(batch_size, device="meta")
    for index in range(spec.num_blocks):
        block = spec.block(index, device="meta")
        flops, saved, owner_outputs, out = _trace(block, x)
        cost = BlockCost(params=sum(p.numel() for p in block.parameters()), param_bytes=_state_bytes(block),
                         flops=flops, activation_bytes=tensor_bytes(out), saved_bytes=saved,
                         owner_output_bytes=owner_outputs, kernel_bytes=kernel_bytes(block),
                         output_shape=tuple(out.shape), output_dtype=str(out.dtype).removeprefix("torch."))
        if measure:
            real_input = (spec.example_input(batch_size, device) if index == 0
                          else torch.rand(x.shape, device=device).to(x.dtype))
            cost.forward_seconds, cost.backward_seconds = _time_block(
                spec.block(index, device=device), real_input, repeats)
        costs.append(cost)
        x = out
    return costs


def stage_input(costs: list[BlockCost], start: int) -> tuple[list[int] | None, str]:
    """(shape, dtype) of what a stage starting at block `start` receives for one micro-batch: the
    previous block's output; (None, "float32") for stage 0, which reads data."""
    if start == 0:
        return None, "float32"
    return list(costs[start - 1].output_shape), costs[start - 1].output_dtype


def state_shapes(spec: ModelSpec) -> dict[str, tuple[tuple[int, ...], int]]:
    """Every key of the whole model's state dict -> (shape, bytes), from the meta device."""
    state = spec.blocks(device="meta").state_dict()
    return {key: (tuple(t.shape), tensor_bytes(t)) for key, t in state.items()}
