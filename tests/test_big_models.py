"""Models bigger than any one machine, through real processes on loopback: the coordinator plans a
10 B-parameter model without allocating its weights, and a model whose fp32 weights exceed every
node's `--max-memory` trains as a 4-stage pipeline with each node's measured peak memory close to
what the planner predicted for its stage."""
from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

from bench.memory import BIG_GPT, BIG_RUNS, OFFER_TEXT, big_job
from ravnest.data import proof
from ravnest.models import build_model, profile_blocks
from scripts.local_cluster import LocalCluster, answering_address

GIB = 1 << 30


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_the_coordinator_plans_a_10b_parameter_gpt_in_little_memory_and_time(tmp_path: Path) -> None:
    config = {"vocab_size": 50_000, "seq_len": 1024, "d_model": 4096, "n_layers": 48, "n_heads": 32}
    assert sum(c.params for c in profile_blocks(build_model("gpt", config), 4)) > 10**10
    with LocalCluster(tmp_path, nodes=0, heartbeat_timeout=120) as cluster:  # REST-only nodes
        books = Path(__file__)  # any file will do: the plan, not the data, is under test
        fingerprint = proof.fingerprint(books)
        nodes = []
        for i in range(8):  # volunteers that joined over REST, offer 64 GiB each, and prove they hold the file
            response = cluster.http.post("/v1/nodes", json={
                "name": f"big{i}", "address": answering_address(f"127.0.0.{i + 1}"),
                "profile": {"flops": 1e13, "memory_bytes": 64 * GIB, "bandwidth_bytes_per_s": 1e9, "latency_s": 0.01,
                            "datasets": ["books"], "fingerprints": {"books": fingerprint}}})
            assert response.status_code == 201, response.text
            nodes.append(response.json())
        for _ in range(3):
            for node in nodes:
                beat = f"/v1/nodes/{node['node_id']}/heartbeat"
                auth = {"Authorization": f"Bearer {node['node_token']}"}
                asked = cluster.http.post(beat, json={}, headers=auth).json()["challenges"]
                if asked:
                    cluster.http.post(beat, json={"proofs": proof.answers(books, "books", asked)}, headers=auth)
        start = time.monotonic()
        job = {"model": {"name": "gpt", "config": config}, "dataset": {"name": "tokens", "source": "books"},
               "training": {"batch_size": 4, "microbatches_in_flight": 1, "optimizer": {"name": "SGD"}},
               "averaging": {"strategy": "none"}, "placement": {"clusters": 1, "min_nodes": 4}}
        response = cluster.http.post("/v1/jobs", json=job)
        elapsed = time.monotonic() - start
        assert response.status_code == 201, response.text
        job = cluster.job(response.json()["id"])
        peak = peak_rss_bytes(cluster.procs[0].pid)
    assert job["state"] == "placing", job["reason"]
    stages = job["plan"]["clusters"][0]["stages"]
    assert len(stages) >= 2 and all(s["predicted_memory_bytes"] <= 64 * GIB for s in stages)
    print(f"10 B-parameter gpt: planned in {elapsed:.1f} s, coordinator peak RSS {peak / 2**20:.0f} MiB, "
          f"{len(stages)} stages: {job['plan']['reason'][:200]}")
    assert elapsed < 30.0  # about 5 s alone; a bound for a planner gone quadratic, not a benchmark
    assert peak < GIB


@pytest.mark.slow
@pytest.mark.parametrize("optimizer,in_flight,cap", BIG_RUNS)
def test_a_model_larger_than_a_node_trains_within_its_predicted_memory(tmp_path: Path, optimizer: str,
                                                                       in_flight: int, cap: str) -> None:
    weights = sum(c.param_bytes for c in profile_blocks(build_model("gpt", BIG_GPT), 4))
    job = big_job(optimizer, in_flight)
    with LocalCluster(tmp_path, nodes=4, node_args=["--max-memory", cap, *OFFER_TEXT]) as cluster:
        offered = [n["profile"]["memory_bytes"] for n in cluster.alive_nodes()]
        if optimizer == "SGD":
            assert all(weights > offer for offer in offered), "the whole model must not fit any one node"
        result = cluster.wait_job(cluster.submit(job), timeout=600)
    assert result["state"] == "completed", result["reason"]
    assert len(result["plan"]["clusters"][0]["stages"]) == 4
    assert result["final_metrics"]["loss"] < math.log(BIG_GPT["vocab_size"]) - 0.5  # from ln(128) = 4.85 down
    print(f"\n{optimizer} K={in_flight}, cap {cap}, whole model {weights / 2**20:.0f} MiB of fp32 weights")
    for stage in result["metrics"]["stages"]:
        predicted, measured = stage["predicted_memory_bytes"], stage["peak_memory_bytes"]
        print(f"  stage {stage['stage']}: predicted {predicted / 2**20:6.1f} MiB, measured peak above idle "
              f"{measured / 2**20:6.1f} MiB ({measured / predicted:.2f}x)")
        assert 0 < measured <= 1.25 * predicted


