"""Trust nobody: credentials over the real REST API (join tokens with expiry, use counts and
revocation; node credentials that expire and can be revoked; API keys with roles, a submitter acting
on its own jobs only), the `ravnest` command, and training with TLS everywhere (real processes)."""
from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from coordinator.app import create_app
from coordinator.config import Settings
from coordinator.security import new_token
from scripts.local_cluster import ROOT, LocalCluster
from tests.test_coordinator_api import (INTERVAL, OPERATOR_TOKEN, FakeClock, _ports, beat, coordinator_process,
                                        digits_job, join, profile)
from tests.test_faults import cnn_job


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def client(tmp_path: Path, clock: FakeClock):
    settings = Settings(data_dir=tmp_path, heartbeat_interval_s=INTERVAL, background=False, clock=clock,
                        operator_token=OPERATOR_TOKEN, node_credential_ttl_s=600)
    with TestClient(create_app(settings), headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}) as c:
        yield c


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def try_join(client: TestClient, token: str):
    return client.post("/v1/nodes", json={"name": "v", "address": f"127.0.0.1:{next(_ports)}", "profile": profile()},
                       headers=bearer(token))


def key(client: TestClient, role: str, name: str) -> tuple[str, dict]:
    r = client.post("/v1/keys", json={"name": name, "role": role})
    assert r.status_code == 201, r.text
    return r.json()["id"], bearer(r.json()["token"])


def test_tokens_never_look_like_command_line_flags() -> None:
    assert all(new_token().startswith("rvn_") for _ in range(200))


def test_join_tokens_expire_run_out_and_can_be_revoked(client: TestClient, clock: FakeClock) -> None:
    r = client.post("/v1/join-tokens", json={"name": "lab", "uses": 2, "expires_in_s": 3600})
    assert r.status_code == 201 and r.json()["token"].startswith("rvn_")
    limited = r.json()
    assert [try_join(client, limited["token"]).status_code for _ in range(3)] == [201, 201, 401]
    assert "used up (2 joins)" in try_join(client, limited["token"]).json()["detail"]

    timed = client.post("/v1/join-tokens", json={"expires_in_s": 60}).json()
    assert try_join(client, timed["token"]).status_code == 201
    clock.now += 61
    r = try_join(client, timed["token"])
    assert r.status_code == 401 and "expired" in r.json()["detail"]

    revocable = client.post("/v1/join-tokens", json={}).json()
    assert client.delete(f"/v1/join-tokens/{revocable['id']}").status_code == 204
    r = try_join(client, revocable["token"])
    assert r.status_code == 401 and "revoked" in r.json()["detail"]
    # the probe before joining is refused too, and nothing was written by any refusal
    assert client.get("/v1/probe", headers=bearer(revocable["token"])).status_code == 401
    assert len(client.get("/v1/nodes").json()) == 3

    listed = {t["id"]: t for t in client.get("/v1/join-tokens").json()}
    assert "token" not in listed[limited["id"]] and listed[limited["id"]]["uses_left"] == 0
    assert listed[limited["id"]]["used"] == 2 and listed[revocable["id"]]["revoked_at"] is not None
    assert "join" in listed  # the default join token is a credential like the others
    r = client.post("/v1/join-tokens", json={"uses": 0})
    assert r.status_code == 422 and "uses" in r.json()["detail"]
    assert client.delete("/v1/join-tokens/nope").status_code == 404


def test_a_node_credential_expires_without_heartbeats_and_can_be_revoked(client: TestClient,
                                                                         clock: FakeClock) -> None:
    quiet_id, quiet = join(client, "quiet")
    busy_id, busy = join(client, "busy")
    for _ in range(4):  # every heartbeat pushes the expiry on
        clock.now += 300
        beat(client, busy_id, busy)
    r = client.post(f"/v1/nodes/{quiet_id}/heartbeat", json={}, headers=quiet)
    assert r.status_code == 401 and "expired" in r.json()["detail"]

    job_id = client.post("/v1/jobs", json=digits_job(clusters=1, min_nodes=1, stages_per_cluster=1)).json()["id"]
    assert beat(client, busy_id, busy)["assignment"]["job_id"] == job_id
    assert client.post(f"/v1/nodes/{busy_id}/revoke").status_code == 204
    r = client.post(f"/v1/nodes/{busy_id}/heartbeat", json={"job_id": job_id}, headers=busy)
    assert r.status_code == 401 and "revoked" in r.json()["detail"]
    r = client.post(f"/v1/jobs/{job_id}/metrics", headers=busy,
                    json={"node_id": busy_id, "cluster": 0, "stage": 0, "step": 1, "metrics": {}})
    assert r.status_code == 401
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["state"] in ("recovering", "pending") and "revoked" in job["reason"]
    assert client.post("/v1/nodes/nope/revoke").status_code == 404


