"""A node's failure report is a claim. No single node decides a job's fate: a report re-plans the job
without the node it names (a peer it lost) or, naming none, without the reporter itself; a stage that
trains on alone leaves out nobody. A report that the stage could not start at all fails the job only
once `fail_after_nodes` different nodes said so (a model that cannot run anywhere); before that, the
job is re-planned without the reporter. Every re-plan a report causes counts against the reporter
(quarantine.py), except a refusal: a node that refused a peer's values as not finite names the sender,
and the re-plan leaves out the sender, the source of the poison, not the messenger. So does an outlier:
a peer whose averaging contributions most members of a robust round found far beyond theirs
(ravnest/averaging/robust.py), or whose activations its pipeline neighbour refused. Whom a refusal
counts against, and who is revoked, is accusations.py's to decide: the accuser may be the liar.

A report that only passes on a neighbour's failure (kind peer_failed, the neighbour's words) is judged
as the reporter's own, for want of better; but where it came first, the failure's own account, heard
while the job is re-planned, replaces it (Recoveries.first_hand): the messenger is back and unblamed."""
from __future__ import annotations

from collections.abc import Collection

from ravnest.failures import PEER_KINDS, Failure, FailureKind

from . import rule
from .base import Blame, Decision, FailJob, Replan, Report, Rule


@rule
class FailureReports(Rule[Report]):
    observes = Report

    def decide(self, seen: Report) -> list[Decision]:
        said_so = {*seen.could_not_start_on, seen.reporter_id}
        if not seen.recoverable and len(said_so) >= self.settings.fail_after_nodes:
            return [FailJob(seen.job_id, f"{seen.reason} (the stage could not start on {len(said_so)} different "
                                         f"nodes)")]
        source = refused_from(seen.failure, seen.reporter_id, seen.peers)
        if source is not None:
            return [Replan(seen.job_id, seen.reason, seen.failure, (source,))]
        return [Replan(seen.job_id, seen.reason, seen.failure, tuple(self.left_out(seen))),
                Blame(seen.reporter_id, seen.reason)]

    @staticmethod
    def left_out(seen: Report) -> list[str]:
        """Whom the re-plan leaves out: the peer the report names, else the reporter unless it trains on."""
        if not seen.recoverable:
            return [seen.reporter_id]
        named = seen.failure.peer_id if seen.failure is not None else None
        if named is not None and named in seen.members and named != seen.reporter_id \
                and seen.failure is not None and seen.failure.kind in (*PEER_KINDS, FailureKind.PEER_FAILED):
            return [named]
        return [] if seen.still_training else [seen.reporter_id]


def refused_from(failure: Failure | None, reporter_id: str, peers: Collection[str]) -> str | None:
    """The peer whose values the reporter refused, as not finite or as an outlier, where the failure names
    one of `peers` (those it exchanges values with: a refusal of anybody else's is the reporter's word
    about a node it never heard from, counted against itself)."""
    if failure is not None and failure.kind in (FailureKind.NAN, FailureKind.OUTLIER) and failure.peer_id in peers \
            and failure.peer_id != reporter_id:
        return failure.peer_id
    return None
