"""How a node is reached when peers cannot dial it, and how it relays for others (ravnest/relay).

The coordinator says in a heartbeat reply that nobody could dial this node, and offers a relay; the
node listens there (a `RelayTunnel`) and sends the address the relay gave it with its heartbeats,
which the coordinator plans with from then on. If that relay goes, the node listens on the next one
offered. With `--relay`, the node runs a `RelayServer` for others; the coordinator hands out the
tokens, derived from the secret this node gets when it joins.

No relay hop where one side can be dialled: every node also runs a relay for its own peers in a job,
whose ports it opens on loopback and dials itself. A hidden node listens there at each peer that
can be dialled (the assignment's `listen_at`), and such a peer sends to it through that port
(`dials_out`): the bytes go straight between the two, over the connection the hidden node opened.

    reachable A ──▶ 127.0.0.1:p (A's relay for peers) ══ Carry, opened by B ══▶ hidden B ──▶ B's server
"""
from __future__ import annotations

import functools
import time
from typing import Callable

from node.client import CoordinatorClient
from node.progress import Progress
from ravnest.relay.ports import span
from ravnest.relay.server import RelayServer
from ravnest.relay.tunnel import RelayTunnel
from ravnest.spec import RelayOffer, StageAssignment
from ravnest.wire import route, unroute

REFUSED_AGAIN_S = 60.0  # a relay that turned this node away (it was full) is tried again after this long


class Relaying:
    def __init__(self, client: CoordinatorClient, progress: Progress, *, use_relay: bool, relay_port: int | None,
                 relay_ports: range | None, host: str, wake: Callable[[], None], peer_relay_port: int | None = 0):
        self.client, self.progress = client, progress
        self.use_relay = use_relay  # where peers cannot dial this node, be reached through the relay offered
        self._wake = wake  # the next heartbeat goes out now
        self.relay = RelayServer(b"", host, relay_port, node_ports=relay_ports) if relay_port is not None else None
        self.for_peers = RelayServer(b"", host, peer_relay_port, node_host="::1" if ":" in host else "127.0.0.1") \
            if peer_relay_port is not None else None
        self._tunnel: RelayTunnel | None = None
        self._to_peers: list[RelayTunnel] = []  # this job's, at its peers' relays for peers
        self._routed: list[str] = []  # this job's hidden peers' addresses, dialled through `for_peers`
        self._found: set[str] = set()  # of those, the ones that listen there (said once)
        self._node_id = ""

    @property
    def relay_port(self) -> int | None:
        return self.relay.port if self.relay else None

    @property
    def peer_relay_port(self) -> int | None:
        return self.for_peers.port if self.for_peers else None

    def joined(self, node_id: str, relay_secret: str) -> None:
        self._node_id = node_id
        if self.for_peers:
            self.for_peers.secret = relay_secret.encode()
        if self.relay:
            self.relay.secret = relay_secret.encode()
            self.progress.log(f"relays for nodes that peers cannot dial, at port {self.relay.port} (once the "
                              f"coordinator has dialled it), on {span(self.relay.node_ports)} for them")

    def advertised(self, own: str) -> str:
        """Where peers dial this node now."""
        return self._tunnel.address or own if self._tunnel else own

    def moved(self, own: str) -> str | None:
        """What the heartbeat says of this node's address: None while it has never used a relay."""
        return self.advertised(own) if self._tunnel else None

    def offered(self, relay: RelayOffer | None, local: str) -> RelayOffer | None:
        """Listen on the relay the coordinator offers, unless this node listens there already (or lost it
        and tries it again); an offer of another relay moves it there. Returns the offer if this node
        uses relays."""
        if not self.use_relay or relay is None:
            return None
        address = self._address_of(relay)
        tunnel = self._tunnel
        if tunnel is not None and tunnel.refused and tunnel.relay == address and \
                time.monotonic() - tunnel.refused_at < REFUSED_AGAIN_S:
            return relay  # the coordinator offers it again (the only one): not at every heartbeat
        if tunnel is None or not tunnel.alive or tunnel.relay != address:
            if tunnel:
                tunnel.close()
            self._tunnel = RelayTunnel(address, self._node_id, relay.token, _dialled_here(local), self._moved)
        return relay

    def job_started(self, a: StageAssignment, local: str) -> None:
        """Listen at the relays of the peers that can be dialled where this node cannot, and send to hidden
        peers through this node's own relay for peers once they listen there."""
        local = _dialled_here(local)
        for peer in {p.node_id: p for p in a.peers()}.values():  # a ring member may be in several rings
            if peer.listen_at is not None:
                self._to_peers.append(RelayTunnel(peer.listen_at.address, self._node_id, peer.listen_at.token, local,
                                                  self._peer_reaches(peer.node_id)))
            if peer.dials_out and self.for_peers:
                route(peer.address, functools.partial(self._hidden_peer, peer.node_id))
                self._routed.append(peer.address)

    def job_ended(self) -> None:
        for tunnel in self._to_peers:
            tunnel.close()
        for address in self._routed:
            unroute(address)
        self._to_peers, self._routed, self._found = [], [], set()

    def _hidden_peer(self, peer: str) -> str | None:
        """Where this node dials hidden `peer` now: its port on this node's relay for peers, once it listens."""
        found = self.for_peers.address_of(peer) if self.for_peers else None
        if found and peer not in self._found:
            self._found.add(peer)
            self.progress.log(f"sends to node {peer[:8]} over the connection it opened to this node")
        return found

    def _peer_reaches(self, peer: str) -> Callable[[str | None, str], None]:
        def said(address: str | None, why: str) -> None:
            self.progress.log(f"node {peer[:8]} sends to this node over a connection this node opened to it" if address
                              else f"lost the connection node {peer[:8]} sends to this node over: {why}")
        return said

    def close(self) -> None:
        self.job_ended()
        if self._tunnel:
            self._tunnel.close()
        if self.relay:
            self.relay.stop()
        if self.for_peers:
            self.for_peers.stop()

    def _address_of(self, relay: RelayOffer) -> str:
        if not relay.address.startswith(":"):
            return relay.address
        host = self.client.http.base_url.host  # the coordinator's own, at the host this node reaches it by
        return f"[{host}]{relay.address}" if ":" in host else f"{host}{relay.address}"

    def _moved(self, address: str | None, why: str) -> None:
        if address:
            self.progress.log(f"peers reach this node at {address}: {why}")
        else:
            self.progress.log(f"peers cannot reach this node now: {why}")
        self._wake()  # the coordinator learns the new address at once


def _dialled_here(address: str) -> str:
    """This node's own server, as a connection from this machine reaches it (not at "every interface")."""
    return address.replace("0.0.0.0:", "127.0.0.1:").replace("[::]:", "[::1]:")