def test_roles_submitters_own_their_jobs_readers_only_read(client: TestClient) -> None:
    _, alice = key(client, "submitter", "alice")
    _, bob = key(client, "submitter", "bob")
    reader_id, reader = key(client, "reader", "grafana")
    node_id, node = join(client, "n")
    job = digits_job()
    alices = client.post("/v1/jobs", json=job, headers=alice).json()["id"]
    bobs = client.post("/v1/jobs", json=job, headers=bob).json()["id"]

    assert [j["id"] for j in client.get("/v1/jobs", headers=alice).json()] == [alices]
    assert client.get(f"/v1/jobs/{alices}", headers=alice).status_code == 200
    for method, path in (("GET", f"/v1/jobs/{bobs}"), ("POST", f"/v1/jobs/{bobs}/cancel"),
                         ("POST", f"/v1/jobs/{bobs}/resume"), ("GET", f"/v1/jobs/{bobs}/model")):
        r = client.request(method, path, headers=alice)
        assert r.status_code == 403 and "own jobs" in r.json()["detail"], (method, path)
    assert client.get(f"/v1/jobs/{bobs}").json()["state"] == "pending"  # nothing changed
    assert client.post(f"/v1/jobs/{alices}/cancel", headers=alice).json()["state"] == "cancelled"

    assert {j["id"] for j in client.get("/v1/jobs", headers=reader).json()} == {alices, bobs}
    assert client.get("/v1/nodes", headers=reader).status_code == 200
    for method, path, body in (("POST", "/v1/jobs", job), ("POST", f"/v1/jobs/{bobs}/cancel", None),
                               ("GET", f"/v1/jobs/{bobs}/model", None), ("POST", "/v1/keys", {"role": "reader"}),
                               ("POST", f"/v1/nodes/{node_id}/revoke", None)):
        r = client.request(method, path, json=body, headers=reader)
        assert r.status_code == 403 and "reader key 'grafana'" in r.json()["detail"], (method, path)
    for who in (alice, node):  # only an operator hands out credentials; a node never submits
        assert client.post("/v1/join-tokens", json={}, headers=who).status_code == 403
        assert client.get("/v1/keys", headers=who).status_code == 403
    assert client.post("/v1/jobs", json=job, headers=node).status_code == 403
    assert client.get("/v1/jobs", headers=node).status_code == 403
    assert client.post(f"/v1/jobs/{bobs}/cancel").json()["state"] == "cancelled"  # the operator may
    assert len(client.get("/v1/jobs").json()) == 2
    r = client.post("/v1/keys", json={"role": "admin"})
    assert r.status_code == 422 and "role" in r.json()["detail"]

    # what each may do, as the dashboard asks before it shows buttons and the submit form
    assert client.get("/v1/whoami", headers=reader).json() == {
        "id": reader_id, "role": "reader", "name": "grafana", "sees_every_job": True, "may_submit": False}
    assert client.get("/v1/whoami", headers=alice).json()["may_submit"] is True
    assert client.get("/v1/whoami", headers=alice).json()["sees_every_job"] is False
    assert client.get("/v1/whoami").json()["role"] == "operator"
    assert client.get("/v1/whoami", headers=node).status_code == 403


