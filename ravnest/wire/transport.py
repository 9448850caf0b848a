"""gRPC transport between peers: one server per node, one long-lived channel and stream per peer.

`PeerServer` receives message streams and hands each complete Message to a handler; a handler that
blocks (e.g. on a full bounded queue) stops the stream from being read, so HTTP/2 flow control pushes
back on the sender: no polling anywhere. `OutboundStream` is the sending side: a bounded queue
drained by gRPC's own request iterator.

Frames cross gRPC as bytes (identity serializers) so that data chunks skip protobuf objects; the
bytes are still exactly `ravnest.v1.Frame`s, and any client of the generated stubs interoperates.
"""
from __future__ import annotations

import collections
import ctypes
import ctypes.util
import hmac
import logging
import queue
import threading
import time
from concurrent import futures
from typing import Callable, Collection, Iterable, Iterator, Union

import grpc

from ravnest.errors import RavnestError
from ravnest.timeouts import KEEPALIVE_S, KEEPALIVE_TIMEOUT_S
from ravnest.v1 import peer_pb2, peer_pb2_grpc
from ravnest.wire import faults, traffic
from ravnest.wire.codec import ByteBudget, WireError, WireLimits
from ravnest.wire.gate import PeerGate, Refusal
from ravnest.wire.messages import (DEFAULT_CHUNK_BYTES, Message, MessageAssembler, chunked_frames,
                                   prepare_message)

log = logging.getLogger(__name__)

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
    # never inherits another's backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
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

Handler = Callable[[Message, str], None]
TokenSource = Union[str, Callable[[], Collection[str]]]


def keep_freed_buffers() -> None:
    """Let glibc malloc reuse freed tensor-sized blocks instead of handing them back to the kernel.

    Every message allocates buffers of megabytes (frames, tensors). By default glibc maps most of
    them fresh and unmaps or trims them on free, so each byte received or sent pays a page fault
    (a third of the sender's CPU in bench.wire). Blocks below 32 MiB (glibc's ceiling for the
    threshold) now come from the heap, and up to 256 MiB of free heap is kept. At most two heaps
    (arenas): with one per thread, a flood of 4 MiB probes left 95 MiB that malloc_trim could not
    return (fragmented over the server's threads' arenas); with two, 10 MiB. Process-wide and
    idempotent; called by PeerServer and OutboundStream; a no-op without glibc.
    """
    global _malloc_tuned
    if _malloc_tuned:
        return
    _malloc_tuned = True
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    for option, value in _MALLOPT.items():
        mallopt(option, value)


_malloc_tuned = False
# M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, M_TOP_PAD, M_ARENA_MAX
_MALLOPT = {-3: 32 << 20, -1: 256 << 20, -2: 16 << 20, -8: 2}


class PeerError(RavnestError, RuntimeError):
    """The peer refused or dropped a stream; the message says which peer and why. `address` names the
    peer for whoever reports the failure (ravnest/failures.py), where the peer is to blame (not where
    this side ended the stream); `unreachable`: it never answered."""

    def __init__(self, message: str, *, address: str | None = None, unreachable: bool = False):
        super().__init__(message)
        self.address, self.unreachable = address, unreachable


def _server_options(limits: WireLimits) -> list[tuple[str, int]]:
    # Frames larger than this are refused by gRPC itself (RESOURCE_EXHAUSTED) before protobuf parses
    # them; below it, chunks up to twice our limit still reach the validator, which names the tensor.
    receive = max(2 * limits.max_chunk_bytes, MAX_PING_BYTES) + (1 << 20)
    # No SO_REUSEPORT (gRPC's default): with it a bind to port 0 can be handed a port another server
    # already listens on, and the two then share (or, once one stops, refuse) each other's peers.
    return [(k, receive if k == "grpc.max_receive_message_length" else v)
            for k, v in GRPC_OPTIONS] + SERVER_KEEPALIVE_OPTIONS + [("grpc.so_reuseport", 0)]


