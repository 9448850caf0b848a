"""The node's link prober against real gRPC servers on loopback."""
from __future__ import annotations

import socket

from node.links import LinkProber
from ravnest.spec import PeerProbe
from ravnest.wire import PeerServer, Router


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_probes_measure_reachable_peers_and_drop_the_rest() -> None:
    peer = PeerServer(Router(), token="job-token", ping_token="probe-token")
    prober = LinkProber("probe-token", probe_bytes=1 << 16)
    try:
        prober.ask([PeerProbe(node_id="good", address=peer.address),
                    PeerProbe(node_id="good", address=peer.address),  # asked twice: measured once
                    PeerProbe(node_id="gone", address=f"127.0.0.1:{closed_port()}")])
        reports = prober.take(wait=30)
        assert [r.peer_id for r in reports] == ["good"]
        assert reports[0].bandwidth_bytes_per_s > 0 and reports[0].latency_s > 0
        assert prober.take() == []
    finally:
        prober.close(timeout=20)
        peer.stop(0)


def test_a_wrong_probe_token_reports_nothing() -> None:
    peer = PeerServer(Router(), token="job-token", ping_token="probe-token")
    prober = LinkProber("guess", probe_bytes=1 << 10)
    try:
        prober.ask([PeerProbe(node_id="peer", address=peer.address)])
        prober.close(timeout=20)  # the probe is done (refused) once the thread has ended
        assert prober.take() == []
    finally:
        peer.stop(0)


def test_settle_waits_for_the_probes_under_way_only() -> None:
    peer = PeerServer(Router(), token="job-token", ping_token="probe-token")
    prober = LinkProber("probe-token", probe_bytes=1 << 16)
    try:
        assert prober.settle(5.0) is False  # nothing asked: no waiting
        prober.ask([PeerProbe(node_id="peer", address=peer.address)])
        assert prober.settle(30.0) is True and [r.peer_id for r in prober.take()] == ["peer"]
        assert prober.settle(5.0) is False
    finally:
        prober.close(timeout=20)
        peer.stop(0)