def test_a_revoked_or_expired_key_is_refused_and_an_operator_cannot_lock_itself_out(client: TestClient,
                                                                                   clock: FakeClock) -> None:
    alice_id, alice = key(client, "submitter", "alice")
    assert client.get("/v1/jobs", headers=alice).status_code == 200
    assert client.delete(f"/v1/keys/{alice_id}").status_code == 204
    r = client.get("/v1/jobs", headers=alice)
    assert r.status_code == 401 and "revoked" in r.json()["detail"]

    r = client.post("/v1/keys", json={"name": "temp", "role": "operator", "expires_in_s": 10})
    temp_id, temp = r.json()["id"], bearer(r.json()["token"])
    r = client.delete(f"/v1/keys/{temp_id}", headers=temp)
    assert r.status_code == 409 and "you are using" in r.json()["detail"]
    clock.now += 11
    r = client.get("/v1/keys", headers=temp)
    assert r.status_code == 401 and "expired" in r.json()["detail"]
    listed = {k["id"]: k for k in client.get("/v1/keys").json()}
    assert listed["operator"]["role"] == "operator" and listed[alice_id]["revoked_at"] is not None


def _replica(data_dir: Path, db_url: str, clock: FakeClock) -> TestClient:
    """One coordinator process of several on one database and data directory (in this test's process)."""
    settings = Settings(data_dir=data_dir, db_url=db_url, background=False, clock=clock, operator_token=OPERATOR_TOKEN)
    return TestClient(create_app(settings), headers=bearer(OPERATOR_TOKEN))


def test_a_node_credential_a_one_time_link_and_the_dashboard_session_work_at_any_replica(
        tmp_path: Path, clock: FakeClock, postgres_url: str) -> None:
    with _replica(tmp_path, postgres_url, clock) as first, _replica(tmp_path, postgres_url, clock) as second:
        node_id, node_auth = join(first)
        assert beat(second, node_id, node_auth)["heartbeat_interval_s"] > 0
        link = first.post("/v1/dashboard-link").json()["path"]
        logged_in = second.get(link, headers={"Authorization": ""}, follow_redirects=False)
        assert logged_in.status_code == 303 and logged_in.cookies.get("ravnest_key")
        assert first.get(link, headers={"Authorization": ""}).status_code == 401  # (once, wherever)
        cookie = {"Cookie": f"ravnest_key={logged_in.cookies['ravnest_key']}", "Authorization": ""}
        assert first.get("/v1/jobs", headers=cookie).status_code == 200


def test_a_key_revoked_at_one_coordinator_process_is_refused_at_another_within_a_second(
        tmp_path: Path, clock: FakeClock, postgres_url: str) -> None:
    """Each process reads a credential without a use limit again at most every REREAD_S (a join storm
    on one token reads it once a second, not at every join): the revoking process refuses it at once,
    the others once that much time has passed."""
    from coordinator.service.credentials import REREAD_S

    with _replica(tmp_path, postgres_url, clock) as first, _replica(tmp_path, postgres_url, clock) as second:
        alice_id, alice = key(first, "submitter", "alice")
        assert first.get("/v1/jobs", headers=alice).status_code == 200
        assert second.get("/v1/jobs", headers=alice).status_code == 200  # (read, and kept for a second)
        assert first.delete(f"/v1/keys/{alice_id}").status_code == 204
        assert first.get("/v1/jobs", headers=alice).status_code == 401
        clock.now += REREAD_S
        r = second.get("/v1/jobs", headers=alice)
        assert r.status_code == 401 and "revoked" in r.json()["detail"]


def test_the_default_join_token_stays_revoked_across_restarts_until_it_is_replaced(tmp_path: Path) -> None:
    def coordinator(join_token: str | None = None) -> TestClient:
        settings = Settings(data_dir=tmp_path, background=False, operator_token=OPERATOR_TOKEN, join_token=join_token)
        return TestClient(create_app(settings), headers=bearer(OPERATOR_TOKEN))

    with coordinator() as client:
        default = (tmp_path / "join_token").read_text().strip()
        assert try_join(client, default).status_code == 201
        assert client.delete("/v1/join-tokens/join").status_code == 204
    with coordinator() as client:
        r = try_join(client, default)
        assert r.status_code == 401 and "revoked" in r.json()["detail"]
    with coordinator(join_token="rvn_a-new-one") as client:
        assert try_join(client, "rvn_a-new-one").status_code == 201
        assert try_join(client, default).status_code == 401