class _SharedTokens:
    """The simple rule (in-process pipelines, tests, benchmarks): every call carries one of the
    accepted tokens. `token` is one token, or a callable returning the tokens accepted right now;
    `ping_token`, in the same forms, is accepted on Ping alone: peers probing the link, no data."""

    def __init__(self, token: TokenSource | None, ping_token: TokenSource | None = None):
        self._token = token
        self._ping_token = ping_token

    @staticmethod
    def _tokens(source: TokenSource | None) -> list[str]:
        if source is None:
            return []
        return [source] if isinstance(source, str) else list(source())

    def check(self, offered: str, ping: bool) -> Refusal | None:
        accepted = self._tokens(self._token) + (self._tokens(self._ping_token) if ping else [])
        # Compare every token in constant time so timing reveals nothing about any of them.
        if any([hmac.compare_digest(offered.encode(), f"Bearer {t}".encode()) for t in accepted if t]):
            return None
        return grpc.StatusCode.UNAUTHENTICATED, "missing or wrong peer token"


class _AuthInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose `authorization` metadata `rule.check` refuses, with its code and reason."""

    def __init__(self, rule: _SharedTokens | PeerGate):
        self.rule = rule

    def refusal(self, offered: str, method: str) -> Refusal | None:
        return self.rule.check(offered, ping=method == PING_METHOD)

    def intercept_service(self, continuation, handler_call_details):
        offered = dict(handler_call_details.invocation_metadata or ()).get(AUTH_HEADER, "")
        refused = self.refusal(offered if isinstance(offered, str) else "", handler_call_details.method)
        if refused is None:
            return continuation(handler_call_details)

        def deny(request, context):
            context.abort(*refused)

        if handler_call_details.method == STREAM_METHOD:
            return grpc.stream_unary_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


def _truncate(text: str) -> str:
    return text if len(text) <= MAX_STATUS_CHARS else text[:MAX_STATUS_CHARS - 3] + "..."


class _PeerService:
    """The Peer service, with Stream reading raw frame bytes (see the module docstring)."""

    def __init__(self, handler: Handler, limits: WireLimits, refusal: Callable[[str], Refusal | None] | None = None,
                 max_streams: int = 32, per_peer: int = STREAMS_PER_PEER):
        self._handler = handler
        self._max_streams, self._per_peer = max_streams, per_peer
        self._streams: dict[str, int] = {}  # open streams per credential (per sending peer)
        self._streams_lock = threading.Lock()
        self._limits = limits
        self._refusal = refusal  # is a stream's credential still accepted? (a job's token ends with the job)
        self._zero_copy = getattr(handler, "zero_copy", None)  # e.g. Router.zero_copy
        self._replies = threading.BoundedSemaphore(PING_REPLIES_AT_ONCE)
        self.receiving = ByteBudget(limits.max_receiving_bytes)  # shared by every stream of this server

    def handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Stream": grpc.stream_unary_rpc_method_handler(
                self.stream, response_serializer=peer_pb2.StreamSummary.SerializeToString),
            "Ping": grpc.unary_unary_rpc_method_handler(
                self.ping, request_deserializer=peer_pb2.PingRequest.FromString,
                response_serializer=peer_pb2.PingReply.SerializeToString),
        })

    def stream(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> peer_pb2.StreamSummary:
        offered = dict(context.invocation_metadata() or ()).get(AUTH_HEADER, "")
        with self._streams_lock:
            full = (sum(self._streams.values()) >= self._max_streams
                    or self._streams.get(offered, 0) >= self._per_peer)
            if not full:
                self._streams[offered] = self._streams.get(offered, 0) + 1
        if full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"too many open streams (at most {self._per_peer} "
                                                              f"per peer, {self._max_streams} in all)")
        try:
            return self._receive(request_iterator, context, offered)
        finally:
            with self._streams_lock:
                self._streams[offered] -= 1
                if not self._streams[offered]:
                    del self._streams[offered]

    def _receive(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext,
                 offered: str) -> peer_pb2.StreamSummary:
        count = nbytes = 0
        peer = context.peer()
        frames = traffic.counted(request_iterator, traffic.RECEIVED.labels(traffic.remote_host(peer)))
        try:
            for msg in MessageAssembler(self._limits, self._zero_copy, self.receiving).messages(frames):
                if self._refusal is not None and self._refusal(offered) is not None:
                    # a stream outlives nothing: what an ended job's peer still sends never reaches the next job
                    raise WireError("this stream's credential is no longer accepted (its job has ended)",
                                    grpc.StatusCode.UNAUTHENTICATED)
                self._deliver(msg, peer)
                count += 1
                nbytes += sum(t.numel() * t.element_size() for t in msg.tensors.values())
        except WireError as e:
            code, reason = e.code, str(e)
        except grpc.RpcError:  # the sender cancelled or went away; nobody is left to tell
            code, reason = grpc.StatusCode.CANCELLED, "stream cancelled by the sender"
        else:
            return peer_pb2.StreamSummary(messages=count, bytes=nbytes)
        log.info("stream from %s failed after %d messages: %s: %s", peer, count, code.name, reason)
        context.abort(code, _truncate(reason))

    def _deliver(self, msg: Message, peer: str) -> None:
        """Run the handler; its exceptions become a status naming the message and the reason."""
        try:
            self._handler(msg, peer)
        except WireError:
            raise
        except ValueError as e:  # the handler refused this input (e.g. wrong activation shape)
            raise WireError(f"message {msg.kind!r} #{msg.id} rejected: {e}") from e
        except Exception as e:
            log.exception("handler failed on message %r #%d from %s", msg.kind, msg.id, peer)
            raise WireError(f"message {msg.kind!r} #{msg.id}: handler failed: {type(e).__name__}: {e}",
                            grpc.StatusCode.INTERNAL) from e

    def ping(self, request: peer_pb2.PingRequest, context: grpc.ServicerContext) -> peer_pb2.PingReply:
        if not 0 <= request.reply_bytes <= MAX_PING_REPLY_BYTES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"reply_bytes must be within 0..{MAX_PING_REPLY_BYTES}")
        if not request.reply_bytes:
            return peer_pb2.PingReply()
        if not self._replies.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many probes with replies at once; retry later")
        try:
            return peer_pb2.PingReply(payload=bytes(request.reply_bytes))
        finally:
            self._replies.release()


class PeerServer:
    """A node's gRPC endpoint. `handler(message, peer)` runs on a server thread per stream. A handler
    with a `zero_copy(kind) -> bool` method (like `Router`) gets read-only tensors that share the
    received frames' memory for the kinds it names.

    A handler exception fails only its own stream: ValueError → INVALID_ARGUMENT, WireError → its code,
    anything else → INTERNAL, each with the reason. Who may call: a `gate` (PeerGate: per-node
    credentials, planned peers only; what node daemons use), or `token`, the bearer token every call
    must carry (or a callable returning the tokens accepted at the moment of the call), with
    `ping_token` (same forms) also accepted on Ping. `tls` is (certificate chain PEM, private key PEM).
    """

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0, *,
                 limits: WireLimits = WireLimits(), token: TokenSource | None = None,
                 ping_token: TokenSource | None = None, gate: PeerGate | None = None,
                 tls: tuple[bytes, bytes] | None = None, max_streams: int = 32):
        keep_freed_buffers()
        rule = gate or (_SharedTokens(token, ping_token) if token else None)
        interceptor = _AuthInterceptor(rule) if rule else None
        # Streams are counted only once their credential is accepted (`_PeerService.stream`), never by
        # gRPC's own call limit: a flood of unauthenticated calls is refused on the spare threads and
        # never takes a legitimate peer's place.
        pool = futures.ThreadPoolExecutor(max_workers=max_streams + SPARE_THREADS, thread_name_prefix=SERVER_THREADS)
        self._server = grpc.server(pool,
                                   options=_server_options(limits), interceptors=[interceptor] if interceptor else [])
        refusal = (lambda offered: interceptor.refusal(offered, STREAM_METHOD)) if interceptor else None
        # with per-node credentials (a gate) a credential is one sender: it gets a share of the streams
        self._service = _PeerService(handler, limits, refusal, max_streams,
                                     per_peer=STREAMS_PER_PEER if gate else max_streams)
        self._server.add_generic_rpc_handlers((self._service.handlers(),))
        bind = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
        if tls:
            creds = grpc.ssl_server_credentials([(tls[1], tls[0])])  # (private key, certificate chain)
            self.port = self._server.add_secure_port(bind, creds)
        else:
            self.port = self._server.add_insecure_port(bind)
        if self.port == 0:
            raise OSError(f"could not bind gRPC server to {bind}")
        self.host = host
        self._server.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}" if ":" not in self.host else f"[{self.host}]:{self.port}"

    def stop(self, grace: float = 1.0) -> None:
        self._server.stop(grace).wait()

    def __enter__(self) -> PeerServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class ChannelPool:
    """One channel per peer address for the life of the process (channels are expensive). Over TLS a
    peer's certificate is checked against the host dialled, or against the name `name_peer` gave its
    address: a node reached through a relay is dialled at the relay's host but holds a certificate for
    its own (ravnest/relay)."""

    def __init__(self, root_certificate: bytes | None = None):
        self._channels: dict[tuple[str, str | None], grpc.Channel] = {}
        self._lock = threading.Lock()
        self._root_certificate = root_certificate

    def get(self, address: str) -> grpc.Channel:
        name = _tls_names.get(address) if self._root_certificate else None
        with self._lock:
            channel = self._channels.get((address, name))
            if channel is None:
                if self._root_certificate:
                    creds = grpc.ssl_channel_credentials(self._root_certificate)
                    named = [("grpc.ssl_target_name_override", name)] if name else []
                    channel = grpc.secure_channel(address, creds, options=[*GRPC_OPTIONS, *named])
                else:
                    channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
                self._channels[(address, name)] = channel
            return channel

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()


_default_pool = ChannelPool()
# address -> the name its certificate carries, where that is not its host; the latest MAX_NAMED_PEERS
# named, since a node serves job after job with peers on relays' ports that come and go
_tls_names: collections.OrderedDict[str, str] = collections.OrderedDict()
MAX_NAMED_PEERS = 4096


def name_peer(address: str, tls_name: str) -> None:
    """Check the certificate of the peer at `address` against `tls_name` from now on (a relayed node's
    own host: the plan says which)."""
    _tls_names[address] = tls_name
    _tls_names.move_to_end(address)
    while len(_tls_names) > MAX_NAMED_PEERS:
        _tls_names.popitem(last=False)


# planned address -> where that peer is dialled instead, once it says: a peer nobody can dial listens at
# this node's relay for its peers (ravnest/relay), which hands this node a loopback port for it
_routes: dict[str, Callable[[], str | None]] = {}
ROUTE_WAIT_S = 10.0  # how long a stream waits for such a peer to listen there before it dials the planned address


def route(address: str, find: Callable[[], str | None]) -> None:
    """Streams to `address` go where `find()` says, once it says somewhere (until `unroute`)."""
    _routes[address] = find


def unroute(address: str) -> None:
    _routes.pop(address, None)


def _dialled(address: str, wait: float) -> str:
    """Where a stream to `address` dials: its route's port once there is one (the peer's certificate is
    checked against the name the planned address has), else after `wait` seconds the planned address."""
    find = _routes.get(address)
    deadline = time.monotonic() + wait
    while find is not None:
        found = find()
        if found:
            if address in _tls_names:
                name_peer(found, _tls_names[address])
            else:  # the peer's certificate names the host it was planned at, not this loopback port
                name_peer(found, address.rpartition(":")[0].strip("[]"))
            return found
        if time.monotonic() >= deadline:
            log.info("peer %s did not listen at this node's relay for peers within %.0f s: dialling it "
                     "as planned", address, wait)
            return address
        time.sleep(0.05)
    return address


def new_pool() -> ChannelPool:
    """A channel pool of its own that dials as the process's default one (TLS included)."""
    return ChannelPool(_default_pool._root_certificate)


