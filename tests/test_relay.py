"""Relays (ravnest/relay): a node's gRPC server reached through a relay that it dialled itself. The
peer's calls run end to end (the node's own credentials are checked as always); the relay turns away
nodes without the coordinator's token, closes what nobody claims and bounds what one node holds; a
node whose relay goes listens again. Then whole jobs: real nodes that peers cannot dial, on loopback."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from argparse import ArgumentTypeError
from dataclasses import replace

import grpc
import pytest
import torch

from fastapi.testclient import TestClient

from coordinator.app import create_app
from coordinator.clustering import NodeInfo
from coordinator.config import Settings
from coordinator.peer_links import link
from coordinator.service.reachability import DirectLinks, relay_shares, tls_names
from coordinator.store import NodeRow
from ravnest.relay import server as relay_server
from ravnest.relay.ports import port_range
from ravnest.relay.server import RelayServer, relay_token
from ravnest.relay.tunnel import RelayTunnel
from ravnest.v1 import relay_pb2, relay_pb2_grpc
from ravnest.wire import PeerServer
from ravnest.wire.transport import DIALER, Dialer
from ravnest.wire.messages import Message
from ravnest.wire.transport import OutboundStream, measure_link, ping
from scripts.local_cluster import LocalCluster
from tests.test_coordinator_api import OPERATOR_TOKEN, beat, profile
from tests.test_faults import CNN_JOB

SECRET = b"relay secret"


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return result


@pytest.fixture
def node_server():
    received: list[tuple[Message, str]] = []
    server = PeerServer(lambda msg, peer: received.append((msg, peer)), token="peer-token")
    server.received = received  # type: ignore[attr-defined]
    yield server
    server.stop()


def tunnel_to(relay: RelayServer, server: PeerServer, node_id: str = "n1", token: str | None = None):
    moves: list[tuple[str | None, str]] = []
    tunnel = RelayTunnel(relay.address, node_id, token or relay_token(SECRET, node_id), server.address,
                         lambda address, why: moves.append((address, why)))
    return tunnel, moves


def test_a_peer_reaches_a_node_through_the_relay_with_its_own_credentials_checked_end_to_end(node_server):
    with RelayServer(SECRET) as relay:
        tunnel, moves = tunnel_to(relay, node_server)
        try:
            address = wait_for(lambda: tunnel.address, 10, "the relay's port")
            assert address.startswith("127.0.0.1:") and address != relay.address and relay.listening == ["n1"]
            assert moves == [(address, f"listening through the relay at {relay.address}")]
            tensors = [torch.randn(300_000) for _ in range(5)]  # 1.2 MB each: many chunks through the relay
            with OutboundStream(address, token="peer-token") as out:
                for i, tensor in enumerate(tensors):
                    out.send(Message("forward", i, {"x": tensor}))
            assert [m.id for m, _ in node_server.received] == list(range(5))
            assert all(torch.equal(m.tensors["x"], t) for (m, _), t in zip(node_server.received, tensors))
            assert ping(address, token="peer-token") >= 0
            latency, bandwidth, _ = measure_link(address, token="peer-token")
            assert bandwidth > 1e6  # measured through the relay, as the planner will price the link
            with pytest.raises(grpc.RpcError) as refused:  # the relay does not vouch for anyone
                ping(address, token="not the node's token")
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            tunnel.close()


def test_a_peer_that_can_be_dialled_sends_to_a_hidden_node_over_the_connection_it_opened(node_server, monkeypatch):
    """No relay hop where one side can be dialled: the hidden node listens at the peer's relay for its
    peers, whose port is on the peer's loopback, and the peer's streams to the hidden node's planned
    address (here one nobody answers at) go there; a hidden node that never comes is dialled as planned."""
    planned = "127.0.0.3:9"  # the hidden node's port at its own relay: nothing answers here in this test
    with RelayServer(SECRET, node_host="127.0.0.1") as for_peers:
        tunnel, _ = tunnel_to(for_peers, node_server, "hidden")
        try:
            DIALER.route(planned, lambda: for_peers.address_of("hidden"))
            with OutboundStream(planned, token="peer-token", wait_ready=10) as out:
                out.send(Message("forward", 7, {"x": torch.ones(3)}))
            assert [m.id for m, _ in node_server.received] == [7]
            assert for_peers.address_of("hidden").startswith("127.0.0.1:") and for_peers.address_of("other") is None
        finally:
            DIALER.unroute(planned)
            tunnel.close()
    monkeypatch.setattr(DIALER, "route_wait_s", 0.3)
    DIALER.route(node_server.address, lambda: None)  # it never listens: after the wait, the planned address
    try:
        with OutboundStream(node_server.address, token="peer-token") as out:
            out.send(Message("forward", 8, {"x": torch.ones(3)}))
        assert [m.id for m, _ in node_server.received] == [7, 8]
    finally:
        DIALER.unroute(node_server.address)


def test_the_coordinator_has_a_hidden_node_listen_at_its_dialable_peers_and_those_send_to_it_there():
    links = DirectLinks(relays={"a": "10.0.0.1:7001", "b": "10.0.0.2:7002"}, hidden=frozenset({"h", "g"}),
                        secret=lambda node: f"secret of {node}".encode())
    offer = links.listen_at("h", "a")
    assert offer is not None and offer.address == "10.0.0.1:7001"
    assert offer.token == relay_token(b"secret of a", "h")  # a's relay lets h, and only h, listen with it
    assert links.listen_at("a", "h") is None and links.listen_at("h", "g") is None  # g cannot be dialled either
    assert links.dials_out("a", "h") and not links.dials_out("h", "a") and not links.dials_out("a", "b")
    assert not links.dials_out("c", "h")  # c offers no relay for its peers: through h's relay, as before


def test_over_tls_a_peer_checks_the_relayed_nodes_certificate_against_its_own_name(tmp_path, monkeypatch):
    """The node's certificate names its own host only, not the relay's: dialled at the relay, a peer
    finds the name wrong until the plan tells it the name to expect (StagePeer.tls_name); then the
    TLS session runs end to end through the relay, which holds no certificate at all."""
    from scripts.make_certs import make_certificates
    certs = make_certificates(tmp_path, ["node-a.example"])
    server = PeerServer(lambda msg, peer: None, token="peer-token",
                        tls=(certs["cert"].read_bytes(), certs["key"].read_bytes()))
    dialer = Dialer()
    dialer.use_tls(certs["ca"].read_bytes())
    pool = dialer.pool
    with RelayServer(SECRET) as relay:
        tunnel, _ = tunnel_to(relay, server)
        try:
            address = wait_for(lambda: tunnel.address, 10, "the relay's port")
            with pytest.raises(grpc.RpcError):  # the relay's host is not a name the certificate carries
                ping(address, token="peer-token", pool=pool, timeout=5)
            dialer.name_peer(address, "node-a.example")
            assert ping(address, token="peer-token", pool=pool, timeout=5) > 0
        finally:
            tunnel.close()
            pool.close()
            server.stop()


def test_a_node_remembers_the_certificate_names_of_its_latest_peers_only(monkeypatch):
    """A node serving job after job names the relayed peers of each: the oldest names go first."""
    dialer = Dialer(max_named=3)
    for port in range(4):
        dialer.name_peer(f"relay.example:{port}", f"node-{port}.example")
    dialer.name_peer("relay.example:1", "node-1.example")  # named again: the latest
    dialer.name_peer("relay.example:4", "node-4.example")
    assert list(dialer.tls_names) == ["relay.example:3", "relay.example:1", "relay.example:4"]


def test_the_relay_turns_away_a_node_without_the_coordinators_token(node_server):
    with RelayServer(SECRET) as relay:
        tunnel, moves = tunnel_to(relay, node_server, "n1", token=relay_token(SECRET, "another node"))
        wait_for(lambda: tunnel.refused, 10, "the refusal")
        assert not tunnel.alive and tunnel.address is None and relay.listening == []
        assert "refused this node: this relay does not know that node" in tunnel.refused
        assert moves == [(None, tunnel.refused)]  # said, though it never had an address there
        tunnel.close()


def test_a_relay_given_a_port_range_opens_its_nodes_ports_there_and_says_when_none_is_free():
    """--relay-ports LOW-HIGH: a firewall lets in that range; a port another program holds is skipped,
    and a node that finds none free is told so (it is offered another relay)."""
    with pytest.raises(ArgumentTypeError, match="LOW-HIGH"):
        port_range("40000:40099")
    with pytest.raises(ArgumentTypeError, match="LOW <= HIGH"):
        port_range("40099-40000")
    taken = socket.socket()  # another program's port, then a free one after it: the range
    taken.bind(("127.0.0.1", 0))
    while not bindable(port := taken.getsockname()[1] + 1):
        taken.close()
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
    with RelayServer(SECRET, node_ports=range(port - 1, port + 1)) as relay, \
            grpc.insecure_channel(relay.address) as channel:
        stub = relay_pb2_grpc.RelayStub(channel)
        first = stub.Listen(relay_pb2.ListenRequest(node_id="n1", token=relay_token(SECRET, "n1")))
        assert next(first).port == port
        second = stub.Listen(relay_pb2.ListenRequest(node_id="n2", token=relay_token(SECRET, "n2")))
        with pytest.raises(grpc.RpcError) as refused:
            next(second)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"no port of this relay's ports {port - 1}-{port} is free" in refused.value.details()
        first.cancel()
    taken.close()


def bindable(port: int) -> bool:
    """Whether `port` can be bound on loopback now."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_unclaimed_and_excess_connections_are_closed(monkeypatch):
    monkeypatch.setattr(relay_server, "CLAIM_S", 0.5)
    with RelayServer(SECRET, max_connections=2) as relay, grpc.insecure_channel(relay.address) as channel:
        stub = relay_pb2_grpc.RelayStub(channel)
        listening = stub.Listen(relay_pb2.ListenRequest(node_id="n1", token=relay_token(SECRET, "n1")))
        port = next(listening).port  # a node that listens but never carries what comes
        peers = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        named = [next(listening).connection for _ in range(2)]
        assert len(set(named)) == 2
        peers[2].settimeout(5)
        assert peers[2].recv(1) == b""  # over the node's share: closed at once
        for peer in peers[:2]:
            peer.settimeout(5)
            assert peer.recv(1) == b""  # not claimed within CLAIM_S: closed
        metadata = (("ravnest-node", "n1"), ("ravnest-connection", str(named[0])),
                    ("authorization", relay_token(SECRET, "n1")))
        with pytest.raises(grpc.RpcError) as gone:
            list(stub.Carry(iter(()), metadata=metadata))
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND
        listening.cancel()
        for peer in peers:
            peer.close()


