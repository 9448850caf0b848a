"""Datasets every node can load locally: sklearn digits, character-level text, token files
(tokens.py) and .npz arrays.

Nothing is downloaded. Splits and shuffles are deterministic so every node of a job agrees on them,
and `shard` gives each data-parallel replica a disjoint part of the training data.
"""
from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch

from ravnest.errors import RavnestError
from ravnest.spec import DatasetRef

from .tokens import TokenFileError, read_header

SPLIT_SEED = 0  # fixed: the train/test split of "digits" must be the same on every node


class DatasetError(RavnestError, ValueError):
    """A dataset that cannot be loaded: missing file, wrong keys, too little data."""


class Windows:
    """Sequences read from a token file when a batch asks for them: row i is the `length` tokens at
    `starts[i]`. A node holds a batch, never the file: rows are read with os.pread, so the file's pages
    sit in the kernel's page cache, shared and reclaimable, not in the process (a memory map would
    count every page it touched as resident). Indexed like the tensor of all rows: a slice is another
    Windows (a shard), an index tensor gives the rows as int64 [len(index), length]."""

    def __init__(self, path: str | os.PathLike, dtype: np.dtype, length: int, starts: range, offset: int = 0):
        self.path, self.dtype, self.length, self.starts, self.offset = os.fspath(path), dtype, length, starts, offset

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.starts), self.length

    def __getitem__(self, index: slice | torch.Tensor) -> Any:
        if isinstance(index, slice):
            return Windows(self.path, self.dtype, self.length, self.starts[index], self.offset)
        size, width = self.length * self.dtype.itemsize, self.dtype.itemsize
        handle = os.open(self.path, os.O_RDONLY)
        try:
            rows = [np.frombuffer(os.pread(handle, size, self.offset + self.starts[int(i)] * width), self.dtype)
                    for i in index.reshape(-1)]
        finally:
            os.close(handle)
        if any(len(row) != self.length for row in rows):
            raise DatasetError(f"{self.path} is shorter than when it was opened: was it changed while training?")
        return torch.from_numpy(np.stack(rows).astype(np.int64)).reshape(*index.shape, self.length)

    def read(self) -> torch.Tensor:
        """Every row (tests and small files)."""
        return self[torch.arange(len(self))]


Examples = Union[torch.Tensor, Windows]  # a tensor of examples, or a token file's sequences read on demand