@pytest.mark.slow
def test_an_operator_hands_out_and_revokes_credentials_with_the_ravnest_command(tmp_path: Path) -> None:
    """Real processes: a coordinator, `ravnest` and `ravnest-node`. A one-use join token admits one
    node; a revoked node stops at its next heartbeat and says why."""
    def ravnest(*args: str, key: str | None = None) -> subprocess.CompletedProcess:
        env = {**os.environ, "RAVNEST_COORDINATOR": cluster.url, "RAVNEST_KEY": key or cluster.operator_token,
               "COLUMNS": "160"}  # piped: every column, unwrapped
        return subprocess.run([sys.executable, "-m", "ravnest.client.cli", *args], capture_output=True, text=True,
                              env=env, timeout=60)

    with LocalCluster(tmp_path, nodes=0) as cluster:
        created = ravnest("token", "create", "--name", "one machine", "--uses", "1", "--expires", "1h")
        assert created.returncode == 0, created.stderr
        token = created.stdout.strip()
        [node_id] = cluster.add_nodes(1, [f"--token={token}"])
        second = subprocess.run([sys.executable, "-m", "node.cli", "join", "--coordinator", cluster.url,
                                 f"--token={token}", "--ephemeral"], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert second.returncode == 1 and "used up" in second.stdout + second.stderr
        listed = ravnest("token", "list")
        assert listed.returncode == 0 and "one machine" in listed.stdout and token not in listed.stdout

        reader = ravnest("key", "create", "--role", "reader", "--name", "watcher").stdout.strip()
        refused = ravnest("token", "list", key=reader)
        assert refused.returncode == 1 and "operator key" in refused.stderr
        assert ravnest("node", "list", key=reader).returncode == 0

        linked = ravnest("dashboard", key=reader)  # a one-time login link; the key is not in it
        assert linked.returncode == 0 and reader not in linked.stdout, linked.stderr
        url = linked.stdout.strip()
        assert url.startswith(f"{cluster.url}/login?once=")
        opened = httpx.get(url, follow_redirects=False)
        assert opened.status_code == 303 and opened.headers["location"] == "/"
        assert httpx.get(f"{cluster.url}/", cookies=opened.cookies).status_code == 200  # the dashboard
        again = httpx.get(url, follow_redirects=False)
        assert again.status_code == 401 and "used already" in again.text

        assert ravnest("node", "revoke", node_id).returncode == 0
        node = cluster.node_process(node_id)
        assert node.wait(timeout=30) == 1
        log = (tmp_path / "logs" / "node-0.log").read_text()
        assert "credential was revoked, by the operator" in log
    unreachable = subprocess.run([sys.executable, "-m", "ravnest.client.cli", "--coordinator", "http://127.0.0.1:9",
                                  "--key", "x", "key", "list"], capture_output=True, text=True, timeout=60)
    assert unreachable.returncode == 3 and "cannot reach" in unreachable.stderr


@pytest.mark.slow
def test_every_file_a_coordinator_and_a_node_write_is_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    """Started with umask 022 in a data directory of mode 0755 (as an operator might make it), the
    coordinator's files, SQLite's -wal and -shm beside its database included, and the node's are 0600."""
    tmp_path.chmod(0o755)
    previous = os.umask(0o022)
    try:
        cluster = LocalCluster(tmp_path, nodes=1)
        cluster.preloaded = False  # fresh interpreters, started with that umask (as a shell starts them)
        with cluster:
            cluster.http.get("/v1/nodes").raise_for_status()
            written = [p for p in tmp_path.rglob("*") if p.is_file() and "logs" not in p.relative_to(tmp_path).parts]
            modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in written}
    finally:
        os.umask(previous)
    assert {"coordinator.db", "coordinator.db-wal", "coordinator.db-shm", "coordinator.db.lock"} <= set(modes), modes
    assert any(name.startswith("nodes/") for name in modes), modes
    assert set(modes.values()) == {"0o600"}, modes


