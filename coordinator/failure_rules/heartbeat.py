"""A node that stopped sending heartbeats is suspect, and gone only on more evidence.

Missed beats alone say little on the internet: a volunteer's laptop busy for 8 seconds, a Wi-Fi hiccup
or a long pause in the node's process delays them (32 nodes on one 2-core host "stopped sending
heartbeats" while every one of them ran). So a node silent for `heartbeat_timeout_factor` of its own
intervals (the one it was told: it grows with the number of nodes, service/presence.py), or longer
where its own recent beats wandered more (an accrual detector: beat_history.py), is *suspect*: not
placed, not waited for, but not re-planned around. It is gone

- where it holds a stage of a pipeline: once its cluster has made no step for as long again. Each
  stage waits on its neighbours, so a cluster whose other stages still step has it alive, whatever its
  beats say; one that stopped stepping has lost it (its neighbours' reports usually say so first);
- otherwise (idle, or alone in its cluster), after `heartbeat_dead_factor` intervals of silence (and
  at least twice its suspicion's threshold).

Worked example (interval 2 s, factors 3 and 10): last beat at 100 s. At 106 s it is suspect; its
cluster's other stages are at step 40. At 110 s they report 44: alive. At 116 s still 44, no step for
6 s: gone, "stopped sending heartbeats (last seen 16 s ago) and its cluster made no step for 6 s".
Idle, it would be gone at 120 s.
"""
from __future__ import annotations

from ravnest.failures import Failure, FailureKind

from ..beat_history import suspect_after_s

from . import rule
from .base import Decision, NodeGone, Rule, Silence


@rule
class SilentNode(Rule[Silence]):
    observes = Silence

    def decide(self, seen: Silence) -> list[Decision]:
        silent_s, settings = seen.at - seen.last_seen, self.settings
        key = (seen.job_id or "", seen.node_id)
        suspect_s = suspect_after_s(settings.heartbeat_timeout_factor * seen.interval_s, seen.usual_gap)
        if silent_s < suspect_s:
            return []
        usual = f"; its beats came every {seen.usual_gap[0]:.1f} s +- {seen.usual_gap[1]:.1f} lately" \
            if seen.usual_gap else ""
        said = f"stopped sending heartbeats (last seen {silent_s:.0f} s ago{usual})"
        if silent_s >= max(settings.silence_dead_factor * seen.interval_s, 2 * suspect_s):
            self.memory.pop(key, None)
            return [self._gone(seen, said, f"heartbeat_dead_factor {settings.silence_dead_factor:g}")]
        if seen.cluster_step is None:
            return []  # no second source: only a long silence convicts it
        last_seen, step, since = self.memory.get(key, (None, None, None))
        if last_seen != seen.last_seen or seen.cluster_step > step:  # a new silence, or a step
            self.memory[key] = (seen.last_seen, seen.cluster_step, seen.at)
            return []
        if seen.at - since < suspect_s:
            return []
        del self.memory[key]
        return [self._gone(seen, f"{said} and its cluster made no step for {seen.at - since:.0f} s",
                           f"heartbeat_timeout_factor {settings.heartbeat_timeout_factor:g}, twice")]

    @staticmethod
    def _gone(seen: Silence, said: str, detail: str) -> NodeGone:
        return NodeGone(seen.node_id, f"node {seen.who} {said}", Failure(
            kind=FailureKind.SILENT, message=said, peer_id=seen.node_id, detail=detail))