def test_a_node_whose_relay_goes_listens_again_when_it_is_back(node_server):
    relay = RelayServer(SECRET)
    port = relay.port
    tunnel, moves = tunnel_to(relay, node_server)
    try:
        first = wait_for(lambda: tunnel.address, 10, "the relay's port")
        relay.stop()
        wait_for(lambda: tunnel.address is None, 40, "the tunnel to notice")
        assert moves[-1][0] is None and f"lost the relay at {relay.address}" in moves[-1][1] and tunnel.alive
        relay = RelayServer(SECRET, port=port)  # back on its address (a restarted coordinator)
        second = wait_for(lambda: tunnel.address, 30, "the tunnel to listen again")
        assert second != first
        with OutboundStream(second, token="peer-token") as out:
            out.send(Message("forward", 7, {"x": torch.ones(3)}))
        assert node_server.received[-1][0].id == 7
    finally:
        tunnel.close()
        relay.stop()


def test_the_coordinator_hands_out_the_least_loaded_relay_and_takes_the_address_it_gave(tmp_path):
    app = create_app(Settings(data_dir=tmp_path, background=False, relay_port=0, operator_token=OPERATOR_TOKEN))
    with TestClient(app, headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}) as client:
        def join(name: str, address: str, **extra) -> tuple[str, dict, dict]:
            r = client.post("/v1/nodes", json={"name": name, "address": address, "profile": profile(), **extra})
            assert r.status_code == 201, r.text
            return r.json()["node_id"], {"Authorization": f"Bearer {r.json()['node_token']}"}, r.json()

        def found(node_id: str, reachable: bool) -> None:  # what the dial-back would find (tests dial none)
            with app.state.service.store.session() as session:
                session.get(NodeRow, node_id).reachable = reachable

        relay, _, joined = join("relay", "10.0.0.1:4000", relay_port=4001)
        assert joined["relay_secret"] and join("plain", "10.0.0.2:4000")[2]["relay_secret"] == ""
        found(relay, True)
        hidden = [join(f"hidden{i}", f"192.168.0.{i}:4000")[:2] for i in range(2)]
        for node_id, _ in hidden:
            found(node_id, False)
        coordinator_port = app.state.service.membership.reachability.relay.port
        offers = [beat(client, node_id, auth)["relay"] for node_id, auth in hidden]
        # the same load (none): the volunteer's relay first, then the coordinator's, which has none yet
        assert [o["address"] for o in offers] == ["10.0.0.1:4001", f":{coordinator_port}"]
        assert offers[0]["token"] == relay_token(joined["relay_secret"].encode(), hidden[0][0])
        assert offers[1]["token"] != relay_token(joined["relay_secret"].encode(), hidden[1][0])
        assert beat(client, *hidden[0])["relay"] == offers[0]  # it keeps the relay it was given
        views = {n["name"]: n for n in client.get("/v1/nodes").json()}
        assert views["hidden0"]["relayed_by"] == relay and views["hidden1"]["relayed_by"] == "coordinator"
        assert views["relay"]["relay_port"] == 4001
        with app.state.service.store.session() as session:  # what the planner counts on: B / 2n
            nodes = [session.get(NodeRow, node_id) for node_id, _ in hidden]
            assert relay_shares(session, nodes) == {hidden[0][0]: profile()["bandwidth_bytes_per_s"] / 2}
            assert relay_shares(session, nodes, 8e6) == {hidden[0][0]: profile()["bandwidth_bytes_per_s"] / 2,
                                                         hidden[1][0]: 4e6}  # --relay-bandwidth 64
        here, there = (NodeInfo(n, 1e10, 2**30, 1e8) for n in ("a", "b"))
        assert link(here, replace(there, relay_share=5e6)) == (5e6, 0.0)  # estimated, then capped
        assert link(here, replace(there, relay_share=5e6), {("a", "b"): (4e7, 0.01)}) == (5e6, 0.01)  # measured too
        # but no relay hop between a hidden node and a peer that runs a relay for its peers: what the hidden
        # one measured probing that peer (both ways, over the connection it opened) is the link
        hidden_b = replace(there, relay_share=5e6, hidden=True)
        measured = {("a", "b"): (4e6, 0.02), ("b", "a"): (4e7, 0.01)}  # a's probe went through b's relay
        assert link(replace(here, peer_relay=True), hidden_b, measured) == (4e7, 0.01)
        assert link(hidden_b, replace(here, peer_relay=True), measured) == (4e7, 0.01)  # either order
        assert link(here, hidden_b, measured) == (4e6, 0.02)  # a opens no relay for peers: b's relay, as before

        def heartbeat_from(node, address: str) -> dict:
            r = client.post(f"/v1/nodes/{node[0]}/heartbeat", json={"address": address}, headers=node[1])
            assert r.status_code == 200, r.text
            return r.json()
        heartbeat_from(hidden[0], "10.0.0.2:4000")  # a live node's address: not taken
        assert {n["name"]: n for n in client.get("/v1/nodes").json()}["hidden0"]["address"] == "192.168.0.0:4000"
        reply = heartbeat_from(hidden[0], "10.0.0.1:40123")  # its port on the relay
        assert reply["relay"] is None and reply["reachable"] is None  # to be dialled there (tests dial none)
        assert {n["name"]: n for n in client.get("/v1/nodes").json()}["hidden0"]["address"] == "10.0.0.1:40123"
        with app.state.service.store.session() as session:  # peers check its certificate for its own host
            assert tls_names(session, [relay, hidden[0][0]]) == {hidden[0][0]: "192.168.0.0"}
        heartbeat_from(hidden[0], "192.168.0.0:4000")  # back at its own: that relay turned it away (or went)
        found(hidden[0][0], False)
        assert beat(client, *hidden[0])["relay"]["address"] == f":{coordinator_port}"  # the other one, though busier
        with app.state.service.store.session() as session:  # reached through the volunteer's relay ...
            session.get(NodeRow, hidden[1][0]).relayed_by, session.get(NodeRow, hidden[1][0]).reachable = relay, True
        assert beat(client, *hidden[1])["relay"] is None
        with app.state.service.store.session() as session:  # ... which its lost links got quarantined
            session.get(NodeRow, relay).quarantined_until = time.time() + 3600
        assert beat(client, *hidden[1])["relay"]["address"] == f":{coordinator_port}"  # moved off it


