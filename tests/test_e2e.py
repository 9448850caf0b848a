"""End to end with real processes on loopback: a coordinator (SQLite) and 4 `ravnest-node` daemons, one
cluster for the whole module, train the shipped MLP data parallel twice, a plug-in architecture as a
pipeline, and the README's digits CNN job across 2 clusters, whose downloaded model is checked in one
process; then a node leaves."""
import json
import re
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from ravnest.data import load_dataset
from ravnest.models import build_model
from ravnest.spec import JobSpec
from scripts.local_cluster import LocalCluster

pytestmark = pytest.mark.slow
JOB = Path(__file__).resolve().parent.parent / "examples" / "jobs" / "digits-cnn.json"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One coordinator and four nodes for the module; each test starts on idle nodes, and the last one
    sends a node away."""
    with LocalCluster(tmp_path_factory.mktemp("e2e"), nodes=4) as cluster:
        yield cluster


def idle(cluster: LocalCluster) -> None:
    cluster.wait_for(lambda: all(n["state"] == "idle" for n in cluster.alive_nodes()), timeout=60,
                     what="every node to be idle")


MLP_JOB = JOB.parent / "digits-mlp.json"


def test_shipped_digits_mlp_goes_data_parallel_and_the_same_nodes_serve_the_next_job(cluster):
    """A tiny model gains nothing from pipeline stages: the planner makes 4 data-parallel replicas
    and says why; the same 4 nodes then run the job again (rings, tokens and streams are per job)."""
    spec_json = json.loads(MLP_JOB.read_text())
    for attempt in range(2):
        idle(cluster)
        job = cluster.wait_job(cluster.submit(spec_json), timeout=600)
        assert job["state"] == "completed", job.get("reason")
        plan = job["plan"]
        assert [len(c["stages"]) for c in plan["clusters"]] == [1, 1, 1, 1]
        # k-means may split the 4 nodes by their (noisy) profiles; every group of 2+ weighed a pipeline
        assert plan["reason"].startswith("4 clusters x 1"), plan["reason"]
        groups = [int(n) for n in re.findall(r"(\d+) nodes? as", plan["reason"])]
        assert sum(groups) == 4 and (max(groups) == 1 or "of 2 stages" in plan["reason"]), plan["reason"]
        print(f"job {attempt + 1}: test accuracy {job['metrics']['test_accuracy']:.4f}; {plan['reason']}")
        assert job["metrics"]["test_accuracy"] >= 0.95
        assert job["metrics"]["averaging_rounds"] >= 5


def test_a_plugin_architecture_trains_as_a_pipeline_on_real_nodes(cluster):
    """The example plug-in (examples/model-plugin, installed as a package) runs like a built-in."""
    job = {"name": "resmlp", "model": {"name": "resmlp", "config": {"width": 64, "depth": 2}},
           "dataset": {"name": "digits"},
           "training": {"steps": 150, "batch_size": 32, "optimizer": {"name": "Adam", "kwargs": {"lr": 0.003}}},
           "placement": {"clusters": 1, "stages_per_cluster": 2, "min_nodes": 2}}
    idle(cluster)
    result = cluster.wait_job(cluster.submit(job), timeout=600)
    assert result["state"] == "completed", result.get("reason")
    assert len(result["plan"]["clusters"][0]["stages"]) == 2
    assert result["metrics"]["test_accuracy"] >= 0.9


def test_digits_cnn_job_across_two_clusters(cluster):
    """Last in the module: its node leaves at the end."""
    spec_json = json.loads(JOB.read_text())
    spec = JobSpec.model_validate(spec_json)
    idle(cluster)
    # idle nodes measure their links to peers when the coordinator asks (gRPC Ping probes)
    cluster.wait_for(lambda: all(len(n["links"]) >= 2 for n in cluster.alive_nodes()), timeout=60,
                     what="every node to report links to two peers")
    ids = {n["id"] for n in cluster.alive_nodes()}
    links = [(n["id"], link) for n in cluster.alive_nodes() for link in n["links"]]
    assert all(link["peer_id"] in ids - {me} and link["bandwidth_bytes_per_s"] > 0 for me, link in links)
    job_id = cluster.submit(spec_json)
    job = cluster.wait_job(job_id, timeout=600)
    assert job["state"] == "completed", job.get("reason")

    plan = job["plan"]
    assert len(plan["clusters"]) == 2
    placed = [s["node_id"] for c in plan["clusters"] for s in c["stages"]]
    assert len(set(placed)) == 4
    accuracy = job["metrics"]["test_accuracy"]
    print(f"pipeline test accuracy {accuracy:.4f}, utilization {job['metrics']['utilization']:.2f}")
    assert accuracy >= 0.95

    response = cluster.http.get(f"/v1/jobs/{job_id}/model")
    assert response.status_code == 200
    model = build_model(spec.model.name, spec.model.config).full_model()
    model.load_state_dict(load(response.content))

    # A node that gets SIGTERM leaves the coordinator gracefully.
    leaving = cluster.procs[1]
    leaving.send_signal(signal.SIGINT)
    assert leaving.wait(timeout=30) == 0
    cluster.wait_for(lambda: sum(n["state"] == "gone" for n in cluster.http.get("/v1/nodes").json()) == 1,
                     timeout=30, what="the node to be listed as gone", ignore_exits=True)

    model.eval()
    data = load_dataset(spec.dataset)
    with torch.no_grad():
        reloaded = (model(data.test_x).argmax(-1) == data.test_y).float().mean().item()
    print(f"downloaded model, single process: test accuracy {reloaded:.4f}")
    assert abs(reloaded - accuracy) < 0.01
