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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ravnest.models.subspace import Subspace

from .service_errors import InvalidRequest

Shapes = dict[str, tuple[tuple[int, ...], int]]  # state-dict key -> (shape, bytes)
MAX_HEADER = 100 << 20  # a safetensors header larger than this is not one of ours
COPY_CHUNK = 1 << 20
TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool}  # safetensors' names
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
    write_text(target, json.dumps(data, indent=1))


def write_text(target: Path, text: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    with os.fdopen(handle, "w") as out:
        out.write(text)
    commit(Path(name), target)


def save_tensors(tensors: dict[str, torch.Tensor], target: Path, metadata: dict[str, str] | None = None) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    os.close(handle)
    save_file(tensors, name, metadata=metadata)
    commit(Path(name), target)


@dataclass(frozen=True)
class Stored:
    """One tensor of a safetensors file, from its header: what it is and where its bytes are."""
    dtype: str  # safetensors' name: F32, BF16, I64, ...
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def index(path: Path) -> tuple[dict[str, Stored], dict[str, str]]:
    """The tensors of a safetensors file and its metadata, from its header alone: nothing is loaded."""
    try:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= MAX_HEADER or size + 8 > path.stat().st_size:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
        metadata = header.pop("__metadata__", None) or {}
        base = 8 + size
        tensors = {key: Stored(str(v["dtype"]), tuple(int(d) for d in v["shape"]), base + int(v["data_offsets"][0]),
                               base + int(v["data_offsets"][1])) for key, v in header.items()}
        with safe_open(str(path), "pt"):  # the library's own checks: offsets, sizes, dtypes
            pass
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidRequest(f"not a valid safetensors file: {e}") from e
    return tensors, metadata


def each_tensor(path: Path, tensors: dict[str, Stored] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The file's tensors (its `index`, read here unless given) one at a time, read (not memory-mapped:
    a map's pages count as the process's until it closes): a stage's state is never in the
    coordinator's memory whole."""
    if tensors is None:
        tensors, _ = index(path)
    with path.open("rb") as f:
        for key, stored in tensors.items():
            f.seek(stored.start)
            raw = bytearray(stored.end - stored.start)
            if f.readinto(raw) != len(raw):  # (into one buffer: read() then bytearray() would hold two)
                raise InvalidRequest(f"{path.name} ends inside tensor {key}")
            dtype = TORCH_DTYPES.get(stored.dtype)
            if dtype is None:
                raise InvalidRequest(f"tensor {key} has dtype {stored.dtype}, which a model's state never holds")
            tensor = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
            yield key, tensor.reshape(stored.shape)


def scan(path: Path, tensors: dict[str, Stored]) -> dict[str, float]:
    """Each floating tensor (of the file's `index`) with its RMS, read one tensor at a time;
    InvalidRequest if one is not finite."""
    scales, bad = {}, []
    for key, tensor in each_tensor(path, tensors):
        if tensor.is_floating_point():
            scales[key] = rms(tensor)
            if not math.isfinite(scales[key]):  # (float64 squares of any finite float32 are finite)
                bad.append(key)
    if bad:
        raise InvalidRequest(f"tensors {bad[:5]} hold NaN or infinite values")
    return scales


def check_stage_tensors(tensors: dict[str, Stored], expected: Shapes, *, optimizer_state: bool) -> None:
    """An upload (its `index`) must hold exactly the stage's state-dict keys with their shapes and
    dtype width; with `optimizer_state` also any "{parameter key}:{name}" entries, shaped like their
    parameter or scalar (e.g. Adam's step)."""
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
    wrong = [key for key, stored in state.items() if stored.shape != expected[key][0]]
    if wrong:
        raise InvalidRequest(f"wrong shapes for {wrong[:5]}, e.g. {wrong[0]}: {state[wrong[0]].shape} "
                             f"instead of {expected[wrong[0]][0]}")
    # a float64 upload for a float32 model would turn the merged model into float64
    widths = [key for key, stored in state.items() if stored.end > stored.start
              and stored.end - stored.start != expected[key][1]]
    if widths:
        key = widths[0]
        numel = math.prod(state[key].shape)
        dtype = str(TORCH_DTYPES.get(state[key].dtype, state[key].dtype)).removeprefix("torch.")
        raise InvalidRequest(f"wrong dtype for {widths[:5]}, e.g. {key}: {dtype} "
                             f"({(state[key].end - state[key].start) // numel} bytes per element) where the model "
                             f"holds {expected[key][1] // numel}")
    odd = [key for key, stored in optimizer.items()
           if math.prod(stored.shape) > 1 and stored.shape != expected[key.split(OPTIMIZER_SEPARATOR, 1)[0]][0]]
    if odd:
        raise InvalidRequest(f"optimizer state {odd[:5]} is neither scalar nor shaped like its parameter")


def rms(tensor: torch.Tensor, chunk: int = 1 << 20) -> float:
    """Root mean square, summed in float64 (3e38 squared overflows float32) a million elements at a
    time (a float64 copy of the whole tensor would double what it costs); NaN or infinite where the
    tensor holds one."""
    if not tensor.numel():
        return 0.0
    flat = tensor.reshape(-1)
    squares = sum(float(flat[i:i + chunk].double().square().sum()) for i in range(0, flat.numel(), chunk))
    return math.sqrt(squares / flat.numel())


def implausible(scales: dict[str, float], initial_rms: dict[str, float], bound: float) -> str | None:
    """Why weights handed in as trained cannot be, or None: a tensor whose RMS (`scales`) is above
    `bound` times its initial RMS (at least 1). Training does not grow weights that much without
    diverging first."""
    for key, value in scales.items():
        if key in initial_rms and value > bound * max(1.0, initial_rms[key]):
            return (f"{key} has an RMS of {value:.3g}, more than {bound:g} times what it started at "
                    f"({initial_rms[key]:.3g}, counted as at least 1)")
    return None


def folded(model: Path, subspace: Subspace | None, scratch: Path) -> list[Path]:
    """A model trained with a residual subspace in plain Llama form: each tensor that folding changes,
    alone in a file under `scratch`, one tensor in memory at a time (ravnest/models/subspace.py)."""
    if subspace is None:
        return []
    written: list[Path] = []
    with safe_open(str(model), "pt") as handle:
        for key in handle.keys():
            if (tensor := subspace.folded(key, handle.get_tensor(key))) is not None:
                written.append(scratch / f"{len(written)}.safetensors")
                save_file({key: tensor.contiguous()}, str(written[-1]))
    return written


def merge(files: list[Path], target: Path, metadata: dict[str, str],
          rename: Callable[[str], str] = lambda key: key, keep: Callable[[str], bool] = lambda key: True) -> None:
    """One safetensors file of every tensor in `files` that `keep` keeps (under `rename`'s names; a key
    in several files is taken from the first), their bytes copied a megabyte at a time: the merged
    model is never in memory (a model of any size goes through a coordinator of 1 GiB)."""
    sources, taken = [], set()
    for path in files:
        tensors = {key: stored for key, stored in index(path)[0].items() if keep(key) and key not in taken}
        taken |= set(tensors)
        sources.append((path, tensors))
    header: dict[str, Any] = {"__metadata__": metadata}
    at = 0
    for _, tensors in sources:
        for key, stored in tensors.items():
            header[rename(key)] = {"dtype": stored.dtype, "shape": list(stored.shape),
                           "data_offsets": [at, at + stored.end - stored.start]}
            at += stored.end - stored.start
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    with os.fdopen(handle, "wb") as out:
        out.write(len(encoded).to_bytes(8, "little") + encoded)
        for path, tensors in sources:
            with path.open("rb") as source:
                for stored in tensors.values():
                    source.seek(stored.start)
                    left = stored.end - stored.start
                    while left:
                        chunk = source.read(min(left, COPY_CHUNK))
                        if not chunk:
                            raise InvalidRequest(f"{path.name} ends early")
                        out.write(chunk)
                        left -= len(chunk)
    commit(Path(name), target)


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
