"""A stage far slower than its cluster is re-planned around like a lost one.

A stage's pace is its compute per micro-batch (busy seconds in training: waiting for peers and
evaluation passes do not count) over the plan's prediction. It is slow where that ratio exceeds
`slow_factor` times its peers' median ratio (at least 1): the other stages of its cluster, or where it
is alone in its cluster, the job's other stages. Both the plan and the peers are needed: on a machine
several nodes share, every stage runs slower than predicted; a node that is slow on its own stands out.
It is re-planned around once it has been slow in every report for `slow_window_s` seconds, and
`slow_after_steps` steps in (kernels warm up, the pipeline fills).

The factor is 8 because 4 re-planned healthy nodes: with four nodes on two cores and stages of a few ms,
where Python's fixed cost per action (which the plan does not count) dominates, a normal stage measured
up to 9.2x its prediction while its peers were at 2.3x. A node held to 8% of a core measured 30-46x
(tests/test_faults.py); a pipeline runs at its slowest stage's pace, so a stage 8x slower than planned
costs its whole cluster about that much.

A stage alone in its job has no peers. Its FLOPs over its compute time, less the plan's fixed cost per
micro-batch, are what its node computes like; it is slow once its profile claimed `claim_factor` (100)
times that, which no crowding explains but a false profile does (1e17 FLOP/s claimed by a CPU is a
million times off).

A node's profile is a claim, and a slow stage is the measurement that refutes it: the node's figure is
corrected to what it measured (with peers, the FLOP/s at which the plan would have predicted the
slowness its peers showed), and the planner uses that figure from then on. A node that lied about its
compute loses its work once measured, and keeps no advantage.
"""
from __future__ import annotations

import math
import statistics

from ravnest.failures import Failure, FailureKind
from ravnest.partition import STAGE_OVERHEAD_S

from . import rule
from .base import CorrectFlops, Decision, JobPace, Replan, Rule, StagePace


@rule
class SlowStage(Rule[JobPace]):
    observes = JobPace

    def decide(self, seen: JobPace) -> list[Decision]:
        ratios = {s: s.compute_s / s.predicted_s for s in seen.stages if s.compute_s is not None and s.predicted_s > 0}
        for stage, ratio in ratios.items():
            slow, measured, said, rule_words = self._judge(stage, ratio, ratios)
            key = (seen.job_id, stage.node_id)
            if not slow or stage.step < self.settings.slow_after_steps:
                self.memory.pop(key, None)
                continue
            since = self.memory.setdefault(key, seen.at)  # when this run of slow reports began
            if seen.at - since < self.settings.slow_window_s:
                continue
            del self.memory[key]
            failure = Failure(kind=FailureKind.SLOW, message=said, peer_id=stage.node_id, step=stage.step,
                              detail=f"{rule_words}, slow in every report for {seen.at - since:.0f} s")
            return [CorrectFlops(stage.node_id, measured),
                    Replan(seen.job_id, f"node {stage.who} is too slow: cluster {stage.cluster} stage {stage.stage} "
                                        f"{said}; re-planning without it", failure, (stage.node_id,))]
        return []

    def _judge(self, stage: StagePace, ratio: float,
               ratios: dict[StagePace, float]) -> tuple[bool, float, str, str]:
        """(slow, the FLOP/s its node computes like, what it measured in words, the rule that judged)."""
        cluster = [r for s, r in ratios.items() if s is not stage and s.cluster == stage.cluster]
        others = cluster or [r for s, r in ratios.items() if s is not stage]
        if others:
            peers = max(1.0, statistics.median(others))
            whose = "the other stages of its cluster" if cluster else "the job's other stages"
            said = (f"computes a micro-batch in {ratio * stage.predicted_s * 1e3:.0f} ms, {ratio:.1f}x the "
                    f"{stage.predicted_s * 1e3:.0f} ms planned ({whose}: {peers:.1f}x)")
            return (ratio > self.settings.slow_factor * peers, stage.flops * peers / ratio, said,
                    f"slow_factor {self.settings.slow_factor:g}")
        compute_s = ratio * stage.predicted_s - STAGE_OVERHEAD_S
        measured = stage.work_flops / compute_s if compute_s > 0 else math.inf
        said = (f"computes like {measured / 1e9:,.1f} GFLOP/s, where its profile claimed "
                f"{stage.flops / 1e9:,.1f} (a micro-batch in {ratio * stage.predicted_s * 1e3:,.1f} ms, "
                f"not {stage.predicted_s * 1e3:,.1f})")
        return (stage.flops > self.settings.claim_factor * measured, measured, said,
                f"claim_factor {self.settings.claim_factor:g}")
