"""The relay's side: reach a node that nobody can dial, through connections it opened itself.

A node behind a NAT holds `Listen` open. The relay opens a port of its own for it and says which;
peers dial `relay-host:that-port` as the node's address. Each connection a peer makes there is named
on the node's `Listen` stream, the node opens `Carry` for it, and the relay copies bytes both ways
until either side closes:

    peer ──TCP──▶ relay:40123 ══ Carry (gRPC stream the node opened) ══▶ node ──TCP──▶ its own server

The peer's gRPC call runs end to end inside those bytes: its credential and, where certificates are
given, TLS. The relay sees what a router on the path sees, and can only delay, drop or garble it,
which the peers' own deadlines and frame checks catch (docs/security.md).

Who may listen: a node with a token the coordinator derived from this relay's secret and the node's
id (`relay_token`). What one node may hold is bounded: connections waiting for `Carry` and connections
carried; a connection not claimed within CLAIM_S is closed. Runs its own event loop on a thread of its
own, so a coordinator or a node daemon can hold one beside everything else.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc
from grpc import aio

from ravnest.relay.ports import span
from ravnest.v1 import relay_pb2
from ravnest.wire.transport import SERVER_KEEPALIVE_OPTIONS

log = logging.getLogger(__name__)

CHUNK_BYTES = 256 << 10  # read from a peer's socket at a time
CLAIM_S = 10.0  # a peer's connection the node does not carry within this long is closed
MAX_NODES = 256  # nodes listening at once
MAX_CONNECTIONS = 32  # per node: waiting to be carried plus carried
GRPC_OPTIONS = [("grpc.max_receive_message_length", 2 * CHUNK_BYTES),
                ("grpc.max_send_message_length", 2 * CHUNK_BYTES)]


def relay_token(secret: bytes, node_id: str) -> str:
    """What a node shows to listen on the relay whose secret this is: only the coordinator and the
    relay know the secret, so a node cannot make a token for another node's id."""
    return hmac.new(secret, f"relay:{node_id}".encode(), hashlib.sha256).hexdigest()


