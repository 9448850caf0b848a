"""Carrying out what the failure rules decide (coordinator/failure_rules): the one place their decisions
touch the store. Services observe (a silent node, a stalled stage, a job's pace, a failure report) and
hand the decisions here."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ravnest.failures import Failure, FailureKind

from .. import calibration, jobs
from ..failure_reasons import who
from ..failure_rules.base import (Accusation, AccusationRecord, Blame, Blamed, BlameRecord, CorrectFlops, Decision,
                                  FailJob, NodeGone, Observation, Quarantine, Replan, Revoke, Silence, Spare, Stall)
from ..failure_rules.quarantine import served
from ..jobs import JobState
from ..store import JobRow, NodeRow, StageRow, stage_of_node
from .core import GONE, Core
from .recovery import Recoveries

log = logging.getLogger(__name__)


class Rulings:
    def __init__(self, core: Core, recoveries: Recoveries) -> None:
        self.core, self.recoveries = core, recoveries

    def observe(self, session: Session, observation: Observation, *, first_hand: bool = False,
                **record: Any) -> list[Decision]:
        """What the rules decide about `observation`, carried out; `record`: more fields of a re-plan's
        Recovery record (who reported it). `first_hand`: the observation is the account of a failure whose
        re-plan a messenger's report opened (Recoveries.first_hand)."""
        decisions = self.core.rules.observe(observation)
        self.enforce(session, decisions, first_hand=first_hand, **record)
        return decisions

    def enforce(self, session: Session, decisions: Sequence[Decision], *, first_hand: bool = False,
                **record: Any) -> None:
        spared = {d.node_id for d in decisions if isinstance(d, Spare)}
        for d in decisions:
            if isinstance(d, FailJob):
                jobs.transition(session.get_one(JobRow, d.job_id), JobState.FAILED, d.reason, self.core.clock())
            elif isinstance(d, Replan):
                job, left_out = session.get_one(JobRow, d.job_id), [n for n in d.left_out if n not in spared]
                if job.state in jobs.ACTIVE:
                    self.recoveries.recover(session, job, d.reason, failure=d.failure, left_out=left_out, **record)
                elif first_hand and d.failure is not None:  # the messenger's blame withdrawn, its re-plan amended
                    self.withdraw_blame(session, job.faults[-1].reported_by, since=job.faults[-1].at)
                    self.recoveries.first_hand(job, d.reason, d.failure, left_out, **record)
            elif isinstance(d, NodeGone):
                node = session.get(NodeRow, d.node_id)
                if node is not None and node.state != GONE:
                    self.node_lost(session, node, d.reason, d.failure)
            elif isinstance(d, CorrectFlops):
                node = session.get(NodeRow, d.node_id)
                if node is not None:
                    node.measured_flops = d.flops  # the planner believes this from now on, not its profile
                    calibration.forget_slowdowns(node)  # measured against the old figure
            elif isinstance(d, Blame):
                self.blame(session, d.node_id, d.reason)
            elif isinstance(d, Revoke):
                node = session.get(NodeRow, d.node_id)
                if node is not None and node.credential_ended != "revoked":
                    node.credential_ended = "revoked"  # (the re-plan already leaves it out)
                    log.warning("node %s revoked: %s", node.id, d.reason)
            elif isinstance(d, AccusationRecord):
                node = session.get(NodeRow, d.node_id)
                if node is not None and d.accusers is not None:
                    node.accusers = [list(a) for a in d.accusers]
                if node is not None and d.accused is not None:
                    node.accused = [list(a) for a in d.accused]
            elif isinstance(d, BlameRecord):
                session.get_one(NodeRow, d.node_id).replans_caused = list(d.caused)
            elif isinstance(d, Quarantine):
                node = session.get_one(NodeRow, d.node_id)
                node.quarantined_until, node.quarantine_reason = d.until, d.reason
                log.warning("node %s quarantined: %s", node.id, d.reason)

    def withdraw_blame(self, session: Session, node_id: str | None, since: float) -> None:
        """The re-plans the node's word caused since `since` were not its doing after all, nor is a
        quarantine they tipped it into."""
        node = session.get(NodeRow, node_id) if node_id else None
        if node is not None and node.replans_caused:
            node.replans_caused = [at for at in node.replans_caused if at < since]
        if node is not None and served(since, node.quarantined_until, self.core.settings):
            node.quarantined_until = node.quarantine_reason = None
            log.warning("node %s is no longer quarantined: the re-plan that tipped it was not its doing", node.id)

    def blame(self, session: Session, node_id: str, reason: str) -> None:
        """What the node said or handed in caused a re-plan (a relay's id may be the coordinator's own)."""
        node = session.get(NodeRow, node_id)
        if node is not None:
            self.observe(session, Blamed(self.core.clock(), node.id, reason, tuple(node.replans_caused or ()),
                                         node.quarantined_until))

    def accuse(self, session: Session, job_id: str, accuser: NodeRow, accused_id: str, failure: Failure,
               reason: str) -> None:
        """`accuser` refused values `accused_id` sent (`failure`: as not finite, or as an outlier's): whom that
        counts against (failure_rules/accusations.py)."""
        accused = session.get(NodeRow, accused_id)
        if accused is None:
            return
        earlier = []
        for node_id, at in accuser.accused or ():
            node = session.get(NodeRow, node_id)
            others = {by for by, _ in (node.accusers or ()) if by != accuser.id} if node is not None else set()
            earlier.append((node_id, at, bool(others)))
        self.observe(session, Accusation(self.core.clock(), job_id, accuser.id, accused.id, reason,
                                         failure.kind == FailureKind.OUTLIER,
                                         tuple((by, at) for by, at in accused.accusers or ()), tuple(earlier)))

    def node_lost(self, session: Session, node: NodeRow, reason: str, failure: Failure) -> None:
        """The node is gone: a job that still needed it is re-planned without it."""
        job = session.get(JobRow, node.job_id) if node.job_id else None
        stage = stage_of_node(session, job.id, node.id) if job is not None else None
        if job is not None and job.state in jobs.ACTIVE and stage is not None and not stage.weights_uploaded:
            self.recoveries.recover(session, job, f"{reason} while holding cluster {stage.cluster} stage {stage.stage}",
                                    failure=failure)
        node.state, node.job_id = GONE, None
        log.info("node %s: %s", node.id, reason)

    @staticmethod
    def _cluster_step(session: Session, node: NodeRow) -> tuple[str | None, int | None]:
        """(the running job it holds a stage of, the furthest step the other stages of its cluster
        reported): a second source on whether it is alive (failure_rules/heartbeat.py)."""
        job = session.get(JobRow, node.job_id) if node.job_id else None
        if job is None or job.state != JobState.RUNNING.value:
            return None, None
        stage = stage_of_node(session, job.id, node.id)
        if stage is None:
            return None, None
        return job.id, session.scalar(select(func.max(StageRow.step)).where(
            StageRow.job_id == job.id, StageRow.cluster == stage.cluster, StageRow.node_id != node.id))

    def check_silence(self, session: Session, now: float) -> None:
        """Every node that missed a heartbeat, and every stage alone in its cluster that has not reported
        since the last interval while its job ran, as the rules see them."""
        base = self.core.settings.heartbeat_interval_s
        late = now - base
        told = func.coalesce(NodeRow.beat_interval_s, base)
        for node in session.scalars(select(NodeRow).where(NodeRow.state != GONE, NodeRow.last_seen < now - told)):
            job_id, cluster_step = self._cluster_step(session, node)
            self.observe(session, Silence(now, node.id, f"{node.id} ({node.name or node.address})", node.last_seen,
                                          node.beat_interval_s or base, job_id, cluster_step,
                                          self.core.beats.usual(node.id)))
        for row in session.scalars(select(StageRow).join(JobRow, JobRow.id == StageRow.job_id).where(
                JobRow.state == JobState.RUNNING.value, StageRow.updated_at < late, JobRow.updated_at < late)):
            job, holder = session.get_one(JobRow, row.job_id), session.get(NodeRow, row.node_id)
            if job.state == JobState.RUNNING.value and holder is not None \
                    and len(self.core.plan(job).clusters[row.cluster].stages) == 1:
                self.observe(session, Stall(now, job.id, holder.id, who(holder), row.cluster, row.stage, row.step,
                                            max(row.updated_at, job.updated_at)))
