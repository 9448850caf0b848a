"""How many micro-batches a pipeline keeps in flight so that its links' round trips do not idle it,
and what a step of it then takes.

A micro-batch's cycle is every stage's time plus every link's round trip; with K in flight the
slowest stage is busy while K x its time covers that cycle. K is bounded by a step's micro-batches
(more would let two updates fall between a forward and its gradient) and by what each stage's node
holds (memory grows with K).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from ravnest.models.profile import BlockCost
from ravnest.partition import Load, NodeCapacity, stage_memory_bytes
from ravnest.pipeline.memory import training_load
from ravnest.spec import TrainingSettings


# micro-batches in flight per what the predicted cycle needs: stage times are predicted up to 2x off (a small
# stage runs faster than its fixed costs say), links jitter, and K beyond the need costs only memory (checked)
HEADROOM = 2
WORTH_HIDING = 1.05  # round trips that slow a pipeline with K = its stages by less than 5% are left be


def in_flight_for(costs: list[BlockCost], ranges: list[tuple[int, int]], weakest: list[NodeCapacity], load: Load,
                   training: TrainingSettings, times_of: Callable[[Load], list[float]],
                   round_trips: list[float]) -> tuple[Load, str]:
    """The load with K micro-batches in flight that keep the slowest stage busy while the others cross
    the links: a micro-batch's cycle (every stage's time and every link's round trip) over the slowest
    stage's time, twice over (HEADROOM). No more than a step's micro-batches (`training.accumulation` whole
    batches: more would let two updates fall between a forward and its gradient), nor than every
    stage's node holds; no fewer than the stages. With it, what the plan says about K ("" when K is
    the default and that is enough).

    Worked example: stages of 5 ms and a 100 ms link need ceil(2 x (5 + 5 + 100) / 5) = 44 in flight.
    With accumulation 1, K stays 2 (cutting the batch into more parts would shorten each micro-batch,
    not the link), and the plan says that accumulation 44 would hide the link; with accumulation 64
    the pipeline keeps 44 whole batches in flight."""
    depth, most = len(ranges), max(len(ranges), training.accumulation)
    # K above the stages only where a step has that many whole batches; their times hold for any such K
    times = times_of(with_in_flight(load, training, depth, most) if most > depth else load)
    cycle = sum(times) + sum(round_trips)
    if cycle / depth <= WORTH_HIDING * max(times):
        return load, ""
    need = math.ceil(HEADROOM * cycle / max(times))
    k, chosen = min(need, most), load
    while k > depth:
        chosen = with_in_flight(load, training, depth, k)
        if all(stage_memory_bytes(costs, a, b, chosen) <= node.memory_bytes for (a, b), node in zip(ranges, weakest)):
            break
        k, chosen = k - 1, load
    trips = f"the links' {'/'.join(f'{rtt * 1e3:.0f}' for rtt in round_trips)} ms round trips"
    if k == need:
        return chosen, f"{k} micro-batches in flight for {trips}"
    batches = f"{training.accumulation} batch{'' if training.accumulation == 1 else 'es'}"
    why = (f"a step has {batches} (training.accumulation) and more in flight would add staleness" if k == most
           else "the weakest node's memory holds no more")
    return chosen, (f"{trips} need {need} micro-batches in flight to keep the slowest stage busy; it keeps {k}, as "
                    f"{why}: accumulation {need} would hide them, or microbatches_in_flight {need} with staleness "
                    f"'predict2' at more staleness")


def with_in_flight(load: Load, training: TrainingSettings, depth: int, k: int) -> Load:
    """`load` with K = k (and the parts and weight versions that come with it)."""
    fresh = training_load(training, depth, averaging=load.averaging_copies > 0, in_flight=k)
    return dataclasses.replace(fresh, split_backward=load.split_backward)


def compute_step_s(stage_times: list[float], load: Load, training: TrainingSettings,
                    round_trips: Sequence[float] = ()) -> float:
    """Seconds per optimizer step of one pipeline from its stages' seconds per micro-batch and its links'
    round trips: its slowest stage, or a micro-batch's cycle (every stage, every round trip) over K, for
    each of the step's micro-batches."""
    cycle = sum(stage_times) + sum(round_trips)
    return training.accumulation * load.parts * max(max(stage_times), cycle / load.in_flight)