def use_tls(root_certificate: bytes) -> None:
    """From now on, channels made without a pool of their own verify peers against
    `root_certificate` (PEM) over TLS: how a node daemon with --tls-ca talks to its peers."""
    global _default_pool
    old, _default_pool = _default_pool, ChannelPool(root_certificate)
    old.close()


def close_channels() -> None:
    """Close this process's pooled channels (new ones open on the next use). A process that stops its
    server should first have every peer close its channels to it: a server that stops under an open
    channel sends GOAWAY, which gRPC logs on the peer's side as an UNAVAILABLE error line."""
    _default_pool.close()


def _metadata(token: str | None):
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()


def _peer_error(address: str, error: grpc.RpcError) -> PeerError:
    return PeerError(f"peer {address}: {error.code().name}: {error.details()}", address=address)


class OutboundStream:
    """A long-lived stream of messages to one peer, fed from a bounded queue.

    `send` serializes the message in the caller's thread, so the caller may reuse or modify its
    tensors as soon as `send` returns (unless copy=False), and encoding errors raise right there
    (ValueError). It blocks
    while `max_pending` messages are queued (back-pressure) and raises PeerError once the peer has
    failed the stream, with the peer's reason.
    """

    _END = object()

    def __init__(self, address: str, *, token: str | None = None, codec: str = "",
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_pending: int = 8,
                 pool: ChannelPool | None = None, wait_ready: float = 30.0):
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        keep_freed_buffers()
        self.address = address
        self.codec = codec
        self.chunk_bytes = chunk_bytes
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._closed = False
        self.sent_bytes = 0  # frames handed to gRPC, as encoded (what the link carries)
        self._opened, self._idle_s = time.monotonic(), 0.0  # time with nothing queued to send
        channel = (pool or _default_pool).get(_dialled(address, min(ROUTE_WAIT_S, wait_ready)))
        ready = grpc.channel_ready_future(channel)
        try:
            ready.result(timeout=wait_ready)
        except grpc.FutureTimeoutError:
            ready.cancel()
            raise PeerError(f"peer {address} not reachable within {wait_ready:.0f}s", address=address,
                            unreachable=True) from None
        call = channel.stream_unary(STREAM_METHOD, request_serializer=None,
                                    response_deserializer=peer_pb2.StreamSummary.FromString)
        self._future = call.future(traffic.counted(self._frames(), traffic.SENT.labels(address)),
                                   metadata=_metadata(token))
        self._future.add_done_callback(self._on_done)

    @property
    def busy(self) -> float:
        """The share of the stream's life it had something to send: near 1, the link sets the pace (gRPC
        takes frames as the link's flow control lets it, a window ahead at most)."""
        alive = time.monotonic() - self._opened
        return max(0.0, 1.0 - self._idle_s / alive) if alive > 0 else 0.0

    @property
    def pending(self) -> int:
        """Messages queued and not yet taken by gRPC."""
        return self._queue.qsize()

    def _frames(self) -> Iterator[bytes]:
        while True:
            waiting = time.monotonic()
            frames = self._queue.get()
            self._idle_s += time.monotonic() - waiting
            if frames is self._END:
                return
            if isinstance(frames, threading.Event):  # a flush marker: everything before it is out
                frames.set()
                continue
            for frame in frames:
                self.sent_bytes += len(frame)
                yield frame

    def _on_done(self, _future) -> None:
        # The stream is over: release senders blocked on a full queue and end the frame generator,
        # so no thread stays parked on a queue nobody will ever drain.
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        try:
            self._queue.put_nowait(self._END)
        except queue.Full:
            pass

    def _raise_if_failed(self) -> None:
        if self._future.done():
            try:
                self._future.result()
            except grpc.RpcError as e:
                raise _peer_error(self.address, e) from None
            except grpc.FutureCancelledError:
                raise PeerError(f"peer {self.address}: stream cancelled by this side") from None  # not the peer's doing
            raise PeerError(f"peer {self.address} closed the stream", address=self.address)

    def _put(self, item: object, deadline: float | None) -> None:
        while True:
            self._raise_if_failed()
            # Wake up now and then as a safety net; a failing stream also wakes us via _on_done.
            wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if wait <= 0:
                raise PeerError(f"peer {self.address}: send timed out", address=self.address)
            try:
                self._queue.put(item, timeout=wait)
                return
            except queue.Full:
                continue

    def send(self, msg: Message, codec: str | None = None, timeout: float | None = None, *,
             copy: bool = True) -> None:
        """Queue one message. `copy=False` skips the snapshot: data is cut into frames only when gRPC
        sends it, which is faster for large tensors, and the caller must then leave the tensors
        unchanged until the stream is closed (e.g. freshly computed activations)."""
        if self._closed:
            self._raise_if_failed()  # the peer's reason, when it has one, says more than "closed"
            raise PeerError(f"peer {self.address}: stream already closed")  # by this side
        injected = faults.active()
        if injected is not None and injected.before_send(self.address):
            self.cancel()
            raise PeerError(f"peer {self.address}: stream severed by fault injection")  # by this side
        parts = prepare_message(msg, self.codec if codec is None else codec)
        frames: Iterable[bytes] = chunked_frames(parts, self.chunk_bytes)
        if copy:
            frames = list(frames)
        self._put(frames, None if timeout is None else time.monotonic() + timeout)
        self._raise_if_failed()  # the stream may have failed while we waited

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every message queued so far has been cut into frames and handed to gRPC, after
        which the tensors of `send(copy=False)` are free to change. PeerError if the stream fails."""
        deadline = None if timeout is None else time.monotonic() + timeout
        marker = threading.Event()
        self._put(marker, deadline)
        while not marker.wait(1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))):
            self._raise_if_failed()
            if deadline is not None and time.monotonic() >= deadline:
                raise PeerError(f"peer {self.address}: flush timed out", address=self.address)

    def close(self, timeout: float = 60.0) -> peer_pb2.StreamSummary:
        """Finish the stream after everything queued was sent; returns the peer's summary."""
        if not self._closed:
            self._closed = True
            try:
                self._put(self._END, time.monotonic() + timeout)
            except PeerError:
                pass  # the stream already ended: its result below says how
        try:
            return self._future.result(timeout=timeout)
        except grpc.RpcError as e:
            raise _peer_error(self.address, e) from None
        except grpc.FutureTimeoutError:
            self._future.cancel()
            raise PeerError(f"peer {self.address}: stream did not finish within {timeout:.0f}s",
                            address=self.address) from None

    def add_done_callback(self, callback: Callable[["OutboundStream"], None]) -> None:
        """Call `callback(stream)` once the stream has ended (closed, failed or cancelled): a send only
        queues, so this is how a sender learns promptly that its peer dropped the stream."""
        self._future.add_done_callback(lambda _: callback(self))

    def cancel(self) -> None:
        self._closed = True
        self._future.cancel()

    @property
    def ended(self) -> bool:
        """The stream is over (closed, failed or cancelled): nothing sent on it arrives any more."""
        return self._future.done()

    def __enter__(self) -> OutboundStream:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:
            self.cancel()


