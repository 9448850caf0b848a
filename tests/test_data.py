"""Local datasets: deterministic splits, disjoint shards, reproducible batches, clear errors."""
from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from ravnest.data import Dataset, DatasetError, load_dataset
from ravnest.spec import DatasetRef


def numbered(count: int) -> Dataset:
    """A dataset whose training inputs are their own indices, to track where examples go."""
    x = torch.arange(count)
    return Dataset("numbered", x, x * 10, torch.arange(5), torch.arange(5), num_classes=None)


def test_digits_shapes_and_scaling() -> None:
    data = load_dataset(DatasetRef(name="digits", test_fraction=0.2))
    assert data.train_x.shape[1:] == (1, 8, 8) and data.train_x.dtype == torch.float32
    assert data.train_y.dtype == torch.int64 and data.num_classes == 10 and data.vocab_size is None
    assert len(data.train_x) + len(data.test_x) == 1797
    assert len(data.test_x) == round(1797 * 0.2)
    assert 0.0 <= float(data.train_x.min()) and float(data.train_x.max()) == 1.0
    assert set(data.test_y.tolist()) == set(range(10))


def test_digits_split_is_deterministic() -> None:
    first, second = load_dataset({"name": "digits"}), load_dataset({"name": "digits"})
    assert torch.equal(first.train_x, second.train_x) and torch.equal(first.test_y, second.test_y)


def test_shards_by_label_are_disjoint_cover_the_set_and_hold_few_classes() -> None:
    data = load_dataset(DatasetRef(name="digits"))
    shards = [data.shard(i, 8, by_label=True) for i in range(8)]
    assert sum(len(s.train_y) for s in shards) == len(data.train_y)
    assert sorted(torch.cat([s.train_y for s in shards]).tolist()) == sorted(data.train_y.tolist())
    assert all(len(s.train_y.unique()) <= 3 for s in shards)  # interleaved shards hold all 10
    assert len(data.shard(0, 8).train_y.unique()) == 10
    text = Dataset("lm", torch.zeros(8, 4), torch.zeros(8, 4, dtype=torch.long), torch.zeros(2, 4),
                   torch.zeros(2, 4, dtype=torch.long), vocab_size=256)
    with pytest.raises(DatasetError, match="classification"):
        text.shard(0, 2, by_label=True)
    with pytest.raises(ValueError, match="classification"):  # a job asking for it is refused at submit
        DatasetRef(name="text", source="books", shards="by-label")


def test_shards_are_disjoint_and_cover_the_training_set() -> None:
    data = numbered(103)
    shards = [data.shard(i, 4) for i in range(4)]
    seen = torch.cat([s.train_x for s in shards])
    assert sorted(seen.tolist()) == list(range(103))
    assert all(torch.equal(s.train_y, s.train_x * 10) for s in shards)  # pairs stay together
    assert all(torch.equal(s.test_x, data.test_x) for s in shards)
    assert torch.equal(data.shard(2, 4).train_x, shards[2].train_x)  # deterministic
    with pytest.raises(DatasetError):
        data.shard(4, 4)
    with pytest.raises(DatasetError, match="cannot make"):
        numbered(3).shard(0, 4)


def test_batches_are_reproducible_and_reshuffle_each_epoch() -> None:
    data = numbered(40)
    first = [x for x, _ in itertools.islice(data.batches(8, seed=1), 15)]
    again = [x for x, _ in itertools.islice(data.batches(8, seed=1), 15)]
    other = [x for x, _ in itertools.islice(data.batches(8, seed=2), 15)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))
    epochs = [torch.cat(first[i:i + 5]) for i in (0, 5, 10)]
    assert all(sorted(epoch.tolist()) == list(range(40)) for epoch in epochs)  # each example once per epoch
    assert not torch.equal(epochs[0], epochs[1]) and not torch.equal(epochs[1], epochs[2])


def test_batches_drop_the_incomplete_tail() -> None:
    batches = list(itertools.islice(numbered(10).batches(4, seed=0), 6))
    assert all(len(x) == 4 for x, _ in batches)
    assert all(torch.equal(y, x * 10) for x, y in batches)
    with pytest.raises(DatasetError, match="batch_size"):
        next(numbered(3).batches(4, seed=0))


