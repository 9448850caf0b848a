"""Per-block cost profiles: parameters, FLOPs, activation shapes and bytes and, optionally, timings.

The planner partitions blocks over nodes and predicts each stage's memory from these numbers. They
come from running every block once on fake CPU tensors (torch's FakeTensorMode: shapes and dtypes, no
storage), so profiling a 10 B-parameter model allocates nothing: shapes, FLOPs (counted per op from
shapes) and what autograd saves for backward are all known without data. Fake CPU tensors dispatch as
a CPU node's do, where the meta device does not: a llama layer's attention (seq_len 256) saves 18 MiB
less on a CPU than on meta, whose attention is the reference one that keeps its whole score matrix.
Under bf16 or fp16 the blocks run under autocast, as a stage does (a llama layer saved 28 MiB there
against 40 in float32). A block that fake tensors cannot run is traced on the meta device instead.
"""
from __future__ import annotations

import contextlib
import copy
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
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
# BLAS's for matrix products), which later jobs reuse: the digits CNN's stages measured 10.4-13.7 MiB
# above idle on CPU nodes (first stage, its one-channel convolution: 12.8-13.7), of 3.1 MiB for their
# tensors; a digits MLP stage, 0.3 MiB of tensors, 7.4-8.2 MiB on a node's first job and 2-3.5 MiB on
# later ones (bench.memory --small, once nodes stopped probing as they start a stage). A stage pays the
# largest of its blocks' (`kernel_bytes`): the prediction is a bound for a node's first job.
# An embedding lookup's backward (index and scatter kernels no warm-up runs): a llama stage holding
# the embedding alone measured 18.8 MiB above idle where 10.8 were predicted without it.
KERNEL_BYTES = {nn.modules.conv._ConvNd: 25 << 18, nn.Linear: 9 << 19, nn.Embedding: 8 << 20}


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


def _trace_as_a_cpu_node(block: nn.Module, x: torch.Tensor, half: torch.dtype | None
                         ) -> tuple[float, int, int, torch.Tensor]:
    """`_trace` of a meta `block` on a meta input `x`, run on fake CPU tensors under autocast to `half`
    (where not None); the output, as a stage sends it (float32), back on the meta device."""
    faked = copy.deepcopy(block)  # the meta block stays as it was, for the fallback
    try:
        with FakeTensorMode():
            for module in faked.modules():
                for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
                    if tensor is not None:
                        on_cpu = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
                        if isinstance(tensor, nn.Parameter):
                            module._parameters[name] = nn.Parameter(on_cpu, tensor.requires_grad)
                        else:
                            module._buffers[name] = on_cpu
            computing = torch.autocast("cpu", dtype=half) if half else contextlib.nullcontext()
            with computing:
                flops, saved, owner_outputs, out = _trace(faked, torch.empty(x.shape, dtype=x.dtype, device="cpu"))
    except Exception:  # noqa: BLE001 - an op fake tensors cannot run (a plug-in's own kernel): meta's figures
        return _trace(block, x)
    widened = torch.float32 if out.dtype in HALF.values() else out.dtype
    return flops, saved, owner_outputs, torch.empty(out.shape, dtype=widened, device="meta")


def _trace(block: nn.Module, x: torch.Tensor) -> tuple[float, int, int, torch.Tensor]:
    """Forward FLOPs, bytes saved for backward (each storage once, weights excluded), bytes output by
    the modules that own parameters (what a split backward holds gradients of) and the output, for a
    block in training mode."""
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


HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}  # training.precision: what autocast computes in


def profile_blocks(spec: ModelSpec, batch_size: int, *, precision: str = "fp32", measure: bool = False,
                   device: str | torch.device = "cpu", repeats: int = 3, fake: bool = True) -> list[BlockCost]:
    """Cost of every block of `spec` for micro-batches of `batch_size` computed in `precision`, in
    block order. Shapes, FLOPs and bytes come from fake CPU tensors (see the module docstring), or
    with `fake=False` from the meta device alone: the same FLOPs and shapes, saved bytes an estimate,
    and none of the megabytes fake tensors' machinery takes in the process (a training node counting
    its FLOPs). `measure=True` also times each block on `device` (built there one at a time, with
    random weights)."""
    if batch_size < 1 or repeats < 1:
        raise ValueError("batch_size and repeats must be >= 1")
    device = torch.device(device)
    costs = []
    x = spec.example_input(batch_size, device="meta")
    for index in range(spec.num_blocks):
        block = spec.block(index, device="meta")
        flops, saved, owner_outputs, out = (_trace_as_a_cpu_node(block, x, HALF.get(precision)) if fake
                                            else _trace(block, x))
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
