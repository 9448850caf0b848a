"""Several coordinator processes on one PostgreSQL (coordinator/db_locks.py): real processes on
loopback, a real server. The lead moves when its holder is killed, nodes given both URLs fail over, and
conflicting operations at two processes at once leave one consistent story."""
from __future__ import annotations

import concurrent.futures
import os
import threading
import time

import httpx
import pytest

from scripts.local_cluster import LocalCluster, free_port
from tests.test_faults import cnn_job, wait_progress

LEAD = "now runs the background work"
JOINS = 12  # one node joining at both processes, this many times at once


class TwoCoordinators(LocalCluster):
    """LocalCluster with a second coordinator process on the same database and data directory; the
    nodes are given both URLs, the first one's first."""

    def __init__(self, data_dir, db: str, **kwargs) -> None:
        super().__init__(data_dir, relay=False, coordinator_args=["--db", db], **kwargs)
        self.second_url = f"http://127.0.0.1:{free_port()}"

    def _start_coordinator(self, timeout: float, log_name: str = "coordinator.log") -> None:
        super()._start_coordinator(timeout, log_name)
        self.wait_for(lambda: LEAD in (self.data_dir / "logs" / log_name).read_text(), 30, "the first to lead")
        port = self.second_url.rsplit(":", 1)[1]
        self.second = self._spawn(["coordinator.cli", "--host", self.host, "--port", port, "--data-dir",
                                   str(self.data_dir), *self.coordinator_args], "coordinator-2.log")
        self.procs.remove(self.second)  # (procs[0] is the first coordinator, procs[1 + i] node i)
        second = httpx.Client(base_url=self.second_url, timeout=30)
        self.wait_for(lambda: _answers(second), timeout, "the second coordinator to answer /healthz")
        second.close()

    def _spawn_node(self, extra_args=()):
        i = len(self.procs) - 1
        return self._spawn(["node.cli", "join", "--coordinator", f"{self.url},{self.second_url}",
                            "--name", f"node-{i}", "--threads", "1",  # (the token: in the environment)
                            "--data-dir", str(self.data_dir / "nodes" / f"node-{i}"),
                            *self.node_args, *extra_args], f"node-{i}.log")

    def use_second(self) -> None:
        """This client talks to the second coordinator from now on."""
        self.http.close()
        self.url = self.second_url
        self.http = httpx.Client(base_url=self.url, timeout=30,
                                 headers={"Authorization": f"Bearer {self.operator_token}"})
        self.coordinator_log = "coordinator-2.log"

    def stop(self, timeout: float = 20.0) -> None:
        super().stop(timeout)
        if self.second.poll() is None:
            self.second.terminate()
            self.second.wait(timeout)


def _answers(client: httpx.Client) -> bool:
    try:
        return client.get("/healthz").status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow
def test_the_leader_is_killed_mid_job_and_the_other_coordinator_carries_on(tmp_path, postgres_url):
    """Two coordinators on one PostgreSQL, 4 nodes given both URLs. kill -9 of the one holding the lead
    at ~40%: the lead moves within the heartbeat timeout, a node joining meanwhile gets in through the
    survivor, and the job completes as well as without the fault."""
    with TwoCoordinators(tmp_path, postgres_url, nodes=4) as cluster:
        job_id = cluster.submit(cnn_job(steps=900, max_nodes=4))
        wait_progress(cluster, job_id, 0.4)
        killed_at = time.monotonic()
        cluster.kill(cluster.procs[0])
        cluster.use_second()
        second_log = tmp_path / "logs" / "coordinator-2.log"
        cluster.wait_for(lambda: LEAD in second_log.read_text(), 30, "the lead to move", ignore_exits=True)
        moved_s = time.monotonic() - killed_at
        timeout_s = 3 * 2.0  # the default heartbeat timeout: 3 intervals of 2 s
        assert moved_s <= timeout_s + 2.0, f"the lead moved after {moved_s:.1f} s"  # (+ one tick)
        newcomer = cluster.add_nodes(1, timeout=60)  # through the survivor: the first URL refuses connections
        assert newcomer
        job = cluster.wait_job(job_id, timeout=600)
        assert job["state"] == "completed", job["reason"]
        assert job["metrics"]["test_accuracy"] >= 0.95
        logs = "".join(path.read_text(errors="replace") for path in (tmp_path / "logs").glob("node-*.log"))
        assert f"using {cluster.second_url}" in logs  # the nodes said where they went
        print(f"lead moved {moved_s:.1f} s after the kill; accuracy {job['metrics']['test_accuracy']:.4f}")


