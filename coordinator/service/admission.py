"""Admission: a node joins, or joins again under its identity (its identity file's secret, kept as a
hash). A join is one transaction: the join token spent (credentials.py), the address free of any
live node, the node's row written with its profile and offers.

On PostgreSQL a join takes no change lock, only keyed locks on its address and identity
(db_locks.py), so a storm of joins after an outage runs in every coordinator process at once. A join
that must first end its identity's old session (the node restarted while it held work) changes a
job, and takes the change lock like any such change."""
from __future__ import annotations

import logging

from sqlalchemy import select
from sqlalchemy.orm import Session

from ravnest.failures import Failure, FailureKind
from ravnest.relay.dial import host_of
from ravnest.spec import JoinRequest, JoinResponse

from ..calibration import remeasured
from ..failure_reasons import who
from ..security import bearer_token, hash_token, new_id, new_token
from ..service_errors import Conflict, Unauthorized
from ..store import NodeRow
from .core import GONE, IDLE, Core
from .credentials import Credentials
from .offers import Offers
from .placement import Placement
from .presence import Presence
from .reachability import Reachability
from .rulings import Rulings

log = logging.getLogger(__name__)


class _NeedsChangeLock(Exception):
    """A join begun without the change lock needs it (Admission._admit)."""


def known_as(request: JoinRequest) -> str | None:
    """What the coordinator keeps of a node's identity secret: its hash, as of any credential."""
    return hash_token(request.identity) if request.identity else None


class Admission:
    def __init__(self, core: Core, credentials: Credentials, offers: Offers, placement: Placement, rulings: Rulings,
                 presence: Presence, reachability: Reachability) -> None:
        self.core, self.credentials, self.offers, self.placement = core, credentials, offers, placement
        self.rulings, self.presence, self.reachability = rulings, presence, reachability

    def join(self, authorization: str | None, request: JoinRequest) -> JoinResponse:
        """A node joins (or joins again under its identity). On PostgreSQL most joins take only the locks
        of their address and identity (db_locks.py), so a storm of them runs in every process at once;
        one that must end its identity's old session first changes a job, and takes the change lock."""
        token, interval = new_token(), self.presence.interval(busy=False)
        try:
            if not self.core.lock.shared:
                raise _NeedsChangeLock
            node, known = self._admit(authorization, request, token, interval, alone=True)
        except _NeedsChangeLock:
            with self.core.lock:
                node, known = self._admit(authorization, request, token, interval, alone=False)
        log.info("node %s (%s) %s from %s: %.1f GFLOP/s, %.1f GiB, %.0f MB/s", node.id, node.name or "unnamed",
                 "joined again" if known else "joined", node.address, request.profile.flops / 1e9,
                 request.profile.memory_bytes / 2**30, request.profile.bandwidth_bytes_per_s / 1e6)
        self.placement.request()
        self.reachability.dial_back(node.id, request.address, request.relay_port)
        return JoinResponse(node_id=node.id, node_token=token, probe_token=self.core.probe_token,
                            heartbeat_interval_s=interval,
                            relay_secret=self.core.relay_secret(node.id).decode()
                            if request.relay_port or request.peer_relay_port else "")

    def _admit(self, authorization: str | None, request: JoinRequest, token: str, interval: float,
               alone: bool) -> tuple[NodeRow, bool]:
        """The join's one transaction: (its row, whether it is known by its identity). `alone`: without
        the change lock, raising _NeedsChangeLock (before anything is written) where it is needed."""
        now = self.core.clock()
        with self.core.store.session() as session:
            self.core.lock.hold_keys(session, request.address, known_as(request))
            admitted = self.credentials.consume_join(session, bearer_token(authorization))
            if isinstance(admitted, str):
                raise Unauthorized(admitted)
            known = self._known_identity(session, request, alone)
            holder = self.core.holder_of(session, request.address, other_than=known.id if known else "")
            if holder is not None:  # else peers would dial the wrong node (or a node would probe itself)
                raise Conflict(f"address {request.address} is held by node {holder.id}, which is alive; "
                               f"advertise this node's own address (a restarted node may retry once the "
                               f"old one times out)")
            node = known or NodeRow(id=new_id(), joined_at=now, identity_hash=known_as(request))
            if known is not None:  # what its jobs measured stays, relative to its new figure
                remeasured(node, request.profile.flops)
            node.name, node.address, node.relay_port = request.name, request.address, request.relay_port
            node.peer_relay_port = request.peer_relay_port
            node.relayed_by, node.tls_name = None, host_of(request.address)  # (it may have moved)
            node.profile = request.profile.model_dump(mode="json")
            node.token_hash = hash_token(token)
            node.token_expires_at = now + self.core.settings.node_credential_ttl_s
            node.state, node.last_seen, node.job_id, node.credential_ended = IDLE, now, None, None
            node.beat_interval_s = interval
            session.add(node)
            self.offers.record(session, node, request.profile, new=known is None)
        return node, known is not None

    def _known_identity(self, session: Session, request: JoinRequest, alone: bool) -> NodeRow | None:
        """The row of a node joining again with its identity file, its old session ended: a node that
        restarted while it held work is lost to that job, which re-plans as for any lost node (under the
        change lock: `alone`, that raises _NeedsChangeLock)."""
        if not request.identity:
            return None
        node = session.scalars(select(NodeRow).where(NodeRow.identity_hash == known_as(request))
                               .with_for_update()).first()
        if node is None:
            return None
        if node.credential_ended == "revoked":
            raise Unauthorized(f"node {who(node)} was revoked by this coordinator's operator; its identity file "
                               f"cannot join again")
        if node.state != GONE or node.job_id is not None:
            if alone:
                raise _NeedsChangeLock
            if node.state != GONE:
                said = "restarted (a node's state does not survive its process)"
                self.rulings.node_lost(session, node, f"node {who(node)} restarted",
                                       Failure(kind=FailureKind.LEFT, message=said, peer_id=node.id))
        return node
