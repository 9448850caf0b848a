"""A report says a relayed node was lost, but the node still heartbeats: its relay lost or withheld what
it carried. The node is spared (a node that is gone is not placed anyway) and the relay is blamed."""
from __future__ import annotations

from . import rule
from .base import Blame, Decision, Report, Rule, Spare


@rule
class RelayBlame(Rule[Report]):
    observes = Report

    def decide(self, seen: Report) -> list[Decision]:
        lost = seen.members.get(seen.failure.peer_id or "") if seen.failure else None
        if lost is None or not lost.relayed_by:
            return []
        alive = lost.last_seen >= seen.at - self.settings.recovery_silence_s * (
            (lost.interval_s or self.settings.heartbeat_interval_s) / self.settings.heartbeat_interval_s)
        return [Spare(lost.id), *([Blame(lost.relayed_by, seen.reason)] if alive else [])]
