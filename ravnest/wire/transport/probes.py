"""Probing a peer: a Ping's round trip, waiting until a peer accepts a credential, and a link's latency
and bandwidth."""
from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import grpc

from ravnest.v1 import peer_pb2, peer_pb2_grpc

from .channels import DIALER, ChannelPool, peer_error
from .options import MAX_PING_BYTES, metadata


class ProbeStopped(Exception):
    """A probe given up mid-way: the node that made it has work for its link now."""


def ping(address: str, *, token: str | None = None, payload_bytes: int = 0, reply_bytes: int = 0,
         timeout: float = 10.0, pool: ChannelPool | None = None, stop: threading.Event | None = None) -> float:
    """Round-trip time in seconds of one Ping carrying the given payloads; grpc.RpcError on failure,
    ProbeStopped (the call cancelled) within 0.1 s of `stop` being set."""
    stub = peer_pb2_grpc.PeerStub((pool or DIALER.pool).get(address))
    start = time.perf_counter()
    call = stub.Ping.future(peer_pb2.PingRequest(payload=bytes(payload_bytes), reply_bytes=reply_bytes),
                            timeout=timeout, metadata=metadata(token))
    while stop is not None and not call.done():
        if stop.wait(0.1):  # (a ping to a peer gone silent waits out its whole timeout otherwise)
            call.cancel()
            raise ProbeStopped(f"probe of {address} stopped")
    call.result()
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


WIDE_SPREAD = 1.5  # repeats further apart than this (largest over smallest of the middle ones) are taken again
REPEATS, MOST_REPEATS = 3, 7  # of a probe's longest transfer: at first, and at most while they stay wide
PINGS = 5  # empty pings a link's round trip is the median of


class Measured(NamedTuple):
    """A figure taken several times: their median, and how far the middle ones lie apart (the largest
    over the smallest, 1.0 where all agree)."""
    value: float
    spread: float


def summarised(samples: Sequence[float]) -> Measured:
    """The median of `samples` and the spread of their middle half (a quarter left out at each end, so
    one slowed repeat of five does not make the spread wide). Worked example: [10, 10, 5] -> (10, 2.0);
    [10, 12, 5, 10, 11] -> (10, 1.1)."""
    ordered = sorted(samples)
    cut = len(ordered) // 4
    middle = ordered[cut:len(ordered) - cut]
    return Measured(statistics.median(ordered), middle[-1] / middle[0] if middle[0] > 0 else math.inf)


def repeated(measure: Callable[[], float], first: Sequence[float] = ()) -> Measured:
    """`measure()` taken until there are REPEATS samples (`first` counts), and again while their spread is
    wider than WIDE_SPREAD, up to MOST_REPEATS: on a busy host some repeats are slowed by what else runs
    (one probe round there once decided a whole plan), and the median of several is what the link does.
    A spread still wide at the end is reported as it is: the coordinator measures that link again."""
    samples = list(first)
    while len(samples) < REPEATS:
        samples.append(measure())
    while (figure := summarised(samples)).spread > WIDE_SPREAD and len(samples) < MOST_REPEATS:
        samples.append(measure())
    return figure


class LinkFigures(NamedTuple):
    """What a probe measured of a link: its round trip (the median of PINGS), its bandwidth (the median
    of its longest transfer's repeats) and their spread."""
    latency: float
    bandwidth: float
    spread: float = 1.0


def measure_link(address: str, *, token: str | None = None, probe_bytes: int = 1 << 20, probe_s: float = 0.25,
                 timeout: float = 10.0, pool: ChannelPool | None = None,
                 stop: threading.Event | None = None) -> LinkFigures:
    """A link to a peer: empty pings, then payload pings that grow while they are short (`growing_probe`;
    1 MiB alone measured 400 Mbit/s links below 100 Mbit/s ones). Once `stop` is set, the ping under way
    is cancelled and ProbeStopped raised."""
    def one(payload_bytes: int = 0) -> float:
        if stop is not None and stop.is_set():
            raise ProbeStopped(f"probe of {address} stopped")
        return ping(address, token=token, payload_bytes=payload_bytes, timeout=timeout, pool=pool, stop=stop)
    one()  # warm the channel
    latency = statistics.median(one() for _ in range(PINGS))
    bandwidth = growing_probe(one, latency, probe_bytes, MAX_PING_BYTES, probe_s)
    return LinkFigures(latency, *bandwidth)


def growing_probe(transfer: Callable[[int], float], latency: float, first_bytes: int, max_bytes: int,
                  probe_s: float) -> Measured:
    """Bytes/s from `transfer(size) -> seconds`, each transfer 4x larger than the last while it took
    under `probe_s` (up to `max_bytes`): a fast link needs more bytes than a slow one to be measured
    beyond a request's own overhead. The last, longest size is `repeated`, each less the round trip
    (at most half of it: a short probe on loopback minus the ping once gave 1 TB/s)."""
    size = first_bytes
    while (elapsed := transfer(size)) < probe_s and size * 4 <= max_bytes:
        size *= 4

    def rate(seconds: float) -> float:
        return size / max(seconds - latency, seconds / 2)
    return repeated(lambda: rate(transfer(size)), first=[rate(elapsed)])
