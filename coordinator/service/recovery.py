"""Re-planning a job after a lost node or stage, onto new nodes, or on request: its nodes hand in
their state, then it is placed again one generation later (where each block continues from:
coordinator/resume_point.py). Each re-plan is one typed `Recovery` record in the job's `faults`.

After a loss, the clusters that lost nothing keep training while the job is re-planned: first every
node is told `train_alone` (a stage that can leaves its averaging and trains on; the lost cluster's
stages have failed, or fail at their broken pipeline, and hand in their state), and only once every
member has stopped, gone silent or trains alone are those told `recover_job`: stop and hand in
(`hand_in_at` in the recovery record); members of a cluster whose pipeline a member said
is broken are not waited for (`broken`). A stage also stops and hands in by itself once it trained
alone as many steps as its averaging lets replicas drift apart (ravnest/pipeline/averaging_hooks.py).
Either way its state is the freshest there is. Growing onto new nodes loses nothing, so there every
node hands in at once."""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from ravnest.failures import Failure, FailureKind

from .. import jobs
from ..jobs import JobState
from ..recovery_budget import REFILL_SHARE, recoveries_left
from ..schemas import Recovery
from ..store import CheckpointRow, JobRow, NodeRow, StageRow, stage_of_node, stages_of
from .artifacts import Artifacts
from .core import GONE, IDLE, LOST, RESUME, Core


