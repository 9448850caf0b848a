"""Datasets loaded locally on every node, with deterministic splits, shards and batches."""
from .datasets import Dataset, DatasetError, load_dataset

__all__ = ["Dataset", "DatasetError", "load_dataset"]
