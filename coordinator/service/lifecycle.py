"""Jobs as users and nodes see them: submit, view, cancel, resume; metrics and failure reports."""
from __future__ import annotations

import logging
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ravnest.failures import Failure, FailureKind
from ravnest.pipeline.memory import training_load
from ravnest.spec import FailureReport, JobSpec, MetricsReport
from ravnest.telemetry import is_stage_figure

from .. import calibration, jobs
from ..service_errors import Conflict, Forbidden, Implausible, InvalidRequest
from ..failure_rules.base import Blame, JobPace, Member, Replan, Report, StagePace
from ..failure_rules.reports import refused_from
from ..failure_reasons import failure_reason, who
from ..jobs import JobState
from ..schemas import CurvePoint, JobCreated, JobSummary, JobView
from ..security import new_id
from ..store import CurvePointRow, JobRow, NodeRow, StageRow, members_of, stages_of
from .artifacts import Artifacts
from .core import RESUME, Core, costs_of, planning_flops, quarantined
from .link_probes import LinkProbes
from .placement import Placement
from .recovery import Recoveries
from .rulings import Rulings

log = logging.getLogger(__name__)
BUSY = 0.2  # a stream to a neighbour busy this share of the time or more measures its link (_check_links)
CURVE_POINTS = 5000  # most points of a curve sent at once: the newest