@dataclass
class _Listener:
    node_id: str
    port: int = 0  # the relay's port peers dial for it, once open
    connections: int = 0  # waiting or carried
    incoming: asyncio.Queue = field(default_factory=asyncio.Queue)
    waiting: dict[int, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = field(default_factory=dict)


class RelayServer:
    """A relay on `host:port` (0: a free port; `self.port` says which). Nodes' ports are opened on
    `node_host` (default: `host`), each a free port, or the first free one of `node_ports` (a firewall
    lets in a range). Until it has a `secret` (a node's relay learns it when it joins), it lets nobody
    listen. A node's relay for its own peers opens their ports on loopback: only it dials them."""

    def __init__(self, secret: bytes, host: str = "127.0.0.1", port: int = 0, *, node_ports: range | None = None,
                 node_host: str | None = None, max_nodes: int = MAX_NODES, max_connections: int = MAX_CONNECTIONS):
        self.secret, self.host, self.node_ports = secret, host, node_ports
        self.node_host = node_host or host
        self._max_nodes, self._max_connections = max_nodes, max_connections
        self._listeners: dict[str, _Listener] = {}
        self._ids = itertools.count(1)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="relay", daemon=True)
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(port), self._loop).result(timeout=30)

    @property
    def address(self) -> str:
        return _joined(self.host, self.port)

    @property
    def listening(self) -> list[str]:
        """The ids of the nodes reachable through this relay now."""
        return list(self._listeners)

    def address_of(self, node_id: str) -> str | None:
        """Where the node `node_id` is dialled through this relay now, if it listens here."""
        listener = self._listeners.get(node_id)
        if listener is None or not listener.port:
            return None
        return _joined(self.node_host, listener.port)

    async def _start(self, port: int) -> int:
        self._server = aio.server(options=[*GRPC_OPTIONS, *SERVER_KEEPALIVE_OPTIONS])  # nodes ping: keeps NATs open
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("ravnest.v1.Relay", {
            "Listen": grpc.unary_stream_rpc_method_handler(
                self.listen, request_deserializer=relay_pb2.ListenRequest.FromString,
                response_serializer=relay_pb2.Incoming.SerializeToString),
            "Carry": grpc.stream_stream_rpc_method_handler(
                self.carry, request_deserializer=relay_pb2.Chunk.FromString,
                response_serializer=relay_pb2.Chunk.SerializeToString)}),))
        bound = self._server.add_insecure_port(_joined(self.host, port))
        if bound == 0:
            raise OSError(f"the relay could not listen on {self.host}:{port}")
        await self._server.start()
        return bound

    def stop(self, grace: float = 1.0) -> None:
        async def stop() -> None:
            await self._server.stop(grace)
        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=grace + 10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> RelayServer:
        return self

    def __exit__(self, *_) -> None:
        self.stop()

    async def _refuse_unless_allowed(self, node_id: str, token: str, context: aio.ServicerContext) -> None:
        if not self.secret or not node_id or not hmac.compare_digest(token, relay_token(self.secret, node_id)):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "this relay does not know that node: ask the coordinator for a relay token")

    async def listen(self, request: relay_pb2.ListenRequest,
                     context: aio.ServicerContext) -> AsyncIterator[relay_pb2.Incoming]:
        await self._refuse_unless_allowed(request.node_id, request.token, context)
        if request.node_id not in self._listeners and len(self._listeners) >= self._max_nodes:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this relay serves {self._max_nodes} nodes already: try another")
        old = self._listeners.get(request.node_id)
        if old is not None:  # the node listens again (it lost its stream, or restarted): its old port goes
            old.incoming.put_nowait(None)
        listener = self._listeners[request.node_id] = _Listener(request.node_id)
        server = await self._open_port(listener)
        if server is None:
            del self._listeners[request.node_id]
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"no port of this relay's {span(self.node_ports)} is free: it serves as many "
                                f"nodes as it has ports")
            return
        port = listener.port = server.sockets[0].getsockname()[1]
        log.info("relaying for node %s at %s:%d", request.node_id, self.node_host, port)
        try:
            yield relay_pb2.Incoming(port=port)
            while (connection := await listener.incoming.get()) is not None:
                yield relay_pb2.Incoming(connection=connection)
        finally:
            server.close()
            for _, writer in listener.waiting.values():
                writer.close()
            if self._listeners.get(request.node_id) is listener:
                del self._listeners[request.node_id]
            log.info("stopped relaying for node %s (port %d)", request.node_id, port)

    async def _open_port(self, listener: _Listener) -> asyncio.Server | None:
        """A listening socket for the node: any free port, or the first free one of the range."""
        for port in self.node_ports or [0]:
            try:
                return await asyncio.start_server(lambda r, w: self._accepted(listener, r, w), self.node_host, port)
            except OSError:  # taken: by another node here, or by another program
                continue
        return None

    def _accepted(self, listener: _Listener, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if listener.connections >= self._max_connections:
            writer.close()  # the node's share is taken: this peer sees a closed connection and retries
            return
        connection = next(self._ids)
        listener.connections += 1
        listener.waiting[connection] = (reader, writer)
        listener.incoming.put_nowait(connection)

        def unclaimed() -> None:
            if listener.waiting.pop(connection, None) is not None:
                listener.connections -= 1
                writer.close()
        self._loop.call_later(CLAIM_S, unclaimed)

    async def carry(self, chunks: AsyncIterator[relay_pb2.Chunk],
                    context: aio.ServicerContext) -> AsyncIterator[relay_pb2.Chunk]:
        metadata = dict(context.invocation_metadata() or ())
        node_id = str(metadata.get("ravnest-node", ""))
        await self._refuse_unless_allowed(node_id, str(metadata.get("authorization", "")), context)
        listener = self._listeners.get(node_id)
        connection = str(metadata.get("ravnest-connection", ""))
        waiting = listener.waiting.pop(int(connection), None) if listener and connection.isdigit() else None
        if listener is None or waiting is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such connection waits on this relay (it was "
                                                           f"closed after {CLAIM_S:g} s, or never made)")
            return
        reader, writer = waiting

        async def node_to_peer() -> None:
            async for chunk in chunks:
                writer.write(chunk.data)
                await writer.drain()  # a slow peer slows the node's stream: nothing piles up here
            if writer.can_write_eof():
                writer.write_eof()

        upward = asyncio.create_task(node_to_peer())
        try:
            while data := await reader.read(CHUNK_BYTES):
                yield relay_pb2.Chunk(data=data)
        except ConnectionError:
            pass  # the peer went: ending the stream tells the node to close its side
        finally:
            upward.cancel()
            writer.close()
            listener.connections -= 1


def _joined(host: str, port: int) -> str:
    """"host:port", an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