def direct_where_one_side_can_be_dialled(job: dict, hidden: set[str], logs: Path, nodes: list[dict]) -> int:
    """Checks, in the nodes' logs, that each hidden node listened at the relay for peers of each neighbour
    (in its pipeline or its ring) that can be dialled, which sent to it through there; returns how many
    such links the 2-cluster plan has."""
    said = {n["id"]: (logs / f"{n['name']}.log").read_text() for n in nodes}
    grid = [[s["node_id"] for s in c["stages"]] for c in job["plan"]["clusters"]]
    neighbours = [*((row[s], row[s + 1]) for row in grid for s in range(len(row) - 1)),
                  *((grid[0][s], grid[1][s]) for s in range(len(grid[0])))]
    mixed = [(a, b) if b in hidden else (b, a) for a, b in neighbours if (a in hidden) != (b in hidden)]
    for shown, hidden_one in mixed:
        assert f"node {shown[:8]} sends to this node over a connection this node opened" in said[hidden_one]
        assert f"sends to node {hidden_one[:8]} over the connection it opened to this node" in said[shown]
    return len(mixed)


@pytest.mark.slow
def test_nodes_that_peers_cannot_dial_train_through_the_coordinators_relay(tmp_path):
    """On loopback: two of four real nodes advertise 127.0.0.2, where nobody listens (their servers are
    on 127.0.0.1), as a NAT hides a home machine. The coordinator's dial-back finds them out, they
    listen on its relay, and the 2 x 2 digits CNN trains across relayed links. A fifth such node that
    refuses the relay (--no-relay) gets no work and is told why. All of it over TLS, the hidden nodes'
    certificates naming 127.0.0.2 only: peers dial them at the relay's host and check their own name."""
    from scripts.make_certs import make_certificates
    with LocalCluster(tmp_path, nodes=2, tls=True) as cluster:
        own = make_certificates(tmp_path / "hidden-certs", ["127.0.0.2"], ca_dir=tmp_path / "certs")
        hidden = cluster.add_nodes(2, ["--advertise", "127.0.0.2", "--tls-cert", str(own["cert"]),
                                       "--tls-key", str(own["key"])])
        refusing = cluster.add_nodes(1, ["--advertise", "127.0.0.2", "--no-relay"])
        relay_port = int(cluster.wait_for(lambda: next(
            (line for line in (tmp_path / "logs" / cluster.coordinator_log).read_text().splitlines()
             if "relay for nodes that peers cannot dial at" in line), None), 30, "the relay").rsplit(":", 1)[1])

        def nodes() -> dict[str, dict]:
            return {n["id"]: n for n in cluster.alive_nodes()}
        cluster.wait_for(lambda: all(nodes()[n]["reachable"] and not nodes()[n]["address"].startswith("127.0.0.2")
                                     for n in hidden) and nodes()[min(refusing)]["reachable"] is False,
                         60, "the hidden nodes to be reachable through the relay")
        assert all(nodes()[n]["address"].startswith("127.0.0.1:") for n in hidden)
        assert all(int(nodes()[n]["address"].rsplit(":", 1)[1]) != relay_port for n in hidden)
        spec = json.loads(CNN_JOB.read_text())
        spec["training"].update(steps=200, eval_every=0)
        job = cluster.wait_job(cluster.submit(spec), timeout=600)
        assert job["state"] == "completed", job["reason"]
        placed = {s["node_id"] for c in job["plan"]["clusters"] for s in c["stages"]}
        assert hidden <= placed and not refusing & placed and len(placed) == 4
        assert job["metrics"]["test_accuracy"] >= 0.9
        log = (tmp_path / "logs" / "node-4.log").read_text()
        assert "peers cannot dial this node at 127.0.0.2:" in log and "or let it use a relay" in log
        assert direct_where_one_side_can_be_dialled(job, hidden, tmp_path / "logs", cluster.alive_nodes()) >= 2


