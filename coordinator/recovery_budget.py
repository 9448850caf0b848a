"""How many re-plans after a loss a job has left: a budget that follows progress.

A job starts with `placement.max_recoveries` re-plans. Each re-plan after a loss spends one, and every
REFILL_SHARE of the job's steps trained past the furthest step any earlier loss reached (new steps, not
steps trained again after a re-plan) gives one back, up to the start. A job that keeps making progress
is not failed by a count of re-plans (on a crowd of volunteers, one leaves now and then); one that
re-plans again and again without moving on fails after `max_recoveries` of them (a node that loses
every pipeline it is put in, placement that cannot hold).

Worked example, max_recoveries 3, a job of 1,000 steps (one re-plan back every 100 new steps):

    losses at steps  120  130  140  150      -> left 2, 1, 0, then -1: the fourth fails the job
    losses at steps  120  400  700  950      -> left 2, 2, 2, 2: before each later loss the new steps
                                                (280, 300, 250) gave back what the one before spent
                                                (3 at most), so it never fails
    losses at steps  120  170  220  270  320 -> 50 new steps each: one back every second loss,
                                                left 2, 1, 1, 0, 0: a slow crawl forward is allowed too

Losses are counted since the job was last resumed by hand (a resume starts the budget over), and growing
onto new nodes is no loss (coordinator/service/recovery.py).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

REFILL_SHARE = 0.1  # of a job's steps, trained anew, gives one re-plan back


def recoveries_left(max_recoveries: int, total_steps: int, loss_steps: Sequence[int]) -> int:
    """Re-plans left after losses at `loss_steps` (the step the job had reached at each, oldest first,
    the one being decided included); below 0, the last one is past the budget."""
    every = max(1, math.ceil(REFILL_SHARE * total_steps))
    left, furthest, credit = max_recoveries, None, 0
    for step in loss_steps:
        if furthest is not None and step > furthest:
            credit += step - furthest
            left, credit = min(max_recoveries, left + credit // every), credit % every
        furthest = step if furthest is None else max(furthest, step)
        left -= 1
    return left
