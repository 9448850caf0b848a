"""A stage's state in and out: its blocks' parameters and buffers, and its optimizer's per-parameter
state, as safetensors (no pickle). Model keys are "{global block index}.<name>"; optimizer keys are
"{parameter key}:{state name}", so every cluster names the same tensor alike."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ravnest.pipeline.optim import StageOptimizer


def live_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The live parameters and floating buffers (same keys); writing them changes the model."""
    tensors = {k: p.detach() for k, p in module.named_parameters()}
    tensors.update((k, b) for k, b in module.named_buffers() if b.is_floating_point())
    return tensors


def optimizer_state(module: nn.Module, optimizer: StageOptimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the optimizer's per-parameter state, keyed "{parameter key}:{state name}"."""
    inner = optimizer.optimizer
    if inner is None:
        return {}
    return {f"{key}:{name}": value for key, param in module.named_parameters()
            for name, value in sorted(inner.state.get(param, {}).items()) if torch.is_tensor(value)}


def optimizer_tensors(module: nn.Module, optimizer: StageOptimizer) -> dict[str, torch.Tensor]:
    """The optimizer's live per-parameter floating state (e.g. Adam's exp_avg, exp_avg_sq); empty
    before the first step. Only tensors shaped like their parameter: scalars such as Adam's `step`
    stay local."""
    params = dict(module.named_parameters())
    return {key: value for key, value in optimizer_state(module, optimizer).items()
            if value.is_floating_point() and value.shape == params[key.split(":", 1)[0]].shape}


def _on_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # on the CPU the live tensors are written in place, without a second copy of the stage in memory
    return {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}


def save_weights(module: nn.Module, path: str | Path, metadata: dict[str, str] | None = None) -> None:
    save_file(_on_cpu(module.state_dict()), str(path), metadata=metadata)


def save_state(module: nn.Module, optimizer: StageOptimizer, path: str | Path) -> int:
    """Weights and optimizer state, to continue from later; returns the step it holds. Call between
    steps (the worker thread)."""
    state = _on_cpu({**module.state_dict(), **optimizer_state(module, optimizer)})
    step = optimizer.steps
    save_file(state, str(path), metadata={"step": str(step)})
    return step


def load_state(module: nn.Module, optimizer: StageOptimizer, path: str | Path, step: int,
               device: torch.device) -> None:
    """The inverse of `save_state`: this stage's blocks exactly, their optimizer state if any."""
    state = load_file(str(path), device=str(device))
    module.load_state_dict({k: v for k, v in state.items() if ":" not in k}, strict=True)  # names any odd key
    params = dict(module.named_parameters())
    by_param: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
    # Adam and friends keep `step` on the CPU unless fused or capturable
    defaults = optimizer.optimizer.defaults if optimizer.optimizer is not None else {}
    scalars_on_cpu = not (defaults.get("fused") or defaults.get("capturable"))
    for key, value in state.items():
        if ":" in key:
            name, entry = key.split(":", 1)
            if name not in params:
                raise ValueError(f"optimizer state for {name}, which is not a parameter of this stage")
            by_param.setdefault(params[name], {})[entry] = value.cpu() if value.dim() == 0 and scalars_on_cpu \
                else value
    optimizer.resume(step, by_param)
