"""Dialling peers: one channel per peer address, checked against the right TLS name, sent where the
peer listens now. `Dialer` holds what a process knows about its peers; the process has one (`DIALER`),
whose methods the package exports as functions."""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

import grpc

from ravnest.failures import FailureKind, KnownFailure

from .options import GRPC_OPTIONS

log = logging.getLogger(__name__)


class PeerError(KnownFailure, RuntimeError):
    """The peer refused or dropped a stream; the message says which peer and why. `address` names the
    peer for whoever reports the failure (ravnest/failures.py), where the peer is to blame (not where
    this side ended the stream); `unreachable`: it never answered; `link_broken`: the connection
    broke (UNAVAILABLE) rather than the peer refusing or ending the stream, so a new one may carry on."""

    def __init__(self, message: str, *, address: str | None = None, unreachable: bool = False,
                 link_broken: bool = False):
        super().__init__(message)
        self.address, self.unreachable, self.link_broken = address, unreachable, link_broken

    @property
    def failure_kind(self) -> FailureKind | None:
        if self.address is None:
            return None
        return FailureKind.PEER_UNREACHABLE if self.unreachable else FailureKind.PEER_LOST

    @property
    def peer_address(self) -> str | None:
        return self.address


def peer_error(address: str, error: grpc.RpcError) -> PeerError:
    return PeerError(f"peer {address}: {error.code().name}: {error.details()}", address=address,
                     link_broken=error.code() == grpc.StatusCode.UNAVAILABLE)


class ChannelPool:
    """One channel per peer address for the life of the pool (channels are expensive). Over TLS a
    peer's certificate is checked against the host dialled, or against the name its dialer gave its
    address: a node reached through a relay is dialled at the relay's host but holds a certificate for
    its own (ravnest/relay)."""

    def __init__(self, root_certificate: bytes | None = None, tls_names: dict[str, str] | None = None):
        self._channels: dict[tuple[str, str | None], grpc.Channel] = {}
        self._lock = threading.Lock()
        self.root_certificate = root_certificate
        self._tls_names = tls_names if tls_names is not None else {}

    def get(self, address: str) -> grpc.Channel:
        name = self._tls_names.get(address) if self.root_certificate else None
        with self._lock:
            channel = self._channels.get((address, name))
            if channel is None:
                if self.root_certificate:
                    creds = grpc.ssl_channel_credentials(self.root_certificate)
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


class Dialer:
    """What this process knows about dialling its peers: the default channel pool (TLS or not), the
    TLS name of each address whose certificate names another host, and the routes to peers that
    listen somewhere other than where they were planned."""

    def __init__(self, max_named: int = 4096, route_wait_s: float = 10.0) -> None:
        # address -> the name its certificate carries, where that is not its host; the latest
        # `max_named` named, since a node serves job after job with peers on relays' ports
        self.max_named = max_named
        # how long a stream waits for a routed peer to listen there before it dials the planned address
        self.route_wait_s = route_wait_s
        self.tls_names: collections.OrderedDict[str, str] = collections.OrderedDict()
        # planned address -> where that peer is dialled instead, once it says: a peer nobody can dial
        # listens at this node's relay for its peers (ravnest/relay), which hands out a loopback port
        self.routes: dict[str, Callable[[], str | None]] = {}
        self.pool = ChannelPool(tls_names=self.tls_names)

    def name_peer(self, address: str, tls_name: str) -> None:
        """Check the certificate of the peer at `address` against `tls_name` from now on (a relayed
        node's own host: the plan says which)."""
        self.tls_names[address] = tls_name
        self.tls_names.move_to_end(address)
        while len(self.tls_names) > self.max_named:
            self.tls_names.popitem(last=False)

    def route(self, address: str, find: Callable[[], str | None]) -> None:
        """Streams to `address` go where `find()` says, once it says somewhere (until `unroute`)."""
        self.routes[address] = find

    def unroute(self, address: str) -> None:
        self.routes.pop(address, None)

    def dialled(self, address: str, wait: float) -> str:
        """Where a stream to `address` dials: its route's port once there is one (the peer's certificate
        is checked against the name the planned address has), else after `wait` seconds the planned
        address."""
        find = self.routes.get(address)
        deadline = time.monotonic() + wait
        while find is not None:
            found = find()
            if found:
                if address in self.tls_names:
                    self.name_peer(found, self.tls_names[address])
                else:  # the peer's certificate names the host it was planned at, not this loopback port
                    self.name_peer(found, address.rpartition(":")[0].strip("[]"))
                return found
            if time.monotonic() >= deadline:
                log.info("peer %s did not listen at this node's relay for peers within %.0f s: dialling it "
                         "as planned", address, wait)
                return address
            time.sleep(0.05)
        return address

    def new_pool(self) -> ChannelPool:
        """A channel pool of its own that dials as the default one (TLS included)."""
        return ChannelPool(self.pool.root_certificate, self.tls_names)

    def use_tls(self, root_certificate: bytes) -> None:
        """From now on, channels made without a pool of their own verify peers against
        `root_certificate` (PEM) over TLS: how a node daemon with --tls-ca talks to its peers."""
        old, self.pool = self.pool, ChannelPool(root_certificate, self.tls_names)
        old.close()

    def close_channels(self) -> None:
        """Close the default pool's channels (new ones open on the next use). A process that stops its
        server should first have every peer close its channels to it: a server that stops under an
        open channel sends GOAWAY, which gRPC logs on the peer's side as an UNAVAILABLE error line."""
        self.pool.close()


DIALER = Dialer()
name_peer, route, unroute = DIALER.name_peer, DIALER.route, DIALER.unroute
new_pool, use_tls, close_channels = DIALER.new_pool, DIALER.use_tls, DIALER.close_channels
