"""Starting weights (fine-tuning): a stage copies its own tensors, and only those, out of a
safetensors file its node offers. safetensors keeps each tensor at a known offset, so a stage of a
70 GB checkpoint reads its slice, never the file.

Two namings are understood:
- a `ravnest download` (its metadata names the model): the keys are Ravnest's, "{block}.{name}";
- a Hugging Face `LlamaForCausalLM` checkpoint (model.safetensors) for a `llama` job: Llama's names,
  mapped by `hf.hf_key` (`model.layers.2.mlp.up_proj.weight` is block 3's `mlp.up_proj.weight`).

Every way a file can fail to fit the job (another architecture, a missing tensor, another shape) is a
ModelError naming the first tensor that does not fit; tensors of another dtype are converted to the
stage's (a bf16 checkpoint trains with float32 master weights).
"""
from __future__ import annotations

import json
import os
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from .hf import hf_key
from .registry import ModelError, ModelSpec


def load_starting_weights(module: nn.Module, spec: ModelSpec, path: str | os.PathLike, label: str) -> None:
    """Copy the tensors of `module` (a stage's blocks, keys "{block}.{name}") from the file at `path`."""
    try:
        with safe_open(os.fspath(path), "pt") as handle:
            names = set(handle.keys())
            name_of = _naming(spec, names, handle.metadata() or {}, label)
            own = module.state_dict()
            tied = {second for _, second in spec.tied}
            for key, target in own.items():
                name = name_of(key)
                if name not in names and key in tied:  # (one tensor: Hugging Face saves a tied head once)
                    continue
                if name not in names:
                    raise ModelError(f"{label} has no tensor {name!r}: it is not the weights of this job's "
                                     f"{spec.name} model ({key} in Ravnest's names)")
                shape = tuple(handle.get_slice(name).get_shape())
                if shape != tuple(target.shape):
                    raise ModelError(f"{label}: tensor {name!r} is {list(shape)}, this job's model has "
                                     f"{list(target.shape)} there: its config does not match the checkpoint's")
                with torch.no_grad():  # one tensor at a time: the slice, never the file, is in memory
                    target.copy_(handle.get_tensor(name))
    except SafetensorError as e:
        raise ModelError(f"{label} is not a readable safetensors file: {e}") from None


def _naming(spec: ModelSpec, names: set[str], metadata: dict[str, str], label: str) -> Callable[[str], str]:
    """How the file names a Ravnest key."""
    if "model" in metadata:  # a `ravnest download`
        saved = json.loads(metadata["model"]).get("name")
        if saved != spec.name:
            raise ModelError(f"{label} holds a {saved!r} model; this job trains a {spec.name!r}")
        return lambda key: key
    if spec.name == "llama" and any(name.startswith("model.") for name in names):
        if spec.config.get("residual_rank"):
            raise ModelError(f"{label} is a Hugging Face Llama, whose layers write into all of the residual "
                             f"stream: a model with residual_rank cannot start from it (set residual_rank 0)")
        layers = spec.config["num_hidden_layers"]
        return lambda key: hf_key(key, layers)
    raise ModelError(f"{label} is neither a `ravnest download` nor a Hugging Face Llama checkpoint for this "
                     f"{spec.name!r} model")
