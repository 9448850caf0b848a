"""The files the coordinator keeps for each job under `<data dir>/jobs/<job id>/`: uploaded stage
weights, checkpoints, their manifest and the merged model.

Every file is written whole or not at all: written to a temporary file in the same folder, flushed to
disk (fsync), then renamed over its name, and the folder is synced so the rename itself survives a
crash. A reader therefore sees the previous version or the new one, never a torn file. Every upload is
checked against the model's shapes before it is kept; nothing here unpickles.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .errors import InvalidRequest

Shapes = dict[str, tuple[tuple[int, ...], int]]  # state-dict key -> (shape, bytes)
OPTIMIZER_SEPARATOR = ":"  # "{parameter key}:{state name}", e.g. "3.weight:exp_avg"


def block_of(key: str) -> int:
    """The global block index a state-dict key belongs to ("3.weight" and "3.weight:exp_avg" -> 3)."""
    return int(key.split(".", 1)[0])


def commit(source: Path, target: Path) -> None:
    """Move a finished temporary file onto `target` atomically and durably (same file system)."""
    with source.open("rb+") as handle:
        os.fsync(handle.fileno())
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(source, target)
    _sync_folder(target.parent)


def write_json(target: Path, data: Any) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    with os.fdopen(handle, "w") as out:
        json.dump(data, out, indent=1)
    commit(Path(name), target)


def save_tensors(tensors: dict[str, torch.Tensor], target: Path, metadata: dict[str, str] | None = None) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    os.close(handle)
    save_file(tensors, name, metadata=metadata)
    commit(Path(name), target)


def load_upload(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise InvalidRequest(f"not a valid safetensors file: {e}") from e


def check_stage_tensors(tensors: dict[str, torch.Tensor], expected: Shapes, *, optimizer_state: bool) -> None:
    """`tensors` must hold exactly the stage's state-dict keys with their shapes and dtype class;
    with `optimizer_state` also any "{parameter key}:{name}" entries, shaped like their parameter
    or scalar (e.g. Adam's step)."""
    state = {k: v for k, v in tensors.items() if OPTIMIZER_SEPARATOR not in k}
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    optimizer = {k: v for k, v in tensors.items() if OPTIMIZER_SEPARATOR in k}
    if not optimizer_state:
        extra += sorted(optimizer)
    else:
        extra += sorted(k for k in optimizer if k.split(OPTIMIZER_SEPARATOR, 1)[0] not in expected)
    if missing or extra:
        raise InvalidRequest(f"weights must hold exactly this stage's blocks; missing {missing[:5]}, "
                             f"unexpected {extra[:5]}")
    wrong = [key for key, tensor in state.items() if tuple(tensor.shape) != expected[key][0]]
    if wrong:
        raise InvalidRequest(f"wrong shapes for {wrong[:5]}, e.g. {wrong[0]}: {tuple(tensors[wrong[0]].shape)} "
                             f"instead of {expected[wrong[0]][0]}")
    # a float64 upload for a float32 model would turn the merged model into float64
    widths = [key for key, tensor in state.items() if tensor.numel() and tensor.numel() * tensor.element_size()
              != expected[key][1]]
    if widths:
        key = widths[0]
        dtype = str(tensors[key].dtype).removeprefix("torch.")
        raise InvalidRequest(f"wrong dtype for {widths[:5]}, e.g. {key}: {dtype} ({tensors[key].element_size()} "
                             f"bytes per element) where the model holds {expected[key][1] // tensors[key].numel()}")
    odd = [key for key, tensor in optimizer.items()
           if tensor.numel() > 1 and tuple(tensor.shape) != expected[key.split(OPTIMIZER_SEPARATOR, 1)[0]][0]]
    if odd:
        raise InvalidRequest(f"optimizer state {odd[:5]} is neither scalar nor shaped like its parameter")
    bad = [key for key, tensor in tensors.items() if tensor.is_floating_point()
           and not bool(torch.isfinite(tensor).all())]
    if bad:
        raise InvalidRequest(f"tensors {bad[:5]} hold NaN or infinite values")


def rms(tensor: torch.Tensor) -> float:
    """Root mean square, summed in float64 (3e38 squared overflows float32)."""
    if not tensor.numel():
        return 0.0
    return float(torch.linalg.vector_norm(tensor, dtype=torch.float64)) / math.sqrt(tensor.numel())


def implausible(tensors: dict[str, torch.Tensor], initial_rms: dict[str, float], bound: float) -> str | None:
    """Why weights handed in as trained cannot be, or None: a tensor whose RMS is above `bound` times
    its initial RMS (at least 1). Training does not grow weights that much without diverging first."""
    for key, tensor in tensors.items():
        if key in initial_rms and (value := rms(tensor)) > bound * max(1.0, initial_rms[key]):
            return (f"{key} has an RMS of {value:.3g}, more than {bound:g} times what it started at "
                    f"({initial_rms[key]:.3g}, counted as at least 1)")
    return None


def merge(files: list[Path], target: Path, metadata: dict[str, str]) -> None:
    merged: dict[str, torch.Tensor] = {}
    for file in files:
        merged.update(load_file(file))
    save_tensors(merged, target, metadata)


def assemble(job_dir: Path, sources: list[dict[str, Any]], blocks: tuple[int, int], target: Path) -> None:
    """One stage's state for blocks [start, end) from the resume sources (each a checkpoint file and
    the block range taken from it), read tensor by tensor: nothing outside the range is loaded."""
    start, end = blocks
    tensors: dict[str, torch.Tensor] = {}
    for source in sources:
        lo, hi = max(start, source["blocks"][0]), min(end, source["blocks"][1])
        if lo >= hi:
            continue
        with safe_open(job_dir / source["file"], framework="pt") as stored:
            for key in stored.keys():
                if lo <= block_of(key) < hi:
                    tensors[key] = stored.get_tensor(key)
    save_tensors(tensors, target)


def _sync_folder(folder: Path) -> None:
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)
