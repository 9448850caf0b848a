"""Heartbeats that change nothing: answered without the coordinator's lock, their `last_seen` written
in batches, at an interval that grows with the number of nodes.

Most heartbeats say "still here": an idle node with nothing to report but its link probes' results,
or a busy one running the job it was given. Such a beat needs one read (the node's row with its job's
state and its stage: a primary-key lookup) and no write: when it was seen, and what its probes
measured, go into a buffer that `flush` writes in one transaction (a background thread, every
FLUSH_S), never moving `last_seen` back. An idle node that was marked gone (it missed its beats: after
an outage, thousands at once) comes back here too, with one write of its own row. Every other beat (a
proof, a new address, a job to start, hand in or stop) takes the slow path, Membership.heartbeat,
under the lock.

The interval. Nodes beat every `heartbeat_interval_s` until there are more than `heartbeat_rate`
times that many live nodes; past that, the interval grows so that all of them together send about
`heartbeat_rate` beats a second, up to IDLE_CAP_S for idle nodes and BUSY_CAP_S for busy ones. A node
is suspect after `heartbeat_timeout_factor` of *its own* intervals (the one it was last told, kept in
`nodes.beat_interval_s`) and gone on more evidence (failure_rules/heartbeat.py), so noticing a lost
node takes at most 10 x 40 s while idle and 2 x 3 x 10 s = 1 minute while busy (where its pipeline
peers also report it at once). With the defaults
(2 s, 100 beats/s) that starts past 200 nodes; 4,000 idle nodes and more beat every 40 s (10,000 of
them: 250 beats/s, shared by the coordinator processes).
"""
from __future__ import annotations

import threading
from collections.abc import Collection
from dataclasses import dataclass

from pydantic import ValidationError
from sqlalchemy import and_, bindparam, case, func, select, update
from sqlalchemy.orm import Session

from ravnest.spec import HeartbeatRequest, HeartbeatResponse, LinkReport

from .. import jobs
from ..jobs import JobState
from ..schemas import Health
from ..security import token_matches
from ..store import JobRow, NodeRow, OfferRow, StageRow
from .core import BUSY, GONE, IDLE, Core, node_refusal
from .link_probes import LinkProbes
from .offers import Offers
from .placement import Placement
from .reachability import Reachability

FLUSH_S = 0.5  # the buffer of sightings is written this often: far below any heartbeat timeout
IDLE_CAP_S, BUSY_CAP_S = 40.0, 10.0  # the longest intervals told (see the docstring)
COUNT_EVERY_S = 5.0  # live nodes are counted again this often to set the interval
MAX_VOUCHED = 100_000  # credentials remembered for quiet_beats.py's check (past that, read from rows again)


# a node's row with its job's state, its stage and how many files it offers: one primary-key lookup
# (built once)
NODE_AND_JOB = (
    select(NodeRow.id, NodeRow.token_hash, NodeRow.credential_ended, NodeRow.token_expires_at, NodeRow.state,
           NodeRow.job_id, NodeRow.reachable, NodeRow.reachability, NodeRow.relayed_by, NodeRow.training_alone,
           JobRow.state.label("job_state"), StageRow.delivered, StageRow.weights_uploaded,
           select(func.count()).where(OfferRow.node_id == NodeRow.id).scalar_subquery().label("offers"))
    .outerjoin(JobRow, JobRow.id == NodeRow.job_id)
    .outerjoin(StageRow, and_(StageRow.job_id == NodeRow.job_id, StageRow.node_id == NodeRow.id))
    .where(NodeRow.id == bindparam("node")))


def _may_be_quiet(request: HeartbeatRequest) -> bool:
    """Nothing in it that only the slow path records (its probes' results are taken here too)."""
    return not (request.proofs or request.training_alone or request.address is not None or request.flops is not None)


