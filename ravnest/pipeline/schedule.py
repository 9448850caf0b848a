"""What one stage does, in which order: a pure function of the stage, the stage count, K, the
accumulation and the number of micro-batches (PipeDream's 1F1B, never flushed, with the backward
split as in zero-bubble pipelines). Timing decides only *when* an action runs, never *what* it
computes, so a seeded run gives the same weights bit for bit, however the threads are scheduled.

Stage s of S with staleness bound K warms up with w_s = max(1, K - s) forwards, then repeats
"backward of the oldest micro-batch, forward of a new one" (the last stage, w = 1, forwards and
backwards each micro-batch at once). w never grows along the pipeline, so stage s has sent
forward(i + w_{s+1} - 1) before it waits for backward(i): no stage waits on a message that its
neighbour would only send after hearing from it (no deadlock).

A backward is split (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): B computes the input
gradient, which is sent upstream at once, and W the weight gradient after it, while the upstream
stage already works on that gradient. The optimizer steps after every `accumulation`-th W, before
the next forward, so the weight version each forward uses is fixed:

    stage 0 of 2, K = 2:  RECV_F is data here
    F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 W0 STEP1 F2 SEND_F2 RECV_B1 B1 W1 STEP2 ...
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

from ravnest.errors import RavnestError

RECV_F, F, SEND_F, RECV_B, B, SEND_B, W, STEP = "RECV_F", "F", "SEND_F", "RECV_B", "B", "SEND_B", "W", "STEP"


@dataclass(frozen=True)
class Action:
    kind: str
    micro_batch: int  # for STEP: the optimizer step it completes (1 = the first)

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


def warmup(stage: int, num_stages: int, window: int) -> int:
    """Forwards stage `stage` runs before its first backward: K at stage 0, one less per stage, at
    least one, exactly one on the last stage."""
    return 1 if stage == num_stages - 1 else max(1, window - stage)


def stage_actions(stage: int, num_stages: int, window: int, micro_batches: int,
                  accumulation: int = 1) -> Iterator[Action]:
    """Every action of one stage, in order (a generator: a run may have millions of micro-batches).
    On stage 0, RECV_F draws the micro-batch from the data and there is no B (its input is data, W
    does the whole backward); the last stage's F includes the loss, and it sends nothing forward."""
    first, last = stage == 0, stage == num_stages - 1
    ahead = min(warmup(stage, num_stages, window), micro_batches)

    def forward(m: int) -> Iterator[Action]:
        yield Action(RECV_F, m)
        yield Action(F, m)
        if not last:
            yield Action(SEND_F, m)

    for m in range(ahead):
        yield from forward(m)
    for m in range(micro_batches):
        if not last:
            yield Action(RECV_B, m)
        if not first:
            yield Action(B, m)
            yield Action(SEND_B, m)
        yield Action(W, m)
        if (m + 1) % accumulation == 0:
            yield Action(STEP, (m + 1) // accumulation)
        if m + ahead < micro_batches:
            yield from forward(m + ahead)


def steps_before_next_forward(micro_batch: int, stage: int, num_stages: int, window: int, micro_batches: int,
                              accumulation: int = 1) -> bool:
    """Whether the optimizer steps after the forward of `micro_batch` before this stage's next forward
    (always, after the last one): that forward is then the last on its weight version."""
    ahead = min(warmup(stage, num_stages, window), micro_batches)
    if micro_batch == micro_batches - 1:
        return True
    return micro_batch >= ahead - 1 and (micro_batch + 2 - ahead) % accumulation == 0


def staleness(micro_batch: int, stage: int, num_stages: int, window: int, accumulation: int = 1) -> int:
    """Optimizer steps this stage takes between the forward of `micro_batch` and its backward: how
    far the weights its forward uses lag the weights its gradient is applied to."""
    ahead = warmup(stage, num_stages, window)
    steps_at_forward = 0 if micro_batch < ahead else (micro_batch - ahead + 1) // accumulation
    return micro_batch // accumulation - steps_at_forward


def staleness_method(setting: str, window: int) -> str:
    """The compensation `training.staleness` means with K = `window`: "auto" is second-order weight
    prediction while at most one update can fall between a forward and its gradient (K <= 2), where it
    is as accurate as synchronous training for 2% of the speed, and PipeDream-2BW with it beyond, where
    prediction alone falls short (docs/pipeline.md has the figures)."""
    if setting != "auto":
        return setting
    return "predict2" if window <= 2 else "2bw+predict2"


def prediction_order(method: str) -> int:
    """How far weight prediction extrapolates: 0 (none), 1 (along the last update) or 2 (along its change
    too, "predict2")."""
    return 2 if method.endswith("predict2") else int(method.endswith("predict"))


def batch_parts(method: str, window: int, batch_size: int, accumulation: int = 1) -> int:
    """Micro-batches each batch is cut into: with PipeDream-2BW, enough that a step's micro-batches
    (`accumulation` batches' parts) cover the K in flight, so that at most one update falls between a
    forward and its gradient (at most one part per sample); else 1. K = 4 cuts a batch into 4 parts
    with accumulation 1, into 2 with accumulation 2, and none with accumulation 4 or more: K whole
    batches are then in flight, which is how a pipeline keeps a long round trip busy (docs/pipeline.md)."""
    return min(-(-window // accumulation), batch_size) if method.startswith("2bw") else 1


class ScheduleError(RavnestError, ValueError):
    """A stage's list of actions breaks a rule every schedule must keep (`validate_schedule`)."""


def validate_schedule(actions: Iterable[Action], stage: int, num_stages: int, window: int, micro_batches: int,
                      accumulation: int = 1) -> None:
    """Check a stage's actions before it runs them, as torch.distributed.pipelining's _validate_schedule
    does: each micro-batch goes through its actions once and in order (RECV_F F SEND_F, then RECV_B B
    SEND_B W; stage 0 has no B, the last stage neither SEND_F nor RECV_B), micro-batches start and
    finish in order, at most `window` are in flight, step k comes right after the W of its last
    micro-batch (no forward may slip in before it: that would change the weights the forward uses), and
    every micro-batch and step is there. ScheduleError names the first action that breaks a rule."""
    first, last = stage == 0, stage == num_stages - 1
    order = [kind for kind in (RECV_F, F, SEND_F, RECV_B, B, SEND_B, W)
             if not (last and kind in (SEND_F, RECV_B)) and not (first and kind in (B, SEND_B))]
    done: dict[int, int] = {}  # micro-batch in flight -> how many of its actions ran
    started = finished = steps = 0
    for index, action in enumerate(actions):
        kind, m = action.kind, action.micro_batch
        where = f"stage {stage} of {num_stages} (K={window}), action {index} ({action})"
        due = finished // accumulation  # the steps the finished micro-batches make
        if kind == STEP:
            if m != steps + 1 or m != due:
                raise ScheduleError(f"{where}: step {steps + 1} is next, and only after the W of micro-batch "
                                    f"{(steps + 1) * accumulation - 1} ({finished} done)")
            steps = m
            continue
        if due > steps:
            raise ScheduleError(f"{where}: step {due} must come first, right after W{finished - 1}")
        if kind not in order:
            raise ScheduleError(f"{where}: this stage has no {kind} actions")
        if m not in done:
            if kind != order[0] or m != started:
                raise ScheduleError(f"{where}: micro-batch {started} starts next, with {order[0]}")
            if started - finished >= window:
                raise ScheduleError(f"{where}: more than K = {window} micro-batches would be in flight")
            done[m], started = 0, started + 1
        if order[done[m]] != kind:
            raise ScheduleError(f"{where}: {order[done[m]]}{m} comes next for micro-batch {m}")
        done[m] += 1
        if kind == W:
            if m != finished:
                raise ScheduleError(f"{where}: W{finished} comes first")
            del done[m]
            finished += 1
    if finished != micro_batches or steps != micro_batches // accumulation or done:
        raise ScheduleError(f"stage {stage} of {num_stages} (K={window}): the schedule ends with {finished} of "
                            f"{micro_batches} micro-batches done and {steps} of {micro_batches // accumulation} steps")


def check_stage_schedule(stage: int, num_stages: int, window: int, micro_batches: int,
                         accumulation: int = 1) -> None:
    """Validate the schedule a stage is about to run, when it is built. A schedule is periodic, so a run
    of a few more steps than its warm-up shows every rule at work (warm-up, steady state and drain
    alike): that twin is checked, never millions of actions."""
    shown = min(micro_batches, accumulation * (window + 4))
    validate_schedule(stage_actions(stage, num_stages, window, shown, accumulation), stage, num_stages, window,
                      shown, accumulation)
