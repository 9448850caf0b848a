"""How a node is reached when peers cannot dial it, and how it relays for others (ravnest/relay).

The coordinator says in a heartbeat reply that nobody could dial this node, and offers a relay; the
node listens there (a `RelayTunnel`) and sends the address the relay gave it with its heartbeats,
which the coordinator plans with from then on. If that relay goes, the node listens on the next one
offered. With `--relay`, the node runs a `RelayServer` for others; the coordinator hands out the
tokens, derived from the secret this node gets when it joins.
"""
from __future__ import annotations

import time
from typing import Callable

from node.client import CoordinatorClient
from node.progress import Progress
from ravnest.relay.ports import span
from ravnest.relay.server import RelayServer
from ravnest.relay.tunnel import RelayTunnel
from ravnest.spec import RelayOffer

REFUSED_AGAIN_S = 60.0  # a relay that turned this node away (it was full) is tried again after this long


class Relaying:
    def __init__(self, client: CoordinatorClient, progress: Progress, *, use_relay: bool, relay_port: int | None,
                 relay_ports: range | None, host: str, wake: Callable[[], None]):
        self.client, self.progress = client, progress
        self.use_relay = use_relay  # where peers cannot dial this node, be reached through the relay offered
        self._wake = wake  # the next heartbeat goes out now
        self.relay = RelayServer(b"", host, relay_port, node_ports=relay_ports) if relay_port is not None else None
        self._tunnel: RelayTunnel | None = None
        self._node_id = ""

    @property
    def relay_port(self) -> int | None:
        return self.relay.port if self.relay else None

    def joined(self, node_id: str, relay_secret: str) -> None:
        self._node_id = node_id
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
            local = local.replace("0.0.0.0:", "127.0.0.1:").replace("[::]:", "[::1]:")
            self._tunnel = RelayTunnel(address, self._node_id, relay.token, local, self._moved)
        return relay

    def close(self) -> None:
        if self._tunnel:
            self._tunnel.close()
        if self.relay:
            self.relay.stop()

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