@pytest.mark.slow
def test_training_works_end_to_end_with_tls_everywhere(tmp_path: Path) -> None:
    """HTTPS to the coordinator and TLS on every gRPC stream (pipeline and rings), with per-node
    credentials: 2 clusters x 2 stages of the digits CNN train to a good accuracy."""
    with LocalCluster(tmp_path, nodes=4, tls=True) as cluster:
        assert cluster.url.startswith("https://")
        job_id = cluster.submit(cnn_job(steps=300, clusters=2, stages_per_cluster=2, min_nodes=4))
        job = cluster.wait_job(job_id, timeout=400)
        assert job["state"] == "completed", job["reason"]
        assert len(job["plan"]["clusters"]) == 2 and job["plan"]["rings"]
        assert job["metrics"]["test_accuracy"] >= 0.9
        with pytest.raises(httpx.HTTPError):  # nothing answers in plain text
            httpx.get(cluster.url.replace("https://", "http://") + "/healthz", timeout=5)


def test_a_one_time_dashboard_link_logs_in_once_within_a_minute(client: TestClient) -> None:
    """POST /v1/dashboard-link with any API key: the path logs in once (the key as the form's HttpOnly
    cookie) and never shows the key; a second visit, a stranger or an expired link gets the form."""
    _, reader = key(client, "reader", "screen")
    assert client.post("/v1/dashboard-link", headers={"Authorization": "Bearer nonsense"}).status_code == 401
    link = client.post("/v1/dashboard-link", headers=reader).json()
    assert link["expires_in_s"] == 60 and reader["Authorization"].split()[1] not in link["path"]
    client.cookies.clear()
    opened = client.get(link["path"], headers={"Authorization": ""}, follow_redirects=False)
    assert opened.status_code == 303 and "httponly" in opened.headers["set-cookie"].lower()
    assert client.get("/", headers={"Authorization": ""}, follow_redirects=False).status_code == 200
    client.cookies.clear()
    used = client.get(link["path"], headers={"Authorization": ""}, follow_redirects=False)
    assert used.status_code == 401 and "used already" in used.text
    assert client.get("/login?once=made-up", follow_redirects=False).status_code == 401


def test_login_links_expire_are_bounded_and_keep_no_key_readable(tmp_path) -> None:
    from coordinator.login_links import LINK_S, MAX_OPEN, LoginLinks
    from coordinator.store import LoginLinkRow, Store
    store = Store(f"sqlite:///{tmp_path / 'links.db'}")
    now = [0.0]
    links, other_process = LoginLinks(store, lambda: now[0]), LoginLinks(store, lambda: now[0])
    late, soon = links.create("key-a"), links.create("key-b" * 40)
    assert other_process.redeem(soon) == "key-b" * 40 and links.redeem(soon) is None  # any process; once
    with store.session() as session:
        [row] = session.query(LoginLinkRow).all()
        assert "key-a" not in row.sealed_key and late not in row.code_hash and b"key-a" not in bytes.fromhex(
            row.sealed_key)
    now[0] = LINK_S + 1
    assert links.redeem(late) is None
    first = links.create("k")
    for _ in range(MAX_OPEN):
        links.create("k")
    assert links.redeem(first) is None and store.count(LoginLinkRow) == MAX_OPEN  # the oldest went first
    store.close()


