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

A node keeps its figures per model besides its overall ones: the same node computed a gpt 2.3x
slower than a llama's learned slowdown predicted (bench.prediction), so a job is planned with each
node's figures on its model where they were measured (`planned`).

A slowdown stays within [1, BOUND]. Its stages' reports are the node's own word: one that says it
computes faster than its profile is not believed (else a liar would multiply the claim it joined
with), and a liar who claimed a million times its compute is caught by the slow-stage rule
(failure_policy.py), which corrects the figure itself and starts the slowdown over.

An idle node measures its matmul figure again now and then (`ravnest-node join --reprofile-every`).
The profile takes the new figure, and a slowdown is rescaled so that what the node computes like
stays what its jobs measured: only a node that has not trained yet is planned differently, such as
one that joined while others trained beside it and looked too slow to be given work. Until its first
job measures it, a node is planned with the median slowdown of the nodes that were measured (`prior`).

The messages between stages are corrected the same way. The plan counts each activation or gradient
a stage sends at its bytes over the link and a fixed cost per message m (partition.MESSAGE_OVERHEAD_S,
1 ms until measured): serialising, the wire's threads, waking the receiver. A pipeline of S stages with
K micro-batches in flight is paced at

    pace = max( max over sending stages of (c + x + 2 m),  c of the last stage,
                (sum of all (c + x + 2 m) + sum of the links' round trips r) / K )

with c a stage's measured compute seconds per micro-batch, x its link's seconds (the last stage
sends nothing) and r a link's probed round trip, which holds a micro-batch up but occupies no stage.
Every stage reports its wall seconds per step, so the m that gives the pace measured is found
(`observed_message_s`) and blended into each node of the pipeline like its slowdown. Four nodes sharing
two cores here measured 0.2-0.7 ms (bench.prediction).

A node's bandwidth is a claim too: its profile times a download from the coordinator, and a node can
send any figure. Its peers measure its links (the idle nodes' link probes, LinkProbes) and, while it
trains, its pipeline neighbours measure what their streams to it carry (bytes per step over the
seconds the stream was busy). Each of those measures the slower end of a link, so none says how fast
the node is; but a node is not LIE_FACTOR times faster than every link any peer measured to it.
Where the measurements of at least EVIDENCE other nodes are all that far below its claim (so one
lying peer cannot pull an honest node's figure down), the claim is not believed: the planner counts
the fastest of them instead (`measured_bandwidth`), and the coordinator says so. What crosses a relay
measures the relay's path, so a relayed node's claim and a relayed measurer's figures are not used
(on loopback, probes through a relay came out far below honest claims). An honest node's
links measure about what its own download from the coordinator did, so only a liar's figure moves (a
lie that placed a node on stage 0 claimed 1e10 B/s against 1.8-3.6e8 measured).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from ravnest.partition import NodeCapacity, compute_seconds

from .schemas import PlannedStage
from .store import NodeRow

WEIGHT = 0.1
BOUND = 100.0
LIE_FACTOR, EVIDENCE = 10.0, 2  # a bandwidth claim this far above this many measurements is not believed
MESSAGE_S = (1e-4, 1.0)  # the bounds of a learned message cost: below, timer noise; above, not a message


def observed_slowdown(measured_s: float, forward_flops: float, flops: float) -> float | None:
    """Measured compute seconds per micro-batch over what `flops` predicts at slowdown 1; None if
    there is nothing to compare (no measurement, no figure)."""
    if not (measured_s > 0 and flops > 0 and math.isfinite(measured_s)):
        return None
    predicted = compute_seconds(forward_flops, NodeCapacity(flops=flops, memory_bytes=0, bandwidth_to_next=1.0))
    return min(BOUND, max(1.0, measured_s / predicted))


def observed_message_s(pace_s: float, stages: Sequence[tuple[float, float | None]], in_flight: int,
                       round_trips: Sequence[float] = ()) -> float | None:
    """The message cost m that gives the measured `pace_s` (seconds per micro-batch) in the model of the
    module docstring; `stages` are each stage's (c, x), x None for the last stage, and `round_trips` the
    links' probed round trips, which a micro-batch's cycle crosses too. None where there is nothing to
    learn from: one stage, or a figure missing.

    Worked example: stages (3 ms, 1 ms) and (4 ms, None), K = 2, paced at 10 ms. Stage 0 gives
    m = (10 - 3 - 1) / 2 = 3 ms; the round trip (3 + 1 + 4 + 2 m) / 2 = 10 ms would need m = 6 ms. The
    smaller is the answer: with m = 3 ms stage 0 takes the 10 ms measured and the round trip 7 ms."""
    senders = [(c, x) for c, x in stages if x is not None]
    if not senders or not pace_s > 0 or not all(c >= 0 and math.isfinite(c) for c, _ in stages):
        return None
    by_stage = (pace_s - max(c + x for c, x in senders)) / 2
    cycle = sum(c + (x or 0.0) for c, x in stages) + sum(round_trips)
    by_round_trip = (in_flight * pace_s - cycle) / (2 * len(senders))
    low, high = MESSAGE_S
    return min(high, max(low, min(by_stage, by_round_trip)))


def reported_stages(stages: Sequence[PlannedStage], compute_s: Mapping[int, float | None]
                    ) -> list[tuple[float, float | None]] | None:
    """Each planned stage's (c, x) for `observed_message_s`: c the compute seconds it reported, x what its
    predicted time has beyond compute and its two messages (None for the last stage). None while a stage
    has not reported yet, or for a plan from before message costs."""
    pairs = []
    for planned in stages:
        c, message_s = compute_s.get(planned.stage), planned.predicted_message_seconds
        if c is None or message_s is None or planned.predicted_compute_seconds is None:
            return None
        rest = planned.predicted_seconds - planned.predicted_compute_seconds - 2 * message_s
        pairs.append((c, None if planned is stages[-1] else max(0.0, rest)))
    return pairs


def blended(previous: float | None, observed: float) -> float:
    """The slowdown after one more report (see the module docstring); the first report sets it."""
    if previous is None:
        return observed
    return math.exp((1 - WEIGHT) * math.log(previous) + WEIGHT * math.log(observed))


def prior(figures: list[float | None], default: float = 1.0) -> float:
    """What a node no job has measured yet is planned with: the median slowdown (or message cost) of
    those that were, `default` when none was. Identical machines then look identical before and after
    their first job, and a newcomer does not look faster than its measured peers only because it is new."""
    known = sorted(s for s in figures if s is not None)
    return statistics.median(known) if known else default


def remeasured(node: NodeRow, flops: float) -> None:
    """An idle node's matmul figure, measured again (see the module docstring)."""
    def rescaled(slowdown: float) -> float:
        return min(BOUND, max(1.0, slowdown * flops / float(node.profile["flops"])))
    if node.slowdown is not None:
        node.slowdown = rescaled(node.slowdown)
    node.by_model = {model: {name: rescaled(value) if name == "slowdown" else value for name, value in figures.items()}
                     for model, figures in (node.by_model or {}).items()}
    node.profile = {**node.profile, "flops": flops}


def measured(node: NodeRow, model: str, figure: str, observed: float) -> None:
    """One more report of a stage of `model`: blends `observed` into the node's `figure` ("slowdown"
    or "message_s"), overall and on that model."""
    setattr(node, figure, blended(getattr(node, figure), observed))
    on_model = dict((node.by_model or {}).get(model, {}))
    on_model[figure] = blended(on_model.get(figure), observed)
    node.by_model = {**(node.by_model or {}), model: on_model}


def refuted_bandwidth(claimed: float, measured_by_others: Mapping[str, float]) -> float | None:
    """The bytes/s to plan a node with instead of its `claimed` figure, or None where the claim stands
    (see the module docstring); `measured_by_others`: each peer that measured its links -> the fastest
    it found. Worked example: a claim of 1e10 against {a: 3.6e8, b: 1.8e8}: 3.6e8."""
    if len(measured_by_others) < EVIDENCE:
        return None
    fastest = max(measured_by_others.values())
    return fastest if claimed > LIE_FACTOR * fastest else None


def forget_slowdowns(node: NodeRow) -> None:
    """Its compute figure was corrected outright (failure_policy.py): slowdowns measured against the
    old one mean nothing now."""
    node.slowdown = None
    node.by_model = {model: {k: v for k, v in figures.items() if k != "slowdown"}
                     for model, figures in (node.by_model or {}).items()}


def planned(nodes: Sequence[NodeRow], model: str, figure: str, default: float) -> dict[str, float]:
    """What each node is planned with for a job of `model`, of `figure` ("slowdown" or "message_s"):
    its own on that model; else the median of the nodes' measured on it (what a model costs over its
    FLOPs is mostly the model's); else its own on any model; else the median of those; else `default`."""
    on_model = {node.id: (node.by_model or {}).get(model, {}).get(figure) for node in nodes}
    if any(on_model.values()):
        model_prior = prior(list(on_model.values()))
        return {node.id: on_model[node.id] or model_prior for node in nodes}
    overall = prior([getattr(node, figure) for node in nodes], default)
    return {node.id: getattr(node, figure) or overall for node in nodes}