def test_test_batches_are_one_ordered_pass() -> None:
    data = load_dataset({"name": "digits"})
    batches = list(data.test_batches(100))
    assert [len(x) for x, _ in batches] == [100, 100, 100, len(data.test_x) - 300]
    assert torch.equal(torch.cat([y for _, y in batches]), data.test_y)


def test_text_from_a_file_on_this_machine() -> None:
    path = os.__file__  # the standard library's os.py is always there and plain ASCII
    raw = Path(path).read_bytes()
    data = load_dataset({"name": "text", "source": "f", "seq_len": 32, "test_fraction": 0.1}, {"f": path})
    assert data.vocab_size == 128 and data.num_classes is None  # ASCII
    x, y, test_x = data.train_x.read(), data.train_y.read(), data.test_x.read()  # read from the file on demand
    assert x.dtype == torch.int64 and x.shape[1] == 32 and data.train_x.shape == x.shape
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    assert torch.equal(y[:-1, -1], x[1:, 0])
    assert bytes(x[0].tolist()) == raw[:32]
    test_start = len(raw) - round(len(raw) * 0.1)
    assert bytes(test_x[0].tolist()) == raw[test_start:test_start + 32]  # the tail is the test set
    assert len(x) == (test_start - 1) // 32
    shard = data.shard(1, 3)  # a replica's share: every third sequence, still read on demand
    assert torch.equal(shard.train_x.read(), x[1::3]) and torch.equal(shard.train_y.read(), y[1::3])
    batch_x, batch_y = next(shard.batches(4, seed=0))
    assert batch_x.shape == (4, 32) and torch.equal(batch_x[:, 1:], batch_y[:, :-1])


def test_text_keeps_bytes_of_non_ascii(tmp_path: Path) -> None:
    path = tmp_path / "tiny.txt"
    path.write_text("héllo wörld " * 4, encoding="utf-8")
    data = load_dataset({"name": "text", "source": "f", "seq_len": 8, "test_fraction": 0.25}, {"f": str(path)})
    assert data.vocab_size == 256 and 127 < int(data.train_x.read().max()) < 256


def test_a_gpt_whose_vocabulary_is_smaller_than_the_texts_bytes_is_refused_with_the_fix(tmp_path: Path) -> None:
    """Not an index error deep in the embedding after some steps (which batch meets the first byte >= 128
    depends on the data order), but a reason before training, with the vocab_size that fits."""
    from ravnest.pipeline.stage import StageRunner
    from ravnest.wire import Router
    from ravnest.pipeline.local import make_assignments
    from ravnest.spec import JobSpec
    path = tmp_path / "tiny.txt"
    path.write_text("héllo wörld " * 40, encoding="utf-8")
    job = JobSpec.model_validate({
        "model": {"name": "gpt", "config": {"vocab_size": 128, "seq_len": 8, "d_model": 16, "n_layers": 1,
                                            "n_heads": 2}},
        "dataset": {"name": "text", "source": "f", "seq_len": 8}, "training": {"steps": 2, "batch_size": 2}})
    [first] = make_assignments(job, [(0, 3)], ["127.0.0.1:1"], "t")
    with pytest.raises(DatasetError, match=r"holds token ids up to 255, but the model takes ids below 128: set "
                                           r"the model's vocab_size to 256"):
        StageRunner(first, Router(), datasets={"f": str(path)})


def test_text_too_short(tmp_path: Path) -> None:
    path = tmp_path / "short.txt"
    path.write_text("abc")
    with pytest.raises(DatasetError, match="too short"):
        load_dataset({"name": "text", "source": "f", "seq_len": 8}, {"f": str(path)})
    path.write_text("")
    with pytest.raises(DatasetError, match="too short"):
        load_dataset({"name": "text", "source": "f", "seq_len": 8}, {"f": str(path)})


