"""Whether peers can dial a node: measured, not assumed.

After every join the coordinator opens a TCP connection to the address the node advertises and
closes it, sending nothing (TLS or not, a NAT or a firewall that drops inbound connections stops it
before any protocol). Link probes between idle peers say the same from the other side: a measured
link means its peer was dialled, and a probe that could not dial its peer is reported. The latest
word is kept with where it came from; `ravnest nodes`, the dashboard and the node's own log show it.

A volunteer could point the dial-back at another host's port: it learns one bit (connected or
not) per dial, and nothing is sent there. Which networks are dialled, and how often a node's move is,
follows coordinator/dial_rules.py.

A node found unreachable is offered a relay (ravnest/relay) with its heartbeat reply: the
coordinator's own (`relay_port`) or a reachable volunteer's (`ravnest-node join --relay`, whose relay
port is dialled back too), whichever relays for the fewest nodes; it keeps the one it was given while
that one is there. Once it listens there it sends the relay's address for it, which replaces its own
(after a dial-back through the relay, it is reachable again). Until then, no job is placed on it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor
from typing import cast

from sqlalchemy import CursorResult, bindparam, case, delete, or_, select, update
from sqlalchemy.orm import Session

from ravnest.relay.dial import dial, host_of
from ravnest.relay.server import RelayServer, relay_token
from ravnest.spec import RelayOffer

from ..dial_rules import DialRules
from ..failure_reasons import who
from ..store import COORDINATOR_RELAY as COORDINATOR
from ..store import LinkRow, NodeRow
from .core import GONE, Core, planning_bandwidth

log = logging.getLogger(__name__)
DIALLERS = 4  # dial-backs at once; a burst of joins waits its turn
MAX_PENDING = 1024  # dial-backs waiting; more joins than this at once go unchecked (shown as unknown)


class Reachability:
    def __init__(self, core: Core) -> None:
        self.core = core
        self._diallers = ThreadPoolExecutor(max_workers=DIALLERS, thread_name_prefix="dial-back")
        self._pending = threading.BoundedSemaphore(MAX_PENDING)
        self._left: dict[str, str] = {}  # node id -> the relay it last left (this coordinator's run only)
        self._dialled: list[Dialled] = []  # what dial-backs found, not yet written (`flush`)
        self._lock = threading.Lock()  # guards _dialled
        self.rules = DialRules(core.settings.dial_allow, core.settings.host, core.clock)
        port = core.settings.relay_port
        self.relay = RelayServer(core.relay_secret(COORDINATOR), core.settings.relay_host, port,
                                 node_ports=core.settings.relay_node_ports) if port is not None else None
        if self.relay:
            log.info("relay for nodes that peers cannot dial at %s", self.relay.address)

    def close(self) -> None:
        if self.relay:
            self.relay.stop()
        self._diallers.shutdown(wait=False, cancel_futures=True)

    def relay_offer(self, session: Session, node: NodeRow) -> RelayOffer | None:
        """The relay for a node that peers could not dial, or whose relay no longer serves (it went, or
        was quarantined), if there is one: the one it was given while that one is there and it has not
        left it, else the one relaying for the fewest nodes (the one it left only if there is no other)."""
        if node.reachable is not False and node.relayed_by is None:
            return None  # dialled directly (most nodes: no query)
        relays, left = self._relays(session, node), self._left.get(node.id)
        if node.reachable is not False and node.relayed_by in relays:
            return None  # through a relay that still serves it
        if node.relayed_by not in relays or node.relayed_by == left:
            if not relays:
                return None
            load = Counter(session.scalars(select(NodeRow.relayed_by).where(
                NodeRow.relayed_by.is_not(None), NodeRow.state != GONE, NodeRow.credential_ended.is_(None))))
            node.relayed_by = min(relays, key=lambda relay: (relay == left, load[relay], relay == COORDINATOR, relay))
        relay = str(node.relayed_by)
        return RelayOffer(address=relays[relay], token=relay_token(self.core.relay_secret(relay), node.id))

    def _relays(self, session: Session, node: NodeRow) -> dict[str, str]:
        """Relays there now, by id -> address (no host: the coordinator's, as the node reaches it):
        volunteers that peers reach directly and that are not quarantined (a relay whose nodes kept
        being lost while they lived is: service/lifecycle.py), and the coordinator's own."""
        relays = {COORDINATOR: f":{self.relay.port}"} if self.relay else {}
        now = self.core.clock()
        for relay in session.scalars(select(NodeRow).where(
                NodeRow.relay_port.is_not(None), NodeRow.reachable.is_(True), NodeRow.relayed_by.is_(None),
                NodeRow.id != node.id, NodeRow.state != GONE, NodeRow.credential_ended.is_(None),
                self.core.live(now),
                or_(NodeRow.quarantined_until.is_(None), NodeRow.quarantined_until <= now))):
            relays[relay.id] = f"{relay.address.rpartition(':')[0]}:{relay.relay_port}"
        return relays

    def moved(self, session: Session, node: NodeRow, address: str) -> tuple[bool, str]:
        """The node is reached at `address` now (its port on a relay, or its own again): dial it there
        (`dial_back`, once this session is committed). (False, why) where a live node holds that address,
        or where the node moved too recently to be dialled again (dial_rules.py: the reply says so)."""
        self.core.lock.hold_keys(session, address)  # (a join there waits, and then finds it held)
        holder = self.core.holder_of(session, address, other_than=node.id)
        if holder is not None:
            log.warning("node %s said it moved to %s, which node %s holds: ignored", who(node), address, who(holder))
            return False, ""
        wait = self.rules.move_waits(node.id, offered=self._offered(session, node, address))
        if wait:
            at = time.strftime("%H:%M:%S UTC", time.gmtime(self.core.clock() + wait))
            return False, (f"{address} is dialled from {at} on: the coordinator dials a node's new address at most "
                           f"once a minute")
        log.info("node %s moved from %s to %s", who(node), node.address, address)
        if node.relayed_by and host_of(address) == node.tls_name:  # back at its own host: it left its relay
            self._left[node.id] = node.relayed_by  # (which went, or turned it away: its port range was full)
        node.address, node.reachable, node.reachability = address, None, ""
        session.execute(delete(LinkRow).where(LinkRow.peer_id == node.id))  # links to it: measured again there
        return True, ""

    def _offered(self, session: Session, node: NodeRow, address: str) -> bool:
        """Whether `address` is where the relay this node was offered reaches it: the port the coordinator's
        own relay gave it, or a volunteer relay's host."""
        if node.relayed_by == COORDINATOR:
            return self.relay is not None and self.relay.address_of(node.id) == address
        relay = session.get(NodeRow, node.relayed_by) if node.relayed_by else None
        return relay is not None and host_of(relay.address) == host_of(address)

    def dial_back(self, node_id: str, address: str, relay_port: int | None = None) -> None:
        """Dial a node that just joined (and its relay's port, if it relays), on a thread of its own
        (the join does not wait for it)."""
        if self.core.settings.background and self._pending.acquire(blocking=False):
            self._diallers.submit(self._dial_back, node_id, address, relay_port)

    def _dial_back(self, node_id: str, address: str, relay_port: int | None) -> None:
        try:
            reached, said = self._dial(address)
            if not reached:
                log.info("node %s is not reachable: the coordinator %s", node_id, said)
            if not relay_port:  # (nearly every join: written with the others' by `flush`)
                with self._lock:
                    self._dialled.append(Dialled(node_id, address, reached, f"the coordinator {said}"))
                return
            relays, relay_said = self._dial(f"{address.rpartition(':')[0]}:{relay_port}") if reached else (False, "")
            found: dict[str, object] = {"reachable": reached, "reachability": f"the coordinator {said}"}
            if reached:  # dialled at its own address: it needs no relay now
                found["relayed_by"] = case((NodeRow.tls_name == host_of(address), None), else_=NodeRow.relayed_by)
            if not relays:
                found["relay_port"] = None
            with self.core.lock.own_rows(), self.core.store.session() as session:
                updated = session.execute(update(NodeRow).where(NodeRow.id == node_id, NodeRow.address == address)
                                          .values(found).execution_options(synchronize_session=False))
            if not relays and cast(CursorResult, updated).rowcount:  # (else it joined again meanwhile)
                log.info("node %s does not relay: %s", node_id, relay_said or "peers cannot dial it")
        finally:
            self._pending.release()

    def _dial(self, address: str) -> tuple[bool, str]:
        """`dial`, where the dial rules allow it (else (False, why not))."""
        target = self.rules.target(address)
        return dial(address, at=target.at) if target.at else (False, target.refused)

    def flush(self) -> None:
        """Write what the dial-backs of nodes that do not relay found since the last time: one statement
        for those reached and one for the others, not a transaction each (a storm of joins after an
        outage dials back thousands). Only where the node is still at the address dialled."""
        with self._lock:
            dialled, self._dialled = self._dialled, []
        if not dialled:
            return
        with self.core.lock.own_rows(), self.core.store.session(quiet=True) as session:
            for reached in (True, False):
                rows = [{"node": d.node_id, "dialled": d.address, "said": d.said, "host": host_of(d.address)}
                        for d in dialled if d.reached is reached]
                found: dict[str, object] = {"reachable": reached, "reachability": bindparam("said")}
                if reached:  # dialled at its own address: it needs no relay now
                    found["relayed_by"] = case((NodeRow.tls_name == bindparam("host"), None),
                                               else_=NodeRow.relayed_by)
                if rows:
                    session.connection().execute(update(NodeRow).where(
                        NodeRow.id == bindparam("node"), NodeRow.address == bindparam("dialled")).values(found), rows)

    def from_probes(self, session: Session, prober: NodeRow, reached: list[str], unreached: list[str]) -> None:
        """What a node's link probes found: the peers it measured were dialled, the others not."""
        for peer_id, ok in [*((p, True) for p in reached), *((p, False) for p in unreached)]:
            peer = session.get(NodeRow, peer_id)  # (loaded already: LinkProbes.record)
            known = peer is not None and peer.reachable is ok and (peer.reachability or "").startswith("node ")
            if peer is not None and peer.id != prober.id and not known:  # (what a peer found is kept, not rewritten)
                self._record(peer, ok, f"node {who(prober)} {'dialled' if ok else 'could not dial'} {peer.address}")

    @staticmethod
    def _record(node: NodeRow, reached: bool, how: str) -> None:
        node.reachable, node.reachability = reached, how


def tls_names(session: Session, node_ids: Collection[str]) -> dict[str, str]:
    """The names the certificates of those of `node_ids` reached through a relay carry (peers dial them
    at the relay's host). Filtered here: a plan's ids may be too many for an IN list."""
    return {node.id: node.tls_name for node in session.scalars(select(NodeRow).where(
        NodeRow.relayed_by.is_not(None), NodeRow.state != GONE)) if node.id in node_ids and node.tls_name}


@dataclass(frozen=True)
class DirectLinks:
    """Which links of a job run over a connection that the side nobody can dial opened itself, at the
    other side's relay for its peers, rather than through its own relay: wherever one side of a link
    can be dialled, there is no relay hop."""
    relays: dict[str, str]  # members peers can dial -> their relay for their peers, "host:port"
    hidden: frozenset[str]  # members nobody can dial: they listen at a relay
    secret: Callable[[str], bytes]  # a node's relay secret (the coordinator's derivation)

    def listen_at(self, me: str, peer: str) -> RelayOffer | None:
        """Where `me` listens for what `peer` sends it, if `me` is hidden and `peer` is not."""
        if me in self.hidden and peer in self.relays:
            return RelayOffer(address=self.relays[peer], token=relay_token(self.secret(peer), me))
        return None

    def dials_out(self, me: str, peer: str) -> bool:
        """Whether `me` reaches hidden `peer` at its own relay for its peers."""
        return me in self.relays and peer in self.hidden


def direct_links(session: Session, node_ids: Collection[str], secret: Callable[[str], bytes]) -> DirectLinks:
    """The DirectLinks among `node_ids` (a node's peers in a job: a few; read 500 at a time all the same)."""
    relays, hidden, ids = {}, set(), sorted(node_ids)
    for start in range(0, len(ids), 500):
        for node in session.scalars(select(NodeRow).where(NodeRow.id.in_(ids[start:start + 500]))):
            if node.relayed_by is not None:
                hidden.add(node.id)
            elif node.reachable and node.peer_relay_port:
                relays[node.id] = f"{node.address.rpartition(':')[0]}:{node.peer_relay_port}"
    return DirectLinks(relays, frozenset(hidden), secret)


def relay_shares(session: Session, nodes: list[NodeRow], coordinators: float | None = None) -> dict[str, float]:
    """The bytes/s of its relay's link that each of `nodes` reached through a volunteer's relay may
    count on, when a job holds all of them. Every byte sent to such a node crosses the relay's link
    twice, in on its download and out on its upload (what it sends goes straight to a reachable peer),
    and a node in a pipeline receives on up to two links (activations from the previous stage,
    gradients from the next): with n of them on one relay of bandwidth B (as planned), each link
    gets B / 2n. The coordinator's relay has the bandwidth its operator gives it (`coordinators`,
    `--relay-bandwidth`), else its nodes are not capped: its link is not measured."""
    relayed = Counter(node.relayed_by for node in nodes if node.relayed_by)
    bandwidth = {relay: planning_bandwidth(row) for relay in relayed
                 if relay != COORDINATOR and (row := session.get(NodeRow, relay)) is not None}
    if coordinators:
        bandwidth[COORDINATOR] = coordinators
    return {node.id: bandwidth[node.relayed_by] / (2 * relayed[node.relayed_by])
            for node in nodes if node.relayed_by in bandwidth}


@dataclass(frozen=True)
class Dialled:
    """What dialling a node that just joined found."""
    node_id: str
    address: str
    reached: bool
    said: str
