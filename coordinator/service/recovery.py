"""Re-planning a job after a lost node or stage, onto new nodes, or on request: its nodes hand in
their state, then it is placed again one generation later (where each block continues from:
coordinator/recovery.py).

After a loss, the clusters that lost nothing keep training while the job is re-planned: first every
node is told `train_alone` (a stage that can leaves its averaging and trains on; the lost cluster's
stages have failed, or fail at their broken pipeline, and hand in their state), and only once every
member has stopped, gone silent or trains alone are those told `recover_job`: stop and hand in
(`hand_in_at` in the recovery record). A stage also stops and hands in by itself once it trained
alone as many steps as its averaging lets replicas drift apart (ravnest/pipeline/stage.py). Either
way its state is the freshest there is. Growing onto new nodes loses nothing, so there every node
hands in at once."""
from __future__ import annotations

import itertools
from collections.abc import Sequence

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from ravnest.failures import Failure

from .. import jobs
from ..jobs import JobState
from ..recovery import StoredState, resume_point
from ..store import CheckpointRow, JobRow, NodeRow, StageRow, stage_of_node, stages_of
from .base import GONE, IDLE, LOST, RESUME, ServiceBase, costs_of


class Recoveries(ServiceBase):
    def _recover(self, session: Session, job: JobRow, reason: str, kind: str = LOST,
                 failure: Failure | None = None, left_out: list[str] | None = None) -> None:
        """Re-plan `job`: its nodes are told to stop and hand in their state; once they did (or left),
        `_replan_recovered` plans it again from the freshest state of every block. Losses since the
        last resume are bounded by placement.max_recoveries; growing onto new nodes is not a loss."""
        spec = jobs.spec_of(job)
        since_resume = list(itertools.takewhile(lambda r: r.get("kind") != RESUME, reversed(job.faults or [])))
        losses = sum(r.get("kind", LOST) == LOST for r in since_resume)
        if kind == LOST and not self.policy.recoveries_left(spec.placement.max_recoveries, losses):
            jobs.transition(job, JobState.FAILED, f"{reason}; no recovery left (placement.max_recoveries = "
                                                  f"{spec.placement.max_recoveries})", self.clock())
            return
        self._open_recovery(session, job, kind, reason, failure, left_out or [])
        self.policy.forget(job.id)
        words = "intact clusters train on, then its nodes hand in their state" if kind == LOST else \
            "its nodes hand in their state"
        jobs.transition(job, JobState.RECOVERING, f"{reason}; {words}, then it is planned again", self.clock())

    def _open_recovery(self, session: Session, job: JobRow, kind: str, reason: str,
                       failure: Failure | None = None, left_out: Sequence[str] = ()) -> None:
        reached = max((row.step for row in stages_of(session, job.id)), default=0)
        now = self.clock()
        job.faults = [*(job.faults or []), {"kind": kind, "at": now, "reason": reason, "generation": job.generation,
                                            "reached_step": reached, **({} if kind == LOST else {"hand_in_at": now}),
                                            **({"failure": failure.model_dump(mode="json")} if failure else {}),
                                            **({"left_out": list(left_out)} if left_out else {})}]

    def _replan_recovered(self, session: Session) -> bool:
        """Recovering jobs whose nodes all stopped (or went silent, or overran the wait) go back to
        pending, one generation later, with where every block's state comes from. A node silent for two
        heartbeat intervals is not waited for: it is most likely the one that died, and a dead node
        hands in nothing (if it is only late, the new credential ends what it still runs). True if any
        job went back to pending."""
        now, replanned = self.clock(), False
        silent_since = self.policy.waited_for_since(now)
        for job in session.scalars(select(JobRow).where(JobRow.state == JobState.RECOVERING.value)):
            members = list(session.scalars(select(NodeRow).where(NodeRow.job_id == job.id, NodeRow.state != GONE)))
            waited_out = now - job.updated_at >= self.settings.recovery_wait_s
            live = [node for node in members if node.last_seen >= silent_since]
            if live and not waited_out:
                if all(self._training_alone.get(node.id) == job.id for node in live):
                    self._hand_in_now(job)
                continue
            for node in members:  # whatever it still runs is ignored from now on; a silent one is not placed
                node.job_id, node.state = None, IDLE if node.last_seen >= silent_since else GONE
            self._forget_lost_clusters(session, job)
            resume = self._resume_point(session, job)
            self._start_generation(session, job, resume)
            resume_note = ("no stored state covers every block: starting over from fresh weights" if resume is None
                           else f"continuing from step {job.resume['step']}")
            jobs.transition(job, JobState.PENDING, f"re-planning after: {job.faults[-1]['reason']}; {resume_note}",
                            now)
            replanned = True
        return replanned

    def _kept_training(self, session: Session, node: NodeRow) -> None:
        """The node's cluster trains on while its recovering job is re-planned: say so in the record."""
        job = session.get(JobRow, node.job_id) if node.job_id else None
        stage = stage_of_node(session, job.id, node.id) if job is not None else None
        if stage is not None and job.state == JobState.RECOVERING.value:
            fault = job.faults[-1]
            if stage.cluster not in fault.get("kept_training", []):
                kept = sorted({*fault.get("kept_training", []), stage.cluster})
                job.faults = [*job.faults[:-1], {**fault, "kept_training": kept}]

    def _forget_lost_clusters(self, session: Session, job: JobRow) -> None:
        """A stage of the lost cluster may have left its averaging before its broken pipeline failed it:
        a cluster with a node gone did not train on, whatever its survivors said."""
        fault = job.faults[-1]
        if fault.get("kept_training"):
            lost = {stage.cluster for stage in stages_of(session, job.id)
                    if (node := session.get(NodeRow, stage.node_id)) is None or node.state == GONE}
            job.faults = [*job.faults[:-1], {**fault, "kept_training": [c for c in fault["kept_training"]
                                                                        if c not in lost]}]

    def _hand_in_now(self, job: JobRow) -> None:
        """Every live member trains alone: the lost cluster is done, so they stop and hand in now."""
        if "hand_in_at" not in job.faults[-1]:
            job.faults = [*job.faults[:-1], {**job.faults[-1], "hand_in_at": self.clock()}]

    def _resume_point(self, session: Session, job: JobRow) -> dict | None:
        stored = [StoredState(row.file, row.generation, (row.block_start, row.block_end), row.step)
                  for row in session.scalars(select(CheckpointRow).where(CheckpointRow.job_id == job.id))]
        return resume_point(stored, len(costs_of(jobs.spec_of(job))))

    def _start_generation(self, session: Session, job: JobRow, resume: dict | None) -> None:
        """Forget the last placement; the next one is a new generation with a new gRPC credential, so
        nothing a stage of the previous one still sends is accepted. Records where it continues from."""
        if resume is not None:
            steps = jobs.spec_of(job).training.steps
            resume = {**resume, "step": min(resume["step"], steps - 1)}  # the last step is trained again
            fault = job.faults[-1]
            # the stages' snapshots may be further than their last metrics report said
            reached = max([fault["reached_step"], *(row.step for row in session.scalars(select(CheckpointRow).where(
                CheckpointRow.job_id == job.id, CheckpointRow.generation == fault["generation"])))])
            job.faults = [*job.faults[:-1], {
                **fault, "reached_step": reached, "steps_trained_on": max(0, reached - fault["reached_step"]),
                "resume_step": resume["step"],
                "steps_redone": max(0, reached - resume["step"]),
                "sources": [f"{_blocks(s['blocks'])}: {s['file']} (step {s['step']})" for s in resume["sources"]]}]
        session.execute(delete(StageRow).where(StageRow.job_id == job.id))
        self._plans.pop(job.id, None)
        job.plan, job.resume = None, resume
        job.generation += 1  # which also changes the job's credential (Coordinator.peer_token)


def _blocks(blocks: list[int]) -> str:
    return f"block {blocks[0]}" if blocks[1] - blocks[0] == 1 else f"blocks [{blocks[0]}, {blocks[1]})"