@dataclass
class Dataset:
    name: str
    train_x: Examples
    train_y: Examples
    test_x: Examples
    test_y: Examples
    num_classes: int | None = None  # classification
    vocab_size: int | None = None   # language modelling

    def shard(self, index: int, count: int, by_label: bool = False) -> Dataset:
        """Shard `index` of `count`, disjoint across shards; the test set is shared. Interleaved: training
        examples index, index+count, ...; `by_label`: the examples in label order (stable), cut into
        `count` contiguous parts, so a shard holds few classes."""
        if count < 1 or not 0 <= index < count:
            raise DatasetError(f"shard index {index} is outside 0..{count - 1}")
        if len(self.train_x) < count:
            raise DatasetError(f"{self.name}: {len(self.train_x)} training examples cannot make {count} shards")
        if not by_label:
            return replace(self, train_x=self.train_x[index::count], train_y=self.train_y[index::count])
        if self.num_classes is None or not isinstance(self.train_y, torch.Tensor):
            raise DatasetError(f"{self.name}: shards 'by-label' need a classification dataset")
        order = torch.sort(self.train_y, stable=True).indices
        part = order[index * len(order) // count:(index + 1) * len(order) // count]
        return replace(self, train_x=self.train_x[part], train_y=self.train_y[part])

    def batches(self, batch_size: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless full training batches, reshuffled every epoch by a generator seeded with (seed, epoch).

        Each epoch drops its last incomplete batch, so every batch has exactly `batch_size` examples.
        """
        size = len(self.train_x)
        if not 1 <= batch_size <= size:
            raise DatasetError(f"{self.name}: batch_size must be in 1..{size} (the training examples here)")
        epoch = 0
        while True:
            generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
            order = torch.randperm(size, generator=generator)
            for start in range(0, size - batch_size + 1, batch_size):
                index = order[start:start + batch_size]
                yield self.train_x[index], self.train_y[index]
            epoch += 1

    def test_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One pass over the test set in order; the last batch may be smaller."""
        if batch_size < 1:
            raise DatasetError("batch_size must be >= 1")
        for start in range(0, len(self.test_x), batch_size):
            rows = torch.arange(start, min(start + batch_size, len(self.test_x)))
            yield self.test_x[rows], self.test_y[rows]


def epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed mixing (seed, epoch), so nearby pairs give unrelated shuffles."""
    state = np.random.SeedSequence([seed % (1 << 64), epoch]).generate_state(1, np.uint64)[0]
    return int(state >> np.uint64(1))


# What the first stage's feed holds of digits, loaded whole, while it trains: its tensors (0.5 MiB) and
# what parsing the file and its first shuffled batches left in the heap. Loading peaks at 1.8 MiB above
# a warm process's idle, before training starts; the first stages of the digits MLP measured 0.8 MiB
# above the last ones' on a node's first job, 0.6 MiB above a prediction of 1 MiB (bench.memory --small).
# Text and token files are read window by window from disk.
DIGITS_RESIDENT_BYTES = 3 << 19
# A token or text file's feed holds a batch, not the file, but its first batch faults in torch's shuffling
# and indexing code (randperm's first call alone: 3.6 MiB of the library's pages): 6.5 MiB above idle in a
# fresh process, 1.2 MiB more for a pass over the test set, then nothing more over 300 batches.
FILE_FEED_BYTES = 15 << 19


def resident_bytes(ref: DatasetRef) -> int:
    """Bytes a dataset keeps in the memory of the stage that feeds it (the first), for the planner."""
    return DIGITS_RESIDENT_BYTES if ref.name == "digits" else FILE_FEED_BYTES


def load_dataset(ref: DatasetRef | dict[str, Any], offered: Mapping[str, str | os.PathLike] | None = None) -> Dataset:
    """Load the dataset a job names; every failure is a DatasetError with the reason.

    `text` and `npz` read a file the volunteer offers under the name `ref.source` (`offered` maps those
    names to paths: `ravnest-node join --dataset NAME=PATH`). A job never names a path, and no reason
    given here says anything about the node's files beyond what was offered."""
    if isinstance(ref, dict):
        try:
            ref = DatasetRef.model_validate(ref)
        except ValueError as exc:
            raise DatasetError(f"invalid dataset reference: {exc}") from exc
    if ref.name == "digits":
        return _load_digits(ref.test_fraction)
    label = f"dataset {ref.source!r}"
    path = (offered or {}).get(ref.source or "")
    if path is None:
        raise DatasetError(f"this node does not offer {label} (volunteers offer files with "
                           f"`ravnest-node join --dataset NAME=PATH`)")
    if not os.path.isfile(path):
        raise DatasetError(f"{label} is offered, but its file is gone from this node")
    if ref.name == "text":
        return _load_text(path, ref.seq_len, ref.test_fraction, label)
    if ref.name == "tokens":
        try:
            header = read_header(path, label)
        except TokenFileError as e:
            raise DatasetError(str(e)) from None
        return _token_windows("tokens", path, header.dtype, header.tokens, ref.seq_len, ref.test_fraction, label,
                              header.vocab_size, header.offset)
    return _load_npz(path, ref.test_fraction, label)


def _split(count: int, test_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic random (train, test) index split."""
    order = torch.randperm(count, generator=torch.Generator().manual_seed(SPLIT_SEED))
    test_count = round(count * test_fraction)
    return order[test_count:], order[:test_count]


def _load_digits(test_fraction: float) -> Dataset:
    # The file scikit-learn's load_digits reads (64 pixels, then the label, per row), read without
    # importing scikit-learn: that import alone costs a node ~70 MiB for 0.5 MiB of data.
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError("the digits dataset needs scikit-learn installed (it ships the file)")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    rows = torch.from_numpy(np.loadtxt(path, delimiter=",", dtype=np.float32))
    x = rows[:, :64].reshape(-1, 1, 8, 8) / 16.0  # pixels are 0..16
    y = rows[:, 64].to(torch.int64)
    train, test = _split(len(x), test_fraction)
    return Dataset("digits", x[train], y[train], x[test], y[test], num_classes=10)


def _windows(path: str | os.PathLike, dtype: np.dtype, start: int, end: int, seq_len: int, offset: int = 0
             ) -> tuple[Windows, Windows]:
    """Non-overlapping sequences of tokens [start, end) as inputs, the same shifted by one as targets."""
    starts = range(start, start + (end - start - 1) // seq_len * seq_len, seq_len)
    return (Windows(path, dtype, seq_len, starts, offset),
            Windows(path, dtype, seq_len, range(start + 1, starts.stop + 1, seq_len), offset))


def _token_windows(name: str, path: str | os.PathLike, dtype: np.dtype, count: int, seq_len: int,
                   test_fraction: float, label: str, vocab_size: int, offset: int = 0) -> Dataset:
    """`count` tokens of `dtype` in a file (from byte `offset`); its tail is the test set."""
    test_start = count - round(count * test_fraction)
    train_x, train_y = _windows(path, dtype, 0, test_start, seq_len, offset)
    test_x, test_y = _windows(path, dtype, test_start, count, seq_len, offset)
    if len(train_x) == 0 or (test_fraction > 0 and len(test_x) == 0):
        raise DatasetError(f"{label} is too short for seq_len={seq_len} with test_fraction={test_fraction}: "
                           "it needs room for one sequence of seq_len + 1 tokens in both the training and the "
                           "test part")
    return Dataset(name, train_x, train_y, test_x, test_y, vocab_size=vocab_size)


def _load_text(path: str | os.PathLike, seq_len: int, test_fraction: float, label: str) -> Dataset:
    """Byte-level language modelling: token id = byte value; the file's tail is the test set.

    vocab_size is 128 for pure ASCII files (the gpt default) and 256 otherwise (one pass over the
    file, a megabyte at a time)."""
    ascii_only = True
    with open(path, "rb") as handle:
        while ascii_only and (chunk := handle.read(1 << 20)):
            ascii_only = chunk.isascii()
    size = os.path.getsize(path)
    return _token_windows("text", path, np.dtype(np.uint8), size, seq_len, test_fraction, label,
                          128 if ascii_only else 256)


def _load_npz(path: str | os.PathLike, test_fraction: float, label: str) -> Dataset:
    """Arrays "x_train", "y_train", "x_test", "y_test", or "x", "y" split with `test_fraction`."""
    try:
        with np.load(path, allow_pickle=False) as arrays:
            data = {key: arrays[key] for key in arrays.files}
    except (OSError, ValueError) as exc:
        raise DatasetError(f"{label} is not a readable npz file: {type(exc).__name__}") from exc
    split_keys = {"x_train", "y_train", "x_test", "y_test"}
    if split_keys <= data.keys():
        parts = [_as_tensor(data[key], key, label) for key in ("x_train", "y_train", "x_test", "y_test")]
    elif {"x", "y"} <= data.keys():
        x, y = _as_tensor(data["x"], "x", label), _as_tensor(data["y"], "y", label)
        if len(x) != len(y):
            raise DatasetError(f"{label}: 'x' has {len(x)} rows but 'y' has {len(y)}")
        train, test = _split(len(x), test_fraction)
        parts = [x[train], y[train], x[test], y[test]]
    else:
        raise DatasetError(f"{label} must hold arrays 'x' and 'y', or 'x_train', 'y_train', 'x_test', "
                           f"'y_test'; found {sorted(data)}")
    train_x, train_y, test_x, test_y = parts
    if len(train_x) != len(train_y) or len(test_x) != len(test_y):
        raise DatasetError(f"{label}: inputs and labels differ in length")
    if len(train_x) == 0:
        raise DatasetError(f"{label}: no training examples")
    num_classes = None
    if not train_y.is_floating_point():  # integer labels: classification over 0..max label
        labels = torch.cat([train_y, test_y])
        if labels.min() < 0:
            raise DatasetError(f"{label}: class labels must be >= 0")
        num_classes = int(labels.max()) + 1
    return Dataset("npz", train_x, train_y, test_x, test_y, num_classes=num_classes)


def _as_tensor(array: np.ndarray, key: str, label: str) -> torch.Tensor:
    """Floats become float32 and integers int64 (what models and cross-entropy expect)."""
    if np.issubdtype(array.dtype, np.floating):
        return torch.from_numpy(array.astype(np.float32))
    if np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_:
        return torch.from_numpy(array.astype(np.int64))
    raise DatasetError(f"{label}: array {key!r} has unsupported dtype {array.dtype}")
