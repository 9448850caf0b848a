"""Through the whole system (coordinator + real node processes): an asynchronous 4-stage pipeline
learns as well as one node, and a seeded job gives the same weights bit for bit when run again."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load

from scripts.local_cluster import LocalCluster

pytestmark = pytest.mark.slow


def mlp_job(stages: int) -> dict:
    """The job issue reports measured at 0.669 and 0.284 as a 4-stage pipeline against 0.864 on one node."""
    return {"name": f"mlp-{stages}-stages",
            "model": {"name": "mlp", "config": {"input_dim": 64, "hidden": 256, "depth": 4, "num_classes": 10}},
            "dataset": {"name": "digits"},
            "training": {"steps": 120, "batch_size": 32, "seed": 3, "microbatches_in_flight": stages,
                         "optimizer": {"name": "Adam", "kwargs": {"lr": 1e-3}}},
            # equal-split: cuts that do not depend on how fast each node measured, which the same seed must not
            # be asked to survive (a layer's staleness is its stage's; CI once measured cuts that differed)
            "placement": {"clusters": 1, "stages_per_cluster": stages, "max_nodes": stages, "min_nodes": stages,
                          "policy": "equal-split"}}


def test_a_four_stage_pipeline_learns_as_one_node_and_again_gives_the_same_weights(tmp_path) -> None:
    with LocalCluster(tmp_path, nodes=4) as cluster:
        jobs, models = [], []
        for stages in (4, 4, 1):
            cluster.wait_for(lambda: all(n["state"] == "idle" for n in cluster.alive_nodes()), timeout=60,
                             what="every node to be idle")
            job = cluster.wait_job(cluster.submit(mlp_job(stages)), timeout=600)
            assert job["state"] == "completed", job.get("reason")
            assert len(job["plan"]["clusters"]) == 1 and len(job["plan"]["clusters"][0]["stages"]) == stages
            jobs.append(job)
            models.append(load(cluster.http.get(f"/v1/jobs/{job['id']}/model").content))
    piped, again, single = (job["metrics"] for job in jobs)
    print(f"4 stages, K=4: test accuracy {piped['test_accuracy']:.4f} (mean staleness {piped['staleness']:.2f}, "
          f"bubble {piped['bubble']:.2f}); one node: {single['test_accuracy']:.4f}")
    assert piped["test_accuracy"] >= single["test_accuracy"] - 0.01
    assert piped["staleness"] > 0  # asynchronous for real: forwards ran on weights later stepped
    assert models[0].keys() == models[1].keys() and len(models[0]) > 0
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0]), "the same seeded job gave other weights"
    assert piped["test_accuracy"] == again["test_accuracy"]