@pytest.mark.slow
def test_a_model_larger_than_a_gibibyte_goes_through_a_coordinator_that_stays_under_one(tmp_path: Path) -> None:
    """Two stages of a 1.07 GiB MLP are handed in, checked, merged and downloaded; the coordinator
    never holds a stage or the model whole (it used to load each upload, then every stage to merge:
    about 1.6 GiB at its peak here)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ravnest.models import state_shapes

    config = {"hidden": 8192, "depth": 4}
    spec = build_model("mlp", config)
    total = sum(size for _, size in state_shapes(spec).values())
    assert total > GIB
    job = {"model": {"name": "mlp", "config": config}, "dataset": {"name": "digits"},
           "training": {"steps": 5, "batch_size": 8, "optimizer": {"name": "SGD", "kwargs": {"lr": 0.01}}},
           "averaging": {"strategy": "none"}, "placement": {"clusters": 1, "stages_per_cluster": 2, "min_nodes": 2}}
    with LocalCluster(tmp_path, nodes=0, heartbeat_timeout=120) as cluster:  # two nodes played over REST
        nodes = []
        for i in range(2):
            joined = cluster.http.post("/v1/nodes", headers={"Authorization": f"Bearer {cluster.join_token}"}, json={
                "name": f"big{i}", "address": answering_address(f"127.0.0.{i + 1}"),
                "profile": {"flops": 1e12, "memory_bytes": 32 * GIB, "bandwidth_bytes_per_s": 1e9, "latency_s": 0.01}})
            assert joined.status_code == 201, joined.text
            nodes.append((joined.json()["node_id"], {"Authorization": f"Bearer {joined.json()['node_token']}"}))
        job_id = cluster.submit(job)
        for node_id, auth in nodes:
            beat = lambda: cluster.http.post(f"/v1/nodes/{node_id}/heartbeat", headers=auth,  # noqa: E731
                                             json={"job_id": job_id}).json()["assignment"]
            a = cluster.wait_for(beat, 60, f"{node_id}'s assignment")
            report = {"node_id": node_id, "cluster": a["cluster"], "stage": a["stage"], "step": 5, "metrics": {}}
            assert cluster.http.post(f"/v1/jobs/{job_id}/metrics", headers=auth, json=report).status_code == 204
            file = tmp_path / f"stage{a['stage']}.safetensors"
            stage = spec.blocks(*a["blocks"], device="meta").state_dict()
            save_file({k: torch.zeros(t.shape) for k, t in stage.items()}, str(file))
            with file.open("rb") as body:
                r = cluster.http.put(f"/v1/jobs/{job_id}/weights", params={"cluster": 0, "stage": a["stage"]},
                                     content=body, headers={**auth, "Content-Type": "application/octet-stream"},
                                     timeout=300)
            assert r.status_code == 204, r.text
            file.unlink()
        assert cluster.job(job_id)["state"] == "completed"
        with cluster.http.stream("GET", f"/v1/jobs/{job_id}/model", timeout=300) as response, \
                (tmp_path / "model.safetensors").open("wb") as out:
            for chunk in response.iter_bytes(1 << 20):
                out.write(chunk)
        peak = peak_rss_bytes(cluster.procs[0].pid)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as merged:
        assert sorted(merged.keys()) == sorted(state_shapes(spec))
        assert merged.get_slice("2.0.weight").get_shape() == [8192, 8192]
    print(f"\n{total / GIB:.2f} GiB model through the coordinator: its peak resident memory {peak / GIB:.2f} GiB")
    assert peak < GIB
