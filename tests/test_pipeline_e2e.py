"""The pipeline end to end: one real OS process per stage on loopback gRPC, against the
single-process reference trained with the same seed, data and optimizer."""
from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.modules.module as torch_module_source

from ravnest.data import load_dataset
from ravnest.models import build_model
from ravnest.pipeline import run_local_pipeline, run_single_process
from ravnest.spec import JobSpec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cnn_job() -> JobSpec:
    return JobSpec.model_validate({"model": {"name": "cnn"}, "dataset": {"name": "digits"},
                                   "training": {"steps": 300, "batch_size": 32, "seed": 0}})


@pytest.fixture(scope="module")
def single_cnn(cnn_job: JobSpec) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_single_process(cnn_job)["metrics"]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("ranges", [[(0, 2), (2, 4)], [(0, 1), (1, 2), (2, 4)]], ids=["2-stages", "3-stages"])
def test_cnn_on_digits_reaches_95_percent_as_a_pipeline(cnn_job: JobSpec, single_cnn: dict, ranges) -> None:
    start = time.monotonic()
    result = run_local_pipeline(cnn_job, ranges, timeout=300)
    piped = result["metrics"]
    print(f"\n{len(ranges)}-stage pipeline: test accuracy {piped['test_accuracy']:.4f} "
          f"(loss {piped['test_loss']:.4f}) in {time.monotonic() - start:.1f}s; single process: "
          f"{single_cnn['test_accuracy']:.4f} (loss {single_cnn['test_loss']:.4f})")
    assert single_cnn["test_accuracy"] >= 0.95
    assert piped["test_accuracy"] >= 0.95
    assert piped["test_accuracy"] >= single_cnn["test_accuracy"] - 0.03
    assert [int(m["step"]) for m in result["stages"]] == [300] * len(ranges)
    assert result["stages"][0]["max_in_flight"] == len(ranges)  # K defaults to the number of stages
    for trace in result["traces"]:
        assert all(fwd == bwd for _, fwd, bwd, _ in trace["records"])
    assert any(now > fwd for _, fwd, _, now in result["traces"][0]["records"])  # staleness happened
    full_model = build_model(cnn_job.model.name, cnn_job.model.config).full_model()
    assert result["state_dict"].keys() == full_model.state_dict().keys()


def unigram_entropy(tokens: torch.Tensor) -> float:
    """Entropy in nats of the token frequencies: the loss of the best model that ignores context."""
    counts = torch.bincount(tokens.flatten()).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def test_gpt_on_text_learns_context_across_three_stages() -> None:
    job = JobSpec.model_validate({
        "model": {"name": "gpt", "config": {"vocab_size": 256, "seq_len": 64, "d_model": 64, "n_layers": 2,
                                            "n_heads": 4}},
        "dataset": {"name": "text", "source": "torch-module", "seq_len": 64},
        "training": {"steps": 300, "batch_size": 16, "optimizer": {"name": "Adam", "kwargs": {"lr": 3e-3}}}})
    offered = {"torch-module": torch_module_source.__file__}
    entropy = unigram_entropy(load_dataset(job.dataset, offered).train_x.read())
    result = run_local_pipeline(job, [(0, 1), (1, 3), (3, 4)], timeout=300, datasets=offered)
    metrics = result["metrics"]
    print(f"\ngpt, 3 stages, 300 steps: train loss {metrics['loss']:.3f}, test loss {metrics['test_loss']:.3f}, "
          f"unigram entropy {entropy:.3f} nats")
    assert math.isfinite(metrics["loss"])
    assert metrics["loss"] < 0.75 * entropy
    assert metrics["test_loss"] < 0.8 * entropy
