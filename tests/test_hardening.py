"""Hardening: limits before work and plausible inputs only. Specs a careless or hostile submitter
might send are refused with the limit named, before anything expensive runs, leaving the
coordinator's memory flat; node profiles, addresses and link reports must be physically plausible."""
from __future__ import annotations

import json
import resource
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient

from coordinator.app import create_app
from coordinator.config import Settings
from ravnest.wire import ping
from scripts.local_cluster import LocalCluster, rss_bytes
from tests.test_coordinator_api import OPERATOR_TOKEN, FakeClock, beat, join, profile


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    settings = Settings(data_dir=tmp_path_factory.mktemp("coordinator"), background=False,
                        operator_token=OPERATOR_TOKEN)
    with TestClient(create_app(settings), headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}) as c:
        yield c


def spec(model: dict | None = None, **sections) -> dict:
    text = model and model["name"] == "gpt"
    return {"model": model or {"name": "mlp", "config": {}},
            "dataset": {"name": "text", "source": "books"} if text else {"name": "digits"}, **sections}


HOSTILE = {
    "a million layers": (spec({"name": "gpt", "config": {"n_layers": 1_000_000}}), 422, "max_blocks"),
    "a hundred trillion parameters": (spec({"name": "mlp", "config": {"hidden": 1_000_000, "depth": 100}}),
                                      422, "max_parameters"),
    "batch of ten million": (spec(training={"batch_size": 10**7}), 422, "training.batch_size"),
    "seed 2**64": (spec(training={"seed": 2**64}), 422, "training.seed"),
    "a trillion steps": (spec(training={"steps": 10**12}), 422, "training.steps"),
    "300-level optimizer kwargs": (spec(training={"optimizer": {"name": "SGD", "kwargs": {
        "lr": 0.1, "x": json.loads("[" * 300 + "]" * 300)}}}), 422, "nests deeper"),
    "a 900 kB model config": (spec({"name": "mlp", "config": {"pad": "x" * 900_000}}), 422, "model.config"),
    "a 50 MB name": (spec(name="x" * 50_000_000), 413, "exceeds"),
    "a long name": (spec(name="x" * 1000), 422, "name"),
    "20000 clusters": (spec(placement={"clusters": 20_000}), 422, "placement.clusters"),
}


@pytest.mark.parametrize("case", HOSTILE, ids=list(HOSTILE))
def test_hostile_specs_are_refused_before_any_work(client: TestClient, case: str) -> None:
    body, status, reason = HOSTILE[case]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    r = client.post("/v1/jobs", json=body)
    elapsed = time.monotonic() - started
    assert r.status_code == status and reason in r.json()["detail"], r.text[:300]
    assert elapsed < 5, f"refusing {case} took {elapsed:.1f} s"  # a bound, not a benchmark: work was skipped
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 200, f"peak memory grew {grown_mib:.0f} MiB while refusing {case}"
    assert client.get("/v1/jobs").json() == []  # nothing stored


def test_limits_are_the_coordinators_to_set(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, background=False, operator_token=OPERATOR_TOKEN, max_blocks=3,
                        max_parameters=1000, max_request_bytes=300)
    with TestClient(create_app(settings), headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}) as c:
        r = c.post("/v1/jobs", json=spec({"name": "mlp", "config": {"depth": 4}}))
        assert r.status_code == 422 and "at most 3 (its max_blocks limit)" in r.json()["detail"]
        r = c.post("/v1/jobs", json=spec({"name": "mlp", "config": {"depth": 1}}))
        assert r.status_code == 422 and "at most 1,000 (its max_parameters limit)" in r.json()["detail"]
        r = c.post("/v1/jobs", json=spec(name="x" * 400))
        assert r.status_code == 413 and "300 bytes" in r.json()["detail"]


IMPLAUSIBLE = {
    "5e-324 FLOP/s": ({"flops": 5e-324}, "profile.flops"),
    "latency false": ({"latency_s": False}, "profile.latency_s"),
    "bandwidth as text": ({"bandwidth_bytes_per_s": "1e9"}, "profile.bandwidth_bytes_per_s"),
    "an exabyte of memory": ({"memory_bytes": 1 << 60}, "profile.memory_bytes"),
    "a device that is not one": ({"device": "gpu0; rm -rf"}, "profile.device"),
    "a dataset name with a path": ({"datasets": ["../etc/passwd"]}, "profile.datasets"),
}


@pytest.mark.parametrize("case", IMPLAUSIBLE, ids=list(IMPLAUSIBLE))
def test_implausible_node_profiles_are_refused(client: TestClient, case: str) -> None:
    change, reason = IMPLAUSIBLE[case]
    r = client.post("/v1/nodes", json={"address": "127.0.0.1:6001", "profile": {**profile(), **change}})
    assert r.status_code == 422 and reason in r.json()["detail"], r.text