class Recoveries:
    def __init__(self, core: Core, artifacts: Artifacts) -> None:
        self.core, self.artifacts = core, artifacts

    def recover(self, session: Session, job: JobRow, reason: str, *, failure: Failure | None, kind: str = LOST,
                left_out: Sequence[str] = (), **record: Any) -> None:
        """Re-plan `job`: its nodes are told to stop and hand in their state; once they did (or left),
        `replan_recovered` plans it again from the freshest state of every block. Losses since the
        last resume are bounded by placement.max_recoveries, growing onto new nodes is not a loss.
        `failure`: what happened, as data (None only where nothing failed: a grow). Losses spend a budget
        that progress refills (coordinator/recovery_budget.py).
        `record`: more fields of the Recovery record (who reported it)."""
        spec, clock = jobs.spec_of(job), self.core.clock
        if kind == LOST and failure is None:
            raise ValueError(f"a re-plan after a loss needs its failure: {reason}")
        if kind == LOST:
            since_resume = list(itertools.takewhile(lambda r: r.kind != RESUME, reversed(job.faults or [])))[::-1]
            reached = [r.reached_step for r in since_resume if r.kind == LOST] + [_reached(session, job)]
            if recoveries_left(spec.placement.max_recoveries, spec.training.steps, reached) < 0:
                every = max(1, math.ceil(REFILL_SHARE * spec.training.steps))
                jobs.transition(job, JobState.FAILED, f"{reason}; no recovery left ({len(reached) - 1} re-plans "
                                f"after losses, placement.max_recoveries = {spec.placement.max_recoveries}, one "
                                f"back every {every} new steps)", clock())
                return
        self.open(session, job, kind, reason, failure, left_out, **record)
        self.core.rules.forget(job.id)
        jobs.transition(job, JobState.RECOVERING, _recovering(reason, kind), clock())

    def open(self, session: Session, job: JobRow, kind: str, reason: str,
             failure: Failure | None = None, left_out: Sequence[str] = (), **record: Any) -> None:
        """Add the job's recovery record (the job's state is the caller's to change)."""
        now = self.core.clock()
        job.faults = [*(job.faults or []), Recovery(
            kind=kind, at=now, reason=reason, generation=job.generation, reached_step=_reached(session, job),
            hand_in_at=None if kind == LOST else now, failure=failure, left_out=list(left_out), **record)]

    @staticmethod
    def outweighs_messenger(job: JobRow, reporter_id: str, failure: Failure | None) -> bool:
        """Whether this report is the first-hand account of a failure whose re-plan is under way on a
        messenger's word: a report of another node that only passed on a neighbour's failure (kind
        peer_failed) and came first. The failure's own node reports it too (else it went silent)."""
        last = job.faults[-1] if job.faults else None
        if job.state != JobState.RECOVERING.value or last is None or last.failure is None \
                or last.failure.kind != FailureKind.PEER_FAILED:
            return False  # no re-plan under way, or it opened on a first-hand account
        passed_on = failure is not None and failure.kind == FailureKind.PEER_FAILED
        return last.reported_by not in (None, reporter_id) and not passed_on

    @staticmethod
    def first_hand(job: JobRow, reason: str, failure: Failure, left_out: Sequence[str], **record: Any) -> None:
        """The failure's own account, heard while a messenger's report re-plans the job (the messenger
        was quicker): it replaces the messenger's, whom the re-plan no longer leaves out, as if it had
        come first."""
        last = job.faults[-1]
        kept = [n for n in last.left_out if n != last.reported_by]
        _amend_last(job, reason=reason, failure=failure, left_out=[*kept, *(n for n in left_out if n not in kept)],
                    **record)
        job.reason = _recovering(reason, LOST)

    @staticmethod
    def refused(job: JobRow, source: str, refuser: str, reason: str) -> None:
        """`refuser` refused values from `source` as not finite (`reason`, in words). Where the job is
        being re-planned, the re-plan under way leaves `source` out; and where an earlier re-plan left the
        refuser out on `source`'s word (its report that the refuser went silent, say, after the refusal
        cut it off), that is undone: the report of a node caught sending poison does not outweigh its
        peer's."""
        doubted = f"; not believed, for {reason}"
        faults = [r.model_copy(update={"left_out": [n for n in r.left_out if n != refuser],
                                       "reason": r.reason + doubted})
                  if r.reported_by == source and refuser in r.left_out else r for r in job.faults]
        last = faults[-1]
        if job.state == JobState.RECOVERING.value and source not in last.left_out:
            faults[-1] = last.model_copy(update={"left_out": [*last.left_out, source], "reason": last.reason + (
                ": the sender is left out instead" if last.reason.endswith(doubted) else f"; then {reason}")})
        elif job.state == JobState.RECOVERING.value and reason not in last.reason:
            # already left out, as a neighbour's report that it went silent said first: the refusal is why
            faults[-1] = last.model_copy(update={"reason": f"{last.reason}; {reason}"})
        job.faults = faults

    def training_again(self, job: JobRow, step: int) -> None:
        """A stage of the re-planned job reported `step`: past its resume step, training goes on, and
        the recovery's `recovery_s` says after how long."""
        last = job.faults[-1] if job.faults else None
        if job.state != JobState.RECOVERING.value and last is not None and last.recovery_s is None \
                and step > (job.resume or {}).get("step", 0):
            _amend_last(job, recovery_s=self.core.clock() - last.at)

    def trains_alone(self, session: Session, node: NodeRow, job_id: str | None) -> None:
        """What the node's heartbeat said: it trains alone in `job_id` (None: it does not)."""
        node.training_alone = job_id
        if job_id is not None:
            self.kept_training(session, node)

    def kept_training(self, session: Session, node: NodeRow) -> None:
        """The node's cluster trains on while its recovering job is re-planned: say so in the record."""
        job = session.get(JobRow, node.job_id) if node.job_id else None
        stage = stage_of_node(session, job.id, node.id) if job is not None else None
        if job is not None and stage is not None and job.state == JobState.RECOVERING.value:
            kept = job.faults[-1].kept_training
            if stage.cluster not in kept:
                _amend_last(job, kept_training=sorted({*kept, stage.cluster}))

    def reported(self, session: Session, job: JobRow, node: NodeRow, cluster: int, still_training: bool) -> None:
        """What a failure report of the recovering job's `node` (in `cluster`) says: it trains on, or stopped."""
        if still_training:
            self.kept_training(session, node)
        else:
            self.stopped(job, cluster)

    @staticmethod
    def stopped(job: JobRow, cluster: int) -> None:
        """A member of the recovering job's `cluster` failed and stopped: that cluster's pipeline is
        broken, so its other members cannot train alone (a stage whose input went silent, say, behind a
        relay that died, would wait for it until `recovery_wait_s`) and are not waited for."""
        if job.state == JobState.RECOVERING.value and cluster not in job.faults[-1].broken:
            _amend_last(job, broken=sorted({*job.faults[-1].broken, cluster}))

    @staticmethod
    def told_to_hand_in(job: JobRow) -> bool:
        """Whether the recovering job's nodes are to stop and hand in their state now."""
        return bool(job.faults) and job.faults[-1].hand_in_at is not None

    def replan_recovered(self, session: Session) -> bool:
        """Recovering jobs whose nodes all stopped (or went silent, or overran the wait) go back to
        pending, one generation later, with where every block's state comes from. A node silent for two
        heartbeat intervals is not waited for: it is most likely the one that died, and a dead node
        hands in nothing (if it is only late, the new credential ends what it still runs). True if any
        job went back to pending."""
        now, replanned = self.core.clock(), False
        for job in session.scalars(select(JobRow).where(JobRow.state == JobState.RECOVERING.value)):
            members = list(session.scalars(select(NodeRow).where(NodeRow.job_id == job.id, NodeRow.state != GONE)))
            waited_out = now - job.updated_at >= self.core.settings.recovery_wait_s
            live = [node for node in members if node.last_seen >= now - self.core.silence_s(node)]
            if live and not waited_out:
                broken = set(job.faults[-1].broken)
                if not self.told_to_hand_in(job) and all(
                        node.training_alone == job.id for node in live
                        if (stage := stage_of_node(session, job.id, node.id)) is None or stage.cluster not in broken):
                    _amend_last(job, hand_in_at=now)  # the lost cluster is done: the others hand in now
                continue
            _amend_last(job, released=sorted(node.id for node in members), released_at=now)
            for node in members:  # whatever it still runs is ignored from now on; a silent one is not placed
                node.job_id, node.state = None, IDLE if node.last_seen >= now - self.core.silence_s(node) else GONE
            self._forget_lost_clusters(session, job)
            resume = self.artifacts.resume_point(session, job)
            self.start_generation(session, job, resume)
            resume_note = ("no stored state covers every block: starting over from fresh weights" if job.resume is None
                           else f"continuing from step {job.resume['step']}")
            jobs.transition(job, JobState.PENDING, f"re-planning after: {job.faults[-1].reason}; {resume_note}",
                            now)
            replanned = True
        return replanned

    def _forget_lost_clusters(self, session: Session, job: JobRow) -> None:
        """A stage of the lost cluster may have left its averaging before its broken pipeline failed it:
        a cluster with a node gone did not train on, whatever its survivors said."""
        kept = job.faults[-1].kept_training
        if kept:
            lost = {stage.cluster for stage in stages_of(session, job.id)
                    if (node := session.get(NodeRow, stage.node_id)) is None or node.state == GONE}
            _amend_last(job, kept_training=[c for c in kept if c not in lost])

    def start_generation(self, session: Session, job: JobRow, resume: dict | None) -> None:
        """Forget the last placement; the next one is a new generation with a new gRPC credential, so
        nothing a stage of the previous one still sends is accepted. Records where it continues from."""
        if resume is not None:
            steps = jobs.spec_of(job).training.steps
            resume = {**resume, "step": min(resume["step"], steps - 1)}  # the last step is trained again
            fault = job.faults[-1]
            # the stages' snapshots may be further than their last metrics report said
            reached = max([fault.reached_step, *(row.step for row in session.scalars(select(CheckpointRow).where(
                CheckpointRow.job_id == job.id, CheckpointRow.generation == fault.generation)))])
            _amend_last(job, reached_step=reached, steps_trained_on=max(0, reached - fault.reached_step),
                        resume_step=resume["step"], steps_redone=max(0, reached - resume["step"]),
                        sources=[f"{_blocks(s['blocks'])}: {s['file']} (step {s['step']})" for s in resume["sources"]])
        session.execute(delete(StageRow).where(StageRow.job_id == job.id))
        self.core.keep_plan(job, None)
        job.resume = resume
        job.generation += 1  # which also changes the job's credential (Core.peer_token)


def _recovering(reason: str, kind: str) -> str:
    """The job's reason while it is re-planned."""
    words = "intact clusters train on, then its nodes hand in their state" if kind == LOST else \
        "its nodes hand in their state"
    return f"{reason}; {words}, then it is planned again"


def _amend_last(job: JobRow, **changes: Any) -> None:
    """Change fields of the job's latest recovery record (replaced, so the store sees the change)."""
    job.faults = [*job.faults[:-1], job.faults[-1].model_copy(update=changes)]


def _blocks(blocks: list[int]) -> str:
    return f"block {blocks[0]}" if blocks[1] - blocks[0] == 1 else f"blocks [{blocks[0]}, {blocks[1]})"


def _reached(session: Session, job: JobRow) -> int:
    """The furthest step any stage of the job has reported."""
    return max((row.step for row in stages_of(session, job.id)), default=0)
