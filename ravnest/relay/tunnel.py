"""The node's side of a relay (ravnest/relay/server.py): be reachable while only dialling out.

`RelayTunnel` holds `Listen` open on the relay; each connection a peer makes to the node's port there
is carried by a `Carry` stream this node opens, spliced to a fresh local connection to the node's own
gRPC server. The server cannot tell a relayed peer from a direct one: its credentials and TLS are
checked as always. If the relay goes, the tunnel tries again (the relay gives a new port, so a new
address) until it is closed or refused for good.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable, Iterator

import grpc

from ravnest.relay.server import CHUNK_BYTES
from ravnest.relay.server import GRPC_OPTIONS as RELAY_LIMITS
from ravnest.v1 import relay_pb2, relay_pb2_grpc
from ravnest.wire.transport import GRPC_OPTIONS

log = logging.getLogger(__name__)
RETRY_S = (1.0, 2.0, 5.0, 10.0)  # waits between tries after the relay is lost, the last repeating
FOR_GOOD = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.UNIMPLEMENTED)  # trying again cannot help: ask the coordinator for another

# (the address peers dial now, or None while there is none; what happened, in words)
AddressCallback = Callable[[str | None, str], None]


class RelayTunnel:
    def __init__(self, relay: str, node_id: str, token: str, local: str, on_address: AddressCallback):
        self.relay, self.local = relay, local
        self._node_id, self._token, self._on_address = node_id, token, on_address
        self.address: str | None = None
        self.refused = ""  # why the relay turned this node away for good
        self.refused_at = 0.0  # when (time.monotonic())
        self._closed = threading.Event()
        self._channel = grpc.insecure_channel(relay, options=[*GRPC_OPTIONS, *RELAY_LIMITS])
        self._stub = relay_pb2_grpc.RelayStub(self._channel)
        self._listening: grpc.Call | None = None
        self._thread = threading.Thread(target=self._keep_listening, name="relay-tunnel", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return not self.refused and not self._closed.is_set()

    def close(self) -> None:
        self._closed.set()
        if self._listening is not None:
            self._listening.cancel()
        self._channel.close()
        self._thread.join(timeout=10)

    def _keep_listening(self) -> None:
        failures = 0
        while not self._closed.is_set():
            try:
                self._listen()
                why = f"the relay at {self.relay} ended this node's stream"
            except grpc.RpcError as e:
                if self._closed.is_set():
                    return
                why = f"lost the relay at {self.relay}: it went away or stopped answering ({e.code().name})"
                if e.code() in FOR_GOOD:
                    self.refused = f"the relay at {self.relay} refused this node: {e.details()}"
                    self.refused_at, self.address = time.monotonic(), None
                    self._on_address(None, self.refused)  # said even if it never had an address there
                    return
            self._moved(None, why)
            self._closed.wait(RETRY_S[min(failures, len(RETRY_S) - 1)])
            failures += 1

    def _listen(self) -> None:
        self._listening = stream = self._stub.Listen(relay_pb2.ListenRequest(node_id=self._node_id, token=self._token))
        for incoming in stream:
            if incoming.port:
                self._moved(f"{self.relay.rpartition(':')[0]}:{incoming.port}", f"listening through the relay "
                                                                               f"at {self.relay}")
            elif incoming.connection:
                threading.Thread(target=self._carry, args=(incoming.connection,), name="relay-carry",
                                 daemon=True).start()

    def _moved(self, address: str | None, why: str) -> None:
        if address != self.address:
            self.address = address
            self._on_address(address, why)

    def _carry(self, connection: int) -> None:
        try:
            host, _, port = self.local.rpartition(":")
            local = socket.create_connection((host.strip("[]"), int(port)), timeout=10)
        except OSError as e:  # the relay closes the peer's connection when nobody claims it
            log.warning("could not reach this node's own server at %s for a relayed peer: %s", self.local, e)
            return
        local.settimeout(None)

        def from_server() -> Iterator[relay_pb2.Chunk]:
            try:
                while data := local.recv(CHUNK_BYTES):
                    yield relay_pb2.Chunk(data=data)
            except OSError:
                return

        metadata = (("ravnest-node", self._node_id), ("ravnest-connection", str(connection)),
                    ("authorization", self._token))
        try:
            for chunk in self._stub.Carry(from_server(), metadata=metadata):
                local.sendall(chunk.data)
        except (grpc.RpcError, OSError):
            pass  # either side went: both close
        finally:
            try:
                local.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            local.close()
