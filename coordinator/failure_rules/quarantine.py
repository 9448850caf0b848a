"""A node whose word (failure reports, handed-in weights) caused `quarantine_after` re-plans within
`quarantine_window_s` is quarantined, not placed and not believed, for `quarantine_s`, with the reason
shown in `ravnest nodes`. A liar thus costs a job one re-plan, and the volunteer pool a few an hour."""
from __future__ import annotations

from . import rule
from .base import BlameRecord, Blamed, Decision, Quarantine, Rule


@rule
class Quarantined(Rule[Blamed]):
    observes = Blamed

    def decide(self, seen: Blamed) -> list[Decision]:
        recent = (*(at for at in seen.caused if seen.at - at < self.settings.quarantine_window_s), seen.at)
        if len(recent) < self.settings.quarantine_after:
            return [BlameRecord(seen.node_id, recent)]
        return [BlameRecord(seen.node_id, ()), Quarantine(
            seen.node_id, seen.at + self.settings.quarantine_s,
            f"what it reported caused {len(recent)} re-plans within {self.settings.quarantine_window_s:.0f} s; "
            f"the last: {seen.reason}")]
