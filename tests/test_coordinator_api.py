"""The coordinator's REST API, run for real in-process (TestClient) on a temporary store: every test
that takes the `settings` fixture runs twice, on SQLite and on a real PostgreSQL server."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import text
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from coordinator.app import create_app
from coordinator.config import Settings
from coordinator.service.core import planning_bandwidth
from coordinator.store import JobRow, NodeRow, StageRow
from ravnest.averaging.signatures import public_key
from ravnest.data import proof
from ravnest.models import build_model
from scripts.preloaded import Forked

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples" / "jobs").glob("*.json"))
INTERVAL = 1.0
OPERATOR_TOKEN = "operator-s3cret"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


BOOKS = Path(argparse.__file__)  # a text file every machine has: the standard library's argparse source
BOOKS_FINGERPRINT = proof.fingerprint(BOOKS)


def profile(flops: float = 1e10, memory: int = 2**30, bandwidth: float = 1e8, datasets: list[str] = (),
            fingerprints: dict | None = None) -> dict:
    """Offered datasets are the books file unless `fingerprints` says otherwise."""
    return {"flops": flops, "memory_bytes": memory, "bandwidth_bytes_per_s": bandwidth, "latency_s": 0.001,
            "datasets": list(datasets),
            "fingerprints": fingerprints if fingerprints is not None else dict.fromkeys(datasets, BOOKS_FINGERPRINT)}


def digits_job(averaging: dict | None = None, **placement) -> dict:
    return {"name": "t", "model": {"name": "cnn", "config": {"channels": [8, 8]}}, "dataset": {"name": "digits"},
            "training": {"steps": 20, "batch_size": 8}, "averaging": {"every": 5, **(averaging or {})},
            "placement": {"clusters": 2, "min_nodes": 4, "stages_per_cluster": 2, **placement}}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request) -> str | None:
    return request.getfixturevalue("migrated_postgres_url") if request.param == "postgresql" else None


@pytest.fixture
def settings(tmp_path: Path, clock: FakeClock, db_url: str | None) -> Settings:
    return Settings(data_dir=tmp_path, db_url=db_url, heartbeat_interval_s=INTERVAL, background=False, clock=clock,
                    operator_token=OPERATOR_TOKEN)


@pytest.fixture
def client(settings: Settings):
    """Acts as the operator unless a call sends its own Authorization header."""
    with TestClient(create_app(settings), headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}) as c:
        yield c


_ports = itertools.count(5000)


def join(client: TestClient, name: str = "n", headers: dict | None = None, **kw) -> tuple[str, dict]:
    r = client.post("/v1/nodes", json={"name": name, "address": f"127.0.0.1:{next(_ports)}",
                                       "profile": profile(**kw)}, headers=headers)
    assert r.status_code == 201, r.text
    body = r.json()
    return body["node_id"], {"Authorization": f"Bearer {body['node_token']}"}


def beat(client: TestClient, node_id: str, auth: dict, job_id: str | None = None, alone: bool = False,
         proofs: list[dict] = ()) -> dict:
    r = client.post(f"/v1/nodes/{node_id}/heartbeat", json={"job_id": job_id, "training_alone": alone,
                                                          "proofs": list(proofs)}, headers=auth)
    assert r.status_code == 200, r.text
    return r.json()


def prove(client: TestClient, nodes: list[tuple[str, dict]], path: Path = BOOKS, dataset: str = "books") -> None:
    """The nodes answer their challenges from `path` (the first holder fills the bank first)."""
    for _ in range(3):
        for node_id, auth in nodes:
            asked = beat(client, node_id, auth)["challenges"]
            if asked:
                beat(client, node_id, auth, proofs=proof.answers(path, dataset, asked))


def counts(client: TestClient) -> tuple[int, int, int]:
    store = client.app.state.service.store
    return store.count(NodeRow), store.count(JobRow), store.count(StageRow)


def placed_job(client: TestClient, nodes: int = 4, averaging: dict | None = None,
               **placement) -> tuple[str, list[tuple[str, dict]]]:
    members = [join(client, f"node{i}") for i in range(nodes)]
    r = client.post("/v1/jobs", json=digits_job(averaging, **placement))
    assert r.status_code == 201, r.text
    return r.json()["id"], members


def test_the_node_list_says_how_many_and_finds_nodes_by_state_and_name(client: TestClient, clock: FakeClock) -> None:
    """Volunteers can push an operator's own nodes off a page: every page says how many there are in all
    (X-Total-Count), and `state` and `name` (a substring, any case, no wildcards) find the others."""
    joined = {name: join(client, name) for name in ("alpha", "Beta", "alphabet", "50%")}
    page = client.get("/v1/nodes", params={"limit": 2})
    assert len(page.json()) == 2 and page.headers["X-Total-Count"] == "4"
    found = client.get("/v1/nodes", params={"name": "ALPHA"})
    assert sorted(n["name"] for n in found.json()) == ["alpha", "alphabet"] and found.headers["X-Total-Count"] == "2"
    assert [n["name"] for n in client.get("/v1/nodes", params={"name": "%"}).json()] == ["50%"]
    assert len(client.get("/v1/nodes", params={"state": "idle"}).json()) == 4
    clock.now += 100 * INTERVAL  # all silent past their timeout but alpha, which beats
    beat(client, *joined["alpha"])
    gone = client.get("/v1/nodes", params={"state": "gone"})
    assert sorted(n["name"] for n in gone.json()) == ["50%", "Beta", "alphabet"] and gone.headers["X-Total-Count"] == "3"
    assert [n["name"] for n in client.get("/v1/nodes", params={"state": "idle", "name": "alpha"}).json()] == ["alpha"]
    refused = client.get("/v1/nodes", params={"state": "asleep"})
    assert refused.status_code == 422 and "state" in refused.text, refused.text


def test_join_heartbeat_list_leave(client: TestClient) -> None:
    node_id, auth = join(client, "alpha")
    reply = beat(client, node_id, auth)
    reachability = {key: reply.pop(key) for key in ("reachable", "reachability", "relay")}  # (not dialled here)
    assert reply == {"assignment": None, "cancel_job": None, "recover_job": None, "train_alone": None, "probe": [],
                     "note": "", "challenges": [], "heartbeat_interval_s": 1.0}  # (this client's setting: few nodes)
    assert reachability == {"reachable": None, "reachability": "", "relay": None}  # tests dial no node back
    nodes = client.get("/v1/nodes").json()
    assert [(n["id"], n["name"], n["state"]) for n in nodes] == [(node_id, "alpha", "idle")]
    assert nodes[0]["profile"]["flops"] == 1e10
    assert client.delete(f"/v1/nodes/{node_id}", headers=auth).status_code == 204
    assert client.get("/v1/nodes").json()[0]["state"] == "gone"
    r = client.post(f"/v1/nodes/{node_id}/heartbeat", json={}, headers=auth)
    assert r.status_code == 401 and "left" in r.json()["detail"]
    assert client.get("/healthz").json() == {"status": "ok", "nodes_alive": 0, "jobs_active": 0}
    assert client.get("/v1/probe", params={"bytes": 1000}).content == bytes(1000)
    assert client.get("/v1/probe", params={"bytes": -1}).status_code == 422


def test_idle_nodes_are_asked_to_probe_peers_and_their_links_are_kept(client: TestClient) -> None:
    a, b, c = (join(client, name) for name in ("alpha", "beta", "gamma"))
    asked = beat(client, *a)["probe"]
    addresses = {n["id"]: n["address"] for n in client.get("/v1/nodes").json()}
    assert {(p["node_id"], p["address"]) for p in asked} == {(b[0], addresses[b[0]]), (c[0], addresses[c[0]])}
    assert beat(client, *a)["probe"] == []  # asked already: not again before probe_retry_s
    assert beat(client, *b)["probe"] == []  # a target now: two probes through one link would halve both
    links = [{"peer_id": b[0], "bandwidth_bytes_per_s": 5e6, "latency_s": 0.02},
             {"peer_id": "no-such-node", "bandwidth_bytes_per_s": 1e9, "latency_s": 0.0},
             {"peer_id": a[0], "bandwidth_bytes_per_s": 1e9, "latency_s": 0.0}]
    r = client.post(f"/v1/nodes/{a[0]}/heartbeat", json={"links": links}, headers=a[1])
    assert r.status_code == 200 and r.json()["probe"] == []
    views = {n["id"]: n for n in client.get("/v1/nodes").json()}
    assert views[a[0]]["links"] == [{"peer_id": b[0], "bandwidth_bytes_per_s": 5e6, "latency_s": 0.02, "spread": 1.0}]
    assert views[b[0]]["links"] == []
    bad = [{"peer_id": b[0], "bandwidth_bytes_per_s": -1, "latency_s": 0.0}]
    r = client.post(f"/v1/nodes/{a[0]}/heartbeat", json={"links": bad}, headers=a[1])
    assert r.status_code == 422 and "bandwidth_bytes_per_s" in r.text
    views = {n["id"]: n for n in client.get("/v1/nodes").json()}
    assert views[a[0]]["links"][0]["bandwidth_bytes_per_s"] == 5e6  # nothing written
    assert beat(client, *a, job_id="some-job")["probe"] == []  # a node that trains is never asked
    done = [{"peer_id": c[0], "bandwidth_bytes_per_s": 5e6, "latency_s": 0.02}]
    assert client.post(f"/v1/nodes/{a[0]}/heartbeat", json={"links": done}, headers=a[1]).status_code == 200
    assert {p["node_id"] for p in beat(client, *b)["probe"]} == {a[0], c[0]}  # a's probes reported: b's turn


def test_a_link_whose_probe_repeats_lay_far_apart_is_measured_again(client: TestClient) -> None:
    """One probe round on a busy host must not decide a link for good: a link reported with a wide
    spread is asked for again (up to REMEASURES rounds); a clean round replaces it, and a wide one does
    not replace a figure measured clean."""
    from coordinator.service.link_probes import REMEASURES

    a, b = (join(client, name) for name in ("alpha", "beta"))

    def report(bandwidth: float, spread: float) -> dict:
        links = [{"peer_id": b[0], "bandwidth_bytes_per_s": bandwidth, "latency_s": 0.02, "spread": spread}]
        r = client.post(f"/v1/nodes/{a[0]}/heartbeat", json={"links": links}, headers=a[1])
        assert r.status_code == 200, r.text
        return {n["id"]: n for n in client.get("/v1/nodes").json()}[a[0]]["links"][0]

    for round_ in range(1, REMEASURES + 1):
        assert [p["node_id"] for p in beat(client, *a)["probe"]] == [b[0]], f"round {round_}"
        assert report(1e6 * round_, 3.0)["bandwidth_bytes_per_s"] == 1e6 * round_
    assert beat(client, *a)["probe"] == []  # REMEASURES wide rounds: it stays as measured
    assert report(5e6, 1.1)["bandwidth_bytes_per_s"] == 5e6  # a clean figure replaces a wide one
    assert report(2e5, 4.0) == {"peer_id": b[0], "bandwidth_bytes_per_s": 5e6, "latency_s": 0.02, "spread": 1.1}


def test_a_node_that_trains_is_not_probed(client: TestClient) -> None:
    """A probe's megabytes would take a training node's bandwidth and memory: only idle peers are."""
    job_id, members = placed_job(client, nodes=4)
    for node_id, auth in members:
        beat(client, node_id, auth, job_id=job_id)
    idle = join(client, "idle")
    assert beat(client, *idle)["probe"] == []  # the four others train
    spare = join(client, "spare")
    assert [p["node_id"] for p in beat(client, *idle)["probe"]] == [spare[0]]


def test_join_token_is_required_when_set(tmp_path: Path, clock: FakeClock) -> None:
    settings = Settings(data_dir=tmp_path, join_token="s3cret", background=False, clock=clock)
    with TestClient(create_app(settings)) as client:
        body = {"address": "127.0.0.1:1", "profile": profile()}
        assert client.post("/v1/nodes", json=body).status_code == 401
        assert client.post("/v1/nodes", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert counts(client) == (0, 0, 0)
        assert client.post("/v1/nodes", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 201


def test_submit_list_get_cancel(client: TestClient) -> None:
    r = client.post("/v1/jobs", json=digits_job())
    assert r.status_code == 201
    job_id = r.json()["id"]
    assert r.json()["state"] == "pending" and "waiting for 4 idle nodes" in r.json()["reason"]
    assert [j["id"] for j in client.get("/v1/jobs").json()] == [job_id]
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "pending" and job["plan"] is None and job["spec"]["model"]["name"] == "cnn"
    assert client.get(f"/v1/jobs/{job_id}/model").status_code == 409
    cancelled = client.post(f"/v1/jobs/{job_id}/cancel").json()
    assert cancelled["state"] == "cancelled" and [h["state"] for h in cancelled["history"]] == ["pending", "cancelled"]
    r = client.post(f"/v1/jobs/{job_id}/cancel")
    assert r.status_code == 409 and "already cancelled" in r.json()["detail"]
    r = client.get(f"/v1/jobs/{job_id}/model")  # it will not complete by itself: the reason says how it can
    assert r.status_code == 409 and "is cancelled" in r.json()["detail"] and "ravnest resume" in r.json()["detail"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_jobs_are_accepted_as_is(client: TestClient, path: Path) -> None:
    r = client.post("/v1/jobs", content=path.read_bytes(), headers={"Content-Type": "application/json"})
    assert r.status_code == 201, r.text


def test_example_jobs_exist() -> None:
    assert {"digits-cnn.json", "digits-mlp.json", "text-gpt.json"} <= {p.name for p in EXAMPLES}


BAD_JOBS = {
    "unknown model": ({**digits_job(), "model": {"name": "nope"}}, "unknown model"),
    "negative batch": ({**digits_job(), "training": {"batch_size": -1}}, "batch_size"),
    "negative channels": ({**digits_job(), "model": {"name": "cnn", "config": {"channels": [-3]}}}, "channels"),
    "bad config key": ({**digits_job(), "model": {"name": "mlp", "config": {"widht": 3}}}, "widht"),
    "model/dataset mismatch": ({**digits_job(), "model": {"name": "gpt"}}, "classify"),
    "text without source": ({**digits_job(), "model": {"name": "gpt"}, "dataset": {"name": "text"}}, "source"),
    "a path on the nodes": ({**digits_job(), "model": {"name": "gpt"}, "dataset": {"name": "text", "path": "/etc/passwd"}},
                            "never names a file on a volunteer's machine"),
    "unknown optimizer": ({**digits_job(), "training": {"optimizer": {"name": "Nope"}}}, "Nope"),
    "an optimizer in the wrong case": ({**digits_job(), "training": {"optimizer": {"name": "adamw"}}},
                                       "unknown optimizer 'adamw' (did you mean 'AdamW'?)"),
    "bad optimizer kwargs": ({**digits_job(), "training": {"optimizer": {"name": "SGD", "kwargs": {"lr": -1}}}}, "learning rate"),
    "a switch as text": ({**digits_job(), "training": {"optimizer": {"name": "Adam", "kwargs": {"fused": "no"}}}},
                         "fused must be true or false"),
    "zero clusters": (digits_job(clusters=0), "clusters"),
    "too few min_nodes": (digits_job(clusters=3, min_nodes=2), "min_nodes"),
    "wrong input size": ({**digits_job(), "model": {"name": "mlp", "config": {"input_dim": 10}}}, "digits"),
    "extra field": ({**digits_job(), "surprise": 1}, "surprise"),
    "boolean steps": ({**digits_job(), "training": {"steps": True}}, "steps"),  # not 1 step
    "steps as text": ({**digits_job(), "training": {"steps": "30"}}, "steps"),
    "unknown strategy": ({**digits_job(), "averaging": {"strategy": "gossip"}}, "known: acid, ada, auto, dadam, dear, diloco, dsgd, none, ring"),
    "token ids through q4": ({"model": {"name": "llama", "config": {"vocab_size": 512, "residual_rank": 12}},
                              "dataset": {"name": "tokens", "source": "books", "seq_len": 32},
                              "training": {"codec": "q4"}},
                             "training.codec 'q4' would round the token ids a residual_rank model sends"),
}


@pytest.mark.parametrize("name", BAD_JOBS)
def test_bad_jobs_are_refused_with_a_reason_and_nothing_written(client: TestClient, name: str) -> None:
    body, reason = BAD_JOBS[name]
    before = counts(client)
    r = client.post("/v1/jobs", json=body)
    assert r.status_code in (400, 422), r.text
    assert reason in r.json()["detail"]
    assert counts(client) == before


def test_bad_requests_are_refused_and_write_nothing(client: TestClient) -> None:
    node_id, auth = join(client)
    before = counts(client)
    r = client.post("/v1/jobs", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"] == ("the body is not valid JSON (at character 1: Expecting "
                                                           "property name enclosed in double quotes)")
    r = client.post("/v1/nodes", json={"address": "x:1", "profile": profile(memory=-5)})
    assert r.status_code == 422 and "memory_bytes" in r.json()["detail"]
    infinite = b'{"address": "x:1", "profile": {"flops": Infinity, "memory_bytes": 1, "bandwidth_bytes_per_s": 1, ' \
               b'"latency_s": 0}}'  # Python's JSON parser takes this literal; the planner must never see it
    r = client.post("/v1/nodes", content=infinite, headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "finite" in r.json()["detail"]
    for path in ("/v1/jobs/nope", "/v1/jobs/nope/model"):
        r = client.get(path)
        assert r.status_code == 404 and "nope" in r.json()["detail"]
    assert client.post("/v1/jobs/nope/cancel").status_code == 404
    r = client.post(f"/v1/nodes/{node_id}/heartbeat", json={}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["detail"]
    r = client.post(f"/v1/nodes/{node_id}/heartbeat", json={})  # with the operator's key: not a node's call
    assert r.status_code == 403 and "node's own credential" in r.json()["detail"]
    assert client.post("/v1/nodes/nope/heartbeat", json={}, headers=auth).status_code == 404
    assert client.delete(f"/v1/nodes/{node_id}", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert counts(client) == before
    assert client.get("/v1/nodes").json()[0]["state"] == "idle"


def test_state_survives_a_restart(settings: Settings) -> None:
    operator = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
    with TestClient(create_app(settings), headers=operator) as client:
        job_id = client.post("/v1/jobs", json=digits_job()).json()["id"]
        node_id, auth = join(client)
    with TestClient(create_app(settings), headers=operator) as client:
        assert client.get(f"/v1/jobs/{job_id}").json()["state"] == "pending"
        assert beat(client, node_id, auth)["assignment"] is None  # its token still works
        assert [n["id"] for n in client.get("/v1/nodes").json()] == [node_id]


def test_placement_on_four_nodes_in_two_clusters_with_rings(client: TestClient) -> None:
    job_id, members = placed_job(client)
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "placing"
    plan = job["plan"]
    assert len(plan["clusters"]) == 2 and all(len(c["stages"]) == 2 for c in plan["clusters"])
    assignments = {}
    for node_id, auth in members:
        a = beat(client, node_id, auth)["assignment"]
        assert a["job_id"] == job_id and a["num_clusters"] == 2 and a["token"]
        assignments[node_id] = a
    assert client.get(f"/v1/jobs/{job_id}").json()["state"] == "running"
    num_blocks = build_model("cnn", {"channels": [8, 8]}).num_blocks
    for a in assignments.values():
        assert a["rings"], "every stage holds at least one segment"
        for ring in a["rings"]:
            assert len(ring["members"]) == 2  # one per cluster, ordered by cluster
            assert ring["members"][a["cluster"]]["node_id"] in assignments
            held = [assignments[m["node_id"]] for m in ring["members"]]
            assert all(h["blocks"][0] <= ring["blocks"][0] and ring["blocks"][1] <= h["blocks"][1] for h in held)
        assert (a["prev"] is None) == (a["stage"] == 0) and (a["next"] is None) == (a["stage"] == a["num_stages"] - 1)
        # a later stage learns its input's shape from the plan; every stage its predicted memory
        assert (a["input_shape"] is None) == (a["stage"] == 0) and a["predicted_memory_bytes"] > 0
        if a["input_shape"]:
            assert a["input_shape"][0] == 8 and a["input_dtype"] == "float32"
    for cluster in range(2):
        ranges = sorted(tuple(a["blocks"]) for a in assignments.values() if a["cluster"] == cluster)
        assert ranges[0][0] == 0 and ranges[-1][1] == num_blocks and ranges[0][1] == ranges[1][0]
    nodes = {n["id"]: n for n in client.get("/v1/nodes").json()}
    assert all(n["state"] == "busy" and n["job_id"] == job_id and n["cluster"] is not None for n in nodes.values())
    # a second job waits: busy nodes are not given another
    second = client.post("/v1/jobs", json=digits_job()).json()
    assert second["state"] == "pending" and "0 available" in second["reason"]


def stage_weights(assignment: dict, state: dict[str, torch.Tensor]) -> bytes:
    start, end = assignment["blocks"]
    return save_safetensors({k: v.contiguous() for k, v in state.items() if start <= int(k.split(".")[0]) < end})


def test_final_weights_grown_in_a_job_with_peers_replan_it_without_blaming_the_uploader(client: TestClient) -> None:
    """Poison reaches an honest stage through averaging and its neighbours' gradients: the final-weights
    bound refuses what it hands in, and the job re-plans from its last plausible checkpoint, leaving
    out and blaming nobody (a lone stage with no peers is the only one whose growth is its own)."""
    job_id, members = placed_job(client)
    node_id, auth, a = next((n, h, a) for n, h in members if (a := beat(client, n, h)["assignment"])["stage"] == 0)
    grown = {k: v * 1e4 if v.is_floating_point() else v
             for k, v in build_model("cnn", {"channels": [8, 8]}).full_model(seed=1).state_dict().items()}
    report = {"node_id": node_id, "cluster": a["cluster"], "stage": 0, "step": 20, "metrics": {"loss": 0.5}}
    assert client.post(f"/v1/jobs/{job_id}/metrics", json=report, headers=auth).status_code == 204
    r = client.put(f"/v1/jobs/{job_id}/weights?cluster={a['cluster']}&stage=0", content=stage_weights(a, grown),
                   headers=auth)
    assert r.status_code == 422 and "implausible weights" in r.json()["detail"], r.text
    job = client.get(f"/v1/jobs/{job_id}").json()
    [recovery] = job["recoveries"]
    assert job["state"] == "recovering" and recovery["left_out"] == [], recovery
    assert "nobody is left out for it" in recovery["reason"] and recovery["failure"]["kind"] == "implausible"
    with client.app.state.service.store.session() as session:
        assert not session.get_one(NodeRow, node_id).replans_caused


def test_metrics_weights_upload_and_model_download(client: TestClient) -> None:
    job_id, members = placed_job(client)
    assignments = [(node_id, auth, beat(client, node_id, auth)["assignment"]) for node_id, auth in members]
    trained = build_model("cnn", {"channels": [8, 8]}).full_model(seed=123).state_dict()
    node_id, auth, a = assignments[0]
    url = f"/v1/jobs/{job_id}/weights?cluster={a['cluster']}&stage={a['stage']}"
    wrong_blocks = save_safetensors({"99.weight": torch.zeros(1)})
    r = client.put(url, content=wrong_blocks, headers=auth)
    assert r.status_code == 422 and "99.weight" in r.json()["detail"]
    assert client.put(url, content=b"garbage, not safetensors", headers=auth).status_code == 422
    wide = {k: v.double() if v.is_floating_point() else v
            for k, v in load_safetensors(stage_weights(a, trained)).items()}
    r = client.put(url, content=save_safetensors(wide), headers=auth)
    assert r.status_code == 422 and "wrong dtype" in r.json()["detail"] and "float64" in r.json()["detail"]
    other_auth = assignments[1][1]
    assert client.put(url, content=stage_weights(a, trained), headers=other_auth).status_code == 403
    stranger_id, stranger_auth = join(client, "stranger")
    assert client.put(url, content=stage_weights(a, trained), headers=stranger_auth).status_code == 403
    assert client.get(f"/v1/jobs/{job_id}/model").status_code == 409
    first = next(x for x in assignments if x[2]["stage"] == 0)
    r = client.put(f"/v1/jobs/{job_id}/weights?cluster={first[2]['cluster']}&stage=0", headers=first[1],
                   content=save_safetensors(load_safetensors(stage_weights(first[2], trained)),
                                            metadata={"tokenizer": "{not a tokenizer"}))
    assert r.status_code == 422 and "not a tokenizer.json" in r.json()["detail"]

    for node_id, auth, a in sorted(assignments, key=lambda x: (x[2]["cluster"], x[2]["stage"])):
        last = a["stage"] == a["num_stages"] - 1
        report = {"node_id": node_id, "cluster": a["cluster"], "stage": a["stage"], "step": 20,
                  "metrics": {"loss": 0.5, "samples_per_s": 100.0, "utilization": 0.8, "bubble": 0.2,
                              "staleness": float(a["num_stages"] - 1 - a["stage"]),
                              **({"test_accuracy": 0.9 + a["cluster"] / 100} if last else {})}}
        assert client.post(f"/v1/jobs/{job_id}/metrics", json=report, headers=auth).status_code == 204
        r = client.put(f"/v1/jobs/{job_id}/weights?cluster={a['cluster']}&stage={a['stage']}",
                       content=stage_weights(a, trained), headers=auth)
        assert r.status_code == 204, r.text
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "completed", job["reason"]
    assert job["final_metrics"]["test_accuracy"] == pytest.approx(0.9)
    assert job["metrics"]["samples_per_s"] == pytest.approx(200.0) and job["progress"]["fraction"] == 1.0
    # what the pipeline's schedule costs, per stage and overall: waiting and stale weights
    assert job["metrics"]["bubble"] == pytest.approx(0.2)
    assert {(s["stage"], s["utilization"], s["staleness"]) for s in job["metrics"]["stages"]} == {
        (a["stage"], 0.8, float(a["num_stages"] - 1 - a["stage"])) for _, _, a in assignments}
    r = client.get(job["model_url"])
    assert r.status_code == 200
    model = build_model("cnn", {"channels": [8, 8]}).full_model()
    model.load_state_dict(load_safetensors(r.content), strict=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.items())
    r = client.get(job["model_url"], params={"format": "hf"})  # (a llama's: tests/test_llama.py)
    assert r.status_code == 422 and "has no Hugging Face form: only llama models" in r.json()["detail"]
    # finished nodes go idle once they report no job
    for node_id, auth, _ in assignments:
        reply = beat(client, node_id, auth)
        assert reply["assignment"] is None and reply["cancel_job"] is None
    assert {n["state"] for n in client.get("/v1/nodes").json()} == {"idle"}


def test_metrics_are_checked(client: TestClient) -> None:
    job_id, members = placed_job(client)
    node_id, auth = members[0]
    a = beat(client, node_id, auth)["assignment"]
    report = {"node_id": node_id, "cluster": a["cluster"], "stage": a["stage"], "step": 1, "metrics": {"loss": 1.0}}
    assert client.post(f"/v1/jobs/{job_id}/metrics", json={**report, "node_id": members[1][0]},
                       headers=auth).status_code == 403
    assert client.post(f"/v1/jobs/{job_id}/metrics", json={**report, "stage": 7}, headers=auth).status_code == 403
    assert client.post(f"/v1/jobs/{job_id}/metrics", json=report, headers={"Authorization": "Bearer x"}).status_code == 401
    assert client.post("/v1/jobs/nope/metrics", json=report, headers=auth).status_code == 404
    assert client.get(f"/v1/jobs/{job_id}").json()["metrics"]["loss"] is None


def settle(client: TestClient, members: list[tuple[str, dict]]) -> None:
    """Every member heartbeats as a node that stopped would (then the coordinator re-plans)."""
    for node_id, auth in members:
        beat(client, node_id, auth)


def test_one_nodes_word_does_not_fail_a_job_but_two_nodes_that_cannot_start_it_do(client: TestClient) -> None:
    """A report that a stage could not start re-plans the job without the reporter; only a second node
    saying the same fails it (a model that cannot run anywhere), and its other nodes are told to stop."""
    job_id, members = placed_job(client, nodes=6, max_nodes=4)
    settle(client, members)
    where = {node["id"]: node["job_id"] for node in client.get("/v1/nodes").json()}
    placed = [(n, h) for n, h in members if where[n] == job_id]
    (first, first_auth), (second, second_auth) = placed[0], placed[1]
    r = client.post(f"/v1/jobs/{job_id}/fail", json={"node_id": first, "reason": "CUDA out of memory"},
                    headers=first_auth)
    assert r.status_code == 204
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "recovering" and "CUDA out of memory" in job["reason"], job["reason"]
    [recovery] = job["recoveries"]
    assert recovery["left_out"] == [first] and recovery["reported_by"] == first and recovery["could_not_start"]
    settle(client, members)  # they stopped: re-planned on the others, not on the reporter
    job = client.get(f"/v1/jobs/{job_id}").json()
    placed_now = {s["node_id"] for c in job["plan"]["clusters"] for s in c["stages"]}
    assert job["state"] in ("placing", "running") and first not in placed_now and second in placed_now
    settle(client, members)
    r = client.post(f"/v1/jobs/{job_id}/fail", json={"node_id": second, "reason": "CUDA out of memory"},
                    headers=second_auth)
    assert r.status_code == 204
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "failed" and "could not start on 2 different nodes" in job["reason"], job["reason"]
    node_id, auth = next((n, h) for n, h in members if n in placed_now and n != second)
    assert beat(client, node_id, auth, job_id=job_id)["cancel_job"] == job_id  # still running: told to stop
    assert beat(client, node_id, auth)["cancel_job"] == job_id  # stopped: told once more, then released
    assert {n["id"]: n["state"] for n in client.get("/v1/nodes").json()}[node_id] == "idle"


def test_a_report_naming_a_peer_leaves_out_that_peer_and_a_node_whose_reports_keep_replanning_is_quarantined(
        client: TestClient, settings: Settings) -> None:
    job_id, members = placed_job(client, nodes=4, max_recoveries=10)
    settle(client, members)
    (reporter, auth), (named, _) = members[0], members[1]
    failure = {"kind": "peer_lost", "message": "its stream broke", "peer_id": named}
    r = client.post(f"/v1/jobs/{job_id}/fail", headers=auth, json={
        "node_id": reporter, "recoverable": True, "reason": "lost a peer", "failure": failure})
    assert r.status_code == 204
    assert client.get(f"/v1/jobs/{job_id}").json()["recoveries"][0]["left_out"] == [named]
    # its reports caused quarantine_after re-plans (a node training alone leaves out nobody): not placed
    for _ in range(settings.quarantine_after - 1):
        settle(client, members)
        job = client.get(f"/v1/jobs/{job_id}").json()
        assert job["state"] in ("placing", "running") and reporter in {
            s["node_id"] for c in job["plan"]["clusters"] for s in c["stages"]}
        settle(client, members)
        r = client.post(f"/v1/jobs/{job_id}/fail", headers=auth, json={
            "node_id": reporter, "recoverable": True, "still_training": True, "reason": "training alone"})
        assert r.status_code == 204 and client.get(f"/v1/jobs/{job_id}").json()["state"] == "recovering"
    [view] = [n for n in client.get("/v1/nodes").json() if n["id"] == reporter]
    assert view["quarantined_until"] is not None and view["note"].startswith("quarantined: what it reported caused")
    settle(client, members)
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert reporter not in {s["node_id"] for c in job["plan"]["clusters"] for s in c["stages"]}


def test_a_refusal_leaves_out_the_sender_and_outweighs_the_senders_report_that_came_first(client: TestClient) -> None:
    """The attacker's averaging sends NaN; its ring partner refuses it and trains on alone. The attacker
    is quicker: it reports its partner silent, and the job re-plans without the partner. The partner's
    refusal, arriving while the job recovers, puts it back and the attacker out; the blame is the
    attacker's alone (issue 47), for its report: what it sent is one node's word, an accusation that a
    second accuser would make a conviction (failure_rules/accusations.py)."""
    job_id, members = placed_job(client)
    at = {(a["cluster"], a["stage"]): (node_id, auth)
          for node_id, auth in members if (a := beat(client, node_id, auth)["assignment"])}
    (evil, evil_auth), (honest, honest_auth) = at[0, 0], at[1, 0]  # the two members of stage 0's ring
    r = client.post(f"/v1/jobs/{job_id}/fail", headers=evil_auth, json={
        "node_id": evil, "recoverable": True, "still_training": True, "reason": "training alone",
        "failure": {"kind": "timeout", "message": "nothing came", "peer_id": honest}})
    assert r.status_code == 204
    assert client.get(f"/v1/jobs/{job_id}").json()["recoveries"][0]["left_out"] == [honest]
    r = client.post(f"/v1/jobs/{job_id}/fail", headers=honest_auth, json={
        "node_id": honest, "recoverable": True, "still_training": True, "reason": "training alone",
        "failure": {"kind": "nan", "message": "sent values that are not finite; refused", "peer_id": evil}})
    assert r.status_code == 204
    [recovery] = client.get(f"/v1/jobs/{job_id}").json()["recoveries"]
    assert recovery["left_out"] == [evil], recovery
    assert re.fullmatch(rf"node node\d \({honest}\) went silent: cluster 0 stage 0 on node node\d \({evil}\) lost it; "
                        rf"not believed, for node node\d \({evil}\) sent values that are not finite: cluster 1 stage 0 "
                        rf"on node node\d \({honest}\) refused them: the sender is left out instead",
                        recovery["reason"]), recovery["reason"]
    blamed = {n["id"]: n for n in client.get("/v1/nodes").json()}
    with client.app.state.service.store.session() as session:
        caused = {node_id: len(session.get_one(NodeRow, node_id).replans_caused or []) for node_id, _ in members}
    assert caused[evil] == 1 and sum(caused.values()) == 1, caused  # its report
    assert not any(n["quarantined_until"] for n in blamed.values())
    assert {node_id: n["accused_by"] for node_id, n in blamed.items() if n["accused_by"]} == {evil: [honest]}


@pytest.mark.parametrize("root", ["outlier", "local_error"])
def test_a_failures_own_account_outweighs_the_messenger_that_reported_it_first(client: TestClient, root: str) -> None:
    """A pipeline of 3: stage 2 stops (it refused stage 1's activations as an outlier's, or a disk filled)
    and aborts its neighbours, who pass its words on (kind peer_failed). Stage 0, two hops away, reports
    first: the re-plan leaves it out for now, as the failure was its own. The stage whose failure it was
    then reports first-hand, and the re-plan becomes what it would have been had that come first: the
    messenger is back and unblamed, and no longer quarantined where its blame tipped it into quarantine (it
    had two re-plans to answer for already); the sender refused (or the stage that failed) is left out."""
    job_id, members = placed_job(client, nodes=3, clusters=1, stages_per_cluster=3, min_nodes=3)
    auth = dict(members)
    at = {a["stage"]: node_id for node_id, h in members if (a := beat(client, node_id, h)["assignment"])}
    service = client.app.state.service
    earlier = [service.core.clock() - 60.0 * i for i in range(service.core.settings.quarantine_after - 1, 0, -1)]
    with service.store.session() as session:
        session.get_one(NodeRow, at[0]).replans_caused = earlier
    said = "stage 2: its input was off in 2 audits in a row; refused as an outlier" if root == "outlier" else \
        "disk full"
    for stage in (0, 1):  # stage 1 passes it on too, later: no second word changes the re-plan
        r = client.post(f"/v1/jobs/{job_id}/fail", headers=auth[at[stage]], json={
            "node_id": at[stage], "recoverable": True, "reason": "a neighbour failed", "failure": {
                "kind": "peer_failed", "message": f"stage {stage}: its neighbour reported a failure ({said!r})"}})
        assert r.status_code == 204
        assert client.get(f"/v1/jobs/{job_id}").json()["recoveries"][0]["left_out"] == [at[0]]
    assert {n["id"]: n for n in client.get("/v1/nodes").json()}[at[0]]["quarantined_until"]
    failure = {"kind": "outlier", "message": said, "peer_id": at[1]} if root == "outlier" else \
        {"kind": "local_error", "message": said}
    r = client.post(f"/v1/jobs/{job_id}/fail", headers=auth[at[2]], json={
        "node_id": at[2], "recoverable": True, "reason": said, "failure": failure})
    assert r.status_code == 204
    job = client.get(f"/v1/jobs/{job_id}").json()
    [recovery] = job["recoveries"]
    culprit = at[1] if root == "outlier" else at[2]
    assert recovery["left_out"] == [culprit] and recovery["reported_by"] == at[2], recovery
    headline = rf"node node\d \({culprit}\) sent values that cannot be honest, and is left out as an outlier: " \
        if root == "outlier" else rf"cluster 0 stage 2 on node node\d \({culprit}\) failed: "
    assert recovery["failure"]["kind"] == root and re.match(headline, recovery["reason"]), recovery
    assert job["reason"].startswith(recovery["reason"]), job["reason"]
    with service.store.session() as session:
        caused = {node_id: session.get_one(NodeRow, node_id).replans_caused or [] for node_id, _ in members}
    assert caused == {at[0]: earlier, at[1]: [], at[2]: [] if root == "outlier" else caused[at[2]]}, caused
    assert len(caused[at[2]]) == (root != "outlier")
    assert not any(n["quarantined_until"] for n in client.get("/v1/nodes").json())
    accused = {n["id"]: n["accused_by"] for n in client.get("/v1/nodes").json() if n["accused_by"]}
    assert accused == ({at[1]: [at[2]]} if root == "outlier" else {}), accused
    settle(client, members)  # they stopped: placed again without the culprit
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert culprit not in {s["node_id"] for c in (job["plan"] or {"clusters": []})["clusters"] for s in c["stages"]}


def test_a_forged_accusation_costs_an_honest_node_one_job_and_never_its_credential(settings: Settings) -> None:
    """A liar reports a peer its assignment names as an outlier, and 20 s later another one: each is left
    out of the job (one node's word cannot be told from the truth), but neither is blamed or revoked,
    though the operator revokes outliers; the liar, whom nobody corroborated against two nodes within
    `corroborate_within_s` (10 s here), is blamed instead."""
    with TestClient(create_app(dataclasses.replace(settings, revoke_outliers=True, corroborate_within_s=10.0)),
                    headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}) as client:
        job_id, members = placed_job(client)
        auths = dict(members)
        assignments = {node_id: beat(client, node_id, auth)["assignment"] for node_id, auth in members}
        liar, a = next((node_id, a) for node_id, a in assignments.items() if a and a["stage"] == 0)
        victims = [a["next"]["node_id"], next(m["node_id"] for m in a["rings"][0]["members"] if m["node_id"] != liar)]
        for victim in victims:
            r = client.post(f"/v1/jobs/{job_id}/fail", headers=auths[liar], json={
                "node_id": liar, "recoverable": True, "still_training": True, "reason": "training alone",
                "failure": {"kind": "outlier", "message": "3 of the 3 other members found ...", "peer_id": victim}})
            assert r.status_code == 204, r.text
            settings.clock.now += 20
        [recovery] = client.get(f"/v1/jobs/{job_id}").json()["recoveries"]
        assert sorted(recovery["left_out"]) == sorted(victims), recovery
        nodes = {n["id"]: n for n in client.get("/v1/nodes").json()}
        assert all(nodes[v]["accused_by"] == [liar] for v in victims), nodes
        for victim in victims:  # their credentials still work
            beat(client, victim, auths[victim])
        with client.app.state.service.store.session() as session:
            caused = {node_id: len(session.get_one(NodeRow, node_id).replans_caused or []) for node_id, _ in members}
        assert caused == {**dict.fromkeys(auths, 0), liar: 1}, caused


def test_a_stage_whose_averaging_failed_trains_on_and_reports_while_the_job_is_replanned(client: TestClient) -> None:
    job_id, members = placed_job(client)
    assignments = {node_id: beat(client, node_id, auth)["assignment"] for node_id, auth in members}
    node_id, auth = next((n, h) for n, h in members if assignments[n]["cluster"] == 1 and assignments[n]["stage"] == 1)
    r = client.post(f"/v1/jobs/{job_id}/fail", headers=auth, json={
        "node_id": node_id, "reason": "training alone: averaging failed: a peer is gone", "recoverable": True,
        "still_training": True})
    assert r.status_code == 204
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "recovering" and job["recoveries"][0]["kept_training"] == [1]
    # it trains on and reports: its figures reach the job's curve, and nobody counts it as recovered
    report = {"node_id": node_id, "cluster": 1, "stage": 1, "step": 15, "metrics": {"loss": 0.25}}
    assert client.post(f"/v1/jobs/{job_id}/metrics", json=report, headers=auth).status_code == 204
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["recoveries"][0]["recovery_s"] is None and job["metrics"]["loss"] == 0.25
    assert [(p["cluster"], p["step"], p["loss"]) for p in client.get(f"/v1/jobs/{job_id}/curve").json()] == [
        (1, 15, 0.25)]
    # it goes on training alone until the others are done: told `train_alone`, not `recover_job`
    reply = beat(client, node_id, auth, job_id=job_id, alone=True)
    assert reply["train_alone"] == job_id and reply["recover_job"] is None


def test_a_stage_of_a_broken_pipeline_is_not_waited_for_to_train_alone(client: TestClient) -> None:
    """A node that trained in cluster 1 and relayed for cluster 0's second stage dies: both pipelines
    break. Cluster 0's first stage reports it first; cluster 1's report comes while the job already
    recovers. The relayed stage, whose input went silent, neither fails nor can train alone: once every
    cluster said it is broken, it is told to hand in its state at once (it used to be waited for until
    recovery_wait_s, and the state it held was lost)."""
    job_id, members = placed_job(client)
    at = {(a["cluster"], a["stage"]): (node_id, auth)
          for node_id, auth in members if (a := beat(client, node_id, auth)["assignment"])}

    def fail(reporter: tuple[str, dict], lost: tuple[str, dict]) -> None:
        r = client.post(f"/v1/jobs/{job_id}/fail", headers=reporter[1], json={
            "node_id": reporter[0], "recoverable": True, "reason": "lost a peer",
            "failure": {"kind": "peer_lost", "message": "its stream broke", "peer_id": lost[0]}})
        assert r.status_code == 204, r.text
    fail(at[0, 0], at[0, 1])
    assert client.get(f"/v1/jobs/{job_id}").json()["recoveries"][0]["broken"] == [0]
    relayed = at[0, 1]
    assert beat(client, *relayed, job_id=job_id)["train_alone"] == job_id  # cluster 1 may still train on
    fail(at[1, 1], at[1, 0])
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "recovering" and job["recoveries"][0]["broken"] == [0, 1], job["recoveries"]
    assert beat(client, *relayed, job_id=job_id)["recover_job"] == job_id


def test_a_peer_lost_while_it_lives_counts_against_the_relay_it_is_reached_through(client: TestClient,
                                                                                   settings: Settings) -> None:
    """A relayed node its pipeline peer lost, though it still heartbeats: its relay dropped or withheld
    what it carried. The reason names the relay, the relay takes the blame (the node stays in the
    re-plan), and a relay blamed quarantine_after times is quarantined and no longer hands out."""
    job_id, members = placed_job(client, max_recoveries=10)
    relay = join(client, "relay", memory=1 << 20)[0]  # relays only: fits no stage
    at = {(a["cluster"], a["stage"]): (node_id, auth)
          for node_id, auth in members if (a := beat(client, node_id, auth)["assignment"])}
    relayed = at[0, 1][0]
    with client.app.state.service.store.session() as session:
        session.get(NodeRow, relayed).relayed_by = relay
    for _ in range(settings.quarantine_after):
        settle(client, members)
        at = {(a["cluster"], a["stage"]): (node_id, auth) for node_id, auth in members
              if (a := beat(client, node_id, auth, job_id=None)["assignment"])}
        [(c, s)] = [key for key, (node_id, _) in at.items() if node_id == relayed]
        reporter = at[c, 1 - s]
        beat(client, relayed, dict(members)[relayed], job_id=job_id)  # it lives
        r = client.post(f"/v1/jobs/{job_id}/fail", headers=reporter[1], json={
            "node_id": reporter[0], "recoverable": True, "reason": "lost a peer",
            "failure": {"kind": "peer_lost", "message": "its stream broke", "peer_id": relayed}})
        assert r.status_code == 204, r.text
        job = client.get(f"/v1/jobs/{job_id}").json()
        assert "(peers reach it through node relay (" in job["reason"] and "'s relay, which may be" in job["reason"]
        assert relayed not in job["recoveries"][-1]["left_out"]
    [view] = [n for n in client.get("/v1/nodes").json() if n["id"] == relay]
    assert view["quarantined_until"] is not None and "through node relay" in view["note"]


def test_a_lone_stage_that_heartbeats_but_reports_no_progress_is_left_out(client: TestClient, clock: FakeClock,
                                                                         settings: Settings) -> None:
    """Two clusters of one stage each, no averaging: nobody would notice a node that only heartbeats.
    After stall_s without a report it is left out; the one that reports is not."""
    job_id, members = placed_job(client, nodes=2, clusters=2, stages_per_cluster=1, min_nodes=2)
    given = {node_id: beat(client, node_id, auth, job_id=job_id)["assignment"] for node_id, auth in members}
    assert client.get(f"/v1/jobs/{job_id}").json()["state"] == "running"
    (worker, worker_auth), (idler, _) = members
    assert beat(client, worker, worker_auth, job_id=job_id)["assignment"] is None  # it runs it: nothing to tell
    cluster = given[worker]["cluster"]
    for step in (5, 10):
        clock.now += settings.stall_s / 2 + 1
        report = {"node_id": worker, "cluster": cluster, "stage": 0, "step": step, "metrics": {"loss": 1.0}}
        assert client.post(f"/v1/jobs/{job_id}/metrics", json=report, headers=worker_auth).status_code == 204
        for node_id, auth in members:
            beat(client, node_id, auth, job_id=job_id)
        client.app.state.service.tick()
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "recovering" and job["recoveries"][0]["left_out"] == [idler], job["reason"]
    assert "node node1" in job["reason"] and "reported no progress for" in job["reason"]


def test_lost_heartbeats_replan_the_running_job_on_the_survivors(client: TestClient, clock: FakeClock) -> None:
    job_id, members = placed_job(client)
    first_token = beat(client, *members[1], job_id=None)["assignment"]["token"]
    clusters = {node_id: beat(client, node_id, auth, job_id=None)["assignment"]["cluster"] for node_id, auth in members}
    clock.now += 2 * INTERVAL
    for node_id, auth in members[1:]:  # members[0] went silent
        beat(client, node_id, auth, job_id=job_id)
    clock.now += 2 * INTERVAL  # members[0] last seen 4 intervals ago, the others 2
    client.app.state.service.tick()
    assert client.get(f"/v1/jobs/{job_id}").json()["state"] == "running"  # suspect: its cluster may step on
    for _ in range(3):  # ... but it does not (no stage reports a step)
        clock.now += INTERVAL
        for node_id, auth in members[1:]:
            beat(client, node_id, auth, job_id=job_id)
        client.app.state.service.tick()
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "recovering" and members[0][0] in job["reason"] and "heartbeats" in job["reason"]
    assert "its cluster made no step for 3 s" in job["reason"]
    states = {n["id"]: n["state"] for n in client.get("/v1/nodes").json()}
    assert states[members[0][0]] == "gone" and states[members[1][0]] == "busy"
    # the survivors are told to train alone (those of intact clusters train on meanwhile) ...
    survivors = members[1:]
    for node_id, auth in survivors:
        reply = beat(client, node_id, auth, job_id=job_id)
        assert reply["train_alone"] == job_id and reply["recover_job"] is None
    for node_id, auth in survivors[:-1]:
        assert beat(client, node_id, auth, job_id=job_id, alone=True)["train_alone"] == job_id
    # ... and once every one of them trains alone, to stop and hand in; once stopped, they are released
    assert beat(client, *survivors[-1], job_id=job_id, alone=True)["recover_job"] == job_id
    for node_id, auth in survivors:
        assert beat(client, node_id, auth, job_id=job_id, alone=True)["recover_job"] == job_id
        assert beat(client, node_id, auth)["recover_job"] == job_id
    # every survivor said it trained alone, but the lost node's cluster did not train on
    [recovery] = client.get(f"/v1/jobs/{job_id}").json()["recoveries"]
    assert recovery["kept_training"] == [1 - clusters[members[0][0]]] and recovery["hand_in_at"] == clock.now
    client.app.state.service.tick()
    job = client.get(f"/v1/jobs/{job_id}").json()
    # nobody handed in state and there was no checkpoint: it starts over, planned on the 3 survivors
    assert job["generation"] == 1 and "fresh weights" in job["history"][-2]["reason"], job["history"]
    assert job["state"] == "placing" and len(job["recoveries"]) == 1
    placed = {s["node_id"] for c in job["plan"]["clusters"] for s in c["stages"]}
    assert placed == {node_id for node_id, _ in members[1:]}
    assignment = beat(client, *members[1])["assignment"]
    assert assignment["generation"] == 1 and assignment["resume_step"] == 0
    assert assignment["token"] != first_token  # the lost generation's streams are refused from now on
    with client.app.state.service.store.session() as session:  # job credentials are derived, never stored
        rows = [str(tuple(row)) for table in ("jobs", "stages", "nodes")
                for row in session.execute(text(f"SELECT * FROM {table}"))]
    assert not any(token in row for row in rows for token in (first_token, assignment["token"]))


@pytest.mark.parametrize("clusters,robust", [(2, ""), (3, "centered_clip")])
def test_a_job_that_lost_a_cluster_continues_with_fewer_than_it_asked_for(client: TestClient, clock: FakeClock,
                                                                           clusters: int, robust: str) -> None:
    """One-node clusters asked for exactly, no spare: one node dies; the job is not left waiting for a
    cluster that cannot be made, it continues with one fewer (and says so; a robust job on 2 also says
    that a liar can no longer be named)."""
    job_id, members = placed_job(client, nodes=clusters, clusters=clusters, stages_per_cluster=1, min_nodes=clusters,
                                 averaging={"robust": robust} if robust else None)
    for node_id, auth in members:
        beat(client, node_id, auth)
    survivors = members[1:]
    clock.now += 7 * INTERVAL  # members[0] went silent (alone in its cluster: only a long silence convicts it)
    for later in (3 * INTERVAL, 0):
        for node_id, auth in survivors:
            beat(client, node_id, auth, job_id=job_id)
        clock.now += later
    client.app.state.service.tick()
    assert client.get(f"/v1/jobs/{job_id}").json()["state"] == "recovering"
    for node_id, auth in survivors:  # each trains alone meanwhile ...
        beat(client, node_id, auth, job_id=job_id, alone=True)
    for node_id, auth in survivors:  # ... until all do: then they stop
        assert beat(client, node_id, auth, job_id=job_id, alone=True)["recover_job"] == job_id
    for node_id, auth in survivors:  # stopped: released, re-planned, placed at once
        beat(client, node_id, auth)
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] in ("running", "placing") and job["generation"] == 1, job["reason"]
    assert sorted(s["node_id"] for c in job["plan"]["clusters"] for s in c["stages"]) == \
        sorted(node_id for node_id, _ in survivors)
    assert f"{clusters} clusters asked for, {clusters - 1} on the nodes there now" in job["plan"]["reason"]
    assert ("robust averaging cannot tell which one lies" in job["plan"]["reason"]) == bool(robust)


@pytest.mark.parametrize("late_one_beats", [True, False])
def test_a_replan_waits_a_few_beats_for_its_own_late_node_before_planning_on_fewer(
        client: TestClient, clock: FakeClock, settings: Settings, late_one_beats: bool) -> None:
    """Three one-node clusters; one dies. While the job is re-planned one survivor's beats are late (a busy
    host): the re-plan waits replan_wait_intervals of its beats for it rather than shrink the job to the
    one node idle that moment; once it beats, both survivors are placed. One that stays silent is not
    waited for past that bound."""
    job_id, members = placed_job(client, nodes=3, clusters=3, stages_per_cluster=1, min_nodes=3)
    for node_id, auth in members:
        beat(client, node_id, auth)
    (late, late_auth), (prompt, prompt_auth) = members[1:]
    clock.now += 7 * INTERVAL  # members[0] is dead: silent until a long silence convicts it
    for later in (3 * INTERVAL, 0):
        for node_id, auth in members[1:]:
            beat(client, node_id, auth, job_id=job_id)
        clock.now += later
    client.app.state.service.tick()
    for node_id, auth in members[1:]:  # both train alone, then are told to stop and hand in
        beat(client, node_id, auth, job_id=job_id, alone=True)
    for node_id, auth in members[1:]:
        assert beat(client, node_id, auth, job_id=job_id, alone=True)["recover_job"] == job_id
    beat(client, prompt, prompt_auth)  # stopped: released; the late one says nothing for a while
    clock.now += 3 * INTERVAL
    beat(client, prompt, prompt_auth)
    client.app.state.service.tick()
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "pending" and job["generation"] == 1, job["reason"]
    assert "waiting up to 3 s more for 1 node of its last run to beat again (node1) before planning on fewer" \
        in job["reason"], job["reason"]
    if late_one_beats:
        beat(client, late, late_auth)
        expected, clusters = {late, prompt}, 2
    else:
        clock.now += settings.replan_wait_intervals * INTERVAL
        beat(client, prompt, prompt_auth)
        client.app.state.service.tick()
        expected, clusters = {prompt}, 1
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] in ("running", "placing"), job["reason"]
    assert {s["node_id"] for c in job["plan"]["clusters"] for s in c["stages"]} == expected
    assert f"3 clusters asked for, {clusters} on the nodes there now" in job["plan"]["reason"]


def test_placement_failure_gives_a_reason(client: TestClient) -> None:
    for i in range(4):
        join(client, f"tiny{i}", memory=1 << 20)
    r = client.post("/v1/jobs", json=digits_job())
    assert r.status_code == 201
    job = client.get(f"/v1/jobs/{r.json()['id']}").json()
    assert job["state"] == "failed" and "cannot place" in job["reason"] and "MiB" in job["reason"]


def test_a_node_that_fits_nowhere_is_told_why(client: TestClient) -> None:
    tiny_id, tiny_auth = join(client, "tiny", memory=1 << 20)
    job_id, members = placed_job(client)
    plan = client.get(f"/v1/jobs/{job_id}").json()["plan"]
    assert tiny_id in plan["unused"] and tiny_id not in {s["node_id"] for c in plan["clusters"] for s in c["stages"]}
    note = beat(client, tiny_id, tiny_auth)["note"]
    assert job_id in note and "MiB" in note and "smallest block" in note
    views = {n["id"]: n for n in client.get("/v1/nodes").json()}
    assert views[tiny_id]["note"] == note and views[members[0][0]]["note"] == ""
    assert beat(client, *members[0])["note"] == ""  # placed nodes hear nothing of the kind


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def coordinator_process(data_dir: Path, *args: str) -> Iterator[tuple[str, Forked]]:
    """A real coordinator process (`python -m coordinator.cli`, forked from the process that imported
    torch once: scripts/preloaded.py) on a free port: (its URL, the process), stopped after."""
    port = free_port()
    process = Forked("coordinator.cli", ["--host", "127.0.0.1", "--port", str(port), "--relay-port", "0",
                                         "--data-dir", str(data_dir), "--log-level", "warning", *args],
                     {**os.environ, "PYTHONUNBUFFERED": "1"}, ROOT, data_dir / "coordinator.log")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/healthz", timeout=2)
                break
            except httpx.TransportError:
                assert process.poll() is None, f"coordinator exited early: {(data_dir / 'coordinator.log').read_text()}"
                assert time.monotonic() < deadline, "coordinator did not answer within 60 s"
                time.sleep(0.1)
        yield url, process
    finally:
        process.terminate()
        process.wait(timeout=20)


def test_real_coordinator_process_serves_health_and_docs(tmp_path: Path) -> None:
    with coordinator_process(tmp_path) as (url, _):
        health = httpx.get(f"{url}/healthz", timeout=2)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        for page, word in (("/docs", "swagger"), ("/redoc", "redoc")):
            docs = httpx.get(f"{url}{page}", timeout=5)
            assert docs.status_code == 200 and word in docs.text.lower()
            assets = re.findall(r"""(?:src|href)=['"]([^'"]+)['"]""", docs.text)
            assert assets and all(a.startswith("/static/") for a in assets), assets  # no CDN: works offline
            assert all(httpx.get(f"{url}{a}", timeout=5).status_code == 200 for a in assets)
        spec = httpx.get(f"{url}/openapi.json", timeout=5).json()
        assert "/v1/jobs/{job_id}/weights" in spec["paths"]
        assert (tmp_path / "coordinator.db").exists()


def test_oversized_weights_upload_is_refused(client: TestClient, settings: Settings) -> None:
    job_id, members = placed_job(client)
    node_id, auth = members[0]
    a = beat(client, node_id, auth)["assignment"]
    r = client.put(f"/v1/jobs/{job_id}/weights?cluster={a['cluster']}&stage={a['stage']}",
                   content=bytes(3 << 20), headers=auth)
    assert r.status_code == 413 and "limit" in r.json()["detail"]
    assert not list((settings.data_dir / "jobs" / job_id).rglob("*.safetensors"))


def test_a_model_that_cannot_fit_the_joined_nodes_fails_with_the_figures(client: TestClient) -> None:
    prove(client, [join(client, f"small{i}", memory=64 << 20, datasets=["books"]) for i in range(2)])
    big = {"name": "big", "model": {"name": "gpt", "config": {"d_model": 1024, "n_layers": 8}},
           "dataset": {"name": "text", "source": "books"},
           "placement": {"min_nodes": 2}}
    response = client.post("/v1/jobs", json=big)
    assert response.status_code == 201, response.text
    job = client.get(f"/v1/jobs/{response.json()['id']}").json()
    assert job["state"] == "failed"
    assert re.search(r"cannot place the job: .*the model needs [\d,]+ MiB.*the 2 nodes offer \w+ 64 MiB, "
                     r"\w+ 64 MiB", job["reason"]), job["reason"]
    assert all(n["state"] == "idle" for n in client.get("/v1/nodes").json())  # nothing was reserved


def test_placement_max_nodes_must_not_be_below_min_nodes(client: TestClient) -> None:
    response = client.post("/v1/jobs", json=digits_job(min_nodes=4, max_nodes=2))
    assert response.status_code == 422 and "max_nodes" in response.text


def test_a_robust_job_asking_for_fewer_than_3_clusters_is_refused_at_submit(client: TestClient) -> None:
    spec = {**digits_job(), "averaging": {"robust": "centered_clip"}}  # 2 clusters x 2 stages
    response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 422 and "of 2 nobody can tell which one lies" in response.json()["detail"]
    spec["placement"] = {**spec["placement"], "clusters": "auto"}  # the planner says so where it places 2
    assert client.post("/v1/jobs", json=spec).status_code == 201


def test_a_job_waits_for_the_nodes_its_shape_asks_for_without_min_nodes(client: TestClient) -> None:
    spec = digits_job()
    del spec["placement"]["min_nodes"]  # 2 clusters x 2 stages: 4 nodes, unsaid
    for i in range(3):
        join(client, f"n{i}")
    response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    job = client.get(f"/v1/jobs/{response.json()['id']}").json()
    assert job["spec"]["placement"]["min_nodes"] == 4
    assert job["state"] == "pending" and "waiting for 4 idle nodes (3 available)" in job["reason"]


def test_a_pending_job_fails_once_its_placement_timeout_passes(client: TestClient, clock: FakeClock) -> None:
    join(client, "lonely")
    job_id = client.post("/v1/jobs", json=digits_job(timeout_s=30)).json()["id"]
    client.app.state.service.tick()
    assert client.get(f"/v1/jobs/{job_id}").json()["state"] == "pending"
    clock.now += 31
    client.app.state.service.tick()
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "failed" and "placement.timeout_s = 30" in job["reason"] and "waiting for 4" in job["reason"]


def test_recoveries_are_bounded_and_a_stage_that_cannot_start_fails_the_job(client: TestClient) -> None:
    job_id, members = placed_job(client, max_recoveries=0)
    for node_id, auth in members:
        beat(client, node_id, auth)
    r = client.post(f"/v1/jobs/{job_id}/fail", headers=members[0][1],
                    json={"node_id": members[0][0], "reason": "lost its next stage", "recoverable": True})
    assert r.status_code == 204
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "failed" and "max_recoveries = 0" in job["reason"]
    r = client.post(f"/v1/jobs/{job_id}/resume")
    assert r.status_code == 409 and "no checkpoint" in r.json()["detail"]
    assert client.post("/v1/jobs/nope/resume").status_code == 404


def test_a_failure_report_names_the_lost_node_first_and_keeps_the_detail(client: TestClient) -> None:
    """The first to report a lost peer is usually a survivor: the reason starts with the node it lost,
    in words; the transport's own words stay in the recovery record's event."""
    job_id, members = placed_job(client)
    for node_id, auth in members:
        beat(client, node_id, auth)
    address = {n["id"]: n["address"] for n in client.get("/v1/nodes").json()}
    (reporter, auth), (lost, _) = members[0], members[1]
    failure = {"kind": "peer_lost", "message": "ring round 80 lost a member", "peer_id": lost,
               "peer_address": address[lost], "step": 80,
               "detail": f"ring round 80: sending to {address[lost]}: UNAVAILABLE: Socket closed"}
    r = client.post(f"/v1/jobs/{job_id}/fail", headers=auth, json={
        "node_id": reporter, "recoverable": True, "reason": "PeerError: ...", "failure": failure})
    assert r.status_code == 204
    [recovery] = client.get(f"/v1/jobs/{job_id}").json()["recoveries"]
    assert recovery["reason"].startswith(f"node node1 ({lost}) stopped answering: cluster "), recovery["reason"]
    assert f"on node node0 ({reporter}) lost it" in recovery["reason"] and "UNAVAILABLE" not in recovery["reason"]
    assert recovery["failure"]["kind"] == "peer_lost" and recovery["failure"]["detail"].endswith("Socket closed")


def test_a_database_from_an_older_version_is_refused_with_a_reason(tmp_path: Path) -> None:
    import sqlite3
    old = tmp_path / "coordinator.db"
    with sqlite3.connect(old) as db:  # the jobs table as it was before recovery existed
        db.execute("CREATE TABLE jobs (id VARCHAR(32) PRIMARY KEY, name VARCHAR(256), spec JSON, state VARCHAR(16), "
                   "reason TEXT, created_at FLOAT, updated_at FLOAT, history JSON, job_token VARCHAR(64), plan JSON, "
                   "final_metrics JSON)")
    log = tmp_path / "coordinator.log"
    returncode = Forked("coordinator.cli", ["--data-dir", str(tmp_path), "--port", "9"], dict(os.environ), ROOT,
                        log).wait(timeout=60)
    said = log.read_text()
    assert returncode == 1 and "older Ravnest" in said and "jobs.generation" in said, said
    assert "Traceback" not in said


def test_secure_by_default_every_job_and_node_endpoint_needs_a_credential(tmp_path: Path) -> None:
    """No tokens configured: the coordinator makes its own (owner-only files); only /healthz and the
    docs are open, and a refusal comes before the body is even parsed."""
    with TestClient(create_app(Settings(data_dir=tmp_path, background=False))) as client:
        operator = (tmp_path / "operator_token").read_text().strip()
        join_token = (tmp_path / "join_token").read_text().strip()
        owner_only = [*tmp_path.glob("*_token"), tmp_path / "coordinator.db"]
        assert {oct(p.stat().st_mode & 0o777) for p in owner_only} == {"0o600"}
        assert client.get("/healthz").status_code == 200 and client.get("/openapi.json").status_code == 200
        node_id, node_auth = join(client, headers={"Authorization": f"Bearer {join_token}"})
        job = digits_job()
        calls = [("POST", "/v1/jobs", job), ("GET", "/v1/jobs", None), ("GET", "/v1/jobs/x", None),
                 ("POST", "/v1/jobs/x/cancel", None), ("POST", "/v1/jobs/x/resume", None),
                 ("GET", "/v1/jobs/x/model", None), ("GET", "/v1/nodes", None), ("GET", "/v1/probe", None),
                 ("POST", "/v1/nodes", {"address": "127.0.0.1:1", "profile": profile()}),
                 ("POST", f"/v1/nodes/{node_id}/heartbeat", {}), ("DELETE", f"/v1/nodes/{node_id}", None),
                 ("POST", "/v1/jobs/x/metrics", {}), ("POST", "/v1/jobs/x/fail", {}),
                 ("PUT", "/v1/jobs/x/weights?cluster=0&stage=0", None), ("GET", "/v1/jobs/x/state", None),
                 ("POST", "/v1/join-tokens", {}), ("GET", "/v1/join-tokens", None),
                 ("DELETE", "/v1/join-tokens/join", None), ("POST", "/v1/keys", {"role": "operator"}),
                 ("GET", "/v1/keys", None), ("DELETE", "/v1/keys/operator", None),
                 ("POST", f"/v1/nodes/{node_id}/revoke", None)]
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic x"}):
            for method, path, body in calls:
                r = client.request(method, path, json=body, headers=headers)
                assert r.status_code == 401 and r.json()["detail"], (method, path, headers, r.text)
        as_operator = {"Authorization": f"Bearer {operator}"}
        assert counts(client) == (1, 0, 0) and len(client.get("/v1/keys", headers=as_operator).json()) == 1
        # authentication before parsing: a wrong token with a broken body is a 401, not a 422
        for method, path in (("POST", "/v1/nodes"), ("POST", "/v1/jobs"), ("POST", f"/v1/nodes/{node_id}/heartbeat")):
            r = client.request(method, path, content=b"{not json", headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401, (path, r.text)
        # each credential opens only its own doors
        as_node = client.post("/v1/jobs", json=job, headers=node_auth)
        assert as_node.status_code == 403 and "submitter or operator key" in as_node.json()["detail"]
        as_joiner = client.get("/v1/jobs", headers={"Authorization": f"Bearer {join_token}"})
        assert as_joiner.status_code == 403 and counts(client) == (1, 0, 0)
        r = client.post("/v1/jobs", json=job, headers={"Authorization": f"Bearer {operator}"})
        assert r.status_code == 201 and counts(client)[1] == 1


def test_the_dashboard_asks_for_a_key_once(client: TestClient) -> None:
    anonymous = {"Authorization": ""}
    r = client.get("/", headers=anonymous, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/login"
    assert "API key" in client.get("/login", headers=anonymous).text
    r = client.post("/login", data={"token": "guess"}, headers=anonymous, follow_redirects=False)
    assert r.status_code == 401 and "unknown token" in r.text
    r = client.post("/login", data={"token": OPERATOR_TOKEN}, headers=anonymous, follow_redirects=False)
    assert r.status_code == 303 and "httponly" in r.headers["set-cookie"].lower()
    assert client.get("/", headers=anonymous).status_code == 200  # the cookie is kept by the client
    assert client.get("/v1/jobs", headers=anonymous).status_code == 200


def test_the_dashboard_says_when_a_list_is_cut(client: TestClient, monkeypatch) -> None:
    from coordinator.routes import site
    monkeypatch.setattr(site, "DASHBOARD_ROWS", 2)
    for name in ("a", "b", "c"):
        join(client, name)
    page = client.get("/").text
    assert '<span id="node-count">(2 of 3 shown)</span>' in page and '<span id="job-count">(0)</span>' in page


def test_a_job_runs_only_on_nodes_that_offer_its_dataset(client: TestClient) -> None:
    join(client, "plain")
    job = {"model": {"name": "gpt", "config": {"n_layers": 1}}, "dataset": {"name": "text", "source": "books"}}
    job_id = client.post("/v1/jobs", json=job).json()["id"]
    view = client.get(f"/v1/jobs/{job_id}").json()
    assert view["state"] == "pending" and "proven to hold dataset 'books' (0 available)" in view["reason"]
    assert view["reason"].startswith("no node offers dataset 'books' (volunteers offer it with `ravnest-node join "
                                     "--dataset books=PATH`) yet; waiting for 1 idle node"), view["reason"]
    offering_id, _ = join(client, "library", datasets=["books"])
    view = client.get(f"/v1/jobs/{job_id}").json()
    assert view["state"] == "placing"
    assert {s["node_id"] for c in view["plan"]["clusters"] for s in c["stages"]} == {offering_id}
    sha = BOOKS_FINGERPRINT.split(":")[1]
    assert view["spec"]["dataset"]["sha256"] == sha  # the content it was placed on, pinned for the rest of the job


def test_a_job_with_starting_weights_runs_only_on_nodes_that_offer_its_data_and_its_weights(
        client: TestClient, tmp_path: Path) -> None:
    """Fine-tuning reads two offered files: a node needs both, and both contents are pinned."""
    weights = tmp_path / "llama.safetensors"
    weights.write_bytes(b"w" * 64)
    both = {"books": BOOKS_FINGERPRINT, "tiny-llama": proof.fingerprint(weights)}
    prove(client, [join(client, "data only", datasets=["books"])])  # the first holder: its bank is filled
    job = {"model": {"name": "llama", "config": {"num_hidden_layers": 1}, "weights": {"source": "tiny-llama"}},
           "dataset": {"name": "tokens", "source": "books", "seq_len": 32}, "placement": {"clusters": 1}}
    job_id = client.post("/v1/jobs", json=job).json()["id"]
    view = client.get(f"/v1/jobs/{job_id}").json()
    assert view["state"] == "pending", view
    assert "proven to hold dataset 'books' and model weights 'tiny-llama' (0 available)" in view["reason"]
    assert view["reason"].startswith("no node offers model weights 'tiny-llama' (volunteers offer it with "
                                     "`ravnest-node join --model-file tiny-llama=PATH`) yet")
    holder = join(client, "both", datasets=["books", "tiny-llama"], fingerprints=both)
    assert client.get(f"/v1/jobs/{job_id}").json()["state"] == "pending"  # its copy of 'books' is not proven yet
    prove(client, [holder])  # (a challenge on 'books'; it was first to offer the weights)
    view = client.get(f"/v1/jobs/{job_id}").json()
    assert view["state"] in ("placing", "running") and {s["node_id"] for c in view["plan"]["clusters"] for s in c["stages"]} == {
        holder[0]}
    assert view["spec"]["model"]["weights"]["sha256"] == proof.fingerprint(weights).split(":")[1]
    assert view["spec"]["dataset"]["sha256"] == BOOKS_FINGERPRINT.split(":")[1]


def test_a_node_reads_a_file_only_once_it_proved_it_holds_that_content(client: TestClient, tmp_path: Path) -> None:
    """The first to offer a content answers a bank of challenges; a node that copied its fingerprint
    without the file fails one and is refused; a node offering other bytes under the same name holds its
    own content, which a job reads only when it pins it."""
    honest = join(client, "library", datasets=["books"])
    prove(client, [honest])  # the bank is filled
    copier = join(client, "copier", datasets=["books"])  # the same fingerprint, not the file
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"x" * 100)
    other = join(client, "other", datasets=["books"], fingerprints={"books": proof.fingerprint(empty)})
    prove(client, [copier], path=empty)  # it answers from what it has
    prove(client, [other], path=empty)
    offers = {n["name"]: n["offers"]["books"] for n in client.get("/v1/nodes").json()}
    assert offers["library"] == "first" and offers["other"] == "first", offers
    assert offers["copier"].startswith("refused: its proof of holding 'books' did not match"), offers
    second = join(client, "library2", datasets=["books"])
    prove(client, [second])
    assert {n["name"]: n["offers"]["books"] for n in client.get("/v1/nodes").json()}["library2"] == "proven"

    job = {"model": {"name": "gpt", "config": {"n_layers": 1}}, "dataset": {"name": "text", "source": "books"},
           "placement": {"clusters": 1, "min_nodes": 1}}
    view = client.get(f"/v1/jobs/{client.post('/v1/jobs', json=job).json()['id']}").json()
    placed = {s["node_id"] for c in view["plan"]["clusters"] for s in c["stages"]}
    assert placed <= {honest[0], second[0]} and placed, view["reason"]  # the content most holders proved
    pinned = {**job, "dataset": {**job["dataset"], "sha256": proof.fingerprint(empty).split(":")[1]}}
    view = client.get(f"/v1/jobs/{client.post('/v1/jobs', json=pinned).json()['id']}").json()
    assert {s["node_id"] for c in view["plan"]["clusters"] for s in c["stages"]} == {other[0]}


def test_a_model_with_tied_embeddings_is_planned_as_one_node_pipelines_or_refused_saying_why(
        client: TestClient) -> None:
    """Tied embeddings put the first and last blocks on one stage: a job asking for deeper pipelines is
    refused at once, and one too big for any single node waits saying why, where the same model untied
    is cut into stages over the same nodes."""
    config = {"vocab_size": 8000, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4}
    job = {"dataset": {"name": "tokens", "source": "books", "seq_len": 32},
           "training": {"batch_size": 4}, "averaging": {"strategy": "none"}, "placement": {"clusters": 1}}
    tied = {**job, "model": {"name": "llama", "config": {**config, "tie_word_embeddings": True}}}
    r = client.post("/v1/jobs", json={**tied, "placement": {"clusters": 1, "stages_per_cluster": 2}})
    assert r.status_code == 422, r.text
    assert "tied embeddings" in r.json()["detail"] and "set it to 1" in r.json()["detail"]
    nodes = [join(client, f"small{i}", memory=256 << 20, datasets=["books"]) for i in range(4)]
    prove(client, nodes)
    view = client.get(f"/v1/jobs/{client.post('/v1/jobs', json=tied).json()['id']}").json()
    assert view["state"] == "failed", view
    assert "first and last blocks share a tensor, tied embeddings" in view["reason"], view["reason"]
    untied = {**job, "model": {"name": "llama", "config": config}}
    view = client.get(f"/v1/jobs/{client.post('/v1/jobs', json=untied).json()['id']}").json()
    assert view["state"] in ("placing", "running") and len(view["plan"]["clusters"][0]["stages"]) >= 2, view["reason"]


def test_typos_in_a_job_spec_get_a_did_you_mean(client: TestClient) -> None:
    job = digits_job()
    for body, words in (({**job, "trainig": {}}, "trainig: Extra inputs are not permitted (did you mean 'training'?)"),
                        ({**job, "training": {"stpes": 3}}, "training.stpes: Extra inputs are not permitted (did "
                                                            "you mean 'steps'?)"),
                        ({**job, "model": {"name": "cnnn"}}, "unknown model 'cnnn' (did you mean 'cnn'?)"),
                        ({**job, "model": {"name": "cnn", "config": {"chanels": [8]}}},
                         "unknown config key 'chanels' (did you mean 'channels'?)"),
                        ({**job, "averaging": {"codec": "topl"}},
                         "averaging.codec: 'topl' is not a codec for averaging (did you mean 'topk'?)")):
        r = client.post("/v1/jobs", json=body)
        assert r.status_code == 422 and words in r.json()["detail"], r.text
        assert "Value error" not in r.json()["detail"]  # pydantic's words, not ours


def test_a_text_job_whose_vocabulary_is_larger_than_bytes_is_refused_saying_what_to_do(client: TestClient) -> None:
    job = {"model": {"name": "gpt", "config": {"vocab_size": 50257}}, "dataset": {"name": "text", "source": "books"}}
    r = client.post("/v1/jobs", json=job)
    assert r.status_code == 422 and "256 ids at most, but the model's vocab_size is 50257" in r.json()["detail"]
    assert "ravnest data prepare" in r.json()["detail"]


def join_with_identity(client: TestClient, identity: str, name: str = "n"):
    return client.post("/v1/nodes", json={"name": name, "address": f"127.0.0.1:{next(_ports)}",
                                          "profile": profile(), "identity": identity})


def test_a_node_that_joins_again_with_its_identity_keeps_its_id_and_row(client: TestClient) -> None:
    secret = "ab" * 32
    first = join_with_identity(client, secret).json()
    old = {"Authorization": f"Bearer {first['node_token']}"}
    # it restarted faster than the heartbeat timeout: the same row, its old session over
    again = join_with_identity(client, secret, name="renamed")
    assert again.status_code == 201 and again.json()["node_id"] == first["node_id"]
    assert client.post(f"/v1/nodes/{first['node_id']}/heartbeat", json={}, headers=old).status_code == 401
    rows = client.get("/v1/nodes").json()
    assert [(n["id"], n["name"], n["state"]) for n in rows] == [(first["node_id"], "renamed", "idle")]
    # it left (SIGTERM) and started again: still one row, idle again
    left = {"Authorization": f"Bearer {again.json()['node_token']}"}
    assert client.delete(f"/v1/nodes/{first['node_id']}", headers=left).status_code == 204
    assert client.get("/v1/nodes").json()[0]["state"] == "gone"
    assert join_with_identity(client, secret, name="renamed").json()["node_id"] == first["node_id"]
    assert [(n["id"], n["state"]) for n in client.get("/v1/nodes").json()] == [(first["node_id"], "idle")]
    assert join_with_identity(client, "cd" * 32).json()["node_id"] != first["node_id"]  # another machine
    assert join_with_identity(client, "").json()["node_id"] != first["node_id"]  # none: a new node
    refused = join_with_identity(client, "not hex")
    assert refused.status_code == 422 and "identity" in refused.json()["detail"]
    # the operator revoked it: its identity file cannot bring it back
    assert client.post(f"/v1/nodes/{first['node_id']}/revoke").status_code == 204
    again = join_with_identity(client, secret)
    assert again.status_code == 401 and "was revoked" in again.json()["detail"]


def test_a_node_that_restarts_while_holding_work_is_lost_to_its_job_saying_so(client: TestClient) -> None:
    secret = "ef" * 32
    volunteer = join_with_identity(client, secret, name="v").json()["node_id"]
    for i in range(3):
        join(client, f"n{i}")
    job_id = client.post("/v1/jobs", json=digits_job()).json()["id"]
    placed = client.get(f"/v1/jobs/{job_id}").json()
    assert volunteer in {s["node_id"] for c in placed["plan"]["clusters"] for s in c["stages"]}
    assert join_with_identity(client, secret, name="v").json()["node_id"] == volunteer
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["reason"].startswith(f"node v ({volunteer}) restarted while holding cluster"), job["reason"]


def test_a_node_changes_its_offers_without_rejoining_and_only_its_own(client: TestClient) -> None:
    node, auth = join(client, "a")
    other, other_auth = join(client, "b")
    body = {"datasets": ["books"], "fingerprints": {"books": BOOKS_FINGERPRINT}}
    assert client.put(f"/v1/nodes/{node}/offers", json=body, headers=auth).status_code == 204
    [row] = [n for n in client.get("/v1/nodes").json() if n["id"] == node]
    assert "books" in row["offers"]
    assert client.put(f"/v1/nodes/{node}/offers", json=body, headers=other_auth).status_code in (401, 403)
    assert client.put(f"/v1/nodes/{node}/offers", json={"datasets": ["../etc"]}, headers=auth).status_code == 422
    assert client.put(f"/v1/nodes/{node}/offers", json={}, headers=auth).status_code == 204  # withdrawn
    [row] = [n for n in client.get("/v1/nodes").json() if n["id"] == node]
    assert row["offers"] == {}


def test_a_node_once_left_out_of_a_job_is_no_helper_for_it(client: TestClient, clock: FakeClock,
                                                          settings: Settings) -> None:
    """Built directly: a running job whose last re-plan left out idle nodes that would speed it up.
    It is not re-planned onto them (before, it was, and left them out again, round after round); the
    same nodes never left out are taken in."""
    from coordinator.schemas import Recovery
    job_id, members = placed_job(client, nodes=2, clusters="auto", min_nodes=2, stages_per_cluster=2)
    for node_id, auth in members:
        beat(client, node_id, auth)  # (its assignment)
    fast = [join(client, f"fast{i}", flops=1e13) for i in range(2)]  # a pipeline of their own: far faster
    service = client.app.state.service

    def left_out(nodes: list[str]) -> None:
        with service.store.session() as session:
            session.get(JobRow, job_id).faults = [Recovery(at=clock(), reason="too slow", generation=0,
                                                           reached_step=0, left_out=nodes)]
    left_out([node_id for node_id, _ in fast])
    for _ in range(3):  # ticks after the job ran grow_after_s, its nodes and the left-out one alive
        clock.now += settings.grow_after_s
        for node_id, auth in members:
            beat(client, node_id, auth, job_id=job_id)
        for node_id, auth in fast:
            beat(client, node_id, auth)
        service.tick()
        job = client.get(f"/v1/jobs/{job_id}").json()
        assert job["state"] == "running" and job["generation"] == 0, job["reason"]
    left_out([])
    service.tick()
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] == "recovering" and "can speed it up" in job["reason"], job["reason"]


def test_a_bandwidth_claim_far_above_what_two_peers_measured_is_not_believed(client: TestClient) -> None:
    """A node that claims 1e10 B/s while two peers measured its links at 3.6e8 and 1.8e8 is planned at
    3.6e8, and `ravnest nodes` says so; a node only one peer measured low (that peer may be the liar)
    keeps its figure, and so do the honest nodes."""
    liar = join(client, "liar", bandwidth=1e10)
    honest = [join(client, f"h{i}", bandwidth=3e8) for i in range(3)]

    def measured(by: tuple[str, dict], links: dict[str, float]) -> None:
        client.post(f"/v1/nodes/{by[0]}/heartbeat", headers=by[1], json={"links": [
            {"peer_id": peer, "bandwidth_bytes_per_s": bandwidth, "latency_s": 0.001}
            for peer, bandwidth in links.items()]}).raise_for_status()

    measured(honest[0], {liar[0]: 3.6e8, honest[1][0]: 3e8})
    nodes = {n["name"]: n for n in client.get("/v1/nodes").json()}
    assert nodes["liar"]["measured_bandwidth"] is None  # one peer's word is not enough
    measured(liar, {honest[2][0]: 1e6})  # the liar's word on an honest node: one peer, not believed
    measured(honest[1], {liar[0]: 1.8e8, honest[0][0]: 2.9e8})
    nodes = {n["name"]: n for n in client.get("/v1/nodes").json()}
    assert nodes["liar"]["measured_bandwidth"] == 3.6e8
    assert all(nodes[f"h{i}"]["measured_bandwidth"] is None for i in range(3))
    with client.app.state.service.store.session() as session:
        assert planning_bandwidth(session.get_one(NodeRow, liar[0])) == 3.6e8


def test_what_a_pipeline_neighbours_stream_carried_counts_against_a_bandwidth_claim(
        client: TestClient, settings: Settings) -> None:
    """The stage after a node reports what its stream of gradients to it carried per busy second; with
    one peer's probe, two nodes' measurements far below the node's claim correct it."""
    job_id, members = placed_job(client, nodes=2, clusters=1, min_nodes=2, stages_per_cluster=2)
    given = {node_id: (auth, beat(client, node_id, auth)["assignment"]) for node_id, auth in members}
    [first] = [node_id for node_id, (_, a) in given.items() if a["stage"] == 0]
    [(second, (auth, a))] = [(node_id, x) for node_id, x in given.items() if x[1]["stage"] == 1]
    beat(client, second, auth, job_id=job_id)
    client.post(f"/v1/jobs/{job_id}/metrics", headers=auth, json={
        "node_id": second, "cluster": a["cluster"], "stage": 1, "step": settings.slow_after_steps,
        "metrics": {"compute_s": 0.01, "step_wall_s": 2.0, "prev_bytes_per_step": 1e6, "prev_link_busy": 0.5,
                    "loss": 1.0}}).raise_for_status()  # 1e6 B/s while busy, against a claim of 1e8
    assert {n["id"]: n for n in client.get("/v1/nodes").json()}[first]["measured_bandwidth"] is None  # one node
    prober = join(client, "prober")
    client.post(f"/v1/nodes/{prober[0]}/heartbeat", headers=prober[1], json={"links": [
        {"peer_id": first, "bandwidth_bytes_per_s": 5e5, "latency_s": 0.001}]}).raise_for_status()
    client.post(f"/v1/jobs/{job_id}/metrics", headers=auth, json={
        "node_id": second, "cluster": a["cluster"], "stage": 1, "step": settings.slow_after_steps,
        "metrics": {"compute_s": 0.01, "step_wall_s": 2.0, "prev_bytes_per_step": 1e6, "prev_link_busy": 0.5,
                    "loss": 1.0}}).raise_for_status()
    assert {n["id"]: n for n in client.get("/v1/nodes").json()}[first]["measured_bandwidth"] == 1e6


