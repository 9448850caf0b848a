"""The rules for nodes that fail: when a node counts as gone, when a stage counts as too slow, how many
re-plans a job gets, whom a re-plan leaves out, and when a node's reports are no longer believed.
Their thresholds are named settings (config.py); the components ask here instead of writing the
arithmetic where they need it.

No single node decides a job's fate. A failure report is a claim: it re-plans the job without the
node it names (a peer it lost) or, naming none, without the reporter itself; a stage that trains on
alone leaves out nobody. A report that the stage could not start at all fails the job only once
`fail_after_nodes` different nodes said so (a model that cannot run anywhere); before that, the
job is re-planned without the reporter. Each re-plan counts against its job's
placement.max_recoveries and against the reporter: a node whose reports caused `quarantine_after`
re-plans within `quarantine_window_s` is quarantined, not placed and not believed, for
`quarantine_s`, with the reason shown in `ravnest nodes`. A liar thus costs a job one re-plan, and
the volunteer pool a few an hour.

Silence: a node is gone after `heartbeat_timeout_factor` missed heartbeat intervals. While its job is
recovering, a member silent for `recovery_silence_intervals` is not waited for: it is most likely the
one that died.

Slowness: a stage whose compute per micro-batch (its busy seconds in training: waiting for peers and
evaluation passes do not count) stays above `slow_factor` times the plan's prediction, and above
`slow_factor` times the median ratio of the job's other stages, for `slow_checks` reports in a row
once it is `slow_after_steps` steps in, is re-planned around like a lost one. Both comparisons are
needed: on a machine several nodes share, every stage runs slower than predicted; a node that is slow
on its own stands out from its peers. The factor is 8 because 4 re-planned healthy nodes: with four
nodes on two cores and stages of a few ms, where Python's fixed cost per action (which the plan does
not count) dominates, a normal stage measured up to 9.2x its prediction while its peers were at 2.3x.
A node held to 8% of a core measured 30-46x (tests/test_faults.py); a pipeline runs at its slowest
stage's pace, so a stage 8x slower than planned costs its whole cluster about that much.

A stage alone in its job has no peers. Its FLOPs over its compute time, less the plan's fixed cost
per micro-batch, are what its node computes like; it is slow once its profile claimed `claim_factor`
(100) times that, which no crowding explains but a false profile does (1e17 FLOP/s claimed by a CPU
is a million times off).

A node's profile is a claim, and a slow stage is the measurement that refutes it: the node's figure
is corrected to what it measured (`Slow.measured_flops`; with peers, the FLOP/s at which the plan
would have predicted the slowness its peers showed), and the planner uses that figure from then on.
A node that lied about its compute loses its work once measured, and keeps no advantage.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Collection
from dataclasses import dataclass

from ravnest.failures import PEER_KINDS, Failure, FailureKind
from ravnest.partition import STAGE_OVERHEAD_S

from .config import Settings


@dataclass(frozen=True)
class StageSpeed:
    """What one stage of a running job measured, and what the plan predicted for it."""
    node_id: str
    cluster: int
    stage: int
    step: int
    compute_s: float | None  # measured busy seconds per micro-batch, recent (None: not reported yet)
    predicted_s: float  # the plan's seconds per micro-batch
    flops: float  # its node's figure the plan used
    work_flops: float  # the stage's FLOPs per micro-batch, forward and backward


@dataclass(frozen=True)
class Slow:
    """A stage found too slow: the reason a user reads, the event, and its node's corrected figure."""
    stage: StageSpeed
    said: str
    failure: Failure
    measured_flops: float


class FailurePolicy:
    def __init__(self, settings: Settings):
        self.settings = settings
        # (job id, node id) -> reports in a row that found the stage slow. Per process, on purpose: a
        # restarted coordinator starts counting again, which only delays a re-plan by a few reports.
        self._slow_in_a_row: dict[tuple[str, str], int] = {}

    def gone_before(self, now: float) -> float:
        """A node last seen before this is gone."""
        return now - self.settings.heartbeat_timeout_s

    def waited_for_since(self, now: float) -> float:
        """While its job recovers, a member last seen before this is not waited for."""
        return now - self.settings.recovery_silence_intervals * self.settings.heartbeat_interval_s

    @staticmethod
    def recoveries_left(max_recoveries: int, losses_since_resume: int) -> bool:
        return losses_since_resume < max_recoveries

    def slow_stage(self, job_id: str, stages: list[StageSpeed]) -> Slow | None:
        """The stage to re-plan around, or None."""
        factor = self.settings.slow_factor
        ratios = {s: s.compute_s / s.predicted_s for s in stages if s.compute_s is not None and s.predicted_s > 0}
        for stage, ratio in ratios.items():
            key = (job_id, stage.node_id)
            others = [r for s, r in ratios.items() if s is not stage]
            if others:
                peers = max(1.0, statistics.median(others))
                slow, measured = ratio > factor * peers, stage.flops * peers / ratio
                said = (f"computes a micro-batch in {ratio * stage.predicted_s * 1e3:.0f} ms, {ratio:.1f}x the "
                        f"{stage.predicted_s * 1e3:.0f} ms planned (the other stages: {peers:.1f}x)")
                rule = f"slow_factor {factor:g}"
            else:
                compute_s = ratio * stage.predicted_s - STAGE_OVERHEAD_S
                measured = stage.work_flops / compute_s if compute_s > 0 else math.inf
                slow = stage.flops > self.settings.claim_factor * measured
                said = (f"computes like {measured / 1e9:,.1f} GFLOP/s, where its profile claimed "
                        f"{stage.flops / 1e9:,.1f} (a micro-batch in {ratio * stage.predicted_s * 1e3:,.1f} ms, "
                        f"not {stage.predicted_s * 1e3:,.1f})")
                rule = f"claim_factor {self.settings.claim_factor:g}"
            slow = slow and stage.step >= self.settings.slow_after_steps
            self._slow_in_a_row[key] = self._slow_in_a_row.get(key, 0) + 1 if slow else 0
            if self._slow_in_a_row[key] >= self.settings.slow_checks:
                del self._slow_in_a_row[key]
                failure = Failure(kind=FailureKind.SLOW, message=said, peer_id=stage.node_id, step=stage.step,
                                  detail=f"{rule}, {self.settings.slow_checks} reports in a row")
                return Slow(stage, said, failure, measured)
        return None

    @staticmethod
    def left_out_by(failure: Failure | None, reporter_id: str, still_training: bool,
                    members: Collection[str]) -> list[str]:
        """Whom the re-plan a failure report causes leaves out of its job."""
        named = failure.peer_id if failure is not None else None
        if named is not None and named in members and named != reporter_id \
                and failure is not None and failure.kind in (*PEER_KINDS, FailureKind.PEER_FAILED):
            return [named]
        return [] if still_training else [reporter_id]

    def fails_job(self, could_not_start_on: Collection[str]) -> bool:
        """Whether reports that a stage could not start, from these different nodes, end the job."""
        return len(set(could_not_start_on)) >= self.settings.fail_after_nodes

    def blame(self, caused: list[float], now: float) -> tuple[list[float], float | None]:
        """A node's report caused a re-plan now: the re-plans it caused within the window (`caused`
        are the earlier ones), and until when it is quarantined (None: it is not)."""
        recent = [at for at in caused if now - at < self.settings.quarantine_window_s] + [now]
        if len(recent) >= self.settings.quarantine_after:
            return [], now + self.settings.quarantine_s
        return recent, None

    def forget(self, job_id: str) -> None:
        self._slow_in_a_row = {k: v for k, v in self._slow_in_a_row.items() if k[0] != job_id}
