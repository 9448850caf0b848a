"""A stage alone in its cluster that reports nothing for `stall_s` while its job runs: its node heartbeats
but does no work (or lies about it). Nobody else would notice (a pipeline's neighbours time out after
300 s and name it), so the job is re-planned without it."""
from __future__ import annotations

from ravnest.failures import Failure, FailureKind

from . import rule
from .base import Decision, Replan, Rule, Stall


@rule
class StalledStage(Rule[Stall]):
    observes = Stall

    def decide(self, seen: Stall) -> list[Decision]:
        quiet_s = seen.at - seen.last_progress
        if quiet_s < self.settings.stall_s:
            return []
        said = f"reported no progress for {quiet_s:.0f} s (at step {seen.step})"
        return [Replan(seen.job_id, f"node {seen.who} {said}: cluster {seen.cluster} stage {seen.stage}; "
                                    f"re-planning without it",
                       Failure(kind=FailureKind.STALLED, message=said, peer_id=seen.node_id, step=seen.step,
                               detail=f"stall_s {self.settings.stall_s:g}"),
                       left_out=(seen.node_id,))]