def test_names_with_control_characters_are_refused_and_tables_show_text_as_text(client: TestClient) -> None:
    """A name that would clear the operator's screen, retitle the window or forge a table row is refused
    at join, saying why; a job's name too. Markup is only text. Whatever reaches a table (rows from
    before, a reason's escapes) is shown escaped: no control character reaches the terminal."""
    from rich.console import Console

    from ravnest.client import typer_app

    volunteer = bearer((client.app.state.service.core.settings.data_dir / "join_token").read_text().strip())
    for name in ("\x1b[2J\x1b[31mPWNED\x1b]0;owned\x07", "line1\nline2", "right\u202eleft"):
        r = client.post("/v1/nodes", json={"name": name, "address": f"127.0.0.1:{next(_ports)}", "profile": profile()},
                        headers=volunteer)
        assert r.status_code == 422 and "control character" in r.text, r.text
    refused = client.post("/v1/jobs", json={**digits_job(), "name": "job\x1b[2J"})
    assert refused.status_code == 422 and "control character" in refused.text, refused.text
    marked, _ = join(client, name="[bold red]x[/bold red]", headers=volunteer)
    assert client.get("/v1/nodes").json()[0]["name"] == "[bold red]x[/bold red]"
    # a failure's reason is prose: kept, escaped, so that a report is never lost to a stray byte
    from ravnest.spec import FailureReport
    assert FailureReport(node_id=marked, reason="peer \x1b[2Jgone\nat step 3").reason == "peer \\x1b[2Jgone\nat step 3"

    grid = typer_app.table("id", "name", "reason")
    grid.add_row(marked, "[bold red]x[/bold red]", "lost\x1b]0;owned\x07 peer\nnext row")
    console = Console(width=120, markup=False, highlight=False, force_terminal=False, record=True)
    console.print(grid)
    text = console.export_text()
    assert "[bold red]x[/bold red]" in text and "\\x1b]0;owned\\x07 peer next row" in text, text
    assert not any(ord(c) < 32 and c != "\n" for c in text) and text.count("\n") == 2, repr(text)

    # the coordinator's log (coordinator/cli.py installs the filter): a reason cannot forge a line of it
    import io
    import logging

    from ravnest.printable import PrintableRecords
    written, logger = io.StringIO(), logging.getLogger("test.printable")
    handler = logging.StreamHandler(written)
    handler.addFilter(PrintableRecords())
    logger.addHandler(handler)
    try:
        logger.warning("job %s failed: %s", "j1", "peer gone\n2026-12-07 INFO coordinator: forged\x1b[2J")
        logger.warning(f"node {marked} reported: lost\r\x1b]0;owned\x07")  # (an f-string: the message itself)
    finally:
        logger.removeHandler(handler)
    assert written.getvalue().splitlines() == [
        "job j1 failed: peer gone 2026-12-07 INFO coordinator: forged\\x1b[2J", f"node {marked} reported: lost \\x1b]0;owned\\x07"]


def _unfinished_beat(port: int, node_id: str, token: str, length: int, sent: bytes) -> socket.socket:
    """A heartbeat that declares `length` bytes of body and sends `sent` of them (what fits at once)."""
    connection = socket.create_connection(("127.0.0.1", port))
    connection.sendall(f"POST /v1/nodes/{node_id}/heartbeat HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n".encode())
    connection.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        connection.send(sent)
    return connection


def _answer(connection: socket.socket, within_s: float) -> tuple[bytes, bool]:
    """(what the coordinator answered within `within_s`, whether it closed the connection after)."""
    answered, deadline = b"", time.monotonic() + within_s
    with contextlib.suppress(TimeoutError):
        while time.monotonic() < deadline:
            connection.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                chunk = connection.recv(65536)
            except ConnectionResetError:  # (closed with what we sent unread: a reset)
                return answered, True
            if not chunk:
                return answered, True
            answered += chunk
    return answered, False


def _rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) / 1024


def test_nothing_of_a_body_is_read_before_its_credential_and_slow_bodies_are_cut(tmp_path: Path) -> None:
    """A stranger's 200 heartbeats, each declaring a megabyte and sending 960 KiB of it, are refused
    from their headers and closed (the coordinator grows < 64 MiB and gives it back), real beats keep
    their pace meanwhile, and a node that sends its own body too slowly is cut with 408."""
    with coordinator_process(tmp_path, "--body-grace", "1") as (url, process):
        port = int(url.rpartition(":")[2])
        with httpx.Client(base_url=url, timeout=30) as http:
            node_id, auth = join(http, headers=bearer((tmp_path / "join_token").read_text().strip()))

            def beats(count: int) -> list[float]:
                took = []
                for _ in range(count):
                    began = time.perf_counter()
                    assert http.post(f"/v1/nodes/{node_id}/heartbeat", json={}, headers=auth).status_code == 200
                    took.append(time.perf_counter() - began)
                return sorted(took)

            def attack(length: int, sent: bytes) -> tuple[list[float], float]:
                """200 strangers' beats (made-up ids and tokens; the real node's id with a made-up token):
                (the real node's beat times meanwhile, the coordinator's peak RSS growth in MiB)."""
                before, peak, held, during = _rss_mib(process.pid), 0.0, [], []
                for wave in range(4):
                    held += [_unfinished_beat(port, node_id if wave % 2 else f"n{i}", "rvn_" + "x" * 40, length, sent)
                             for i in range(50)]
                    during += beats(15)
                    peak = max(peak, _rss_mib(process.pid) - before)
                answers = [_answer(connection, 5) for connection in held]
                for connection in held:
                    connection.close()
                assert all(a.startswith(b"HTTP/1.1 401") and b"unknown token" in a and closed
                           for a, closed in answers), answers[:3]
                return sorted(during), peak

            beats(20)  # (the first beats warm the coordinator up)
            before = _rss_mib(process.pid)
            bodiless, _ = attack(0, b"")  # the same callers with no body: what a refusal itself costs
            unfinished, grew = attack(1_000_000, bytes(960 << 10))
            assert grew < 64, grew
            p99 = lambda took: took[int(0.99 * (len(took) - 1))]  # noqa: E731
            assert p99(unfinished) < 2 * p99(bodiless) + 0.05, (p99(bodiless), p99(unfinished))
            # the node's own credential, and a body that does not come: cut after its grace (1 s here)
            began = time.monotonic()
            answer, closed = _answer(_unfinished_beat(port, node_id, auth["Authorization"].split()[1], 100, b"{"), 10)
            assert answer.startswith(b"HTTP/1.1 408") and closed, answer
            assert b"came too slowly: 1 of 100 bytes" in answer and time.monotonic() - began < 5, answer
            assert beats(1)  # and it beats on
            time.sleep(2.5)  # the coordinator's tick hands freed memory back (every heartbeat interval)
            assert _rss_mib(process.pid) - before < 32, (before, _rss_mib(process.pid))


