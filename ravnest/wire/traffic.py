"""Bytes this process sent to and received from each peer, as Prometheus counters.

Counted where frames cross gRPC (ravnest.wire.transport), so pipeline activations, gradients and
averaging rounds all show up. Peers are labelled by the address dialled when sending and by the
remote host when receiving (a sender's port is an ephemeral one; the host keeps the label set small).
"""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter

SENT = Counter("ravnest_peer_sent_bytes", "bytes sent to a peer over the peer wire", ["peer"])
RECEIVED = Counter("ravnest_peer_received_bytes", "bytes received from a peer over the peer wire", ["peer"])


def remote_host(grpc_peer: str) -> str:
    """'ipv4:127.0.0.1:5123' -> '127.0.0.1'; 'ipv6:[::1]:5123' -> '::1'."""
    address = grpc_peer.split(":", 1)[1] if grpc_peer.startswith(("ipv4:", "ipv6:")) else grpc_peer
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]")


def counted(frames: Iterator[bytes], counter) -> Iterator[bytes]:
    """Pass `frames` through, adding each one's size to `counter` (a labelled child)."""
    for frame in frames:
        counter.inc(len(frame))
        yield frame