@pytest.mark.parametrize("ref, message", [
    ({"name": "text", "source": "books"}, "does not offer dataset 'books'"),
    ({"name": "npz", "path": "/etc/hostname"}, "never names a file on a volunteer's machine"),
    ({"name": "imagenet"}, "invalid dataset reference"),
    ({"name": "digits", "test_fraction": 1.5}, "invalid dataset reference"),
])
def test_bad_references(ref: dict, message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        load_dataset(ref)
    assert issubclass(DatasetError, ValueError)


def test_npz_with_x_and_y_is_split(tmp_path: Path) -> None:
    path = tmp_path / "data.npz"
    np.savez(path, x=np.arange(100, dtype=np.float64).reshape(50, 2), y=np.arange(50) % 3)
    data = load_dataset({"name": "npz", "source": "f", "test_fraction": 0.2}, {"f": str(path)})
    assert data.train_x.dtype == torch.float32 and data.train_y.dtype == torch.int64
    assert len(data.train_x) == 40 and len(data.test_x) == 10 and data.num_classes == 3
    assert torch.equal(data.train_x[:, 0] / 2 % 3, data.train_y.float())  # rows kept with their labels
    again = load_dataset({"name": "npz", "source": "f", "test_fraction": 0.2}, {"f": str(path)})
    assert torch.equal(data.test_x, again.test_x)


def test_npz_with_explicit_split(tmp_path: Path) -> None:
    path = tmp_path / "split.npz"
    np.savez(path, x_train=np.zeros((6, 3), np.float32), y_train=np.array([0, 1, 2, 3, 4, 5]),
             x_test=np.ones((2, 3), np.float32), y_test=np.array([1, 7]))
    data = load_dataset({"name": "npz", "source": "f"}, {"f": str(path)})
    assert len(data.train_x) == 6 and torch.equal(data.test_x, torch.ones(2, 3)) and data.num_classes == 8


@pytest.mark.parametrize("arrays, message", [
    ({"inputs": np.zeros(3), "labels": np.zeros(3)}, "must hold arrays"),
    ({"x": np.zeros((3, 2)), "y": np.zeros(4, np.int64)}, "rows"),
    ({"x": np.array(["a", "b"]), "y": np.zeros(2, np.int64)}, "unsupported dtype"),
    ({"x": np.zeros((3, 2)), "y": np.array([0, -1, 2])}, "labels must be >= 0"),
])
def test_npz_errors(tmp_path: Path, arrays: dict, message: str) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(DatasetError, match=message):
        load_dataset({"name": "npz", "source": "f"}, {"f": str(path)})


def test_npz_never_unpickles(tmp_path: Path) -> None:
    path = tmp_path / "pickled.npz"
    np.savez(path, x=np.array([{"a": 1}, None], dtype=object), y=np.zeros(2, np.int64))
    with pytest.raises(DatasetError, match="not a readable npz file"):
        load_dataset({"name": "npz", "source": "f"}, {"f": str(path)})


def test_not_an_npz_file(tmp_path: Path) -> None:
    path = tmp_path / "garbage.npz"
    path.write_bytes(b"not a zip file")
    with pytest.raises(DatasetError, match="not a readable npz file"):
        load_dataset({"name": "npz", "source": "f"}, {"f": str(path)})


def test_digits_are_scikit_learns_digits_read_without_importing_it() -> None:
    from sklearn.datasets import load_digits

    reference = load_digits()
    data = load_dataset({"name": "digits", "test_fraction": 0.0})
    assert data.train_x.shape == (1797, 1, 8, 8) and data.train_x.dtype == torch.float32
    # same images and labels (the split shuffles rows: compare them as sets of rows)
    ours = torch.cat([data.train_x.reshape(-1, 64) * 16, data.train_y[:, None].float()], dim=1)
    theirs = torch.cat([torch.tensor(reference.data, dtype=torch.float32),
                        torch.tensor(reference.target, dtype=torch.float32)[:, None]], dim=1)
    assert torch.equal(torch.unique(ours, dim=0), torch.unique(theirs, dim=0))


def test_reasons_say_nothing_about_the_nodes_files(tmp_path: Path) -> None:
    """Only offered files are read, and a failure names the dataset, never a path or a size."""
    secret = tmp_path / "secret.txt"
    secret.write_text("xy")
    for ref, offered in (({"name": "text", "source": "s", "seq_len": 8}, {"s": secret}),
                         ({"name": "npz", "source": "s"}, {"s": secret}),
                         ({"name": "text", "source": "s"}, {"s": tmp_path / "gone.txt"}),
                         ({"name": "text", "source": "other"}, {"s": secret})):
        with pytest.raises(DatasetError) as refused:
            load_dataset(ref, offered)
        assert str(tmp_path) not in str(refused.value) and not re.search(r"\d+ bytes", str(refused.value))
