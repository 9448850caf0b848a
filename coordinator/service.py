"""The coordinator's operations, independent of HTTP: nodes join and beat, jobs are submitted,
placed, reported on and finished. One lock serialises every change (one coordinator process per
store); each operation is one SQL transaction, so a refused request writes nothing.
"""
from __future__ import annotations

import functools
import itertools
import json
import os
import threading
from pathlib import Path

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from ravnest.models import build_model, profile_blocks, state_shapes
from ravnest.models.profile import BlockCost
from ravnest.spec import (FailureReport, HeartbeatRequest, HeartbeatResponse, JobSpec, JoinRequest, JoinResponse,
                          LinkReport, MetricsReport, NodeProfile, PeerProbe)

from . import artifacts, jobs
from .clustering import NodeInfo
from .config import Settings
from .errors import Conflict, Forbidden, InvalidRequest, NotFound, Unauthorized
from .jobs import JobState
from .planning import PlanningError, plan_job
from .recovery import StoredState, resume_point
from .schemas import Health, JobCreated, JobSummary, JobView, NodeView, Plan, Recovery
from .security import bearer_token, check_join_token, hash_token, new_id, new_token, token_matches
from .store import CheckpointRow, JobRow, LinkRow, NodeRow, StageRow, Store, stage_of_node, stages_of

IDLE, BUSY, GONE = "idle", "busy", "gone"
HEADER_ALLOWANCE = 1 << 20  # safetensors JSON header on top of the tensors' bytes
OPTIMIZER_STATE_FACTOR = 3  # a checkpoint holds parameters plus at most this many copies (Adam: 2)
PERIODIC, SNAPSHOT = "periodic", "snapshot"
LOST, GROW, RESUME = "lost", "grow", "resume"  # why a job was re-planned
MAX_LINKS_PER_NODE = 16  # a node stops being asked for probes once it measured this many links


@functools.lru_cache(maxsize=32)
def _block_costs(name: str, config_json: str, batch_size: int) -> tuple[BlockCost, ...]:
    """Profiled on the meta device: no weights are allocated, whatever the model's size."""
    return tuple(profile_blocks(build_model(name, json.loads(config_json)), batch_size))


def _costs(spec: JobSpec) -> list[BlockCost]:
    return list(_block_costs(spec.model.name, json.dumps(spec.model.config, sort_keys=True), spec.training.batch_size))


@functools.lru_cache(maxsize=32)
def _state_shapes(name: str, config_json: str) -> dict[str, tuple[tuple[int, ...], int]]:
    """Every key of the full model's state dict -> (shape, bytes), from the meta device."""
    return state_shapes(build_model(name, json.loads(config_json)))