def test_conflicting_operations_at_two_processes_leave_one_story(tmp_path, postgres_url):
    """The same node (one identity file) joining at both processes at once, and a job cancelled at one
    while the other re-plans it: one row per identity, never two placements, and every state change
    in a job's history is one its state machine allows."""
    from coordinator import jobs
    from coordinator.app import create_app
    from coordinator.config import Settings
    from fastapi.testclient import TestClient
    from tests.test_coordinator_api import digits_job, profile

    token = "t" * 32
    settings = dict(data_dir=tmp_path, db_url=postgres_url, background=False, join_token=token,
                    operator_token="o" * 32)
    with TestClient(create_app(Settings(**settings))) as a, TestClient(create_app(Settings(**settings))) as b:
        operator = {"Authorization": f"Bearer {'o' * 32}"}
        joined = {"Authorization": f"Bearer {token}"}
        identity = os.urandom(32).hex()

        ready = threading.Barrier(JOINS)

        def join(i: int):
            ready.wait()  # all at once
            return (a, b)[i % 2].post("/v1/nodes", headers=joined, json={
                "name": "twin", "address": f"127.0.0.1:{20000 + i}", "profile": profile(), "identity": identity})
        with concurrent.futures.ThreadPoolExecutor(JOINS) as pool:
            replies = list(pool.map(join, range(JOINS)))
        assert all(r.status_code == 201 for r in replies), [r.text for r in replies]
        rows = [n for n in a.get("/v1/nodes", headers=operator).json() if n["name"] == "twin"]
        assert len(rows) == 1 and len({r.json()["node_id"] for r in replies}) == 1

        for i in range(4):  # nodes to place a job on; then cancel at one process while the other places
            a.post("/v1/nodes", headers=joined, json={"name": f"n{i}", "address": f"127.0.0.1:{21000 + i}",
                                                      "profile": profile()}).raise_for_status()
        job_id = a.post("/v1/jobs", headers=operator, json=digits_job()).json()["id"]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            cancelled = pool.submit(b.post, f"/v1/jobs/{job_id}/cancel", headers=operator)
            pool.submit(a.app.state.service.placement.place_pending).result()
            assert cancelled.result().status_code in (200, 409)
        job = b.get(f"/v1/jobs/{job_id}", headers=operator).json()
        states = [h["state"] for h in job["history"]]
        for before, after in zip(states, states[1:]):
            assert jobs.JobState(after) in jobs._NEXT[jobs.JobState(before)], states  # the state machine's edges
        busy = [n for n in b.get("/v1/nodes", headers=operator).json() if n["state"] == "busy"]
        if job["state"] == "cancelled":
            assert not busy or all(n.get("job_id") in (None, job_id) for n in busy)
        placed = [s["node_id"] for c in (job.get("plan") or {}).get("clusters", []) for s in c["stages"]]
        assert len(placed) == len(set(placed))  # no node placed twice


def test_joins_at_once_at_two_processes_spend_a_token_once_and_take_an_address_once(tmp_path, postgres_url):
    """Joins take no lock shared by every change (db_locks.py, keyed locks): a token with N uses admits
    N of 2N joins made at once at two processes, an unlimited one counts every join, and of several
    nodes claiming one address at once, one gets it."""
    from coordinator.app import create_app
    from coordinator.config import Settings
    from fastapi.testclient import TestClient
    from tests.test_coordinator_api import profile

    settings = dict(data_dir=tmp_path, db_url=postgres_url, background=False, join_token="t" * 32,
                    operator_token="o" * 32)
    operator = {"Authorization": f"Bearer {'o' * 32}"}
    with TestClient(create_app(Settings(**settings))) as a, TestClient(create_app(Settings(**settings))) as b:
        limited = a.post("/v1/join-tokens", headers=operator, json={"name": "few", "uses": JOINS // 2}).json()

        def at_once(token: str, address: callable) -> list[httpx.Response]:
            ready = threading.Barrier(JOINS)

            def join(i: int) -> httpx.Response:
                ready.wait()
                return (a, b)[i % 2].post("/v1/nodes", headers={"Authorization": f"Bearer {token}"},
                                          json={"name": f"n{i}", "address": address(i), "profile": profile()})
            with concurrent.futures.ThreadPoolExecutor(JOINS) as pool:
                return list(pool.map(join, range(JOINS)))

        replies = at_once(limited["token"], lambda i: f"127.0.0.1:{22000 + i}")
        assert sorted(r.status_code for r in replies) == [201] * (JOINS // 2) + [401] * (JOINS // 2)
        assert all("used up" in r.json()["detail"] for r in replies if r.status_code == 401)
        replies = at_once("t" * 32, lambda i: "127.0.0.1:23000")
        assert sorted(r.status_code for r in replies) == [201] + [409] * (JOINS - 1)
        assert "is held by node" in next(r for r in replies if r.status_code == 409).json()["detail"]
        tokens = {t["name"]: t for t in b.get("/v1/join-tokens", headers=operator).json()}
        assert tokens["few"]["used"] == JOINS // 2 and tokens["few"]["uses_left"] == 0
        assert [t["used"] for t in tokens.values() if t["name"] != "few"] == [JOINS]  # (the 409s were admitted)