@pytest.mark.slow
def test_volunteers_relay_for_the_hidden_nodes_and_a_relay_lost_mid_job_is_replaced(tmp_path):
    """The coordinator relays nothing (--no-relay); two reachable volunteers relay and do nothing else
    (--relay --max-memory 1MiB). The two hidden nodes are spread over them. One relay is killed while a
    pipeline of the reachable node and one or both hidden ones runs (no node relays for its own peers,
    so every link to a hidden node crosses its relay): the node it relayed for moves to the other relay
    and is not blamed for the lost link (the re-plan leaves it in: it takes it if it is back by then),
    and the job completes. (Over 60 s: 5 nodes, a pipeline whose every hop goes through a relay, and a
    recovery.)"""
    with LocalCluster(tmp_path, nodes=1, relay=False, node_args=["--no-peer-relay"]) as cluster:
        relays = cluster.add_nodes(2, ["--relay", "--max-memory", "1MiB"])
        hidden = cluster.add_nodes(2, ["--advertise", "127.0.0.2"])

        def nodes() -> dict[str, dict]:
            return {n["id"]: n for n in cluster.alive_nodes()}
        cluster.wait_for(lambda: all(nodes()[n]["reachable"] and nodes()[n]["relayed_by"] for n in hidden),
                         60, "the hidden nodes to be reachable through the volunteers' relays")
        assert {nodes()[n]["relayed_by"] for n in hidden} == relays  # one each: the least loaded relay
        assert all(nodes()[r]["relay_port"] for r in relays)
        env = {**os.environ, "RAVNEST_COORDINATOR": cluster.url, "RAVNEST_KEY": cluster.operator_token,
               "COLUMNS": "100"}
        listed = subprocess.run([sys.executable, "-m", "ravnest.client.cli", "nodes"], capture_output=True,
                                text=True, env=env, timeout=60).stdout.replace("\n", " ")
        assert "is reached through node-" in listed and "relays for nodes that peers cannot dial" in listed

        spec = json.loads(CNN_JOB.read_text())
        spec["training"].update(steps=800, eval_every=0)  # the relay is lost at step 50: running on after it
        spec["averaging"] = {"strategy": "none"}
        spec["placement"] = {"clusters": 1, "stages_per_cluster": 3, "min_nodes": 3}
        job_id = cluster.submit(spec)
        cluster.wait_for(lambda: (job := cluster.job(job_id))["state"] == "running" and any(
            s["metrics"].get("step", 0) >= 50 for s in job["metrics"]["stages"]), 120, "the job to train")
        # the relay of a hidden node the plan holds (it may find two nodes faster than three): with no peer
        # relays (--no-peer-relay), every link to a hidden node crosses its relay
        placed = {s["node_id"] for c in cluster.job(job_id)["plan"]["clusters"] for s in c["stages"]}
        moved = min(hidden & placed)
        lost = nodes()[moved]["relayed_by"]
        cluster.node_process(lost).kill()
        [kept] = relays - {lost}
        cluster.wait_for(lambda: nodes()[moved]["relayed_by"] == kept and nodes()[moved]["reachable"],
                         90, "the node to move to the other relay")
        job = cluster.wait_job(job_id, timeout=600)
        assert job["state"] == "completed", job["reason"]
        assert job["recoveries"] and all(moved not in r["left_out"] for r in job["recoveries"]), job["recoveries"]
        cluster.wait_for(lambda: nodes()[moved]["state"] == "idle", 60, "the moved node to be free again")
        assert not nodes()[moved]["quarantined_until"]
