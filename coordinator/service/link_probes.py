"""Which links a node measures, and what it measured: the planner prices every link between the
nodes it places, so each node probes a few peers per heartbeat until it has measured enough of them."""
from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ravnest.spec import LinkReport, PeerProbe

from ..store import LinkRow, NodeRow
from .core import IDLE, MAX_LINKS_PER_NODE, Core


class LinkProbes:
    def __init__(self, core: Core) -> None:
        self.core = core
        self._asked: dict[tuple[str, str], float] = {}  # (node, peer) -> when it was asked (per process)

    def record(self, session: Session, node: NodeRow, reports: list[LinkReport], unreached: list[str]) -> set[str]:
        """Keep the latest measurement per peer; reports on unknown peers or itself are dropped
        (a peer may have left and been forgotten meanwhile). A peer it could not dial is an answer too.
        Returns the peers it was asked to probe and answered for (what it says of others is not asked)."""
        now = self.core.clock()
        answered = {peer for peer in [*unreached, *(r.peer_id for r in reports)]
                    if self._asked.pop((node.id, peer), None) is not None}
        for report in reports:
            if report.peer_id == node.id or session.get(NodeRow, report.peer_id) is None:
                continue
            session.merge(LinkRow(node_id=node.id, peer_id=report.peer_id, bandwidth=report.bandwidth_bytes_per_s,
                                  latency=report.latency_s, measured_at=now))
        return answered

    def forget_probes_of(self, peer_id: str) -> None:
        """The peer moved (to a relay's address): what probes of its old address find says nothing of
        the new one, so their reports are not taken as answers."""
        self._asked = {pair: at for pair, at in self._asked.items() if pair[1] != peer_id}

    def probes_for(self, session: Session, node: NodeRow) -> list[PeerProbe]:
        """Up to `probe_peers` idle peers whose link this node has not measured, oldest members first;
        none once it measured MAX_LINKS_PER_NODE links. A peer that trains is not probed: a probe's
        megabytes would take its link's bandwidth and its memory from the job. A node takes part in
        one round of probes at a time, as prober or as target (until reported, or `probe_retry_s`):
        two probes through one host's link each measured about half of it (a 400 Mbit/s pair came out
        below 100 Mbit/s)."""
        want, now = self.core.settings.probe_peers, self.core.clock()
        if len(self._asked) > 10_000:  # forget requests that were never answered
            retry_s = self.core.settings.probe_retry_s
            self._asked = {k: at for k, at in self._asked.items() if now - at < retry_s}
        busy = {end for pair, at in self._asked.items() if now - at < self.core.settings.probe_retry_s
                for end in pair}
        measured = select(LinkRow.peer_id).where(LinkRow.node_id == node.id)
        if want <= 0 or node.id in busy or \
                (session.scalar(select(func.count()).select_from(measured.subquery())) or 0) >= MAX_LINKS_PER_NODE:
            return []
        candidates = session.scalars(select(NodeRow).where(
            NodeRow.id != node.id, NodeRow.state == IDLE, NodeRow.credential_ended.is_(None),
            NodeRow.last_seen >= now - self.core.settings.heartbeat_timeout_s, NodeRow.id.not_in(measured))
            .order_by(NodeRow.joined_at, NodeRow.id).limit(want + len(busy)))
        chosen = [peer for peer in candidates if peer.id not in busy][:want]
        for peer in chosen:
            self._asked[(node.id, peer.id)] = now
        return [PeerProbe(node_id=peer.id, address=peer.address, tls_name=peer.tls_name if peer.relayed_by else None)
                for peer in chosen]
