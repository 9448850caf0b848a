"""Membership: nodes join (admission.py), beat, measure links on request, and leave, are revoked or
are lost; the periodic tick marks silent nodes lost, re-plans recovered jobs and places pending ones."""
from __future__ import annotations

import logging

from sqlalchemy import delete, func, or_, select
from sqlalchemy.orm import Session

from ravnest.averaging.signatures import public_key
from ravnest.failures import Failure, FailureKind
from ravnest.spec import (HeartbeatRequest, HeartbeatResponse, JoinRequest, JoinResponse, LinkReport,
                          NodeProfile, Offered)
from ravnest.wire.gate import credential_hash

from .. import jobs
from ..calibration import remeasured
from ..service_errors import NotFound, Unauthorized
from ..jobs import JobState
from ..schemas import NodeView
from ..security import bearer_token, token_matches
from ..store import JobRow, LinkRow, NodeRow, OfferRow, StageRow, stage_of_node
from .admission import Admission
from .core import BUSY, GONE, IDLE, Core, node_refusal, quarantined, undelivered
from .credentials import Credentials
from .link_probes import LinkProbes
from .offers import Offers
from .placement import Placement
from .presence import Presence
from .reachability import Reachability, direct_links, tls_names
from .recovery import Recoveries
from .rulings import Rulings

log = logging.getLogger(__name__)