def test_a_job_pinning_content_no_node_holds_says_which_checksums_differ(client: TestClient) -> None:
    """A wrong weights.sha256 left the job waiting for 'proven holders (0 available)' while nodes listed
    the file as proven. The reason now says the offered file's checksum differs from the job's, with both."""
    holder = join(client, "library", datasets=["books"])
    prove(client, [holder])
    wrong = "0123456789abcdef" * 4
    job = {"model": {"name": "gpt", "config": {"n_layers": 1}},
           "dataset": {"name": "text", "source": "books", "sha256": wrong}, "placement": {"clusters": 1}}
    view = client.get(f"/v1/jobs/{client.post('/v1/jobs', json=job).json()['id']}").json()
    held = BOOKS_FINGERPRINT.rpartition(":")[2]
    assert view["state"] == "pending" and view["reason"].startswith(
        f"dataset 'books' is held by 1 node with sha256 {held[:16]}..., not the job's dataset.sha256 "
        f"0123456789abcdef...; waiting for 1 idle node proven to hold dataset 'books' (0 available)"), view["reason"]


def test_a_vocabulary_below_the_offered_token_files_is_refused_at_submit_or_waited_out(client: TestClient) -> None:
    """A vocab_size of 2,000 on a token file of 4,096 ids was accepted and failed on three nodes. Now the
    nodes say each token file's vocabulary: where every offered file has more ids, the submit is
    refused naming both numbers; where some do, the job waits for nodes whose file fits, saying why."""
    def node(name: str, vocab: int) -> tuple[str, dict]:
        r = client.post("/v1/nodes", json={"name": name, "address": f"127.0.0.1:{next(_ports)}", "profile": {
            **profile(datasets=["books"]), "vocab_sizes": {"books": vocab}}})
        assert r.status_code == 201, r.text
        return r.json()["node_id"], {"Authorization": f"Bearer {r.json()['node_token']}"}

    prove(client, [node(f"big{i}", 4096) for i in range(2)])
    job = {"model": {"name": "llama", "config": {"vocab_size": 2000, "num_hidden_layers": 2}},
           "dataset": {"name": "tokens", "source": "books", "seq_len": 32}, "placement": {"clusters": 1, "min_nodes": 2}}
    r = client.post("/v1/jobs", json=job)
    assert r.status_code == 422 and r.json()["detail"] == (
        "the model's vocab_size 2,000 is below the 4,096 ids of token file 'books', as every node offering it says "
        "(`ravnest data prepare` prints what a model needs): set model.config.vocab_size to 4,096 or more"), r.text
    prove(client, [node("fits", 1000)])  # one file that fits: accepted, and waiting for a second
    view = client.get(f"/v1/jobs/{client.post('/v1/jobs', json=job).json()['id']}").json()
    assert view["state"] == "pending" and view["reason"].startswith(
        "token file 'books' has 4,096 ids or more on 2 nodes, more than the model's vocab_size 2,000; waiting for "
        "2 idle nodes proven to hold dataset 'books' (1 available)"), view["reason"]


