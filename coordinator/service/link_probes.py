"""Which links a node measures, and what it measured: the planner prices every link between the
nodes it places, so each idle node probes a few peers at a time until it has measured enough of them.

What is asked and not yet answered is per process (a cache: lost on a restart, a probe is only asked
again; several coordinator processes each run their own rounds). Bounded three ways, so that 10,000
nodes cost no more per beat than 10: a node takes part in one round of probes at a time, as prober or
as target; at most MAX_ROUNDS rounds run at once; and a node that measured MAX_LINKS_PER_NODE links
is not asked again (remembered without a query). Peers are drawn at random from the idle nodes.
A link whose repeats lay far apart (`WIDE_SPREAD`) is asked for again, and a round as wide does not
replace a figure measured clean.
"""
from __future__ import annotations

import logging
import math
import random
import threading
from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

from sqlalchemy import select
from sqlalchemy.orm import Session

from ravnest.spec import LinkReport, PeerProbe
from ravnest.wire.transport.probes import WIDE_SPREAD

from ..calibration import refuted_bandwidth
from ..failure_reasons import who
from ..store import LinkRow, NodeRow
from .core import IDLE, MAX_LINKS_PER_NODE, Core

log = logging.getLogger(__name__)

MAX_ROUNDS = 64  # probe rounds at once, in all (each a prober and probe_peers targets)
DRAWS = 8  # random idle nodes looked at per probe asked (those measured or in a round are passed over)
IDLE_EVERY_S = 2.0  # the idle nodes probes are drawn from are read again this often
FORGET_ENOUGH_S = 600.0  # how long "measured enough" is believed without counting again
REMEASURES = 3  # probe rounds at most for a link whose repeats lay far apart (the node's probe repeats them too)


class Candidate(NamedTuple):
    id: str
    address: str
    tls_name: str | None
    relayed_by: str | None


