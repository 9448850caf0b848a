"""Stage 0's data: the cluster's shard of the job's dataset, drawn in batches and cut into
micro-batches, and the test set it streams through the pipeline at evaluation."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Mapping

import torch

from ravnest.data import DatasetError, load_dataset
from ravnest.spec import StageAssignment

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets)


class BatchFeed:
    """Clusters train on disjoint shards, each in its own order. With `parts` > 1 (PipeDream-2BW) every
    batch is cut into that many micro-batches, whose gradients make one update."""

    def __init__(self, assignment: StageAssignment, parts: int,
                 datasets: Mapping[str, str | Path] | None = None, token_limit: int | None = None):
        a, training = assignment, assignment.training
        self.dataset = load_dataset(a.dataset, datasets)  # only files the volunteer offers
        if token_limit is not None and self.dataset.vocab_size and self.dataset.vocab_size > token_limit:
            raise DatasetError(f"{a.dataset.name} '{a.dataset.source}' holds token ids up to "
                               f"{self.dataset.vocab_size - 1}, but the model takes ids below {token_limit}: "
                               f"set the model's vocab_size to {self.dataset.vocab_size} (a text file that is "
                               f"not pure ASCII has byte values from 128 up)")
        self.batch_size, self.parts = training.batch_size, parts
        self.batches: Iterator[Batch] = self.dataset.shard(
            a.cluster, a.num_clusters, by_label=a.dataset.shards == "by-label").batches(
            training.batch_size, seed=data_seed(training.seed, a))
        self._rest: list[Batch] = []  # the parts of the current batch not handed out yet

    def micro_batch(self, index: int) -> Batch:
        """Micro-batch `index` (counted from the run's start): a new batch every `parts` of them."""
        if index % self.parts == 0:
            x, y = next(self.batches)
            self._rest = list(zip(x.tensor_split(self.parts), y.tensor_split(self.parts)))
        return self._rest.pop(0)

    def test_batches(self) -> Iterator[Batch]:
        return self.dataset.test_batches(self.batch_size)


def data_seed(seed: int, a: StageAssignment) -> int:
    """Each cluster draws its own order; a run continued at step s draws a fresh one (the same for the
    same seed, cluster and step), not the order the first run began with."""
    return seed + a.cluster + 1_000_003 * a.resume_step
