"""The node's link prober against real gRPC servers on loopback."""
from __future__ import annotations

import socket
import time

from node.links import LinkProber
from ravnest.spec import PeerProbe
from ravnest.wire import PeerServer, Router


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_probes_measure_reachable_peers_and_name_the_ones_they_could_not_dial() -> None:
    peer = PeerServer(Router(), token="job-token", ping_token="probe-token")
    prober = LinkProber("probe-token", probe_bytes=1 << 16)
    try:
        prober.ask([PeerProbe(node_id="good", address=peer.address),
                    PeerProbe(node_id="good", address=peer.address),  # asked twice: measured once
                    PeerProbe(node_id="gone", address=f"127.0.0.1:{closed_port()}")])
        reports, unreached = prober.take(wait=30)  # returns with the first one done
        prober.close(timeout=20)
        more, later = prober.take()
        assert [r.peer_id for r in reports + more] == ["good"] and unreached + later == ["gone"]
        assert reports[0].bandwidth_bytes_per_s > 0 and reports[0].latency_s > 0
        assert prober.take() == ([], [])
    finally:
        prober.close(timeout=20)
        peer.stop(0)


def test_a_wrong_probe_token_reports_nothing_not_even_an_unreachable_peer() -> None:
    peer = PeerServer(Router(), token="job-token", ping_token="probe-token")
    prober = LinkProber("guess", probe_bytes=1 << 10)
    try:
        prober.ask([PeerProbe(node_id="peer", address=peer.address)])
        prober.close(timeout=20)  # the probe is done (refused) once the thread has ended
        assert prober.take() == ([], [])  # the peer answered: it is reachable, only the probe was refused
    finally:
        peer.stop(0)


def test_settle_waits_for_the_probes_under_way_only() -> None:
    peer = PeerServer(Router(), token="job-token", ping_token="probe-token")
    prober = LinkProber("probe-token", probe_bytes=1 << 16)
    try:
        assert prober.settle(5.0) is False  # nothing asked: no waiting
        prober.ask([PeerProbe(node_id="peer", address=peer.address)])
        assert prober.settle(30.0) is True and [r.peer_id for r in prober.take()[0]] == ["peer"]
        assert prober.settle(5.0) is False
    finally:
        prober.close(timeout=20)
        peer.stop(0)


def test_probes_not_started_are_dropped_when_the_node_starts_training(monkeypatch) -> None:
    """A node given a stage forgets its queued probes: their megabytes would compete with the job (and the
    one under way, which waits on a silent peer here, ends with its deadline: nothing more goes out)."""
    monkeypatch.setattr("node.links.LINK_PROBE_S", 1.0)
    peer = PeerServer(Router(), token="job-token", ping_token="probe-token")
    silent = socket.socket()  # accepts the connection and never speaks: the first probe hangs until its deadline
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    prober = LinkProber("probe-token", probe_bytes=1 << 16)
    try:
        prober.ask([PeerProbe(node_id="silent", address=f"127.0.0.1:{silent.getsockname()[1]}"),
                    PeerProbe(node_id="a", address=peer.address), PeerProbe(node_id="b", address=peer.address)])
        while prober._todo.qsize() > 2:  # the first one is under way
            time.sleep(0.01)
        prober.stand_aside(wait_s=0.1)
        prober.close(timeout=20)
        reports, _ = prober.take()
        assert [r.peer_id for r in reports] == []
    finally:
        prober.close(timeout=20)
        peer.stop(0)
        silent.close()


def test_the_probe_under_way_stops_at_its_next_ping_when_the_node_starts_training(monkeypatch) -> None:
    """A probe's transfers go on for seconds (up to 16 MiB a ping, repeated; a silent peer's ping waits
    out its deadline): the one under way when the node is given a stage is cancelled, nothing more is
    sent, nothing reported, and `stand_aside` returns at once."""
    import threading

    import ravnest.wire.transport.probes as probes

    real_ping, under_way, payloads = probes.ping, threading.Event(), []

    def ping(address, *, payload_bytes=0, stop=None, **kwargs):
        if payload_bytes:  # a transfer that lasts until the node stands aside: a ping to a peer gone silent
            payloads.append(payload_bytes)
            under_way.set()
            return real_ping(silent_address, stop=stop, **kwargs)
        return real_ping(address, stop=stop, **kwargs)
    monkeypatch.setattr(probes, "ping", ping)
    silent = socket.socket()  # accepts the connection and never speaks
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    silent_address = f"127.0.0.1:{silent.getsockname()[1]}"
    peer = PeerServer(Router(), token="job-token", ping_token="probe-token")
    prober = LinkProber("probe-token", probe_bytes=1 << 16)
    try:
        prober.ask([PeerProbe(node_id="peer", address=peer.address)])
        assert under_way.wait(10)
        started = time.monotonic()
        prober.stand_aside(wait_s=10)
        assert time.monotonic() - started < 1 and payloads == [1 << 16]  # cancelled, and nothing more sent
        assert prober.take() == ([], []) and prober.settle(0.1) is False
    finally:
        prober.close(timeout=20)
        peer.stop(0)
        silent.close()
