"""Probing a peer: a Ping's round trip, waiting until a peer accepts a credential, and a link's latency
and bandwidth."""
from __future__ import annotations

import time
from typing import Callable

import grpc

from ravnest.v1 import peer_pb2, peer_pb2_grpc

from .channels import DIALER, ChannelPool, peer_error
from .options import MAX_PING_BYTES, metadata


def ping(address: str, *, token: str | None = None, payload_bytes: int = 0, reply_bytes: int = 0,
         timeout: float = 10.0, pool: ChannelPool | None = None) -> float:
    """Round-trip time in seconds of one Ping carrying the given payloads; grpc.RpcError on failure."""
    stub = peer_pb2_grpc.PeerStub((pool or DIALER.pool).get(address))
    start = time.perf_counter()
    stub.Ping(peer_pb2.PingRequest(payload=bytes(payload_bytes), reply_bytes=reply_bytes),
              timeout=timeout, metadata=metadata(token))
    return time.perf_counter() - start


AUTH_GRACE_S = 30.0  # how long a job's peer may take to learn the job's credential (its next heartbeat)


def wait_authorized(address: str, token: str | None, timeout: float = AUTH_GRACE_S,
                    pool: ChannelPool | None = None) -> None:
    """Wait until the peer accepts `token` (a Ping carrying it succeeds). Peers of one job get
    their credentials at their own next heartbeat, so a neighbour may briefly not know the job
    yet; past `timeout` its refusal is final (PeerError). The peer is remote: nothing to wait on
    but asking again, with backoff."""
    deadline, delay = time.monotonic() + timeout, 0.05
    while True:
        try:
            ping(address, token=token, timeout=max(1.0, min(10.0, deadline - time.monotonic())), pool=pool)
            return
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE) \
                    or time.monotonic() + delay > deadline:
                raise peer_error(address, e) from None
        time.sleep(delay)
        delay = min(2 * delay, 1.0)


def measure_link(address: str, *, token: str | None = None, probe_bytes: int = 1 << 20, probe_s: float = 0.25,
                 timeout: float = 10.0, pool: ChannelPool | None = None) -> tuple[float, float]:
    """(latency seconds, bandwidth bytes/s) to a peer: empty pings, then payload pings that grow while
    they are short (`growing_probe`; 1 MiB alone measured 400 Mbit/s links below 100 Mbit/s ones)."""
    ping(address, token=token, timeout=timeout, pool=pool)  # warm the channel
    latency = min(ping(address, token=token, timeout=timeout, pool=pool) for _ in range(3))
    return latency, growing_probe(lambda size: ping(address, token=token, payload_bytes=size, timeout=timeout,
                                                    pool=pool), latency, probe_bytes, MAX_PING_BYTES, probe_s)


def growing_probe(transfer: Callable[[int], float], latency: float, first_bytes: int, max_bytes: int,
                  probe_s: float) -> float:
    """Bytes/s from `transfer(size) -> seconds`, each transfer 4x larger than the last while it took
    under `probe_s` (up to `max_bytes`): a fast link needs more bytes than a slow one to be measured
    beyond a request's own overhead. The last, longest size is sent twice and the faster counts (noise
    on a shared machine only ever slows a transfer: a join's one probe of a 400 Mbit/s link once came
    out at 211), less the round trip (at most half of it: a short probe on loopback minus the ping
    once gave 1 TB/s)."""
    size = first_bytes
    while True:
        elapsed = transfer(size)
        if elapsed >= probe_s or size * 4 > max_bytes:
            elapsed = min(elapsed, transfer(size))
            return size / max(elapsed - latency, elapsed / 2)
        size *= 4
