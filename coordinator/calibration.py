"""A node's compute figure, corrected by what its stages measured.

A profile is one matmul benchmark at join. It says what the hardware peaks at, not what a stage of a
real model computes like there, with its owner's programs and other nodes beside it: on one 2-core
machine four identical nodes joined at 17 to 82 GFLOP/s, and a 2 x 2 llama was predicted at 248
samples/s and ran at 127. The planner predicts a stage's compute seconds per micro-batch as

    predicted = (3 F / flops + overhead) x slowdown        (partition.compute_seconds)

and every stage report measures them. A node's slowdown is the geometric running mean of
measured / predicted-with-slowdown-1 over its reports, each weighing WEIGHT against all before it:
after some 1/WEIGHT reports its last job dominates, so a node is judged by its recent jobs. The
first `slow_after_steps` steps of a run are not counted (kernels warming up, the pipeline filling).

Worked example, WEIGHT 0.1: a node measured 1.0 for one job. Its next job's stages compute 3.0x
their slowdown-1 prediction: after one report 1.0^0.9 x 3.0^0.1 = 1.12, after ten 1.0^0.35 x 3.0^0.65
= 2.05, after thirty 2.86.

A slowdown stays within [1, BOUND]. Its stages' reports are the node's own word: one that says it
computes faster than its profile is not believed (else a liar would multiply the claim it joined
with), and a liar who claimed a million times its compute is caught by the slow-stage rule
(failure_policy.py), which corrects the figure itself and starts the slowdown over.

An idle node measures its matmul figure again now and then (`ravnest-node join --reprofile-every`).
The profile takes the new figure, and a slowdown is rescaled so that what the node computes like
stays what its jobs measured: only a node that has not trained yet is planned differently, such as
one that joined while others trained beside it and looked too slow to be given work. Until its first
job measures it, a node is planned with the median slowdown of the nodes that were measured (`prior`).
"""
from __future__ import annotations

import math
import statistics

from ravnest.partition import NodeCapacity, compute_seconds

from .store import NodeRow

WEIGHT = 0.1
BOUND = 100.0


def observed_slowdown(measured_s: float, forward_flops: float, flops: float) -> float | None:
    """Measured compute seconds per micro-batch over what `flops` predicts at slowdown 1; None if
    there is nothing to compare (no measurement, no figure)."""
    if not (measured_s > 0 and flops > 0 and math.isfinite(measured_s)):
        return None
    predicted = compute_seconds(forward_flops, NodeCapacity(flops=flops, memory_bytes=0, bandwidth_to_next=1.0))
    return min(BOUND, max(1.0, measured_s / predicted))


def blended(previous: float | None, observed: float) -> float:
    """The slowdown after one more report (see the module docstring); the first report sets it."""
    if previous is None:
        return observed
    return math.exp((1 - WEIGHT) * math.log(previous) + WEIGHT * math.log(observed))


def prior(slowdowns: list[float | None]) -> float:
    """What a node no job has measured yet is planned with: the median slowdown of those that were
    (1 when none was). Identical machines then look identical before and after their first job, and a
    newcomer does not look faster than its measured peers only because it is new."""
    known = sorted(s for s in slowdowns if s is not None)
    return statistics.median(known) if known else 1.0


def remeasured(node: NodeRow, flops: float) -> None:
    """An idle node's matmul figure, measured again (see the module docstring)."""
    if node.slowdown is not None:
        node.slowdown = min(BOUND, max(1.0, node.slowdown * flops / float(node.profile["flops"])))
    node.profile = {**node.profile, "flops": flops}