class Membership:
    def __init__(self, core: Core, credentials: Credentials, offers: Offers, placement: Placement,
                 recoveries: Recoveries, rulings: Rulings) -> None:
        self.core, self.credentials, self.offers = core, credentials, offers
        self.placement, self.recoveries, self.rulings = placement, recoveries, rulings
        self.links = LinkProbes(core)
        self.reachability = Reachability(core)
        self.presence = Presence(core, self.links, self.reachability, offers, placement)
        self.admission = Admission(core, credentials, offers, placement, rulings, self.presence, self.reachability)

    def tick(self) -> None:
        """Silent nodes and stalled stages to the failure rules, then place pending jobs."""
        core = self.core
        self.presence.flush()
        now = core.clock()
        with core.lock:
            if now >= core.started_at + core.settings.heartbeat_timeout_s:  # after a restart, give nodes time
                with core.store.session() as session:
                    self.rulings.check_silence(session, now)
                    self._prune_nodes(session, now - core.settings.node_retention_s)
            with core.store.session() as session:
                self.recoveries.replan_recovered(session)
            self.placement.place_pending()

    def join(self, authorization: str | None, request: JoinRequest) -> JoinResponse:
        return self.admission.join(authorization, request)

    def offer(self, node_id: str, authorization: str | None, offered: Offered) -> None:
        """A running node changed what it offers: recorded as at join, to be proven again."""
        with self.core.lock:
            with self.core.store.session() as session:
                node = self._node(session, node_id, authorization)
                node.profile = {**node.profile, **offered.model_dump(mode="json")}
                self.offers.record(session, node, offered)
            log.info("node %s now offers %s", node_id, ", ".join(offered.datasets) or "nothing")
        self.placement.request()  # a job waiting for one of them may start

    def heartbeat(self, node_id: str, authorization: str | None, request: HeartbeatRequest) -> HeartbeatResponse:
        """Most beats change nothing and take the fast path (presence.py); the others are recorded here."""
        quiet = self.presence.answer(node_id, authorization, request)
        if quiet is not None:
            return quiet
        with self.core.lock:
            with self.core.store.session() as session:
                node = self._node(session, node_id, authorization)
                node.last_seen = self.core.clock()
                self.core.beats.arrived(node.id, node.last_seen)
                node.token_expires_at = node.last_seen + self.core.settings.node_credential_ttl_s
                moved, waiting = self.reachability.moved(session, node, request.address) \
                    if request.address is not None and request.address != node.address else (False, "")
                if moved:
                    self.links.forget_probes_of(node.id)
                self.presence.take_probes(session, node, request)
                proven = self.offers.take_proofs(session, node, request.proofs)
                self.recoveries.trains_alone(session, node, request.job_id if request.training_alone else None)
                # a re-plan may wait for this node to train alone, or for a lost one to fall silent: the
                # heartbeat of an idle node or of one in a recovering job moves it on, not only the next
                # tick (nodes busy with running jobs, the most, skip the query)
                job = session.get(JobRow, node.job_id) if node.job_id else None
                replanned = (job is None or job.state == JobState.RECOVERING.value) and \
                    self.recoveries.replan_recovered(session)
                freed = node.state == GONE
                if freed:  # missed heartbeats, but it is back
                    node.state = BUSY if node.job_id else IDLE
                response = HeartbeatResponse()
                if node.job_id:
                    response, released = self._job_heartbeat(session, node, request)
                    freed = freed or released
                if request.job_id and request.job_id != node.job_id and response.cancel_job is None:
                    response.cancel_job = request.job_id  # it runs something it no longer holds
                if request.flops is not None and node.state == IDLE and not request.job_id:
                    remeasured(node, request.flops)
                if node.state == IDLE and not request.job_id:  # probes never take bandwidth from training
                    response.probe = self.links.probes_for(session, node.id)
                    response.note = self.placement.left_out_note(node.id)
                response.challenges = self.offers.challenges_for(session, node)
                response.reachable, response.reachability = node.reachable, node.reachability or ""
                response.note = waiting or response.note
                response.relay = self.reachability.relay_offer(session, node)
                response.heartbeat_interval_s = node.beat_interval_s = self.presence.interval(node.state == BUSY)
            if moved:
                self.reachability.dial_back(node_id, str(request.address))
            # a re-plan may have waited for this node; placing may give it work (debounced: after an
            # outage, thousands come back at once)
            if freed or replanned or proven:
                with self.core.store.session() as session:
                    self.recoveries.replan_recovered(session)
                self.placement.request()
                with self.core.store.session() as session:
                    node = session.get_one(NodeRow, node_id)
                    if node.job_id and response.assignment is None and not request.job_id:
                        response.assignment = self._job_heartbeat(session, node, request)[0].assignment
        return response

    def _job_heartbeat(self, session: Session, node: NodeRow,
                       request: HeartbeatRequest) -> tuple[HeartbeatResponse, bool]:
        """Assignment or cancellation for the node's job; the node is released once it is done
        with the job (finished or stopped) and no longer reports running it."""
        job = session.get(JobRow, node.job_id)
        stage = stage_of_node(session, job.id, node.id) if job else None
        response = HeartbeatResponse()
        if job is None or stage is None:
            done = True
        elif job.state in jobs.ACTIVE and not stage.weights_uploaded:
            stage.delivered = True
            plan = self.core.plan(job)
            members = {s.node_id for c in plan.clusters for s in c.stages}
            token = self.core.peer_token
            response.assignment = jobs.assignment(job, plan, stage.cluster, stage.stage, token(job, node.id),
                                                  {m: credential_hash(token(job, m)) for m in members},
                                                  tls_names(session, members),
                                                  direct_links(session, members, self.core.relay_secret),
                                                  self.core.audit_secret(job), lambda m: public_key(token(job, m)))
            if job.state == JobState.PLACING.value and not undelivered(session, job.id):
                jobs.transition(job, JobState.RUNNING, f"every node has its assignment; {self.core.plan(job).reason}",
                                self.core.clock())
            done = False
        else:
            if job.state in jobs.STOPPED:
                response.cancel_job = job.id
            elif job.state == JobState.RECOVERING.value and self.recoveries.told_to_hand_in(job):
                response.recover_job = job.id  # stop, hand in the stage's state, then be placed anew
            elif job.state == JobState.RECOVERING.value:
                response.train_alone = job.id  # a loss elsewhere, maybe: train on until the others are done
            done = True
        if done and request.job_id != node.job_id:
            node.job_id, node.state = None, IDLE
            return response, True
        return response, False

    def leave(self, node_id: str, authorization: str | None) -> None:
        with self.core.lock, self.core.store.session() as session:
            node = self._node(session, node_id, authorization)
            self.rulings.node_lost(session, node, f"node {node.id} ({node.name or node.address}) left",
                                   Failure(kind=FailureKind.LEFT, message="left", peer_id=node.id))
            node.credential_ended = "left"

    def revoke_node(self, node_id: str) -> None:
        """The node's credential stops working at once; a job it held is re-planned without it."""
        with self.core.lock, self.core.store.session() as session:
            node = session.get(NodeRow, node_id)
            if node is None:
                raise NotFound(f"no node {node_id}")
            if node.credential_ended != "revoked":
                self.rulings.node_lost(session, node, f"node {node.id} ({node.name or node.address}) was revoked",
                                       Failure(kind=FailureKind.LEFT, message="was revoked by the operator",
                                               peer_id=node.id))
                node.credential_ended = "revoked"

    def list_nodes(self, limit: int | None = None, offset: int = 0, state: str | None = None,
                   name: str | None = None) -> tuple[list[NodeView], int]:
        """A page of nodes in the order they joined, and how many there are; only those in `state`
        (idle, busy or gone) and whose name holds `name` (in any case), where given."""
        now = self.core.clock()
        wanted = []
        if state == GONE:  # (as the view says it: silent past its timeout, or its row says so)
            wanted.append(or_(~self.core.live(now), NodeRow.state == GONE))
        elif state is not None:
            wanted += [self.core.live(now), NodeRow.state == state]
        if name:
            wanted.append(func.lower(NodeRow.name).contains(name.lower(), autoescape=True))
        with self.core.store.session() as session:
            total = session.scalar(select(func.count()).select_from(NodeRow).where(*wanted)) or 0
            rows = session.execute(select(NodeRow, StageRow).outerjoin(
                StageRow, (StageRow.job_id == NodeRow.job_id) & (StageRow.node_id == NodeRow.id)).where(*wanted)
                .order_by(NodeRow.joined_at, NodeRow.id).limit(limit).offset(offset)).all()
            links: dict[str, list[LinkReport]] = {}
            page = [node.id for node, _ in rows]
            offers = self.offers.describe(session, page)
            for row in session.scalars(select(LinkRow).where(LinkRow.node_id.in_(page)).order_by(LinkRow.peer_id)):
                links.setdefault(row.node_id, []).append(LinkReport(
                    peer_id=row.peer_id, bandwidth_bytes_per_s=row.bandwidth, latency_s=row.latency, spread=row.spread))
            return [NodeView(id=node.id, name=node.name, address=node.address,
                             profile=NodeProfile.model_validate(node.profile),
                             state=GONE if self.core.gone(node, now) else node.state,
                             joined_at=node.joined_at, last_seen=node.last_seen, job_id=node.job_id,
                             cluster=stage.cluster if stage else None, stage=stage.stage if stage else None,
                             links=links.get(node.id, []), offers=offers.get(node.id, {}),
                             quarantined_until=node.quarantined_until if quarantined(node, now) else None,
                             accused_by=sorted({by for by, at in node.accusers or ()
                                                if now - at < self.core.settings.quarantine_window_s}),
                             measured_flops=node.measured_flops, measured_bandwidth=node.measured_bandwidth,
                             slowdown=node.slowdown, message_s=node.message_s,
                             by_model=node.by_model or {},
                             reachable=node.reachable, reachability=node.reachability or "",
                             relay_port=node.relay_port, relayed_by=node.relayed_by,
                             note=f"quarantined: {node.quarantine_reason}" if quarantined(node, now)
                             else self.placement.left_out_note(node.id) if node.state == IDLE else "")
                    for node, stage in rows], total

    def _node(self, session: Session, node_id: str, authorization: str | None) -> NodeRow:
        token = bearer_token(authorization)
        node = session.get(NodeRow, node_id)
        if node is None:
            raise NotFound(f"no node {node_id}")
        refusal = node_refusal(node, self.core.clock())
        if refusal:
            raise Unauthorized(refusal)
        if not token_matches(token, node.token_hash):
            raise Unauthorized(f"wrong token for node {node_id}")
        return node

    def _prune_nodes(self, session: Session, cutoff: float) -> None:
        """Forget nodes gone since before `cutoff` (and the links they measured): 2000 joins must not
        make every node list megabytes long for ever. Their credentials end with them."""
        stale = select(NodeRow.id).where(NodeRow.state == GONE, NodeRow.last_seen < cutoff, NodeRow.job_id.is_(None))
        ids = list(session.scalars(stale))
        if ids:
            session.execute(delete(LinkRow).where(LinkRow.node_id.in_(ids) | LinkRow.peer_id.in_(ids)))
            session.execute(delete(OfferRow).where(OfferRow.node_id.in_(ids)))
            session.execute(delete(NodeRow).where(NodeRow.id.in_(ids)))

