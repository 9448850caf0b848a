"""The settings both ends of a peer connection agree on: gRPC channel and server options, the Peer
service's method names, and the limits a server puts on what one peer may ask of it."""
from __future__ import annotations

from ravnest.timeouts import KEEPALIVE_S, KEEPALIVE_TIMEOUT_S
from ravnest.v1 import peer_pb2
from ravnest.wire.tensors import WireLimits

KEEPALIVE_MS = int(KEEPALIVE_S * 1000)
# gRPC's own frame limit sits above our chunk size so oversize chunks reach our validator.
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    # Liveness: a peer that stops answering pings is dropped within keepalive time + timeout (30 s),
    # also between calls; streams to it fail then, without waiting for a message's deadline.
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A peer that was unreachable is retried within 2 s, not gRPC's up-to-120 s backoff: a volunteer
    # restarting on its address, or a new job's peer on a port an earlier one used, is reached at
    # once. Each channel keeps its own connections (no process-wide subchannel pool): a fresh channel
    # never inherits another's backoff. gRPC core reads "min_reconnect_backoff" as the least time a
    # connection attempt is given (doc/connection-backoff.md's MIN_CONNECT_TIMEOUT): at 100 ms, no peer
    # 100 ms away ever connected (the TCP and HTTP/2 handshakes take two round trips); 20 s, gRPC's own.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 20_000),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.use_local_subchannel_pool", 1),
]
# The server side must agree, or it answers an idle client's pings with GOAWAY "too_many_pings"
# (its default minimum is 5 minutes between pings without data).
SERVER_KEEPALIVE_OPTIONS = [("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
                            ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2)]
AUTH_HEADER = "authorization"
SERVICE = peer_pb2.DESCRIPTOR.services_by_name["Peer"].full_name
STREAM_METHOD = f"/{SERVICE}/Stream"
PING_METHOD = f"/{SERVICE}/Ping"
MAX_STATUS_CHARS = 1000  # status details travel in an HTTP/2 header: keep them short
MAX_PING_BYTES = 16 << 20  # a probe's payload (measuring upload bandwidth)
# a probe's reply (bandwidth probes send a payload, not ask for one): what a prober can make this node
# allocate per call...
MAX_PING_REPLY_BYTES = 64 << 10
PING_REPLIES_AT_ONCE = 4  # ... and how many such replies are built at once (more: RESOURCE_EXHAUSTED)
STREAMS_PER_PEER = 8  # open streams one sender (one credential) may hold on a node
SPARE_THREADS = 8  # server threads beyond the stream limit: pings and refusals are always answered
SERVER_THREADS = "peer-server"  # their name; the pool keeps (up to its bound) the threads it once needed


def server_options(limits: WireLimits) -> list[tuple[str, int]]:
    # Frames larger than this are refused by gRPC itself (RESOURCE_EXHAUSTED) before protobuf parses
    # them; below it, chunks up to twice our limit still reach the validator, which names the tensor.
    receive = max(2 * limits.max_chunk_bytes, MAX_PING_BYTES) + (1 << 20)
    # No SO_REUSEPORT (gRPC's default): with it a bind to port 0 can be handed a port another server
    # already listens on, and the two then share (or, once one stops, refuse) each other's peers.
    return [(k, receive if k == "grpc.max_receive_message_length" else v)
            for k, v in GRPC_OPTIONS] + SERVER_KEEPALIVE_OPTIONS + [("grpc.so_reuseport", 0)]


def metadata(token: str | None):
    """The call metadata that carries `token`."""
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()