class Presence:
    def __init__(self, core: Core, links: LinkProbes, reachability: Reachability, offers: Offers,
                 placement: Placement) -> None:
        self.core, self.links, self.reachability = core, links, reachability
        self.offers, self.placement = offers, placement
        self._seen: dict[str, tuple[float, float]] = {}  # node id -> (when, interval told): not yet written
        self._probed: list[Probed] = []  # link probes' results not yet written
        self._lock = threading.Lock()  # guards _seen and _probed only
        self._live, self._counted_at = 0, float("-inf")
        self._vouched: dict[str, str] = {}  # node id -> the hash of the credential its beats last came with

    def known(self, node_id: str, authorization: str) -> bool | None:
        """True where `authorization` holds the credential this node's beats last came with; None where
        that takes its row (`vouched`). Neither does I/O: quiet_beats.py asks before reading a body."""
        held = self._vouched.get(node_id)
        return True if held is not None and token_matches(_token(authorization), held) else None

    def vouched(self, node_id: str, authorization: str) -> bool:
        """Whether `authorization` holds this node's own credential, live (one primary-key read)."""
        with self.core.store.reading() as session:
            row = session.execute(NODE_AND_JOB, {"node": node_id}).first()
            return row is not None and self._vouches(row, authorization, self.core.clock())

    def _vouches(self, row, authorization: str | None, now: float) -> bool:
        """The check of `vouched`, on a row read already; remembered for `known`."""
        if node_refusal(row, now) or not token_matches(_token(authorization), row.token_hash):
            self._vouched.pop(row.id, None)
            return False
        if len(self._vouched) >= MAX_VOUCHED:
            self._vouched.clear()
        self._vouched[row.id] = row.token_hash
        return True

    def interval(self, busy: bool) -> float:
        """The heartbeat interval to tell a node now (see the docstring)."""
        settings, now = self.core.settings, self.core.clock()
        if now - self._counted_at >= COUNT_EVERY_S:
            with self.core.store.reading() as session:
                self._live = session.scalar(select(func.count()).select_from(NodeRow).where(
                    NodeRow.state != GONE, self.core.live(now))) or 0
            self._counted_at = now
        spread = self._live / max(settings.heartbeat_rate, 1e-9)
        return max(settings.heartbeat_interval_s, min(spread, BUSY_CAP_S if busy else IDLE_CAP_S))

    def answer_raw(self, node_id: str, authorization: str, body: bytes) -> bytes | None:
        """`answer` for a body not yet parsed (quiet_beats.py): the reply's JSON, or None."""
        reply = self.answer(node_id, authorization, body)
        return None if reply is None else reply.model_dump_json().encode()

    def answer(self, node_id: str, authorization: str | None,
               request: HeartbeatRequest | bytes) -> HeartbeatResponse | None:
        """The reply to a beat that changes nothing, or None where the slow path must answer (anything
        to record, to tell, or to refuse: the slow path says why). A body not yet parsed is parsed
        only once the node's credential is found good."""
        if isinstance(request, HeartbeatRequest) and not _may_be_quiet(request):
            return None
        now = self.core.clock()
        with self.core.store.reading() as session:
            row = session.execute(NODE_AND_JOB, {"node": node_id}).first()
            if row is None or not self._vouches(row, authorization, now):
                return None
            if isinstance(request, bytes):
                try:
                    request = HeartbeatRequest.model_validate_json(request)
                except ValidationError:
                    return None  # (the route says what is wrong with it)
                if not _may_be_quiet(request):
                    return None
            back = row.state == GONE and row.job_id is None  # (silent too long, and holding nothing)
            idle = row.state in (IDLE, GONE) and row.job_id is None and request.job_id is None
            running = row.state == BUSY and row.job_id is not None and request.job_id == row.job_id and \
                row.job_state == JobState.RUNNING.value and row.delivered and not row.weights_uploaded
            if not (idle or running) or row.reachable is False or row.relayed_by is not None or \
                    row.training_alone is not None or \
                    (row.offers and self.offers.has_news_for(session, node_id)):
                return None
            probed = bool(request.links or request.unreached)  # (its next beat is asked for more)
            probes = self.links.probes_for(session, node_id) if idle and not probed else []
        interval = self.interval(busy=running)
        if back and idle:
            self._back(node_id, now)
        self.seen(node_id, now, interval)
        if probed:
            with self._lock:
                self._probed.append(self._probed_by(node_id, request, now))
        if not self.core.settings.background:  # no loop to write it (tests drive the coordinator)
            self.flush()
        return HeartbeatResponse(probe=probes, note=self.placement.left_out_note(node_id) if idle else "",
                                 reachable=row.reachable, reachability=row.reachability or "",
                                 heartbeat_interval_s=interval)

    def _back(self, node_id: str, now: float) -> None:
        """An idle node marked gone (it missed its beats) beats again: idle once more, in one statement of
        its own row. After a stall thousands may come back at once, so this takes no change lock, and a
        placement is asked for (debounced), as for a node that joined."""
        with self.core.lock.own_rows(), self.core.store.session() as session:
            session.execute(update(NodeRow).where(NodeRow.id == node_id, NodeRow.state == GONE,
                                                  NodeRow.job_id.is_(None)).values(state=IDLE, last_seen=now)
                            .execution_options(synchronize_session=False))
        self.placement.request()

    def count_by_state(self) -> dict[str, int]:
        """How many nodes are idle, busy and gone (silent past the timeout counts as gone, as listed)."""
        shown = case((~self.core.live(self.core.clock()), GONE), else_=NodeRow.state)
        with self.core.store.session() as session:
            counts: dict[str, int] = dict(session.execute(select(shown, func.count()).group_by(shown)).all())
        return {state: counts.get(state, 0) for state in (IDLE, BUSY, GONE)}

    def health(self) -> Health:
        with self.core.store.session() as session:
            alive = session.scalar(select(func.count()).select_from(NodeRow).where(
                NodeRow.state != GONE, self.core.live(self.core.clock()))) or 0
            active = session.scalar(select(func.count()).select_from(JobRow).where(
                JobRow.state.not_in(jobs.TERMINAL))) or 0
        return Health(nodes_alive=alive, jobs_active=active)

    def take_probes(self, session: Session, node: NodeRow, request: HeartbeatRequest) -> None:
        """What a beat on the slow path says its link probes measured, written now."""
        self._write_probed(session, [self._probed_by(node.id, request, self.core.clock())])

    def seen(self, node_id: str, at: float, interval: float) -> None:
        self.core.beats.arrived(node_id, at)
        with self._lock:
            self._seen[node_id] = (at, interval)

    def flush(self) -> None:
        """Write the buffered sightings (one statement) and probe results; `last_seen` only moves on (a
        slow-path beat may have written a later one meanwhile). On PostgreSQL the rows another
        transaction holds (FOR UPDATE SKIP LOCKED) stay in the buffer for the next flush: a flush takes
        no change lock, so waiting for them could deadlock with a change that writes many nodes."""
        with self._lock:
            seen, self._seen = self._seen, {}
            probed, self._probed = self._probed, []
        if not seen and not probed:
            return
        ttl = self.core.settings.node_credential_ttl_s
        if seen:  # (one transaction every FLUSH_S keeps SQLite's other writers waiting least)
            try:
                with self.core.lock.own_rows(), self.core.store.session(quiet=True) as session:
                    free = sorted(seen)
                    if self.core.lock.shared:  # rows a change holds now are written next time: never a wait
                        free = list(session.scalars(select(NodeRow.id).where(NodeRow.id.in_(free))
                                                    .with_for_update(skip_locked=True)))
                    if free:
                        session.connection().execute(
                            update(NodeRow).where(NodeRow.id == bindparam("node"), NodeRow.last_seen < bindparam("at"))
                            .values(last_seen=bindparam("at"), beat_interval_s=bindparam("interval"),
                                    token_expires_at=bindparam("at") + ttl),
                            [{"node": node, "at": seen[node][0], "interval": seen[node][1]} for node in free])
                self._keep(seen, seen.keys() - set(free))
            except BaseException:
                self._keep(seen, seen.keys())  # (the next flush tries again)
                raise
        if probed:  # (what a node found of its peers decides where jobs go: a change like any other)
            with self.core.lock, self.core.store.session() as session:
                self._write_probed(session, probed)

    def _keep(self, seen: dict[str, tuple[float, float]], unwritten: Collection[str]) -> None:
        """Sightings a flush did not write, back in the buffer (unless a later one came meanwhile)."""
        with self._lock:
            for node in unwritten:
                if node not in self._seen or self._seen[node][0] < seen[node][0]:
                    self._seen[node] = seen[node]

    def _probed_by(self, node_id: str, request: HeartbeatRequest, at: float) -> Probed:
        answered = self.links.answered(node_id, request.links, request.unreached)
        return Probed(node_id, at, request.links, [r.peer_id for r in request.links if r.peer_id in answered],
                      [peer for peer in request.unreached if peer in answered])

    def _write_probed(self, session: Session, probed: list[Probed]) -> None:
        """What beats said their probes found, in a few statements however many (the rows they touch are
        read at once, and stay loaded for from_probes)."""
        ends = {end for result in probed for end in (result.node_id, *result.reached, *result.unreached,
                                                     *(report.peer_id for report in result.reports))}
        nodes = {node.id: node for node in session.scalars(select(NodeRow).where(NodeRow.id.in_(ends)))}
        self.links.record(session, [(result.node_id, result.reports, result.at) for result in probed], nodes.keys())
        for result in probed:
            if result.node_id in nodes:
                self.reachability.from_probes(session, nodes[result.node_id], result.reached, result.unreached)
        self.links.check_claims(session, {report.peer_id for result in probed for report in result.reports
                                          if report.peer_id in nodes and report.peer_id != result.node_id})


@dataclass(frozen=True)
class Probed:
    """What one beat said its link probes found: every measurement, and which peers it was asked to
    probe that it reached or could not dial (what it says of others is not believed)."""
    node_id: str
    at: float
    reports: list[LinkReport]
    reached: list[str]
    unreached: list[str]


def _token(authorization: str | None) -> str:
    """The token of an `Authorization: Bearer <token>` header, or "" (the gate says what is wrong)."""
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""
