"""Per-block cost profiles: parameters, FLOPs, boundary activation sizes and, optionally, timings.

The planner partitions blocks over nodes from these numbers, so they are computed by running each
block once on a real example micro-batch (the output of the previous block).
"""
from __future__ import annotations

import copy
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
    forward_seconds: float | None = None   # measured on the local device when measure=True
    backward_seconds: float | None = None


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.nelement() * tensor.element_size()


def input_bytes(spec: ModelSpec, batch_size: int) -> int:
    """Bytes of one micro-batch of model input (what block 0 receives)."""
    return tensor_bytes(spec.example_input(batch_size))


def _state_bytes(block: nn.Module) -> int:
    buffers = (b for b in block.buffers() if b.is_floating_point())
    return sum(tensor_bytes(t) for t in [*block.parameters(), *buffers])


def _cpu_attention_flops(query_shape: torch.Size, key_shape: torch.Size, value_shape: torch.Size,
                         *args: object, **kwargs: object) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


# FlopCounterMode knows the CUDA attention kernels but not the CPU one scaled_dot_product_attention
# dispatches to; count it the same way so profiles agree across devices.
_EXTRA_FLOP_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops}


def _count_flops(block: nn.Module, x: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Forward FLOPs and output, leaving the block's buffers (e.g. BatchNorm statistics) untouched."""
    saved = {name: buf.clone() for name, buf in block.named_buffers()}
    counter = FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOP_FORMULAS)
    with torch.no_grad(), counter:
        out = block(x)
    with torch.no_grad():
        for name, buf in block.named_buffers():
            buf.copy_(saved[name])
    return float(counter.get_total_flops()), out


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_block(block: nn.Module, x: torch.Tensor, device: torch.device, repeats: int) -> tuple[float, float]:
    """Median forward and backward seconds of a copy of `block` on `device` (the original is not moved)."""
    local = copy.deepcopy(block).to(device)
    x = x.detach().to(device)
    if x.is_floating_point():
        x.requires_grad_(True)  # a pipeline stage also sends the input gradient back
    forward_times, backward_times = [], []
    for attempt in range(repeats + 1):  # the first run warms up kernels and allocators
        _synchronize(device)
        start = time.perf_counter()
        out = local(x)
        _synchronize(device)
        middle = time.perf_counter()
        if out.requires_grad:
            out.backward(torch.ones_like(out))
        _synchronize(device)
        end = time.perf_counter()
        local.zero_grad(set_to_none=True)
        x.grad = None
        if attempt:
            forward_times.append(middle - start)
            backward_times.append(end - middle)
    return statistics.median(forward_times), statistics.median(backward_times)


def profile_blocks(spec: ModelSpec, batch_size: int, *, measure: bool = False,
                   device: str | torch.device = "cpu", repeats: int = 3) -> list[BlockCost]:
    """Cost of every block of `spec` for micro-batches of `batch_size`, in block order."""
    if batch_size < 1 or repeats < 1:
        raise ValueError("batch_size and repeats must be >= 1")
    device = torch.device(device)
    costs = []
    x = spec.example_input(batch_size)
    for block in spec.blocks:
        flops, out = _count_flops(block, x)
        cost = BlockCost(params=sum(p.numel() for p in block.parameters()), param_bytes=_state_bytes(block),
                         flops=flops, activation_bytes=tensor_bytes(out))
        if measure:
            cost.forward_seconds, cost.backward_seconds = _time_block(block, x, device, repeats)
        costs.append(cost)
        x = out
    return costs
