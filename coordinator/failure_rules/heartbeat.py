"""A node that stopped sending heartbeats is gone: after `heartbeat_timeout_factor` missed intervals (the
interval it was told: it grows with the number of nodes, service/presence.py)."""
from __future__ import annotations

from ravnest.failures import Failure, FailureKind

from . import rule
from .base import Decision, NodeGone, Rule, Silence


@rule
class SilentNode(Rule[Silence]):
    observes = Silence

    def decide(self, seen: Silence) -> list[Decision]:
        silent_s = seen.at - seen.last_seen
        if silent_s < self.settings.heartbeat_timeout_factor * seen.interval_s:
            return []
        said = f"stopped sending heartbeats (last seen {silent_s:.0f} s ago)"
        return [NodeGone(seen.node_id, f"node {seen.who} {said}", Failure(
            kind=FailureKind.SILENT, message=said, peer_id=seen.node_id,
            detail=f"heartbeat_timeout_factor {self.settings.heartbeat_timeout_factor:g}"))]