def test_stage_0_of_a_robust_job_alone_gets_the_audit_secret_the_same_in_every_cluster(client: TestClient) -> None:
    """Audits (ravnest/pipeline/audits.py) are drawn from a secret every cluster's stage 0 shares and no
    later stage learns."""
    members = [join(client, f"node{i}") for i in range(6)]
    spec = {**digits_job(clusters=3, min_nodes=6), "averaging": {"every": 5, "robust": "centered_clip"}}
    assert client.post("/v1/jobs", json=spec).status_code == 201
    assignments = [beat(client, node_id, auth)["assignment"] for node_id, auth in members]
    assert sorted(a["stage"] for a in assignments) == [0, 0, 0, 1, 1, 1]
    secrets = {a["audit_secret"] for a in assignments if a["stage"] == 0}
    assert len(secrets) == 1 and None not in secrets
    assert all(a["audit_secret"] is None for a in assignments if a["stage"] > 0)


def test_ring_members_of_a_robust_job_get_each_others_signing_keys_and_where_their_stages_start(
        client: TestClient) -> None:
    """A robust round's commitments are signed (ravnest/averaging/signatures.py): every ring member is named
    with the public key of the credential that only that node holds, so nobody can sign for another, and
    with the first block of its stage, so that audits compare only stages that start alike."""
    members = [join(client, f"node{i}") for i in range(6)]
    spec = {**digits_job(clusters=3, min_nodes=6), "averaging": {"every": 5, "robust": "centered_clip"}}
    assert client.post("/v1/jobs", json=spec).status_code == 201
    assignments = {node_id: beat(client, node_id, auth)["assignment"] for node_id, auth in members}
    named = {m["node_id"]: m["signing_key"] for a in assignments.values() for ring in a["rings"]
             for m in ring["members"]}
    assert named == {node_id: public_key(a["token"]) for node_id, a in assignments.items()}
    assert len(set(named.values())) == 6
    assert all(a["next"]["signing_key"] is None for a in assignments.values() if a["next"])  # (ring members only)
    starts = {m["node_id"]: m["starts_at"] for a in assignments.values() for ring in a["rings"] for m in ring["members"]}
    assert starts == {node_id: a["blocks"][0] for node_id, a in assignments.items()}  # (whom audits compare)
