"""gRPC transport between peers: one server per node, one long-lived channel and stream per peer.

`PeerServer` receives message streams and hands each complete Message to a handler; a handler that
blocks (e.g. on a full bounded queue) stops the stream from being read, so HTTP/2 flow control pushes
back on the sender: no polling anywhere. `OutboundStream` is the sending side: a bounded queue
drained by gRPC's own request iterator.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent import futures
from typing import Callable

import grpc

from ravnest.v1 import peer_pb2, peer_pb2_grpc
from ravnest.wire.codec import WireError, WireLimits
from ravnest.wire.messages import DEFAULT_CHUNK_BYTES, Message, MessageAssembler, message_frames

# gRPC's own frame limit sits above our chunk size so oversize chunks reach our validator.
GRPC_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
AUTH_HEADER = "authorization"

Handler = Callable[[Message, str], None]


class PeerError(RuntimeError):
    """The peer refused or dropped a stream; the message says which peer and why."""


class _TokenInterceptor(grpc.ServerInterceptor):
    """Rejects every call whose `authorization: Bearer <token>` does not match the job's token."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}"

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong peer token")

        self._deny = deny

    def intercept_service(self, continuation, handler_call_details):
        metadata = dict(handler_call_details.invocation_metadata or ())
        if metadata.get(AUTH_HEADER) == self._expected:
            return continuation(handler_call_details)
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if method == "Stream":
            return grpc.stream_unary_rpc_method_handler(lambda it, ctx: self._deny(it, ctx))
        return grpc.unary_unary_rpc_method_handler(self._deny)


class _PeerService(peer_pb2_grpc.PeerServicer):
    def __init__(self, handler: Handler, limits: WireLimits):
        self._handler = handler
        self._limits = limits

    def Stream(self, request_iterator, context):
        count = nbytes = 0
        try:
            for msg in MessageAssembler(self._limits).messages(request_iterator):
                count += 1
                nbytes += sum(t.numel() * t.element_size() for t in msg.tensors.values())
                self._handler(msg, context.peer())
        except WireError as e:
            context.abort(e.code, str(e))
        return peer_pb2.StreamSummary(messages=count, bytes=nbytes)

    def Ping(self, request, context):
        if not 0 <= request.reply_bytes <= 16 << 20:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "reply_bytes must be within 0..16 MiB")
        return peer_pb2.PingReply(payload=bytes(request.reply_bytes))


class PeerServer:
    """A node's gRPC endpoint. `handler(message, peer)` runs on a server thread per stream."""

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0, *,
                 limits: WireLimits = WireLimits(), token: str | None = None,
                 tls: tuple[bytes, bytes] | None = None, max_streams: int = 32):
        interceptors = [_TokenInterceptor(token)] if token else []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_streams),
                                   options=GRPC_OPTIONS, interceptors=interceptors,
                                   maximum_concurrent_rpcs=max_streams)
        peer_pb2_grpc.add_PeerServicer_to_server(_PeerService(handler, limits), self._server)
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


