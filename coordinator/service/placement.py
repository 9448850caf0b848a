"""Placement: pending jobs are planned onto idle live nodes (those proven to hold the job's dataset,
less the ones it left out and those quarantined), and idle nodes may grow a running job."""
from __future__ import annotations

import threading

import logging
import math

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from ravnest.models import build_model
from ravnest.partition import MESSAGE_OVERHEAD_S
from ravnest.spec import JobSpec

from .. import calibration, jobs
from ..clustering import NodeInfo
from ..codec_choice import lossiest_codec
from ..jobs import JobState
from ..equal_split import plan_equal_split
from ..plan_words import plural
from ..planning import PlanningError, plan_job
from ..schemas import Plan
from ..store import JobRow, LinkRow, NodeRow, StageRow, stages_of
from .core import BUSY, GROW, IDLE, Core, costs_of, planning_bandwidth, planning_flops
from .offers import Offers, files_read
from .reachability import relay_shares
from .recovery import Recoveries

log = logging.getLogger(__name__)


class Placement:
    def __init__(self, core: Core, offers: Offers, recoveries: Recoveries) -> None:
        self.core, self.offers, self.recoveries = core, offers, recoveries
        self._left_out: dict[str, str] = {}  # node id -> why the last placement gave it no stage
        # job -> (generation, idle node ids, links measured among them) it was last weighed with, to grow it
        self._grow_considered: dict[str, tuple[int, frozenset[str], int]] = {}
        self._asked = threading.Event()  # a placement was asked for (request)

    def request(self) -> None:
        """Place soon: a burst of joins asks once. At once where there is no background work (tests
        drive it), else within `placement_debounce_s` (the app's loop calls `place_if_asked`)."""
        if self.core.settings.background:
            self._asked.set()
        else:
            self.place_pending()

    def place_if_asked(self) -> None:
        if self._asked.is_set():
            self._asked.clear()
            self.place_pending()

    def left_out_note(self, node_id: str) -> str:
        """Why the last placement gave this idle node no stage ("" if none did)."""
        return self._left_out.get(node_id, "")

    def place_pending(self) -> None:
        """Place waiting jobs, oldest first, on idle live nodes (a new job that cannot be placed fails);
        nodes still idle then may make a running job re-plan onto them."""
        now = self.core.clock()
        with self.core.lock, self.core.store.session() as session:
            pending = list(session.scalars(select(JobRow).where(JobRow.state == JobState.PENDING.value)
                                           .order_by(JobRow.created_at)))
            grown_since = now - self.core.settings.grow_after_s
            if not pending and not session.scalar(select(func.count()).select_from(JobRow).where(
                    JobRow.state == JobState.RUNNING.value, JobRow.updated_at <= grown_since)):
                return  # nothing to place, nothing to grow: the idle nodes are not read (10,000 rows)
            idle = list(session.scalars(select(NodeRow).where(
                NodeRow.state == IDLE, NodeRow.credential_ended.is_(None),
                self.core.live(now),  # not gone
                NodeRow.reachable.is_not(False),  # peers could not dial it (it may get a relay: reachability.py)
                or_(NodeRow.quarantined_until.is_(None), NodeRow.quarantined_until <= now))  # (failure_rules/)
                .order_by(NodeRow.joined_at)))
            if not idle and not pending:
                return
            for job in pending:
                spec = jobs.spec_of(job)
                waited = now - job.history[-1]["at"]
                if spec.placement.timeout_s is not None and waited > spec.placement.timeout_s:
                    jobs.transition(job, JobState.FAILED, f"not placed within placement.timeout_s = "
                                                          f"{spec.placement.timeout_s:g} s: {job.reason}", now)
                    continue
                # a job already under way continues on whatever nodes there are; a new one waits for min_nodes
                needed = 1 if job.generation else spec.placement.min_nodes or 1  # (set by the spec)
                offered, content = self.offers.holders(session, spec, idle)  # only proven holders read a file
                vocab = build_model(spec.model.name, spec.model.config).input.high
                misfits = self.offers.too_many_ids(spec, vocab, offered)
                candidates = [node for node in offered if node.id not in left_out_of(job) and node.id not in misfits]
                if len(candidates) < needed:
                    files = " and ".join(f"{field.replace('.', ' ')} {name!r}" for field, name, _ in files_read(spec))
                    source = f" proven to hold {files}" if files else ""
                    excluded = sum(node.id in left_out_of(job) for node in offered)
                    also = f"; {excluded} more left out of this job after failures" if excluded else ""
                    reason = f"waiting for {plural(needed, 'idle node')}{source} ({len(candidates)} available{also})"
                    unoffered = self.offers.unoffered(session, spec)
                    other = self.offers.other_content(session, spec)
                    if unoffered:  # the likeliest reason first: nobody has the file, or not with that content
                        reason = f"no node offers {unoffered} yet; {reason}"
                    elif other:
                        reason = f"{other}; {reason}"
                    elif misfits:
                        reason = (f"token file {spec.dataset.source!r} has {min(misfits.values()):,} ids or more "
                                  f"on {plural(len(misfits), 'node')}, more than the model's vocab_size {vocab:,}; "
                                  f"{reason}")
                    if job.reason != reason:
                        job.reason = reason
                    continue
                if due := self._own_nodes_due(session, job, {node.id for node in idle}, now):
                    wait_s = max(wait for _, wait in due)
                    job.reason = (f"waiting up to {wait_s:.0f} s more for {plural(len(due), 'node')} of its last "
                                  f"run to beat again ({', '.join(node.name or node.id for node, _ in due[:5])}"
                                  f"{', ...' if len(due) > 5 else ''}) before planning on fewer")
                    continue
                try:
                    planner = self._plan_continuing if job.generation else self._plan_on
                    plan = planner(session, spec, candidates)
                except PlanningError as e:
                    if job.generation:  # more nodes may come back; placement.timeout_s bounds the wait
                        job.reason = f"waiting for nodes that can hold the model: {e}"
                    else:
                        jobs.transition(job, JobState.FAILED, f"cannot place the job: {e}", now)
                    continue
                jobs.transition(job, JobState.PLACING, f"placing on {plural(len(candidates), 'idle node')}", now)
                jobs.pin_content(job, content)  # it reads this content from now on, whoever offers what
                used = self._reserve(session, job, plan, candidates)
                idle = [node for node in idle if node.id not in used]
            if idle:
                self._grow_running(session, idle)

    def _grow_running(self, session: Session, idle: list[NodeRow]) -> None:
        """Nodes that joined mid-job: the oldest running job whose planner predicts at least `grow_gain`
        more throughput with them (after running `grow_after_s`, with a quarter of its steps left) is
        re-planned onto its nodes plus these, continuing from the state its stages hand in."""
        now = self.core.clock()
        for job in session.scalars(select(JobRow).where(JobRow.state == JobState.RUNNING.value)
                                   .order_by(JobRow.created_at)):
            if now - job.updated_at < self.core.settings.grow_after_s:
                continue
            spec, current = jobs.spec_of(job), self.core.plan(job)
            # a node once left out of it (too slow, lost, blamed) is no helper: it would be planned in and
            # left out again, round after round
            newcomers = [node for node in self.offers.holders(session, spec, idle)[0]
                         if node.id not in left_out_of(job)]
            if not newcomers:
                continue
            members = list(session.scalars(select(NodeRow).where(NodeRow.job_id == job.id)))
            ids = [node.id for node in members + newcomers]
            measured = session.scalar(select(func.count()).select_from(LinkRow).where(
                LinkRow.node_id.in_(ids), LinkRow.peer_id.in_(ids))) or 0
            # planned with these very nodes and links already (each tick would plan again); newcomers
            # measure their links over their first heartbeats, and each measurement may change the answer
            considered = (job.generation, frozenset(node.id for node in newcomers), measured)
            if self._grow_considered.get(job.id) == considered:
                continue
            self._grow_considered[job.id] = considered
            some = plural(len(newcomers), "idle node")
            done = jobs.progress(job, stages_of(session, job.id)).fraction
            if done > 0.75:
                log.info("job %s stays on its nodes: it is %.0f%% done, too little is left to re-plan it onto %s",
                         job.id, 100 * done, some)
                continue
            try:
                plan = self._plan_on(session, spec, members + newcomers)
            except PlanningError as e:
                log.info("job %s stays on its nodes: with %s it cannot be planned: %s", job.id, some, e)
                continue
            try:  # like with like: its own nodes planned again with the links measured since it was placed
                baseline = self._plan_on(session, spec, members).predicted_samples_per_s
            except PlanningError:
                baseline = current.predicted_samples_per_s
            if plan.predicted_samples_per_s > baseline and \
                    plan.predicted_samples_per_s >= (1 + self.core.settings.grow_gain) * baseline:
                self.recoveries.recover(session, job, f"{some} can speed it up: predicted "
                                            f"{baseline:,.0f} -> {plan.predicted_samples_per_s:,.0f} samples/s",
                                        failure=None, kind=GROW)
                return  # the idle nodes wait for its re-plan
            log.info("job %s stays on its nodes: with %s the planner predicts %.0f -> %.0f samples/s "
                     "(%s; it grows at +%.0f%%)", job.id, some, baseline,
                     plan.predicted_samples_per_s, plan.reason, 100 * self.core.settings.grow_gain)

    def _own_nodes_due(self, session: Session, job: JobRow, idle: set[str], now: float) -> list[tuple[NodeRow, float]]:
        """The nodes the job's lost run released that are not idle and live yet, with the seconds a re-plan
        still waits for them (`replan_wait_intervals` of their own beats from their release). Late beats on
        a busy host are not a smaller crowd: without the wait, a re-plan of 16 clusters took the 3 nodes
        that had beaten that second while 29 more were about to, and shrank the job for good. The nodes its
        failure left out (the lost one), quarantined ones and those another job took are not waited for."""
        fault = job.faults[-1] if job.generation and job.faults else None
        if fault is None or fault.released_at is None:
            return []
        left, due = left_out_of(job), []
        for node_id in fault.released:
            node = session.get(NodeRow, node_id)
            if node is None or node_id in idle or node_id in left or node.job_id is not None or \
                    node.credential_ended is not None or (node.quarantined_until or 0) > now:
                continue
            interval = node.beat_interval_s or self.core.settings.heartbeat_interval_s
            wait_s = fault.released_at + self.core.settings.replan_wait_intervals * interval - now
            if wait_s > 0:
                due.append((node, wait_s))
        return due

    def _plan_on(self, session: Session, spec: JobSpec, nodes: list[NodeRow]) -> Plan:
        costs = costs_of(spec)
        slowdowns = calibration.planned(nodes, spec.model.name, "slowdown", 1.0)
        messages = calibration.planned(nodes, spec.model.name, "message_s", MESSAGE_OVERHEAD_S)
        shares = relay_shares(session, nodes, self.core.settings.relay_bytes_per_s)
        infos = [NodeInfo(node.id, planning_flops(node), node.profile["memory_bytes"],
                          min(planning_bandwidth(node), shares.get(node.id, math.inf)),
                          node.profile["latency_s"], node.address, slowdowns[node.id],
                          shares.get(node.id, math.inf), node.relayed_by is not None,
                          node.relayed_by is None and bool(node.reachable) and node.peer_relay_port is not None,
                          messages[node.id])
                 for node in nodes]
        ids = {node.id for node in nodes}  # filtered here: an IN list of 10,000 ids is too long for SQLite
        links = {(row.node_id, row.peer_id): (row.bandwidth, row.latency) for row in session.scalars(select(LinkRow))
                 if row.node_id in ids and row.peer_id in ids}
        model = build_model(spec.model.name, spec.model.config)
        deepest, lossiest = model.stages_at_most, lossiest_codec(model)  # (tied embeddings: 1 stage)
        try:
            if spec.placement.policy == "equal-split":
                joined = {node.id: (node.joined_at, node.id) for node in nodes}
                return plan_equal_split(costs, sorted(infos, key=lambda n: joined[n.node_id]), spec.placement,
                                        training=spec.training, averaging=spec.averaging, links=links,
                                        max_depth=deepest, lossiest=lossiest)
            return plan_job(costs, infos, spec.placement, training=spec.training, averaging=spec.averaging,
                            pipeline_cap=self.core.settings.pipeline_cap, links=links, max_depth=deepest,
                            lossiest=lossiest)
        except PlanningError as e:
            if deepest == 1:
                raise PlanningError(f"{e} (its first and last blocks share a tensor, tied embeddings, so each "
                                    f"pipeline is one node holding the whole model)") from None
            raise

    def _plan_continuing(self, session: Session, spec: JobSpec, nodes: list[NodeRow]) -> Plan:
        """A job under way continues on the nodes there now: where they cannot make the exact number of
        clusters it asked for (a cluster lost its node and no spare is left), with as many as they can
        (the lost cluster is dissolved into the others' data parallelism); it grows back when nodes come."""
        try:
            return self._plan_on(session, spec, nodes)
        except PlanningError as refused:
            asked = spec.placement.clusters
            if not isinstance(asked, int):
                raise
            for clusters in range(min(asked - 1, len(nodes)), 0, -1):
                fewer = spec.model_copy(update={"placement": spec.placement.model_copy(update={"clusters": clusters})})
                try:
                    plan = self._plan_on(session, fewer, nodes)
                except PlanningError:
                    continue
                plan.reason = f"{asked} clusters asked for, {clusters} on the nodes there now; {plan.reason}"
                return plan
            raise refused

    def _reserve(self, session: Session, job: JobRow, plan: Plan, idle: list[NodeRow]) -> set[str]:
        self.core.keep_plan(job, plan)
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


def left_out_of(job: JobRow) -> set[str]:
    """The nodes a job is no longer placed on: too slow, lost, or failed in it (its re-plans say)."""
    return {node for fault in job.faults or [] for node in fault.left_out}
