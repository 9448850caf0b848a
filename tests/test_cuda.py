"""The CUDA path, where there is a GPU (skipped elsewhere, CI included): real node processes on
`--device cuda` train a pipeline and data-parallel replicas averaging over the ring; the model they
upload reloads on the CPU and scores what the job reported; the memory each stage measured on the
GPU stays within the planner's prediction."""
from __future__ import annotations

import pytest
import torch

import ravnest
from ravnest.data import load_dataset
from scripts.local_cluster import LocalCluster
from tests.test_faults import cnn_job

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")]


def accuracy_on_cpu(cluster: LocalCluster, job_id: str, path) -> float:
    response = cluster.http.get(f"/v1/jobs/{job_id}/model")
    assert response.status_code == 200
    path.write_bytes(response.content)
    model = ravnest.load_model(path)
    correct = total = 0
    with torch.no_grad():
        for x, y in load_dataset({"name": "digits"}).test_batches(64):
            correct += int((model(x).argmax(dim=1) == y).sum())
            total += len(y)
    return correct / total


@pytest.mark.parametrize("shape", [{"clusters": 1, "stages_per_cluster": 2},   # a pipeline across two GPU nodes
                                   {"clusters": 2, "stages_per_cluster": 1}])  # two replicas, ring averaging
def test_gpu_nodes_train_and_their_model_reloads_on_the_cpu(tmp_path, shape):
    with LocalCluster(tmp_path, nodes=2, node_args=["--device", "cuda"]) as cluster:
        nodes = cluster.alive_nodes()
        assert all(n["profile"]["device"].startswith("cuda") and n["profile"]["gpu_name"] for n in nodes)
        job = cluster.wait_job(cluster.submit(cnn_job(steps=400, min_nodes=2, **shape)), timeout=600)
        assert job["state"] == "completed", job["reason"]
        metrics = job["metrics"]
        print(f"{shape}: {nodes[0]['profile']['gpu_name']}, {nodes[0]['profile']['flops'] / 1e12:.1f} TFLOP/s "
              f"profiled; {metrics['samples_per_s']:.0f} samples/s, accuracy {metrics['test_accuracy']:.4f}; "
              f"stage peaks (MiB) {[round(s['peak_memory_bytes'] / 2**20, 1) for s in metrics['stages']]} "
              f"predicted {[round(s['predicted_memory_bytes'] / 2**20, 1) for s in metrics['stages']]}")
        assert metrics["test_accuracy"] >= 0.95
        assert accuracy_on_cpu(cluster, job["id"], tmp_path / "model.safetensors") == \
            pytest.approx(metrics["test_accuracy"], abs=1e-9)
        for stage in metrics["stages"]:  # allocated bytes on the GPU above the idle level
            assert 0 < stage["peak_memory_bytes"] <= stage["predicted_memory_bytes"]