class Coordinator:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        self.store = Store(settings.database_url)
        self.clock = settings.clock
        self.started_at = self.clock()
        self._lock = threading.RLock()
        self._plans: dict[str, Plan] = {}
        self.probe_token = _probe_token(settings.data_dir)
        self._probes_asked: dict[tuple[str, str], float] = {}  # (node, peer) -> when it was asked
        self._left_out: dict[str, str] = {}  # node id -> why the last placement gave it no stage
        self._grow_considered: dict[str, tuple[int, frozenset[str]]] = {}  # job -> (generation, idle nodes) planned with

    # --- nodes ---------------------------------------------------------------------------------------

    def join(self, authorization: str | None, request: JoinRequest) -> JoinResponse:
        check_join_token(authorization, self.settings.join_token)
        token, now = new_token(), self.clock()
        with self._lock:
            with self.store.session() as session:
                node = NodeRow(id=new_id(), name=request.name, address=request.address,
                               profile=request.profile.model_dump(mode="json"), token_hash=hash_token(token),
                               state=IDLE, joined_at=now, last_seen=now, job_id=None)
                session.add(node)
            self.place_pending()
        return JoinResponse(node_id=node.id, node_token=token, heartbeat_interval_s=self.settings.heartbeat_interval_s,
                            probe_token=self.probe_token)

    def heartbeat(self, node_id: str, authorization: str | None, request: HeartbeatRequest) -> HeartbeatResponse:
        with self._lock:
            with self.store.session() as session:
                node = self._node(session, node_id, authorization)
                node.last_seen = self.clock()
                self._record_links(session, node, request.links)
                freed = node.state == GONE
                if freed:  # missed heartbeats, but it is back
                    node.state = BUSY if node.job_id else IDLE
                response = HeartbeatResponse()
                if node.job_id:
                    response, released = self._job_heartbeat(session, node, request)
                    freed = freed or released
                if request.job_id and request.job_id != node.job_id and response.cancel_job is None:
                    response.cancel_job = request.job_id  # it runs something it no longer holds
                if node.state == IDLE and not request.job_id:  # probes never take bandwidth from training
                    response.probe = self._probes_for(session, node)
                    response.note = self._left_out.get(node.id, "")
            if freed:
                self.place_pending()
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
            response.assignment = jobs.assignment(job, self._plan(job), stage.cluster, stage.stage)
            if job.state == JobState.PLACING.value and not _undelivered(session, job.id):
                jobs.transition(job, JobState.RUNNING, f"every node has its assignment; {self._plan(job).reason}",
                                self.clock())
            done = False
        else:
            if job.state in jobs.STOPPED:
                response.cancel_job = job.id
            elif job.state == JobState.RECOVERING.value:
                response.recover_job = job.id  # stop, hand in the stage's state, then be placed anew
            done = True
        if done and request.job_id != node.job_id:
            node.job_id, node.state = None, IDLE
            return response, True
        return response, False

    def _record_links(self, session: Session, node: NodeRow, reports: list[LinkReport]) -> None:
        """Keep the latest measurement per peer; reports on unknown peers or itself are dropped
        (a peer may have left and been forgotten meanwhile)."""
        now = self.clock()
        for report in reports:
            self._probes_asked.pop((node.id, report.peer_id), None)
            if report.peer_id == node.id or session.get(NodeRow, report.peer_id) is None:
                continue
            session.merge(LinkRow(node_id=node.id, peer_id=report.peer_id, bandwidth=report.bandwidth_bytes_per_s,
                                  latency=report.latency_s, measured_at=now))

    def _probes_for(self, session: Session, node: NodeRow) -> list[PeerProbe]:
        """Up to `probe_peers` live peers whose link this node has not measured nor been asked for
        lately, oldest members first; none once it measured MAX_LINKS_PER_NODE links."""
        want, now = self.settings.probe_peers, self.clock()
        if len(self._probes_asked) > 10_000:  # forget requests that were never answered
            self._probes_asked = {k: at for k, at in self._probes_asked.items() if now - at < self.settings.probe_retry_s}
        measured = select(LinkRow.peer_id).where(LinkRow.node_id == node.id)
        if want <= 0 or (session.scalar(select(func.count()).select_from(measured.subquery())) or 0) >= MAX_LINKS_PER_NODE:
            return []
        asked = {peer for (asker, peer), at in self._probes_asked.items()
                 if asker == node.id and now - at < self.settings.probe_retry_s}
        candidates = session.scalars(select(NodeRow).where(
            NodeRow.id != node.id, NodeRow.state != GONE, NodeRow.token_hash.is_not(None),
            NodeRow.last_seen >= now - self.settings.heartbeat_timeout_s, NodeRow.id.not_in(measured))
            .order_by(NodeRow.joined_at, NodeRow.id).limit(want + len(asked)))
        chosen = [peer for peer in candidates if peer.id not in asked][:want]
        for peer in chosen:
            self._probes_asked[(node.id, peer.id)] = now
        return [PeerProbe(node_id=peer.id, address=peer.address) for peer in chosen]

    def leave(self, node_id: str, authorization: str | None) -> None:
        with self._lock, self.store.session() as session:
            node = self._node(session, node_id, authorization)
            self._node_lost(session, node, f"node {node.id} ({node.name or node.address}) left")
            node.token_hash = None

    def health(self) -> Health:
        cutoff = self.clock() - self.settings.heartbeat_timeout_s
        with self.store.session() as session:
            alive = session.scalar(select(func.count()).select_from(NodeRow).where(
                NodeRow.state != GONE, NodeRow.last_seen >= cutoff)) or 0
            active = session.scalar(select(func.count()).select_from(JobRow).where(
                JobRow.state.not_in(jobs.TERMINAL))) or 0
        return Health(nodes_alive=alive, jobs_active=active)

    def list_nodes(self) -> list[NodeView]:
        cutoff = self.clock() - self.settings.heartbeat_timeout_s
        with self.store.session() as session:
            rows = session.execute(select(NodeRow, StageRow).outerjoin(
                StageRow, (StageRow.job_id == NodeRow.job_id) & (StageRow.node_id == NodeRow.id))
                .order_by(NodeRow.joined_at, NodeRow.id)).all()
            links: dict[str, list[LinkReport]] = {}
            for row in session.scalars(select(LinkRow).order_by(LinkRow.peer_id)):
                links.setdefault(row.node_id, []).append(LinkReport(
                    peer_id=row.peer_id, bandwidth_bytes_per_s=row.bandwidth, latency_s=row.latency))
            return [NodeView(id=node.id, name=node.name, address=node.address,
                             profile=NodeProfile.model_validate(node.profile),
                             state=GONE if node.last_seen < cutoff else node.state,
                             joined_at=node.joined_at, last_seen=node.last_seen, job_id=node.job_id,
                             cluster=stage.cluster if stage else None, stage=stage.stage if stage else None,
                             links=links.get(node.id, []),
                             note=self._left_out.get(node.id, "") if node.state == IDLE else "")
                    for node, stage in rows]

    def _node(self, session: Session, node_id: str, authorization: str | None) -> NodeRow:
        token = bearer_token(authorization)
        node = session.get(NodeRow, node_id)
        if node is None:
            raise NotFound(f"no node {node_id}")
        if node.token_hash is None:
            raise Unauthorized(f"node {node_id} has left; join again")
        if not token_matches(token, node.token_hash):
            raise Unauthorized(f"wrong token for node {node_id}")
        return node

    def _node_by_token(self, session: Session, authorization: str | None) -> NodeRow:
        token_hash = hash_token(bearer_token(authorization))
        node = session.scalars(select(NodeRow).where(NodeRow.token_hash == token_hash)).first()
        if node is None:
            raise Unauthorized("unknown node token")
        return node

    def _node_lost(self, session: Session, node: NodeRow, reason: str) -> None:
        """The node is gone: a job that still needed it is re-planned without it."""
        job = session.get(JobRow, node.job_id) if node.job_id else None
        stage = stage_of_node(session, job.id, node.id) if job is not None else None
        if job is not None and job.state in jobs.ACTIVE and stage is not None and not stage.weights_uploaded:
            self._recover(session, job, f"{reason} while holding cluster {stage.cluster} stage {stage.stage}")
        node.state, node.job_id = GONE, None

    # --- jobs ----------------------------------------------------------------------------------------

    def submit(self, spec: JobSpec) -> JobCreated:
        jobs.validate_spec(spec)
        _costs(spec)  # profile now, outside the lock, so placing later never stalls heartbeats
        now = self.clock()
        with self._lock:
            with self.store.session() as session:
                job = JobRow(id=new_id(), name=spec.name, spec=spec.model_dump(mode="json"),
                             state=JobState.PENDING.value, reason="waiting for nodes", created_at=now,
                             updated_at=now, history=[{"state": "pending", "at": now, "reason": "submitted"}],
                             job_token=new_token(), plan=None, final_metrics=None)
                session.add(job)
            self.place_pending()
            with self.store.session() as session:
                job = session.get(JobRow, job.id)
                return JobCreated(id=job.id, state=job.state, reason=job.reason)

    def list_jobs(self) -> list[JobSummary]:
        with self.store.session() as session:
            return [_summary(job) for job in session.scalars(select(JobRow).order_by(JobRow.created_at))]

    def get_job(self, job_id: str) -> JobView:
        with self.store.session() as session:
            job = self._job(session, job_id)
            stages = stages_of(session, job.id)
            return JobView(**_summary(job).model_dump(), spec=JobSpec.model_validate(job.spec),
                           history=job.history, generation=job.generation,
                           recoveries=[Recovery.model_validate(fault) for fault in job.faults or []],
                           checkpoint_step=self._manifest(job.id).get("step"),
                           progress=jobs.progress(job, stages),
                           metrics=jobs.metrics(stages, self._plan(job) if job.plan else None),
                           final_metrics=job.final_metrics, plan=self._plan(job) if job.plan else None,
                           model_url=f"/v1/jobs/{job.id}/model" if job.state == JobState.COMPLETED.value else None)

    def cancel(self, job_id: str) -> JobView:
        with self._lock, self.store.session() as session:
            job = self._job(session, job_id)
            if job.state in jobs.TERMINAL:
                raise Conflict(f"job {job_id} is already {job.state}")
            # its nodes hear `cancel_job` on their next heartbeat, then go idle
            jobs.transition(job, JobState.CANCELLED, "cancelled by request", self.clock())
        return self.get_job(job_id)

    def resume(self, job_id: str) -> JobView:
        """Continue a failed or cancelled job from the freshest state its stages left (its last
        checkpoint, or snapshots handed in since), on whatever nodes are there now."""
        with self._lock:
            with self.store.session() as session:
                job = self._job(session, job_id)
                if job.state not in jobs.STOPPED:
                    raise Conflict(f"job {job_id} is {job.state}; only failed or cancelled jobs can be resumed")
                resume = self._resume_point(session, job)
                if resume is None:
                    raise Conflict(f"job {job_id} has no checkpoint covering every block to resume from; "
                                   f"submit it again (checkpoints.every sets how often they are written)")
                self._open_recovery(session, job, RESUME, f"resumed by request after it {job.state}")
                self._start_generation(session, job, resume)
                jobs.transition(job, JobState.PENDING, f"resumed from step {resume['step']}; waiting for nodes",
                                self.clock())
            self.place_pending()
        return self.get_job(job_id)

    def report_metrics(self, job_id: str, authorization: str | None, report: MetricsReport) -> None:
        jobs.check_finite(report.metrics)
        with self._lock, self.store.session() as session:
            job, stage = self._job_member(session, job_id, authorization, report.node_id)
            if (report.cluster, report.stage) != (stage.cluster, stage.stage):
                raise Forbidden(f"node {report.node_id} holds cluster {stage.cluster} stage {stage.stage}, "
                                f"not cluster {report.cluster} stage {report.stage}")
            if job.state in jobs.STOPPED | {JobState.RECOVERING.value}:
                raise Conflict(f"job {job_id} is {job.state}")
            if job.faults and "recovery_s" not in job.faults[-1] and report.step > (job.resume or {}).get("step", 0):
                fault = job.faults[-1]  # the first step after a re-plan: training again
                job.faults = [*job.faults[:-1], {**fault, "recovery_s": self.clock() - fault["at"]}]
            stage.step = max(stage.step, report.step)
            stage.metrics = {**stage.metrics, **report.metrics}  # keeps e.g. test_accuracy between evaluations
            stage.updated_at = self.clock()

    def report_failure(self, job_id: str, authorization: str | None, report: FailureReport) -> None:
        with self._lock, self.store.session() as session:
            job, stage = self._job_member(session, job_id, authorization, report.node_id)
            if job.state not in jobs.ACTIVE:
                return  # the job already ended or is being re-planned; a late report changes nothing
            reason = f"node {report.node_id} (cluster {stage.cluster} stage {stage.stage}) failed: {report.reason}"
            if report.recoverable:
                self._recover(session, job, reason)
            else:
                jobs.transition(job, JobState.FAILED, reason, self.clock())

    def _job(self, session: Session, job_id: str) -> JobRow:
        job = session.get(JobRow, job_id)
        if job is None:
            raise NotFound(f"no job {job_id}")
        return job

    def _job_member(self, session: Session, job_id: str, authorization: str | None,
                    claimed_node_id: str | None = None) -> tuple[JobRow, StageRow]:
        node = self._node_by_token(session, authorization)
        job = self._job(session, job_id)
        if claimed_node_id is not None and claimed_node_id != node.id:
            raise Forbidden(f"the token belongs to node {node.id}, not {claimed_node_id}")
        stage = stage_of_node(session, job.id, node.id)
        if stage is None:
            raise Forbidden(f"node {node.id} is not part of job {job_id}")
        return job, stage

    def _plan(self, job: JobRow) -> Plan:
        if job.id not in self._plans:  # parsed once per process; the store keeps it across restarts
            self._plans[job.id] = Plan.model_validate(job.plan)
        return self._plans[job.id]

    # --- weights, checkpoints and the trained model ----------------------------------------------------

    def job_dir(self, job_id: str) -> Path:
        return self.settings.data_dir / "jobs" / job_id

    def upload_limit(self, job_id: str, authorization: str | None, cluster: int, stage: int, *,
                     checkpoint: bool = False) -> int:
        """Checks an upload may start (before its body is read); returns its size limit in bytes."""
        with self.store.session() as session:
            job, row = self._job_member(session, job_id, authorization)
            self._check_upload_target(job, row, cluster, stage, checkpoint=checkpoint)
            expected = sum(size for _, size in self._stage_shapes(job, row).values())
        copies = 1 + OPTIMIZER_STATE_FACTOR if checkpoint else 1
        return min(self.settings.max_upload_bytes, copies * expected + HEADER_ALLOWANCE)

    def _check_upload_target(self, job: JobRow, row: StageRow, cluster: int, stage: int, *,
                             checkpoint: bool = False, generation: int | None = None) -> None:
        if (row.cluster, row.stage) != (cluster, stage):
            raise Forbidden(f"node {row.node_id} holds cluster {row.cluster} stage {row.stage}, "
                            f"not cluster {cluster} stage {stage}")
        if generation is not None and generation != job.generation:
            raise Conflict(f"job {job.id} was re-planned (generation {job.generation}); state of generation "
                           f"{generation} is no longer taken")
        accepted = jobs.ACTIVE | ({JobState.RECOVERING.value} if checkpoint else {JobState.COMPLETED.value})
        if job.state not in accepted:
            raise Conflict(f"job {job.id} is {job.state}; {'state' if checkpoint else 'weights'} not accepted")

    def _stage_shapes(self, job: JobRow, row: StageRow) -> artifacts.Shapes:
        start, end = self._plan(job).clusters[row.cluster].stages[row.stage].blocks
        model = job.spec["model"]
        shapes = _state_shapes(model["name"], json.dumps(model["config"], sort_keys=True))
        return {key: value for key, value in shapes.items() if start <= artifacts.block_of(key) < end}

    def accept_weights(self, job_id: str, authorization: str | None, cluster: int, stage: int, upload: Path) -> None:
        """Validate an uploaded stage state dict (safetensors, no pickle), keep it, and finish the job
        once every stage of cluster 0 is in."""
        tensors = artifacts.load_upload(upload)
        with self._lock, self.store.session() as session:
            job, row = self._job_member(session, job_id, authorization)
            self._check_upload_target(job, row, cluster, stage)
            artifacts.check_stage_tensors(tensors, self._stage_shapes(job, row), optimizer_state=False)
            folder = self.job_dir(job.id) / "weights"
            artifacts.commit(upload, folder / f"c{cluster}-s{stage}.safetensors")
            row.weights_uploaded, row.updated_at = True, self.clock()
            cluster0 = [s for s in stages_of(session, job.id) if s.cluster == 0]
            if job.state != JobState.COMPLETED.value and all(s.weights_uploaded for s in cluster0):
                artifacts.merge([folder / f"c0-s{s}.safetensors" for s in range(len(cluster0))],
                                self.job_dir(job.id) / "model.safetensors",
                                {"job_id": job.id, "model": json.dumps(job.spec["model"])})
                job.final_metrics = dict(cluster0[-1].metrics)
                if job.state == JobState.PLACING.value:  # every node is done, so every node was told
                    jobs.transition(job, JobState.RUNNING, f"every node has its assignment; {self._plan(job).reason}",
                                self.clock())
                jobs.transition(job, JobState.COMPLETED, "every stage of cluster 0 uploaded its weights",
                                self.clock())

    def accept_checkpoint(self, job_id: str, authorization: str | None, cluster: int, stage: int, generation: int,
                          step: int, kind: str, upload: Path) -> None:
        """Keep a stage's state (parameters, optimizer state) at `step`: a periodic checkpoint, or the
        snapshot a stage hands in when its job is re-planned. A complete set of periodic checkpoints at
        one step gets a manifest, and older periodic ones are deleted."""
        tensors = artifacts.load_upload(upload)
        with self._lock, self.store.session() as session:
            job, row = self._job_member(session, job_id, authorization)
            self._check_upload_target(job, row, cluster, stage, checkpoint=True, generation=generation)
            artifacts.check_stage_tensors(tensors, self._stage_shapes(job, row), optimizer_state=True)
            start, end = self._plan(job).clusters[cluster].stages[stage].blocks
            name = f"checkpoints/g{generation}-c{cluster}-s{stage}-{kind}-{step}.safetensors"
            artifacts.commit(upload, self.job_dir(job.id) / name)
            session.merge(CheckpointRow(job_id=job.id, file=name, kind=kind, generation=generation,
                                        block_start=start, block_end=end, step=step, created_at=self.clock()))
            session.flush()
            if kind == PERIODIC:
                self._collect_checkpoint(session, job, generation, step)

    def _collect_checkpoint(self, session: Session, job: JobRow, generation: int, step: int) -> None:
        """Once the periodic checkpoints at (generation, step) cover every block, write the manifest
        (atomically: a reader sees the previous one or this one) and drop older periodic files."""
        rows = list(session.scalars(select(CheckpointRow).where(
            CheckpointRow.job_id == job.id, CheckpointRow.kind == PERIODIC,
            CheckpointRow.generation == generation, CheckpointRow.step == step).order_by(CheckpointRow.block_start)))
        num_blocks = len(_costs(JobSpec.model_validate(job.spec)))
        covered = 0
        for row in rows:
            if row.block_start == covered:
                covered = row.block_end
        if covered != num_blocks:
            return
        artifacts.write_json(self.job_dir(job.id) / "checkpoints" / "manifest.json", {
            "job_id": job.id, "generation": generation, "step": step, "model": job.spec["model"],
            "files": [{"file": row.file, "blocks": [row.block_start, row.block_end]} for row in rows]})
        keep = {row.file for row in rows}
        for old in session.scalars(select(CheckpointRow).where(
                CheckpointRow.job_id == job.id, CheckpointRow.kind == PERIODIC,
                (CheckpointRow.generation < generation)
                | ((CheckpointRow.generation == generation) & (CheckpointRow.step < step)))):
            if old.file not in keep:
                (self.job_dir(job.id) / old.file).unlink(missing_ok=True)
                session.delete(old)

    def _manifest(self, job_id: str) -> dict:
        try:
            return json.loads((self.job_dir(job_id) / "checkpoints" / "manifest.json").read_text())
        except (OSError, ValueError):
            return {}

    def stage_state(self, job_id: str, authorization: str | None, cluster: int, stage: int, target: Path) -> None:
        """Write the state a re-planned stage continues from (its blocks, from the resume sources)."""
        with self.store.session() as session:
            job, row = self._job_member(session, job_id, authorization)
            if (row.cluster, row.stage) != (cluster, stage):
                raise Forbidden(f"node {row.node_id} holds cluster {row.cluster} stage {row.stage}")
            if not job.resume:
                raise NotFound(f"job {job_id} starts from fresh weights; there is no state to fetch")
            blocks = self._plan(job).clusters[cluster].stages[stage].blocks
            sources = job.resume["sources"]
        artifacts.assemble(self.job_dir(job_id), sources, blocks, target)

    def model_file(self, job_id: str) -> Path:
        with self.store.session() as session:
            job = self._job(session, job_id)
            if job.state != JobState.COMPLETED.value:
                raise Conflict(f"job {job_id} is {job.state}; the model is available once it is completed")
        return self.job_dir(job_id) / "model.safetensors"

    # --- recovery ------------------------------------------------------------------------------------

    def _recover(self, session: Session, job: JobRow, reason: str, kind: str = LOST) -> None:
        """Re-plan `job`: its nodes are told to stop and hand in their state; once they did (or left),
        `_replan_recovered` plans it again from the freshest state of every block. Losses since the
        last resume are bounded by placement.max_recoveries; growing onto new nodes is not a loss."""
        spec = JobSpec.model_validate(job.spec)
        since_resume = list(itertools.takewhile(lambda r: r.get("kind") != RESUME, reversed(job.faults or [])))
        if kind == LOST and sum(r.get("kind", LOST) == LOST for r in since_resume) >= spec.placement.max_recoveries:
            jobs.transition(job, JobState.FAILED, f"{reason}; no recovery left (placement.max_recoveries = "
                                                  f"{spec.placement.max_recoveries})", self.clock())
            return
        self._open_recovery(session, job, kind, reason)
        jobs.transition(job, JobState.RECOVERING, f"{reason}; its nodes hand in their state, then it is "
                                                  f"planned again", self.clock())

    def _open_recovery(self, session: Session, job: JobRow, kind: str, reason: str) -> None:
        reached = max((row.step for row in stages_of(session, job.id)), default=0)
        job.faults = [*(job.faults or []), {"kind": kind, "at": self.clock(), "reason": reason,
                                            "generation": job.generation, "reached_step": reached}]

    def _replan_recovered(self, session: Session) -> None:
        """Recovering jobs whose nodes all stopped (or went away, or overran the wait) go back to
        pending, one generation later, with where every block's state comes from."""
        now = self.clock()
        for job in session.scalars(select(JobRow).where(JobRow.state == JobState.RECOVERING.value)):
            members = list(session.scalars(select(NodeRow).where(NodeRow.job_id == job.id, NodeRow.state != GONE)))
            if members and now - job.updated_at < self.settings.recovery_wait_s:
                continue
            for node in members:  # overran the wait: whatever it still runs is ignored from now on
                node.job_id, node.state = None, IDLE
            resume = self._resume_point(session, job)
            self._start_generation(session, job, resume)
            resume_note = ("no stored state covers every block: starting over from fresh weights" if resume is None
                           else f"continuing from step {job.resume['step']}")
            jobs.transition(job, JobState.PENDING, f"re-planning after: {job.faults[-1]['reason']}; {resume_note}",
                            now)

    def _resume_point(self, session: Session, job: JobRow) -> dict | None:
        stored = [StoredState(row.file, row.generation, (row.block_start, row.block_end), row.step)
                  for row in session.scalars(select(CheckpointRow).where(CheckpointRow.job_id == job.id))]
        return resume_point(stored, len(_costs(JobSpec.model_validate(job.spec))))

    def _start_generation(self, session: Session, job: JobRow, resume: dict | None) -> None:
        """Forget the last placement; the next one is a new generation with a new gRPC credential, so
        nothing a stage of the previous one still sends is accepted. Records where it continues from."""
        if resume is not None:
            steps = JobSpec.model_validate(job.spec).training.steps
            resume = {**resume, "step": min(resume["step"], steps - 1)}  # the last step is trained again
            fault = job.faults[-1]
            job.faults = [*job.faults[:-1], {
                **fault, "resume_step": resume["step"], "steps_redone": max(0, fault["reached_step"] - resume["step"]),
                "sources": [f"{_blocks(s['blocks'])}: {s['file']} (step {s['step']})" for s in resume["sources"]]}]
        session.execute(delete(StageRow).where(StageRow.job_id == job.id))
        self._plans.pop(job.id, None)
        job.plan, job.resume, job.job_token = None, resume, new_token()
        job.generation += 1

    # --- liveness and placement ----------------------------------------------------------------------

    def tick(self) -> None:
        """Mark nodes without recent heartbeats gone (failing their jobs), then place pending jobs."""
        now = self.clock()
        with self._lock:
            if now >= self.started_at + self.settings.heartbeat_timeout_s:  # after a restart, give nodes time
                with self.store.session() as session:
                    cutoff = now - self.settings.heartbeat_timeout_s
                    for node in session.scalars(select(NodeRow).where(NodeRow.state != GONE,
                                                                      NodeRow.last_seen < cutoff)):
                        self._node_lost(session, node, f"node {node.id} ({node.name or node.address}) stopped "
                                                       f"sending heartbeats (last seen {now - node.last_seen:.0f} s ago)")
            with self.store.session() as session:
                self._replan_recovered(session)
            self.place_pending()

    def place_pending(self) -> None:
        """Place waiting jobs, oldest first, on idle live nodes (a new job that cannot be placed fails);
        nodes still idle then may make a running job re-plan onto them."""
        now = self.clock()
        with self._lock, self.store.session() as session:
            pending = list(session.scalars(select(JobRow).where(JobRow.state == JobState.PENDING.value)
                                           .order_by(JobRow.created_at)))
            idle = list(session.scalars(select(NodeRow).where(
                NodeRow.state == IDLE, NodeRow.token_hash.is_not(None),
                NodeRow.last_seen >= now - self.settings.heartbeat_timeout_s).order_by(NodeRow.joined_at)))
            if not idle and not pending:
                return
            for job in pending:
                spec = JobSpec.model_validate(job.spec)
                waited = now - job.history[-1]["at"]
                if spec.placement.timeout_s is not None and waited > spec.placement.timeout_s:
                    jobs.transition(job, JobState.FAILED, f"not placed within placement.timeout_s = "
                                                          f"{spec.placement.timeout_s:g} s: {job.reason}", now)
                    continue
                # a job already under way continues on whatever nodes there are; a new one waits for min_nodes
                needed = 1 if job.generation else spec.placement.min_nodes
                if len(idle) < needed:
                    reason = f"waiting for {needed} idle nodes ({len(idle)} available)"
                    if job.reason != reason:
                        job.reason = reason
                    continue
                try:
                    plan = self._plan_on(session, spec, idle)
                except PlanningError as e:
                    if job.generation:  # more nodes may come back; placement.timeout_s bounds the wait
                        job.reason = f"waiting for nodes that can hold the model: {e}"
                    else:
                        jobs.transition(job, JobState.FAILED, f"cannot place the job: {e}", now)
                    continue
                jobs.transition(job, JobState.PLACING, f"placing on {len(idle)} idle nodes", now)
                used = self._reserve(session, job, plan, idle)
                idle = [node for node in idle if node.id not in used]
            if idle:
                self._grow_running(session, idle)

    def _grow_running(self, session: Session, idle: list[NodeRow]) -> None:
        """Nodes that joined mid-job: the oldest running job whose planner predicts at least `grow_gain`
        more throughput with them (after running `grow_after_s`, with a quarter of its steps left) is
        re-planned onto its nodes plus these, continuing from the state its stages hand in."""
        now = self.clock()
        for job in session.scalars(select(JobRow).where(JobRow.state == JobState.RUNNING.value)
                                   .order_by(JobRow.created_at)):
            if now - job.updated_at < self.settings.grow_after_s or jobs.progress(
                    job, stages_of(session, job.id)).fraction > 0.75:
                continue
            offered = (job.generation, frozenset(node.id for node in idle))
            if self._grow_considered.get(job.id) == offered:
                continue  # planned with these very nodes already (each tick would plan again)
            self._grow_considered[job.id] = offered
            spec, current = JobSpec.model_validate(job.spec), self._plan(job)
            members = list(session.scalars(select(NodeRow).where(NodeRow.job_id == job.id)))
            try:
                plan = self._plan_on(session, spec, members + idle)
            except PlanningError:
                continue
            if plan.predicted_samples_per_s >= (1 + self.settings.grow_gain) * current.predicted_samples_per_s:
                self._recover(session, job, f"{len(idle)} idle node(s) can speed it up: predicted "
                                            f"{current.predicted_samples_per_s:,.0f} -> "
                                            f"{plan.predicted_samples_per_s:,.0f} samples/s", kind=GROW)
                return  # the idle nodes wait for its re-plan

    def _plan_on(self, session: Session, spec: JobSpec, nodes: list[NodeRow]) -> Plan:
        costs = _costs(spec)
        infos = [NodeInfo(node.id, node.profile["flops"], node.profile["memory_bytes"],
                          node.profile["bandwidth_bytes_per_s"], node.profile["latency_s"], node.address)
                 for node in nodes]
        ids = {node.id for node in nodes}  # filtered here: an IN list of 10,000 ids is too long for SQLite
        links = {(row.node_id, row.peer_id): (row.bandwidth, row.latency) for row in session.scalars(select(LinkRow))
                 if row.node_id in ids and row.peer_id in ids}
        return plan_job(costs, infos, spec.placement, training=spec.training, averaging=spec.averaging,
                        pipeline_cap=self.settings.pipeline_cap, links=links)

    def _reserve(self, session: Session, job: JobRow, plan: Plan, idle: list[NodeRow]) -> set[str]:
        job.plan = plan.model_dump(mode="json")
        self._plans[job.id] = plan
        by_id = {node.id: node for node in idle}
        used = set()
        for cluster in plan.clusters:
            for stage in cluster.stages:
                session.add(StageRow(job_id=job.id, cluster=cluster.cluster, stage=stage.stage, node_id=stage.node_id,
                                     delivered=False, step=(job.resume or {}).get("step", 0), metrics={},
                                     weights_uploaded=False, updated_at=0.0))
                node = by_id[stage.node_id]
                node.state, node.job_id = BUSY, job.id
                used.add(node.id)
                self._left_out.pop(node.id, None)
        for node_id, why in plan.unused.items():
            self._left_out[node_id] = f"no stage in job {job.id}: {why}"
        job.reason = f"planned {plan.reason}; waiting for every node to fetch its stage"
        return used


def _probe_token(data_dir: Path) -> str:
    """The token peers' Ping probes carry, kept in the data directory so it outlives a restart."""
    path = data_dir / "probe_token"
    if not path.exists():
        path.touch(mode=0o600)
        path.write_text(new_token())
    return path.read_text().strip()


def _undelivered(session: Session, job_id: str) -> int:
    return session.scalar(select(func.count()).select_from(StageRow).where(
        StageRow.job_id == job_id, StageRow.delivered.is_(False))) or 0


def _summary(job: JobRow) -> JobSummary:
    return JobSummary(id=job.id, name=job.name, state=job.state, reason=job.reason, model=job.spec["model"]["name"],
                      created_at=job.created_at, updated_at=job.updated_at)


def _blocks(blocks: list[int]) -> str:
    return f"block {blocks[0]}" if blocks[1] - blocks[0] == 1 else f"blocks {blocks[0]}-{blocks[1] - 1}"