def test_the_coordinator_dials_a_nodes_moves_once_a_minute_and_only_in_the_networks_it_may(tmp_path: Path) -> None:
    """Ten address moves in a row make the coordinator dial the first alone (the others' replies say when
    it will), and an address outside --dial-allow is never dialled: the node is told why."""
    def listener(host: str = "127.0.0.1") -> socket.socket:
        server = socket.create_server((host, 0))
        server.setblocking(False)
        return server

    def address(server: socket.socket) -> str:
        return "%s:%d" % server.getsockname()

    def dialled(server: socket.socket, within_s: float = 0.0) -> bool:
        return bool(select.select([server], [], [], within_s)[0])

    homes, outside, later = [listener() for _ in range(10)], listener("127.0.0.2"), listener()
    with coordinator_process(tmp_path, "--dial-allow", "127.0.0.1/32") as (url, _), \
            httpx.Client(base_url=url, timeout=30) as http:
        join_auth = bearer((tmp_path / "join_token").read_text().strip())
        node_id, auth = join(http, headers=join_auth)
        named = http.post("/v1/nodes", json={"name": "\x1b[2J\x1b]0;owned\x07", "address": address(later),
                                             "profile": profile()}, headers=join_auth)
        assert named.status_code == 422 and "control character (U+001B at 0)" in named.text, named.text
        replies = [http.post(f"/v1/nodes/{node_id}/heartbeat", json={"address": address(home)}, headers=auth).json()
                   for home in homes]
        assert dialled(homes[0], 10)
        assert replies[0]["note"] == "" and all(
            r["note"].startswith(f"{address(home)} is dialled from ") and "at most once a minute" in r["note"]
            for r, home in zip(replies[1:], homes[1:])), replies
        [view] = [n for n in http.get("/v1/nodes", headers=_operator(tmp_path)).json() if n["id"] == node_id]
        assert view["address"] == address(homes[0])
        # an address outside the networks allowed: refused in words, never dialled (another node joins
        # within them, and is dialled, meanwhile)
        r = http.post("/v1/nodes", json={"name": "outside", "address": address(outside), "profile": profile()},
                      headers=join_auth)
        http.post("/v1/nodes", json={"name": "later", "address": address(later), "profile": profile()},
                  headers=join_auth).raise_for_status()
        assert dialled(later, 10)

        def outsider() -> dict:
            return next(n for n in http.get("/v1/nodes", headers=_operator(tmp_path)).json() if n["name"] == "outside")
        deadline = time.monotonic() + 10
        while outsider()["reachable"] is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert outsider()["reachable"] is False and outsider()["reachability"] == (
            f"the coordinator does not dial {address(outside)}: 127.0.0.2 is outside --dial-allow 127.0.0.1/32"), r.text
        assert not any(dialled(server) for server in [*homes[1:], outside])


def _operator(data_dir: Path) -> dict:
    return bearer((data_dir / "operator_token").read_text().strip())