def test_addresses_are_host_port_and_not_another_live_nodes(client: TestClient) -> None:
    for address in ("q", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000", "a b:1", "http://x:1"):
        r = client.post("/v1/nodes", json={"address": address, "profile": profile()})
        assert r.status_code == 422 and "address" in r.json()["detail"], address
    holder = client.post("/v1/nodes", json={"address": "[::1]:6002", "profile": profile()}).json()
    r = client.post("/v1/nodes", json={"address": "[::1]:6002", "profile": profile()})
    assert r.status_code == 409 and holder["node_id"] in r.json()["detail"]
    link = {"peer_id": holder["node_id"], "bandwidth_bytes_per_s": 1e15, "latency_s": 0.001}
    r = client.post(f"/v1/nodes/{holder['node_id']}/heartbeat", json={"links": [link]},
                    headers={"Authorization": f"Bearer {holder['node_token']}"})
    assert r.status_code == 422 and "bandwidth_bytes_per_s" in r.json()["detail"]


def test_nodes_gone_past_retention_are_pruned_and_lists_come_in_pages(tmp_path: Path) -> None:
    clock = FakeClock()
    settings = Settings(data_dir=tmp_path, background=False, operator_token=OPERATOR_TOKEN, clock=clock,
                        heartbeat_interval_s=1.0, node_retention_s=3600)
    with TestClient(create_app(settings), headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}) as c:
        joined = []
        for i in range(5):
            clock.now += 1
            joined.append(join(c, f"n{i}"))
        for node_id, auth in joined[:3]:
            assert c.delete(f"/v1/nodes/{node_id}", headers=auth).status_code == 204
        for _ in range(3):
            c.post("/v1/jobs", json=spec())
        page = c.get("/v1/nodes", params={"limit": 2, "offset": 1})
        assert page.headers["x-total-count"] == "5" and [n["name"] for n in page.json()] == ["n1", "n2"]
        jobs = c.get("/v1/jobs", params={"limit": 2})
        assert jobs.headers["x-total-count"] == "3" and len(jobs.json()) == 2
        assert c.get("/v1/nodes", params={"limit": 5000}).status_code == 422
        clock.now += 1800
        for node_id, auth in joined[3:]:  # alive: they keep beating
            beat(c, node_id, auth)
        c.app.state.service.tick()
        assert c.get("/v1/nodes").headers["x-total-count"] == "5"  # gone, but not for long enough
        clock.now += 1801
        for node_id, auth in joined[3:]:
            beat(c, node_id, auth)
        c.app.state.service.tick()
        assert [n["name"] for n in c.get("/v1/nodes").json()] == ["n3", "n4"]
        r = c.post(f"/v1/nodes/{joined[0][0]}/heartbeat", json={}, headers=joined[0][1])
        assert r.status_code == 401  # a forgotten node's credential is gone with it


@pytest.mark.slow
def test_a_probe_flood_leaves_a_node_answering_and_its_memory_where_it_was(tmp_path: Path) -> None:
    """Anybody holding the probe token (every joined node does) sends 200 Pings asking for big replies:
    replies are capped and built a few at a time, so the node's memory stays put and it keeps answering."""
    with LocalCluster(tmp_path, nodes=1) as cluster:
        [node] = cluster.alive_nodes()
        pid, probe = cluster.node_process(node["id"]).pid, (tmp_path / "probe_token").read_text().strip()
        ping(node["address"], token=probe, reply_bytes=64 << 10)  # the channel and the reply path are warm
        before = rss_bytes(pid)
        with pytest.raises(grpc.RpcError) as info:
            ping(node["address"], token=probe, reply_bytes=(64 << 10) + 1)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        def flood(i: int) -> str:
            try:  # half ask for replies, half send what a bandwidth probe sends
                ping(node["address"], token=probe, reply_bytes=(64 << 10) * (i % 2),
                     payload_bytes=(4 << 20) * (1 - i % 2), timeout=30)
                return "OK"
            except grpc.RpcError as e:
                return e.code().name
        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(flood, range(200)))
        assert set(answers) <= {"OK", "RESOURCE_EXHAUSTED"} and "OK" in answers
        peak = (rss_bytes(pid) - before) / 2**20
        # an idle node hands what the wire buffered back at its next heartbeat
        cluster.wait_for(lambda: rss_bytes(pid) - before < 64 << 20, 30, "the node's memory to settle")
        grown = (rss_bytes(pid) - before) / 2**20
        assert ping(node["address"], token=probe) > 0
        print(f"200 probes: {answers.count('OK')} answered, {answers.count('RESOURCE_EXHAUSTED')} told to retry; "
              f"node memory {peak:+.0f} MiB right after, {grown:+.0f} MiB a heartbeat later")