def ping(address: str, *, token: str | None = None, payload_bytes: int = 0, reply_bytes: int = 0,
         timeout: float = 10.0, pool: ChannelPool | None = None) -> float:
    """Round-trip time in seconds of one Ping carrying the given payloads; grpc.RpcError on failure."""
    stub = peer_pb2_grpc.PeerStub((pool or _default_pool).get(address))
    start = time.perf_counter()
    stub.Ping(peer_pb2.PingRequest(payload=bytes(payload_bytes), reply_bytes=reply_bytes),
              timeout=timeout, metadata=_metadata(token))
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
                raise _peer_error(address, e) from None
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
    beyond a request's own overhead. The last, longest one counts, less the round trip (at most half
    of it: a short probe on loopback minus the ping once gave 1 TB/s)."""
    size = first_bytes
    while True:
        elapsed = transfer(size)
        if elapsed >= probe_s or size * 4 > max_bytes:
            return size / max(elapsed - latency, elapsed / 2)
        size *= 4


class Router:
    """A PeerServer handler that dispatches messages by kind to the parts of a node that own them
    (the pipeline stage, the averager, ...).

    Peers of one job start at slightly different moments, so a message may arrive before the part
    that handles it exists: it waits up to `wait_for_route` seconds for the route to be registered,
    and only then is it a protocol error for the sender. Only the kinds in `expected_kinds` (when
    given) may wait: any other is refused at once, so a peer cannot hold the server's call slots with
    made-up kinds. A message waiting when the routes are cleared (its job ended) is refused, never
    handed to the next job's routes.
    """

    def __init__(self, wait_for_route: float = 0.0, expected_kinds: Collection[str] | None = None):
        self.wait_for_route = wait_for_route
        self.expected_kinds = None if expected_kinds is None else frozenset(expected_kinds)
        self._routes: dict[str, Handler] = {}
        self._zero_copy: set[str] = set()
        self._changed = threading.Condition()
        self._cleared = 0  # how many times the routes were cleared
        self.waiting = 0  # messages waiting for their route right now

    def route(self, kind: str, handler: Handler, *, zero_copy: bool = False) -> None:
        """Send messages of `kind` to `handler`. With `zero_copy`, a tensor that arrived in one chunk
        shares the received frame's memory instead of being copied out of it: the handler must treat
        it as read-only (copy before modifying in place)."""
        with self._changed:
            self._routes[kind] = handler
            if zero_copy:
                self._zero_copy.add(kind)
            else:
                self._zero_copy.discard(kind)
            self._changed.notify_all()

    def zero_copy(self, kind: str) -> bool:
        """Whether the route of `kind` accepts read-only tensors viewing the received frames."""
        return kind in self._zero_copy

    def wait_until_waiting(self, count: int, timeout: float) -> bool:
        """Until `count` messages wait for their route (tests, diagnostics); False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self.waiting >= count, timeout=timeout)

    def clear(self) -> None:
        """Forget every route, e.g. when the job they belonged to is over."""
        with self._changed:
            self._routes.clear()
            self._zero_copy.clear()
            self._cleared += 1
            self._changed.notify_all()

    def __call__(self, msg: Message, peer: str) -> None:
        if self.expected_kinds is not None and msg.kind not in self.expected_kinds:
            raise WireError(f"unknown message kind {msg.kind!r}", grpc.StatusCode.UNIMPLEMENTED)
        with self._changed:
            cleared = self._cleared
            self.waiting += 1
            self._changed.notify_all()
            try:
                self._changed.wait_for(lambda: msg.kind in self._routes or self._cleared != cleared,
                                       timeout=self.wait_for_route)
            finally:
                self.waiting -= 1
            if self._cleared != cleared:
                raise WireError(f"message kind {msg.kind!r} arrived for a job that has ended on this node",
                                grpc.StatusCode.UNAVAILABLE)
            handler = self._routes.get(msg.kind)
        if handler is None:
            raise WireError(f"no handler for message kind {msg.kind!r} on this node",
                            grpc.StatusCode.UNIMPLEMENTED)
        handler(msg, peer)