class ChannelPool:
    """One channel per peer address for the life of the process (channels are expensive)."""

    def __init__(self, root_certificate: bytes | None = None):
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._root_certificate = root_certificate

    def get(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                if self._root_certificate:
                    creds = grpc.ssl_channel_credentials(self._root_certificate)
                    channel = grpc.secure_channel(address, creds, options=GRPC_OPTIONS)
                else:
                    channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
                self._channels[address] = channel
            return channel

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()


_default_pool = ChannelPool()


def _metadata(token: str | None):
    return ((AUTH_HEADER, f"Bearer {token}"),) if token else ()


class OutboundStream:
    """A long-lived stream of messages to one peer, fed from a bounded queue.

    `send` blocks when `max_pending` messages are queued (back-pressure); it raises PeerError once
    the peer has failed the stream, with the peer's reason.
    """

    _END = object()

    def __init__(self, address: str, *, token: str | None = None, codec: str = "",
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_pending: int = 8,
                 pool: ChannelPool | None = None, wait_ready: float = 30.0):
        self.address = address
        self.codec = codec
        self.chunk_bytes = chunk_bytes
        self._queue: queue.Queue = queue.Queue(max_pending)
        channel = (pool or _default_pool).get(address)
        try:
            grpc.channel_ready_future(channel).result(timeout=wait_ready)
        except grpc.FutureTimeoutError:
            raise PeerError(f"peer {address} not reachable within {wait_ready:.0f}s") from None
        stub = peer_pb2_grpc.PeerStub(channel)
        self._future = stub.Stream.future(self._frames(), metadata=_metadata(token))
        self._closed = False

    def _frames(self):
        while True:
            item = self._queue.get()
            if item is self._END:
                return
            msg, codec = item
            yield from message_frames(msg, codec, self.chunk_bytes)

    def _raise_if_failed(self) -> None:
        if self._future.done():
            try:
                self._future.result()
            except grpc.RpcError as e:
                raise PeerError(f"peer {self.address}: {e.code().name}: {e.details()}") from None
            raise PeerError(f"peer {self.address} closed the stream")

    def send(self, msg: Message, codec: str | None = None, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        item = (msg, self.codec if codec is None else codec)
        while True:
            self._raise_if_failed()
            # Wake up now and then to notice a failed stream instead of blocking forever.
            wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if wait <= 0:
                raise PeerError(f"peer {self.address}: send timed out")
            try:
                self._queue.put(item, timeout=wait)
                return
            except queue.Full:
                continue

    def close(self, timeout: float = 60.0) -> peer_pb2.StreamSummary:
        """Finish the stream after everything queued was sent; returns the peer's summary."""
        if not self._closed:
            self._closed = True
            self._queue.put(self._END)
        try:
            return self._future.result(timeout=timeout)
        except grpc.RpcError as e:
            raise PeerError(f"peer {self.address}: {e.code().name}: {e.details()}") from None
        except grpc.FutureTimeoutError:
            self._future.cancel()
            raise PeerError(f"peer {self.address}: stream did not finish within {timeout:.0f}s") from None

    def cancel(self) -> None:
        self._closed = True
        self._future.cancel()


def ping(address: str, *, token: str | None = None, payload_bytes: int = 0, reply_bytes: int = 0,
         timeout: float = 10.0, pool: ChannelPool | None = None) -> float:
    """Round-trip time in seconds of one Ping carrying the given payloads."""
    stub = peer_pb2_grpc.PeerStub((pool or _default_pool).get(address))
    start = time.perf_counter()
    stub.Ping(peer_pb2.PingRequest(payload=bytes(payload_bytes), reply_bytes=reply_bytes),
              timeout=timeout, metadata=_metadata(token))
    return time.perf_counter() - start


def measure_link(address: str, *, token: str | None = None, probe_bytes: int = 4 << 20,
                 timeout: float = 10.0) -> tuple[float, float]:
    """(latency seconds, bandwidth bytes/s) to a peer: an empty ping, then a payload ping."""
    ping(address, token=token, timeout=timeout)  # warm the channel
    latency = min(ping(address, token=token, timeout=timeout) for _ in range(3))
    elapsed = ping(address, token=token, payload_bytes=probe_bytes, timeout=timeout)
    return latency, probe_bytes / max(elapsed - latency, 1e-6)


class Router:
    """A PeerServer handler that dispatches messages by kind to the parts of a node that own them
    (the pipeline stage, the averager, ...). Unknown kinds are a protocol error for the sender."""

    def __init__(self):
        self._routes: dict[str, Handler] = {}

    def route(self, kind: str, handler: Handler) -> None:
        self._routes[kind] = handler

    def __call__(self, msg: Message, peer: str) -> None:
        handler = self._routes.get(msg.kind)
        if handler is None:
            raise WireError(f"no handler for message kind {msg.kind!r} on this node",
                            grpc.StatusCode.UNIMPLEMENTED)
        handler(msg, peer)
