"""A node's gRPC endpoint: who may call it (a shared token or per-node credentials), and the Peer
service that reads message streams as raw frame bytes and hands each complete Message to a handler.
A handler that blocks (e.g. on a full bounded queue) stops the stream from being read, so HTTP/2 flow
control pushes back on the sender: no polling anywhere."""
from __future__ import annotations

import hmac
import logging
import threading
from concurrent import futures
from typing import Callable, Collection, Iterator, Union

import grpc

from ravnest.v1 import peer_pb2
from ravnest.wire import traffic
from ravnest.wire.tensors import ByteBudget, WireError, WireLimits
from ravnest.wire.gate import PeerGate, Refusal
from ravnest.wire.messages import Message, MessageAssembler

from .allocator import keep_freed_buffers
from .options import (
    AUTH_HEADER,
    MAX_PING_REPLY_BYTES,
    MAX_STATUS_CHARS,
    PING_METHOD,
    PING_REPLIES_AT_ONCE,
    SERVER_THREADS,
    SERVICE,
    SPARE_THREADS,
    STREAM_METHOD,
    STREAMS_PER_PEER,
    server_options,
)

log = logging.getLogger(__name__)
Handler = Callable[[Message, str], None]
TokenSource = Union[str, Callable[[], Collection[str]]]


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
        self._decode_device = getattr(handler, "decode_device", None)  # e.g. Router.decode_device
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
            assembler = MessageAssembler(self._limits, self._zero_copy, self.receiving, self._decode_device)
            for msg in assembler.messages(frames):
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
                                   options=server_options(limits), interceptors=[interceptor] if interceptor else [])
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