class JobLifecycle:
    def __init__(self, core: Core, placement: Placement, recoveries: Recoveries, artifacts: Artifacts,
                 rulings: Rulings, links: LinkProbes) -> None:
        self.core, self.placement, self.recoveries, self.artifacts = core, placement, recoveries, artifacts
        self.rulings, self.links = rulings, links

    def submit(self, spec: JobSpec, owner: str | None = None) -> JobCreated:
        """`owner`: the id of the submitting key (a submitter sees and acts on its own jobs only)."""
        model = jobs.validate_spec(spec, self.core.settings.max_blocks)
        # profile now, outside the lock, so placing later never stalls heartbeats
        parameters = sum(cost.params for cost in costs_of(spec))
        if parameters > self.core.settings.max_parameters:
            raise InvalidRequest(f"model {spec.model.name!r} has {parameters:,} parameters; this coordinator takes "
                                 f"at most {self.core.settings.max_parameters:,.0f} (its max_parameters limit)")
        now = self.core.clock()
        with self.core.lock:
            with self.core.store.session() as session:
                refusal = self.placement.offers.vocabulary_refusal(session, spec, model.input.high)
                if refusal:
                    raise InvalidRequest(refusal)
                job = JobRow(id=new_id(), name=spec.name, owner=owner, spec=spec.model_dump(mode="json"),
                             state=JobState.PENDING.value, reason="waiting for nodes", created_at=now,
                             updated_at=now, history=[{"state": "pending", "at": now, "reason": "submitted"}],
                             plan=None, final_metrics=None)
                session.add(job)
            log.info("job %s (%s) submitted by key %s: model %s, %d steps", job.id, spec.name, owner,
                     spec.model.name, spec.training.steps)
            self.placement.place_pending()
            with self.core.store.session() as session:
                job = session.get_one(JobRow, job.id)
                return JobCreated(id=job.id, state=job.state, reason=job.reason)

    def list_jobs(self, owner: str | None = None, limit: int | None = None,
                  offset: int = 0) -> tuple[list[JobSummary], int]:
        """A page of every job (or `owner`'s only), oldest first, and how many there are."""
        mine = (lambda query: query) if owner is None else (lambda query: query.where(JobRow.owner == owner))
        with self.core.store.session() as session:
            total = session.scalar(mine(select(func.count()).select_from(JobRow))) or 0
            rows = session.scalars(mine(select(JobRow)).order_by(JobRow.created_at, JobRow.id)
                                   .limit(limit).offset(offset))
            return [_summary(job) for job in rows], total

    def get_job(self, job_id: str, owner: str | None = None) -> JobView:
        with self.core.store.session() as session:
            job = self.core.job(session, job_id, owner)
            stages = stages_of(session, job.id)
            return JobView(**_summary(job).model_dump(), spec=jobs.spec_of(job),
                           history=job.history, generation=job.generation, recoveries=job.faults or [],
                           checkpoint_step=self.artifacts.manifest(job.id).get("step"),
                           progress=jobs.progress(job, stages),
                           metrics=jobs.metrics(stages, self.core.plan(job) if job.plan else None),
                           final_metrics=job.final_metrics, plan=self.core.plan(job) if job.plan else None,
                           model_url=f"/v1/jobs/{job.id}/model" if job.state == JobState.COMPLETED.value else None)

    def cancel(self, job_id: str, owner: str | None = None) -> JobView:
        with self.core.lock, self.core.store.session() as session:
            job = self.core.job(session, job_id, owner)
            if job.state in jobs.TERMINAL:
                raise Conflict(f"job {job_id} is already {job.state}")
            # its nodes hear `cancel_job` on their next heartbeat, then go idle
            jobs.transition(job, JobState.CANCELLED, "cancelled by request", self.core.clock())
        return self.get_job(job_id)

    def resume(self, job_id: str, owner: str | None = None) -> JobView:
        """Continue a failed or cancelled job from the freshest state its stages left (its last
        checkpoint, or snapshots handed in since), on whatever nodes are there now."""
        with self.core.lock:
            with self.core.store.session() as session:
                job = self.core.job(session, job_id, owner)
                if job.state not in jobs.STOPPED:
                    raise Conflict(f"job {job_id} is {job.state}; only failed or cancelled jobs can be resumed")
                resume = self.artifacts.resume_point(session, job)
                if resume is None:
                    raise Conflict(f"job {job_id} has no checkpoint covering every block to resume from; "
                                   f"submit it again (checkpoints.every sets how often they are written)")
                self.recoveries.open(session, job, RESUME, f"resumed by request after it {job.state}")
                self.recoveries.start_generation(session, job, resume)
                jobs.transition(job, JobState.PENDING, f"resumed from step {resume['step']}; waiting for nodes",
                                self.core.clock())
            self.placement.place_pending()
        return self.get_job(job_id)

    def report_metrics(self, job_id: str, authorization: str | None, report: MetricsReport) -> None:
        jobs.check_finite(report.metrics)
        with self.core.lock, self.core.store.session() as session:
            job, stage = self.core.job_member(session, job_id, authorization, report.node_id)
            if (report.cluster, report.stage) != (stage.cluster, stage.stage):
                raise Forbidden(f"node {report.node_id} holds cluster {stage.cluster} stage {stage.stage}, "
                                f"not cluster {report.cluster} stage {report.stage}")
            if job.state in jobs.STOPPED:  # while recovering, intact clusters train on and report
                raise Conflict(f"job {job_id} is {job.state}")
            steps = jobs.spec_of(job).training.steps
            if report.step > steps:
                raise InvalidRequest(f"step {report.step} is beyond job {job_id}'s {steps} steps")
            figures = {name: value for name, value in report.metrics.items() if is_stage_figure(name)}
            self.recoveries.training_again(job, report.step)
            stage.step = max(stage.step, report.step)
            stage.metrics = {**stage.metrics, **figures}  # keeps e.g. test_accuracy between evaluations
            stage.updated_at = self.core.clock()
            if job.state == JobState.RUNNING.value and "compute_s" in figures:
                rows = stages_of(session, job.id)  # every stage's latest figures, this one's included
                self._calibrate(session, job, stage, report.step, figures, rows)
                self._check_links(session, job, stage, figures)
                self._check_speed(session, job, rows)
            if "loss" in figures or "test_accuracy" in figures:  # a last stage: a point of the curve
                session.add(CurvePointRow(job_id=job.id, cluster=stage.cluster, step=report.step, at=self.core.clock(),
                                          loss=figures.get("loss"), test_accuracy=figures.get("test_accuracy"),
                                          test_loss=figures.get("test_loss"),
                                          samples_per_s=figures.get("samples_per_s")))

    def _calibrate(self, session: Session, job: JobRow, stage: StageRow, step: int, figures: dict[str, float],
                   rows: list[StageRow]) -> None:
        """Corrects the stage's node's compute figure by the compute seconds the stage measured, and its
        message cost by the pace its pipeline keeps (calibration.py)."""
        node, spec = session.get(NodeRow, stage.node_id), jobs.spec_of(job)
        cluster = next((c for c in self.core.plan(job).clusters if c.cluster == stage.cluster), None)
        if step < self.core.settings.slow_after_steps or node is None or cluster is None:
            return
        # a micro-batch is 1/parts of a batch, with the K planned for the links' round trips
        load = training_load(spec.training, len(cluster.stages), in_flight=cluster.in_flight)
        forward_flops = sum(c.flops for c in costs_of(spec)[slice(*cluster.stages[stage.stage].blocks)]) / load.parts
        observed = calibration.observed_slowdown(figures["compute_s"], forward_flops, planning_flops(node))
        if observed is not None:
            calibration.measured(node, spec.model.name, "slowdown", observed)
        if "step_wall_s" not in figures or len(cluster.stages) < 2:
            return
        reported = {row.stage: row.metrics.get("compute_s") for row in rows if row.cluster == stage.cluster}
        stages = calibration.reported_stages(cluster.stages, reported)
        if stages is None:
            return
        pace = figures["step_wall_s"] / (spec.training.accumulation * load.parts)  # per micro-batch
        round_trips = [planned.round_trip_seconds or 0.0 for planned in cluster.stages[:-1]]
        observed = calibration.observed_message_s(pace, stages, load.in_flight, round_trips)
        if observed is not None:
            calibration.measured(node, spec.model.name, "message_s", observed)

    def _check_links(self, session: Session, job: JobRow, stage: StageRow, figures: dict[str, float]) -> None:
        """What this stage's streams to its neighbours carried, per second the stream was busy, is what
        the neighbours' links measure at least: their bandwidth claims are checked against it, with
        their peers' probes (LinkProbes.check_claims). A stream busy under BUSY of the time says little
        (it waited for compute, not for the link)."""
        cluster = next((c for c in self.core.plan(job).clusters if c.cluster == stage.cluster), None)
        wall = figures.get("step_wall_s", 0.0)
        if cluster is None or not wall > 0:
            return
        if session.get_one(NodeRow, stage.node_id).relayed_by is not None:
            return  # (its streams cross a relay: they measure the relay's path, not the neighbour)
        rates: dict[str, dict[str, float]] = {}
        for side, neighbour in (("next", stage.stage + 1), ("prev", stage.stage - 1)):
            sent, busy = figures.get(f"{side}_bytes_per_step", 0.0), figures.get(f"{side}_link_busy", 0.0)
            if 0 <= neighbour < len(cluster.stages) and sent > 0 and busy >= BUSY:
                rates[cluster.stages[neighbour].node_id] = {stage.node_id: sent / (wall * busy)}
        if rates:
            self.links.check_claims(session, rates.keys(), rates)

    def _check_speed(self, session: Session, job: JobRow, rows: list[StageRow]) -> None:
        """Every stage's pace to the failure rules (failure_rules/slow_stage.py)."""
        costs, nodes, now = costs_of(jobs.spec_of(job)), members_of(session, job.id), self.core.clock()
        planned = {(c.cluster, s.stage): s for c in self.core.plan(job).clusters for s in c.stages}
        stages = tuple(StagePace(now, job.id, row.node_id, who(nodes[row.node_id]), row.cluster, row.stage, row.step,
                                 row.metrics.get("compute_s"), plan.predicted_seconds,
                                 planning_flops(nodes[row.node_id]),
                                 3 * sum(c.flops for c in costs[slice(*plan.blocks)]))  # forward, backward twice
                       for row in rows if row.node_id in nodes and (plan := planned.get((row.cluster, row.stage))))
        self.rulings.observe(session, JobPace(now, job.id, stages))

    def curve(self, job_id: str, owner: str | None = None, after: int = 0,
              limit: int = CURVE_POINTS) -> list[CurvePoint]:
        """The job's curve points with ids above `after`, oldest first (at most `limit`, the newest)."""
        with self.core.store.session() as session:
            self.core.job(session, job_id, owner)
            rows = session.scalars(select(CurvePointRow).where(CurvePointRow.job_id == job_id,
                                                               CurvePointRow.id > after)
                                   .order_by(CurvePointRow.id.desc()).limit(limit))
            return [CurvePoint(id=row.id, cluster=row.cluster, step=row.step, at=row.at, loss=row.loss,
                               test_accuracy=row.test_accuracy, test_loss=row.test_loss,
                               samples_per_s=row.samples_per_s)
                    for row in reversed(list(rows))]

    def report_failure(self, job_id: str, authorization: str | None, report: FailureReport) -> None:
        """A node's failure report is a claim, judged by the failure rules (failure_rules/reports.py,
        relay.py): it re-plans the job without whom it names (or without the reporter), and counts
        against the reporter; it fails the job only when different nodes say the job cannot start."""
        now = self.core.clock()
        with self.core.lock, self.core.store.session() as session:
            job, stage = self.core.job_member(session, job_id, authorization, report.node_id)
            reporter = session.get_one(NodeRow, report.node_id)  # (job_member checked it)
            if quarantined(reporter, now):
                log.info("job %s: ignored a failure report of quarantined node %s", job.id, reporter.id)
                return
            members = members_of(session, job.id)
            # (no plan while the job waits to be placed again: then any member, as its stage rows say)
            peers = jobs.planned_peers(self.core.plan(job), stage.cluster, stage.stage) if job.plan else set(members)
            source = refused_from(report.failure, reporter.id, peers)
            first_hand = self.recoveries.outweighs_messenger(job, reporter.id, report.failure)
            if job.state not in jobs.ACTIVE and not first_hand:  # the job already ended or is being re-planned
                if source is not None and report.failure is not None and job.state == JobState.RECOVERING.value:
                    self._refused(session, job, source, reporter, report.failure,
                                  failure_reason(report.failure, report.reason, reporter, stage, members))
                self.recoveries.reported(session, job, reporter, stage.cluster, report.still_training)
                return
            relays = {relay.id: relay for node in members.values()
                      if node.relayed_by and (relay := session.get(NodeRow, node.relayed_by)) is not None}
            reason = failure_reason(report.failure, report.reason, reporter, stage, members, relays)
            # a node that words its failure only (older nodes) reports a failure of its own
            failure = report.failure or Failure(kind=FailureKind.LOCAL_ERROR, message=report.reason[:1000] or "failed")
            seen = Report(now, job.id, reporter.id, reason, failure, report.recoverable, report.still_training,
                          {node.id: Member(node.id, node.last_seen, node.relayed_by, node.beat_interval_s)
                           for node in members.values()},
                          {r.reported_by for r in job.faults if r.could_not_start and r.reported_by}, peers)
            self.rulings.observe(session, seen, first_hand=first_hand, reported_by=reporter.id,
                                 could_not_start=not report.recoverable)
            if source is not None:
                self._refused(session, job, source, reporter, failure, reason)
            self.recoveries.reported(session, job, reporter, stage.cluster, report.still_training)

    def _refused(self, session: Session, job: JobRow, source: str, refuser: NodeRow, failure: Failure,
                 reason: str) -> None:
        """A refusal, heard while the job runs or is re-planned (the sender's report may have come first):
        the sender is left out of the re-plan, and accused (failure_rules/accusations.py)."""
        log.warning("job %s: %s", job.id, reason)
        self.recoveries.refused(job, source, refuser.id, reason)
        self.rulings.accuse(session, job.id, refuser, source, failure, reason)

    def hand_in_weights(self, job_id: str, authorization: str | None, cluster: int, stage: int,
                        upload: Path) -> None:
        """A stage's final weights (Artifacts.accept_weights); weights it cannot believe are refused,
        and a job still under way re-plans without their node."""
        try:
            self.artifacts.accept_weights(job_id, authorization, cluster, stage, upload)
        except Implausible as refused:
            with self.core.lock, self.core.store.session() as session:
                job, node = self.core.job(session, job_id), session.get_one(NodeRow, refused.node_id)
                reason = f"node {who(node)} handed in cluster {cluster} stage {stage}'s {refused.detail}"
                log.warning("job %s: %s", job_id, reason)
                failure = Failure(kind=FailureKind.IMPLAUSIBLE, message=f"handed in {refused.detail}", peer_id=node.id,
                                  detail=f"weight_growth_bound {self.core.settings.weight_growth_bound:g}")
                if refused.blame:
                    decided = [Replan(job.id, f"{reason}; re-planning without it", failure, (node.id,)),
                               Blame(node.id, reason)]
                else:  # the messenger: weights grow through averaging and a neighbour's gradients too
                    decided = [Replan(job.id, f"{reason}; nobody is left out for it (weights grow through averaging "
                                              "and a neighbour's gradients too, or training diverged: a lower "
                                              "learning rate or training.grad_clip may help), re-planning from the "
                                              "last plausible checkpoint", failure)]
                self.rulings.enforce(session, decided, reported_by=node.id)
            raise


def _summary(job: JobRow) -> JobSummary:
    return JobSummary(id=job.id, name=job.name, state=job.state, reason=job.reason, model=job.spec["model"]["name"],
                      created_at=job.created_at, updated_at=job.updated_at)
