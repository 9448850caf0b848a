"""A node whose word (failure reports, handed-in weights) caused `quarantine_after` re-plans within
`quarantine_window_s` is quarantined, not placed and not believed, for `quarantine_s`, with the reason
shown in `ravnest nodes`. A liar thus costs a job one re-plan, and the volunteer pool a few an hour.
The re-plans are kept past the quarantine (a blame withdrawn later lifts the quarantine it tipped, and
the others count again) but not counted again once it began."""
from __future__ import annotations

from ..config import Settings
from . import rule
from .base import BlameRecord, Blamed, Decision, Quarantine, Rule


@rule
class Quarantined(Rule[Blamed]):
    observes = Blamed

    def decide(self, seen: Blamed) -> list[Decision]:
        recent = (*(at for at in seen.caused if seen.at - at < self.settings.quarantine_window_s), seen.at)
        counted = [at for at in recent if not served(at, seen.quarantined_until, self.settings)]
        if len(counted) < self.settings.quarantine_after:
            return [BlameRecord(seen.node_id, recent)]
        return [BlameRecord(seen.node_id, recent), Quarantine(
            seen.node_id, seen.at + self.settings.quarantine_s,
            f"what it reported caused {len(counted)} re-plans within {self.settings.quarantine_window_s:.0f} s; "
            f"the last: {seen.reason}")]


def served(at: float, quarantined_until: float | None, settings: Settings) -> bool:
    """Whether a quarantine ending at `quarantined_until` began at or after `at` (so it served a re-plan then)."""
    return quarantined_until is not None and at + settings.quarantine_s <= quarantined_until
