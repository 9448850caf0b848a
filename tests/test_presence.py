"""Heartbeats at scale (coordinator/service/presence.py): the interval grows with the number of nodes, a
node is judged by the interval it was told, quiet beats are written in batches, and one SQLite file
serves one coordinator process."""
from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from coordinator.app import create_app
from coordinator.config import Settings
from coordinator.store import NodeRow, Store, StoreInUse
from tests.test_coordinator_api import OPERATOR_TOKEN, FakeClock, beat, join


def coordinator(tmp_path: Path, clock: FakeClock, **settings) -> TestClient:
    app = create_app(Settings(data_dir=tmp_path, background=False, clock=clock, operator_token=OPERATOR_TOKEN,
                              **{"heartbeat_interval_s": 1.0, **settings}))
    return TestClient(app, headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"})


def test_the_interval_grows_with_the_nodes_and_a_node_is_judged_by_its_own(tmp_path: Path) -> None:
    clock = FakeClock()
    with coordinator(tmp_path, clock, heartbeat_interval_s=2.0, heartbeat_rate=1.0) as client:  # 1 beat/s in all
        nodes = [join(client, f"n{i}") for i in range(6)]
        clock.now += 5.5  # counted again (every 5 s): 6 live nodes at 1 beat/s -> every 6 s
        replies = [beat(client, node, auth) for node, auth in nodes]
        assert [reply["heartbeat_interval_s"] for reply in replies] == [6.0] * 6
        clock.now += 2.9 * 6  # under 3 of its intervals (6 s each): still there
        client.app.state.service.tick()
        assert {n["state"] for n in client.get("/v1/nodes").json()} == {"idle"}
        clock.now += 0.2 * 6  # past them: gone (it would be after 6 s at the configured 2 s interval)
        client.app.state.service.tick()
        assert {n["state"] for n in client.get("/v1/nodes").json()} == {"gone"}


def test_few_nodes_beat_at_the_configured_interval(tmp_path: Path) -> None:
    with coordinator(tmp_path, FakeClock()) as client:
        node, auth = join(client)
        assert beat(client, node, auth)["heartbeat_interval_s"] == 1.0


def test_a_quiet_beat_is_written_and_never_moves_last_seen_back(tmp_path: Path) -> None:
    clock = FakeClock()
    with coordinator(tmp_path, clock) as client:
        service = client.app.state.service
        node, auth = join(client)
        clock.now += 0.5
        beat(client, node, auth)  # quiet: the fast path (no background loop here: written at once)
        with service.store.session() as session:
            assert session.get_one(NodeRow, node).last_seen == clock.now
        presence = service.membership.presence
        presence.seen(node, clock.now - 0.3, 1.0)  # a sighting older than the row's, written late
        presence.flush()
        with service.store.session() as session:
            assert session.get_one(NodeRow, node).last_seen == clock.now


def test_an_idle_node_marked_gone_comes_back_on_the_quiet_path(tmp_path: Path) -> None:
    """After a stall thousands of idle nodes may be marked gone at once: each one's next beat brings it
    back without the change lock (one write of its own row)."""
    clock = FakeClock()
    with coordinator(tmp_path, clock) as client:
        service = client.app.state.service
        node, auth = join(client)
        clock.now += 3.5  # past 3 intervals of 1 s
        service.tick()
        assert client.get("/v1/nodes").json()[0]["state"] == "gone"
        slow = []
        service.membership.heartbeat = lambda *args: slow.append(args)  # (the slow path, were it taken)
        reply = beat(client, node, auth)
        assert not slow and reply["heartbeat_interval_s"] == 1.0
        assert client.get("/v1/nodes").json()[0]["state"] == "idle"


def test_a_refused_beat_takes_the_slow_path_and_says_why(tmp_path: Path) -> None:
    with coordinator(tmp_path, FakeClock()) as client:
        node, _ = join(client)
        reply = client.post(f"/v1/nodes/{node}/heartbeat", json={}, headers={"Authorization": "Bearer " + "0" * 64})
        assert reply.status_code == 401 and reply.json()["detail"] == "unknown token"  # (the gate refuses it first)


def test_one_sqlite_file_serves_one_coordinator_process(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'coordinator.db'}"
    first = Store(url)
    with pytest.raises(StoreInUse, match="another coordinator process is using .*coordinator.db.*PostgreSQL"):
        Store(url)
    first.close()
    Store(url).close()  # free again once the first one closed


def test_quiet_beats_are_answered_before_the_framework_and_everything_else_as_before(tmp_path: Path) -> None:
    """coordinator/quiet_beats.py answers a quiet beat itself; a beat it declines (a wrong credential,
    a body that does not validate or is over the limit) gets the reply the application always gave."""
    with coordinator(tmp_path, FakeClock(), max_request_bytes=2048) as client:
        node, auth = join(client)
        calls = []
        presence = client.app.state.service.membership.presence
        answer = presence.answer
        presence.answer = lambda *args: calls.append(type(args[2]).__name__) or answer(*args)  # (records the door)
        quiet = beat(client, node, auth)
        assert calls == ["bytes"] and quiet["reachable"] is None and quiet["heartbeat_interval_s"] == 1.0
        wrong = client.post(f"/v1/nodes/{node}/heartbeat", json={}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["detail"] == "unknown token"
        bad = client.post(f"/v1/nodes/{node}/heartbeat", json={"links": "many"}, headers=auth)
        assert bad.status_code == 422 and bad.json()["detail"].startswith("links:")
        big = client.post(f"/v1/nodes/{node}/heartbeat", content="{" + " " * 4096 + "}",  # quiet, but too long
                          headers={**auth, "Content-Type": "application/json"})
        assert big.status_code == 413 and "exceeds 2,048 bytes" in big.json()["detail"]
