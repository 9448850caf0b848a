"""Re-planning a job after a lost node or stage, onto new nodes, or on request: its nodes hand in
their state, then it is placed again one generation later (where each block continues from:
coordinator/recovery.py)."""
from __future__ import annotations

import itertools

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from ravnest.spec import JobSpec

from .. import jobs
from ..jobs import JobState
from ..recovery import StoredState, resume_point
from ..store import CheckpointRow, JobRow, NodeRow, StageRow, stages_of
from .base import GONE, IDLE, LOST, RESUME, ServiceBase, costs_of


class Recoveries(ServiceBase):
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
        """Recovering jobs whose nodes all stopped (or went silent, or overran the wait) go back to
        pending, one generation later, with where every block's state comes from. A node silent for two
        heartbeat intervals is not waited for: it is most likely the one that died, and a dead node
        hands in nothing (if it is only late, the new credential ends what it still runs)."""
        now = self.clock()
        silent_since = now - 2 * self.settings.heartbeat_interval_s
        for job in session.scalars(select(JobRow).where(JobRow.state == JobState.RECOVERING.value)):
            members = list(session.scalars(select(NodeRow).where(NodeRow.job_id == job.id, NodeRow.state != GONE)))
            waited_out = now - job.updated_at >= self.settings.recovery_wait_s
            if any(node.last_seen >= silent_since for node in members) and not waited_out:
                continue
            for node in members:  # whatever it still runs is ignored from now on; a silent one is not placed
                node.job_id, node.state = None, IDLE if node.last_seen >= silent_since else GONE
            resume = self._resume_point(session, job)
            self._start_generation(session, job, resume)
            resume_note = ("no stored state covers every block: starting over from fresh weights" if resume is None
                           else f"continuing from step {job.resume['step']}")
            jobs.transition(job, JobState.PENDING, f"re-planning after: {job.faults[-1]['reason']}; {resume_note}",
                            now)

    def _resume_point(self, session: Session, job: JobRow) -> dict | None:
        stored = [StoredState(row.file, row.generation, (row.block_start, row.block_end), row.step)
                  for row in session.scalars(select(CheckpointRow).where(CheckpointRow.job_id == job.id))]
        return resume_point(stored, len(costs_of(JobSpec.model_validate(job.spec))))

    def _start_generation(self, session: Session, job: JobRow, resume: dict | None) -> None:
        """Forget the last placement; the next one is a new generation with a new gRPC credential, so
        nothing a stage of the previous one still sends is accepted. Records where it continues from."""
        if resume is not None:
            steps = JobSpec.model_validate(job.spec).training.steps
            resume = {**resume, "step": min(resume["step"], steps - 1)}  # the last step is trained again
            fault = job.faults[-1]
            # the stages' snapshots may be further than their last metrics report said
            reached = max([fault["reached_step"], *(row.step for row in session.scalars(select(CheckpointRow).where(
                CheckpointRow.job_id == job.id, CheckpointRow.generation == fault["generation"])))])
            job.faults = [*job.faults[:-1], {
                **fault, "reached_step": reached, "resume_step": resume["step"],
                "steps_redone": max(0, reached - resume["step"]),
                "sources": [f"{_blocks(s['blocks'])}: {s['file']} (step {s['step']})" for s in resume["sources"]]}]
        session.execute(delete(StageRow).where(StageRow.job_id == job.id))
        self._plans.pop(job.id, None)
        job.plan, job.resume = None, resume
        job.generation += 1  # which also changes the job's credential (Coordinator.peer_token)


def _blocks(blocks: list[int]) -> str:
    return f"block {blocks[0]}" if blocks[1] - blocks[0] == 1 else f"blocks [{blocks[0]}, {blocks[1]})"