class LinkProbes:
    def __init__(self, core: Core) -> None:
        self.core = core
        self._lock = threading.Lock()
        self._asked: dict[tuple[str, str], float] = {}  # (prober, peer) -> when it was asked
        self._rounds: dict[str, set[str]] = {}  # prober -> the peers it was asked for and has not answered
        self._busy: dict[str, float] = {}  # node -> until when it is in a round (as prober or target)
        self._enough: set[str] = set()  # nodes that measured MAX_LINKS_PER_NODE links
        self._expired_at = self._enough_since = core.clock()
        self._idle: list[Candidate] = []
        self._idle_by_id: dict[str, Candidate] = {}
        self._idle_at = float("-inf")

    def answered(self, node_id: str, reports: list[LinkReport], unreached: list[str]) -> set[str]:
        """The peers it was asked to probe and answered for (what it says of others is not asked): its
        round ends with the last of them. A peer it could not dial is an answer too."""
        with self._lock:
            answered = {peer for peer in [*unreached, *(r.peer_id for r in reports)]
                        if self._asked.pop((node_id, peer), None) is not None}
            for peer in answered:
                self._busy.pop(peer, None)
                self._rounds.get(node_id, set()).discard(peer)
            if not self._rounds.get(node_id, True):
                del self._rounds[node_id]
                self._busy.pop(node_id, None)
        return answered

    def record(self, session: Session, measured: Sequence[tuple[str, list[LinkReport], float]],
               known: Collection[str]) -> None:
        """Each (prober, its reports, when): the latest measurement kept per link; reports on peers not
        `known` or on itself are dropped (a peer may have left and been forgotten meanwhile). One read
        whatever their number: a flush writes many beats' at once, under the change lock."""
        probers = {node_id for node_id, _, _ in measured}
        links = {(link.node_id, link.peer_id): link for link in session.scalars(select(LinkRow).where(
            LinkRow.node_id.in_(probers)))} if measured else {}
        for node_id, reports, at in measured:
            for report in reports:
                if report.peer_id not in known or report.peer_id == node_id:
                    continue
                link = links.get((node_id, report.peer_id)) or LinkRow(node_id=node_id, peer_id=report.peer_id)
                if link.bandwidth is None or report.spread <= max(WIDE_SPREAD, link.spread):
                    link.bandwidth, link.latency = report.bandwidth_bytes_per_s, report.latency_s
                    link.spread = report.spread
                # (else a link measured clean once keeps that figure: this round was taken on a busy host)
                link.measured_at, link.rounds = at, (link.rounds or 0) + 1
                links[(node_id, report.peer_id)] = link
                session.add(link)

    def check_claims(self, session: Session, node_ids: Collection[str],
                     pipeline: Mapping[str, Mapping[str, float]] | None = None) -> None:
        """The bandwidth claims of `node_ids` against what others measured of their links: their probes
        (the links table) and `pipeline`'s rates (node -> {neighbour: what its stream to it carried}).
        A claim far above all of it is not believed (calibration.refuted_bandwidth), and said so."""
        measured = {node_id: dict((pipeline or {}).get(node_id, {})) for node_id in node_ids}
        relayed = set(session.scalars(select(NodeRow.id).where(NodeRow.relayed_by.is_not(None))))
        for prober, peer_id, bandwidth in session.execute(select(LinkRow.node_id, LinkRow.peer_id, LinkRow.bandwidth)
                                                          .where(LinkRow.peer_id.in_(measured),
                                                                 LinkRow.node_id != LinkRow.peer_id)):
            if prober not in relayed:  # (through a relay, a probe measures the relay's path, not either node)
                measured[peer_id][prober] = max(bandwidth, measured[peer_id].get(prober, 0.0))
        for node_id, figures in measured.items():
            node = session.get(NodeRow, node_id)
            claimed = float(node.profile["bandwidth_bytes_per_s"]) if node is not None else 0.0
            believed = refuted_bandwidth(claimed, figures)
            if node is None or node.relayed_by is not None or believed is None or \
                    (node.measured_bandwidth or math.inf) <= believed:
                continue
            node.measured_bandwidth = believed
            log.warning("node %s claims its link carries %.3g B/s, but %d other nodes measured its links at "
                        "%.3g B/s at most: it is planned at that from now on", who(node), claimed, len(figures),
                        believed)

    def forget_probes_of(self, peer_id: str) -> None:
        """The peer moved (to a relay's address): what probes of its old address find says nothing of
        the new one, so their reports are not taken as answers."""
        with self._lock:
            self._asked = {pair: at for pair, at in self._asked.items() if pair[1] != peer_id}

    def probes_for(self, session: Session, node_id: str) -> list[PeerProbe]:
        """Up to `probe_peers` idle peers whose link this node has not measured, drawn at random, after
        those whose link it measured with repeats far apart (up to REMEASURES rounds: a busy host's moment
        is not the link's); none once it measured MAX_LINKS_PER_NODE links. A peer that trains is not probed: a probe's
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
        measured, wide = set(), []
        for peer_id, spread, rounds in session.execute(select(LinkRow.peer_id, LinkRow.spread, LinkRow.rounds)
                                                       .where(LinkRow.node_id == node_id)):
            measured.add(peer_id)
            if spread > WIDE_SPREAD and rounds < REMEASURES:
                wide.append(peer_id)
        if len(measured) - len(wide) >= MAX_LINKS_PER_NODE:
            with self._lock:
                self._enough.add(node_id)
            return []
        idle = self._idle_nodes(session, now)
        with self._lock:
            if self._busy.get(node_id, 0.0) > now or len(self._rounds) >= MAX_ROUNDS:
                return []  # another thread gave it (or the last round) meanwhile
            chosen: list[Candidate] = [peer for peer_id in wide if (peer := self._idle_by_id.get(peer_id))
                                       and self._busy.get(peer_id, 0.0) <= now][:want]
            for peer in random.sample(idle, min(len(idle), DRAWS * want) if len(chosen) < want else 0):
                if peer.id != node_id and peer.id not in measured and self._busy.get(peer.id, 0.0) <= now:
                    chosen.append(peer)
                    if len(chosen) == want:
                        break
            if not chosen:
                return []
            self._rounds[node_id] = {peer.id for peer in chosen}
            for end in [node_id, *self._rounds[node_id]]:
                self._busy[end] = now + retry_s
            for peer in chosen:
                self._asked[(node_id, peer.id)] = now
        return [PeerProbe(node_id=peer.id, address=peer.address, tls_name=peer.tls_name if peer.relayed_by else None)
                for peer in chosen]

    def _idle_nodes(self, session: Session, now: float) -> list[Candidate]:
        """The idle, live nodes, read again every IDLE_EVERY_S (one query, whatever the number of beats;
        one that fell silent meanwhile is at worst asked for, and its round runs out). Read every time
        where no background loop runs (tests drive the coordinator, and its clock)."""
        with self._lock:
            if now - self._idle_at < IDLE_EVERY_S and self.core.settings.background:
                return self._idle
            self._idle_at = now  # (the other threads take the last list meanwhile, not a read each)
        idle = [Candidate(*row) for row in session.execute(select(
            NodeRow.id, NodeRow.address, NodeRow.tls_name, NodeRow.relayed_by).where(
            NodeRow.state == IDLE, NodeRow.credential_ended.is_(None), self.core.live(now)))]
        with self._lock:
            self._idle, self._idle_by_id = idle, {peer.id: peer for peer in idle}
        return idle

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
