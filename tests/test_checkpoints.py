"""Checkpoints against a real coordinator process: a complete set gets a manifest, an upload cut off
mid-body (its node killed while writing) or holding NaN or implausibly grown weights leaves the
previous checkpoint as it was, and a resumed
job's stages fetch exactly the state that checkpoint holds. The test plays the two nodes over REST."""
import socket
from urllib.parse import urlparse

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ravnest.models import build_model
from scripts.local_cluster import LocalCluster, answering_address

MODEL = {"name": "cnn", "config": {"channels": [8, 8]}}
PROFILE = {"flops": 1e10, "memory_bytes": 2**30, "bandwidth_bytes_per_s": 1e8, "latency_s": 0.001}


def stage_state(blocks: tuple[int, int], step: int) -> dict[str, torch.Tensor]:
    """What a node would upload: its blocks' state dict plus Adam-like state per parameter."""
    module = build_model(MODEL["name"], MODEL["config"]).blocks(*blocks, seed=step)
    state = {k: v.contiguous() for k, v in module.state_dict().items()}
    for key, param in module.named_parameters():
        state[f"{key}:exp_avg"] = torch.full_like(param, float(step))
        state[f"{key}:step"] = torch.tensor(float(step))
    return state


def cut_off_upload(url: str, path: str, token: str, body: bytes) -> None:
    """Send the headers and half the body, then close the socket, as a node killed mid-upload does."""
    address = urlparse(url)
    with socket.create_connection((address.hostname, address.port)) as s:
        s.sendall((f"PUT {path} HTTP/1.1\r\nHost: {address.netloc}\r\nAuthorization: Bearer {token}\r\n"
                   f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n").encode())
        s.sendall(body[:len(body) // 2])


def test_a_torn_checkpoint_upload_changes_nothing_and_resume_uses_the_last_complete_one(tmp_path):
    with LocalCluster(tmp_path, nodes=0, heartbeat_timeout=120) as cluster:  # REST-only nodes
        http = cluster.http
        nodes = []
        for i in range(2):
            joined = http.post("/v1/nodes", json={"name": f"n{i}", "address": answering_address(),
                                                  "profile": PROFILE}).json()
            nodes.append((joined["node_id"], joined["node_token"]))

        def beat(node, job_id=None):
            r = http.post(f"/v1/nodes/{node[0]}/heartbeat", json={"job_id": job_id},
                          headers={"Authorization": f"Bearer {node[1]}"})
            assert r.status_code == 200, r.text
            return r.json()

        job_id = cluster.submit({"model": MODEL, "dataset": {"name": "digits"}, "training": {"steps": 200},
                                 "checkpoints": {"every": 50},
                                 "placement": {"clusters": 1, "stages_per_cluster": 2, "min_nodes": 2}})
        assignments = [beat(node)["assignment"] for node in nodes]
        assert all(a["checkpoint_every"] == 50 and a["generation"] == 0 for a in assignments)

        def upload(node, a, step, body):
            return http.put(f"/v1/jobs/{job_id}/checkpoint", content=body,
                            params={"cluster": 0, "stage": a["stage"], "generation": 0, "step": step},
                            headers={"Authorization": f"Bearer {node[1]}"})

        saved = {a["stage"]: stage_state(tuple(a["blocks"]), 50) for a in assignments}
        for node, a in zip(nodes, assignments):
            assert upload(node, a, 50, save_safetensors(saved[a["stage"]])).status_code == 204
        assert cluster.job(job_id)["checkpoint_step"] == 50
        manifest = tmp_path / "jobs" / job_id / "checkpoints" / "manifest.json"
        before = manifest.read_bytes()

        stage0 = next((node, a) for node, a in zip(nodes, assignments) if a["stage"] == 0)
        bad = {**saved[0], next(iter(saved[0])): torch.full_like(next(iter(saved[0].values())), float("nan"))}
        r = upload(*stage0, 100, save_safetensors(bad))
        assert r.status_code == 422 and "NaN" in r.json()["detail"]
        poisoned = {k: v * 1e4 if ":" not in k and v.is_floating_point() else v for k, v in saved[0].items()}
        r = upload(*stage0, 100, save_safetensors(poisoned))  # finite, but no training grows weights so
        assert r.status_code == 422 and "not kept, its weights are implausible" in r.json()["detail"], r.text
        cut_off_upload(cluster.url, f"/v1/jobs/{job_id}/checkpoint?cluster=0&stage=0&generation=0&step=100",
                       stage0[0][1], save_safetensors(stage_state(tuple(stage0[1]["blocks"]), 100)))
        uploads = tmp_path / "jobs" / job_id / "uploads"
        cluster.wait_for(lambda: not any(uploads.iterdir()), 30, "the torn upload's temporary file to be removed")
        assert manifest.read_bytes() == before and cluster.job(job_id)["checkpoint_step"] == 50
        stored = sorted(p.name for p in manifest.parent.glob("*.safetensors"))
        assert len(stored) == 2 and all("-50." in name for name in stored)

        assert http.post(f"/v1/jobs/{job_id}/cancel").json()["state"] == "cancelled"
        r = http.get(f"/v1/jobs/{job_id}/model")  # a cancelled job's training is not lost: its last checkpoint
        assert r.status_code == 200, r.text
        weights = {k: v for stage in saved.values() for k, v in stage.items() if ":" not in k}
        partial = load_safetensors(r.content)
        assert partial.keys() == weights.keys() and all(torch.equal(partial[k], v) for k, v in weights.items())
        from safetensors import safe_open
        (tmp_path / "partial.safetensors").write_bytes(r.content)
        with safe_open(str(tmp_path / "partial.safetensors"), "pt") as handle:
            assert handle.metadata()["step"] == "50"
        for node in nodes:
            beat(node)  # not running it: released
        resumed = http.post(f"/v1/jobs/{job_id}/resume").json()
        assert resumed["generation"] == 1, resumed
        for node in nodes:
            a = beat(node)["assignment"]
            assert a["generation"] == 1 and a["resume_step"] == 50
            r = http.get(f"/v1/jobs/{job_id}/state", params={"cluster": 0, "stage": a["stage"]},
                         headers={"Authorization": f"Bearer {node[1]}"})
            assert r.status_code == 200
            state = load_safetensors(r.content)
            blocks = tuple(a["blocks"])
            expected = {k: v for stage in saved.values() for k, v in stage.items()
                        if blocks[0] <= int(k.split(".", 1)[0]) < blocks[1]}
            assert state.keys() == expected.keys() and all(torch.equal(state[k], v) for k, v in expected.items())
        # someone else's state is not handed out
        r = http.get(f"/v1/jobs/{job_id}/state", params={"cluster": 0, "stage": 0})
        assert r.status_code == 403 and "node's own credential" in r.json()["detail"]
