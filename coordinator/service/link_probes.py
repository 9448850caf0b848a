"""Which links a node measures, and what it measured: the planner prices every link between the
nodes it places, so each idle node probes a few peers at a time until it has measured enough of them.

What is asked and not yet answered is per process (a cache: lost on a restart, a probe is only asked
again). Bounded three ways, so that 10,000 nodes cost no more per beat than 10: a node takes part in
one round of probes at a time, as prober or as target; at most MAX_ROUNDS rounds run at once; and a
node that measured MAX_LINKS_PER_NODE links is not asked again (remembered without a query).
"""
from __future__ import annotations

import threading

from sqlalchemy import select
from sqlalchemy.orm import Session

from ravnest.spec import LinkReport, PeerProbe

from ..store import LinkRow, NodeRow
from .core import IDLE, MAX_LINKS_PER_NODE, Core

MAX_ROUNDS = 64  # probe rounds at once, in all (each a prober and probe_peers targets)
SLACK = 32  # candidate rows read beyond those known to be skipped (silent ones not yet marked gone)
FORGET_ENOUGH_S = 600.0  # how long "measured enough" is believed without counting again


class LinkProbes:
    def __init__(self, core: Core) -> None:
        self.core = core
        self._lock = threading.Lock()
        self._asked: dict[tuple[str, str], float] = {}  # (prober, peer) -> when it was asked
        self._rounds: dict[str, set[str]] = {}  # prober -> the peers it was asked for and has not answered
        self._busy: dict[str, float] = {}  # node -> until when it is in a round (as prober or target)
        self._enough: set[str] = set()  # nodes that measured MAX_LINKS_PER_NODE links
        self._expired_at = self._enough_since = core.clock()

    def record(self, session: Session, node: NodeRow, reports: list[LinkReport], unreached: list[str]) -> set[str]:
        """Keep the latest measurement per peer; reports on unknown peers or itself are dropped
        (a peer may have left and been forgotten meanwhile). A peer it could not dial is an answer too.
        Returns the peers it was asked to probe and answered for (what it says of others is not asked)."""
        now = self.core.clock()
        with self._lock:
            answered = {peer for peer in [*unreached, *(r.peer_id for r in reports)]
                        if self._asked.pop((node.id, peer), None) is not None}
            for peer in answered:
                self._busy.pop(peer, None)
                self._rounds.get(node.id, set()).discard(peer)
            if not self._rounds.get(node.id, True):
                del self._rounds[node.id]
                self._busy.pop(node.id, None)
        for report in reports:
            if report.peer_id == node.id or session.get(NodeRow, report.peer_id) is None:
                continue
            session.merge(LinkRow(node_id=node.id, peer_id=report.peer_id, bandwidth=report.bandwidth_bytes_per_s,
                                  latency=report.latency_s, measured_at=now))
        return answered

    def forget_probes_of(self, peer_id: str) -> None:
        """The peer moved (to a relay's address): what probes of its old address find says nothing of
        the new one, so their reports are not taken as answers."""
        with self._lock:
            self._asked = {pair: at for pair, at in self._asked.items() if pair[1] != peer_id}

    def probes_for(self, session: Session, node_id: str) -> list[PeerProbe]:
        """Up to `probe_peers` idle peers whose link this node has not measured, oldest members first;
        none once it measured MAX_LINKS_PER_NODE links. A peer that trains is not probed: a probe's
        megabytes would take its link's bandwidth and its memory from the job. A node takes part in
        one round of probes at a time, as prober or as target (until reported, or `probe_retry_s`):
        two probes through one host's link each measured about half of it (a 400 Mbit/s pair came out
        below 100 Mbit/s). Reads only: no lock is needed."""
        want, now, retry_s = self.core.settings.probe_peers, self.core.clock(), self.core.settings.probe_retry_s
        with self._lock:
            self._expire(now)
            if want <= 0 or node_id in self._enough or self._busy.get(node_id, 0.0) > now \
                    or len(self._rounds) >= MAX_ROUNDS:
                return []
            busy = len(self._busy)
        measured = set(session.scalars(select(LinkRow.peer_id).where(LinkRow.node_id == node_id)))
        if len(measured) >= MAX_LINKS_PER_NODE:
            with self._lock:
                self._enough.add(node_id)
            return []
        # the oldest idle nodes, filtered here rather than in SQL (where liveness and "not measured" would
        # make the database look at every node): enough rows to skip the measured, busy and silent ones
        candidates = [peer for peer in session.scalars(select(NodeRow).where(
            NodeRow.id != node_id, NodeRow.state == IDLE, NodeRow.credential_ended.is_(None))
            .order_by(NodeRow.joined_at, NodeRow.id).limit(want + busy + len(measured) + SLACK))
            if peer.id not in measured and not self.core.gone(peer, now)]
        with self._lock:
            if self._busy.get(node_id, 0.0) > now or len(self._rounds) >= MAX_ROUNDS:
                return []  # another thread gave it (or the last round) meanwhile
            chosen = [peer for peer in candidates if self._busy.get(peer.id, 0.0) <= now][:want]
            if not chosen:
                return []
            self._rounds[node_id] = {peer.id for peer in chosen}
            for end in [node_id, *self._rounds[node_id]]:
                self._busy[end] = now + retry_s
            for peer in chosen:
                self._asked[(node_id, peer.id)] = now
        return [PeerProbe(node_id=peer.id, address=peer.address, tls_name=peer.tls_name if peer.relayed_by else None)
                for peer in chosen]

    def _expire(self, now: float) -> None:
        """Rounds never answered end after `probe_retry_s` (once a second is enough to look)."""
        if now - self._expired_at < 1.0:
            return
        self._expired_at = now
        retry_s = self.core.settings.probe_retry_s
        self._asked = {pair: at for pair, at in self._asked.items() if now - at < retry_s}
        self._busy = {node: until for node, until in self._busy.items() if until > now}
        self._rounds = {node: peers for node, peers in self._rounds.items() if node in self._busy}
        if now - self._enough_since > FORGET_ENOUGH_S:  # a peer pruned takes its link along: count again
            self._enough, self._enough_since = set(), now
