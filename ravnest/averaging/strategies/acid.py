"""Strategy "acid" (A2CiD2, Nabli, Belilovsky and Oyallon, NeurIPS 2023, arXiv 2306.08289): asynchronous
pairwise gossip with a continuous momentum. Gradient steps never wait for communication.

Each replica keeps its weights x and a second copy x~. Three kinds of events change them:

- a gradient step moves both by the same update;
- a pairwise averaging with neighbour j: x~ += alpha~ (x_j - x), x <- (x + x_j) / 2;
- between events they mix continuously for the time tau since the last event (in gradient steps):
  x, x~ <- ((1+e)/2) x + ((1-e)/2) x~, ((1-e)/2) x + ((1+e)/2) x~, e = exp(-2 eta tau) (`mix`; it
  keeps x + x~). Here it is applied once per gradient step with tau = 1 (mixing is a semigroup in tau).

A replica keeps the gap d = x~ - x rather than x~ itself, which makes each event one pass over the
weights: a gradient step leaves d as it is (nothing to do), mixing is x += ((1-e)/2) d, d *= e, and an
averaging with g = x_j - x is x += g / 2, d += (alpha~ - 1/2) g (`gap_mixing`, `gap_averaging`).

eta and alpha~ come from the graph's Laplacian L = rate (I - W), W the random walk on the graph and
`rate` the averagings per gradient step: chi1 = 1 / lambda_2(L), chi2 = max over edges of
(1/2) (e_i - e_j)^T L^+ (e_i - e_j), eta = 1 / (2 sqrt(chi1 chi2)), alpha~ = (1/2) sqrt(chi1 / chi2)
(`acid_constants`), or given (`acid_eta`, `acid_alpha`); eta = 0 is the plain asynchronous pairwise
baseline.

Asynchrony: a communication thread per segment runs averaging events 0, 1, 2, ... while the stage
trains. Event k pairs every member with one neighbour by a fixed matching (`partner`: on the ring,
alternately the right and the left neighbour; on the exponential graph, hypercube neighbours
i XOR 2^h), so both ends run the same event. Event k may start once this member has taken k / rate
gradient steps (`acid_rate`), or, with `acid_poisson`, the k-th arrival of a Poisson process of that
rate whose arrival times every member draws from the same seed: then all members run the same
number of events by the end. An event exchanges the latest published snapshot of x with the
partner and computes its two corrections; the stage adds the corrections of finished events after
its next step and never waits for one. A slow member therefore slows its partners' communication,
not their computation. `finish` runs the remaining events, then sets every replica to the exact
average, like the other gossip strategies.
"""
from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ravnest.timeouts import PEER_SILENCE_S
from ravnest.averaging.layout import FlatLayout, canonical_keys
from ravnest.averaging.collectives import RingError, RingMember
from pydantic import Field

from ravnest.averaging.registry import StrategySettings
from ravnest.averaging.strategy import GroupStrategy, StageContext, group_member, register_strategy

GRAPHS = ("ring", "exponential")
FINAL_ROUND = 1 << 40


def neighbours(topology: str, rank: int, size: int) -> list[int]:
    """The graph's neighbours of `rank` (with repeats where a small graph wraps onto itself)."""
    if topology == "ring":
        return [(rank - 1) % size, (rank + 1) % size]
    hops = int(math.log2(size))
    return [(rank + sign * 2**h) % size for h in range(hops) for sign in (-1, 1)]


def partner(topology: str, rank: int, size: int, event: int) -> int | None:
    """Whom `rank` averages with in event `event` (None: it sits this one out, an odd ring's end)."""
    if size < 2:
        return None
    if topology == "ring":
        other = rank + 1 if (rank + event) % 2 == 0 else rank - 1
        if 0 <= other < size:
            return other
        return other % size if size % 2 == 0 else None
    return rank ^ (1 << (event % int(math.log2(size))))


def acid_constants(topology: str, size: int, rate: float) -> tuple[float, float]:
    """(eta, alpha~) from the Laplacian of `topology` over `size` members at `rate` averagings per
    gradient step (see the module docstring)."""
    walk = np.zeros((size, size))
    for i in range(size):
        around = neighbours(topology, i, size)
        for j in around:
            walk[i, j] += 1 / len(around)
    laplacian = rate * (np.eye(size) - walk)
    chi1 = 1 / np.linalg.eigvalsh(laplacian)[1]
    pseudo = np.linalg.pinv(laplacian)
    chi2 = max(0.5 * (pseudo[i, i] + pseudo[j, j] - 2 * pseudo[i, j])
               for i in range(size) for j in neighbours(topology, i, size) if j != i)
    return 0.5 / math.sqrt(chi1 * chi2), 0.5 * math.sqrt(chi1 / chi2)


def mix(x: torch.Tensor, tilde: torch.Tensor, eta: float, tau: float = 1.0) -> None:
    """The continuous momentum over time `tau`, in place; x + x~ does not change."""
    e = math.exp(-2 * eta * tau)
    difference = (x - tilde).mul_(e)  # x - x~ decays by e; their sum stays
    total = x + tilde
    torch.add(total, difference, out=x).mul_(0.5)
    torch.sub(total, difference, out=tilde).mul_(0.5)


def gap_mixing(eta: float, tau: float = 1.0) -> tuple[float, float]:
    """`mix` on (x, d = x~ - x): x += shift d, d *= decay; returns (shift, decay)."""
    e = math.exp(-2 * eta * tau)
    return (1 - e) / 2, e


def gap_averaging(gap: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A pairwise averaging on (x, d) with g = x_j - x (consumed): the changes (dx, dd) to add."""
    return gap * 0.5, gap.mul_(alpha - 0.5)


@dataclass
class _Segment:
    member: RingMember  # (or a TorchGroup: the same interface)
    layout: FlatLayout
    gap: torch.Tensor         # x~ - x
    published: torch.Tensor   # the latest x the training thread published
    pending: torch.Tensor     # the sum of the finished averagings' dx it has not taken yet
    pending_gap: torch.Tensor  # ... and of their dd
    lock: threading.Lock = field(default_factory=threading.Lock)
    untaken: int = 0          # how many finished averagings those sums hold
    events: int = 0
    thread: threading.Thread = field(default_factory=threading.Thread)  # replaced by its communication thread


class AcidSettings(StrategySettings):
    rate: float = Field(1.0, gt=0, le=64, description="pairwise averagings per gradient step")
    poisson: bool = Field(False, description="averagings at Poisson times of that rate (the same on every "
                          "member) instead of evenly spaced")
    eta: float | None = Field(None, ge=0, le=100, description="the momentum's mixing rate (default: from the "
                              "graph's Laplacian; 0: plain asynchronous pairwise averaging)")
    alpha: float | None = Field(None, ge=0, le=100, description="the momentum's step on an averaging (default: "
                                "from the graph's Laplacian)")


@register_strategy("acid", settings=AcidSettings, gossip=True, waits_for_peers=False,
                   flat_keys={"acid_rate": "rate", "acid_poisson": "poisson", "acid_eta": "eta",
                              "acid_alpha": "alpha"})
class AsyncPairwiseMomentum(GroupStrategy):
    name = "acid"

    def __init__(self, context: StageContext, *, step_timeout: float = PEER_SILENCE_S):
        a, settings = context.assignment, context.assignment.averaging
        self.live, self.device, self._companions = context.live, torch.device(context.device), context.companions
        self.rank, self.size = a.cluster, a.num_clusters
        self.topology = settings.topology if settings.topology in GRAPHS else "ring"
        if self.topology == "exponential" and self.size & (self.size - 1):
            self.topology = "ring"  # the hypercube matching needs a power of two
        own: AcidSettings = settings.of("acid")
        self.rate = own.rate
        eta, alpha = acid_constants(self.topology, self.size, self.rate) if self.size > 1 else (0.0, 0.0)
        self.eta = own.eta if own.eta is not None else eta
        self.alpha = own.alpha if own.alpha is not None else alpha
        # arrival times (in gradient steps) of the averaging events, the same on every member
        steps = a.training.steps - a.resume_step
        count = int(self.rate * steps)
        if own.poisson:
            draw = random.Random(a.training.seed)
            arrivals, t = [], 0.0
            while True:
                t += draw.expovariate(self.rate)
                if t > steps:
                    break
                arrivals.append(t)
        else:
            arrivals = [k / self.rate for k in range(count)]
        self._arrivals = arrivals
        self._steps_done: float = 0  # math.inf once finishing
        self._progress = threading.Condition()
        self._stopping = threading.Event()
        self._segments: list[_Segment] = []
        for ring in a.rings:
            layout = FlatLayout(self.live, canonical_keys(self.live, ring.blocks))
            x = layout.flatten(self.live)
            self._segments.append(_Segment(group_member(context, ring, step_timeout=step_timeout), layout,
                                           torch.zeros_like(x), x, torch.zeros_like(x), torch.zeros_like(x)))
        self.comm_s = 0.0
        self._failure: BaseException | None = None  # a communication thread's, raised on the training thread
        for segment in self._segments:
            segment.thread = threading.Thread(target=self._communicate, args=(segment,), daemon=True,
                                              name=f"ravnest-acid-{segment.member.segment}")
            segment.thread.start()

    # --- the training thread ------------------------------------------------------------------------

    def after_step(self, step: int) -> None:
        """The step moved x and x~ alike (d unchanged); add the finished averagings; mix for one step;
        publish x."""
        self._raise_failure()
        shift, decay = gap_mixing(self.eta)
        for segment in self._segments:
            with segment.lock:  # taken and published at once: an averaging sees every earlier one
                self._take_finished(segment)
                if self.eta:
                    segment.layout.add_into(segment.gap, self.live, *self._companions(), alpha=shift)
                    segment.gap.mul_(decay)
                segment.layout.flatten(self.live, out=segment.published)
        with self._progress:
            self._steps_done += 1
            self._progress.notify_all()

    def finish(self) -> None:
        """Run the remaining events, add them, then set every replica to the exact average."""
        with self._progress:
            self._steps_done = math.inf
            self._progress.notify_all()
        for segment in self._segments:
            segment.thread.join()
        self._raise_failure()
        for segment in self._segments:
            with segment.lock:
                self._take_finished(segment)
            average = segment.member.allreduce(segment.layout.flatten(self.live), FINAL_ROUND, codec="")
            with torch.no_grad():  # copied, not added: every replica ends with exactly the same bits
                for key, value in segment.layout.views(average).items():
                    self.live[key].copy_(value)

    def abort(self) -> None:
        self._stopping.set()
        with self._progress:
            self._progress.notify_all()
        super().abort()

    def close(self) -> None:
        self.abort()
        for segment in self._segments:
            if segment.thread is not None:
                segment.thread.join()

    def metrics(self) -> dict[str, float]:
        events = sum(segment.events for segment in self._segments)
        figures = {"avg_rounds": float(events), "avg_eta": self.eta, "avg_alpha": self.alpha}
        if events:
            figures["avg_round_s"] = self.comm_s / events
        return figures

    # --- the communication threads -------------------------------------------------------------------

    def _communicate(self, segment: _Segment) -> None:
        """Events 0, 1, ... as this member's steps allow, each with the event's partner."""
        snapshot = torch.empty_like(segment.published)
        try:
            for event, arrival in enumerate(self._arrivals):
                with self._progress:
                    while self._steps_done < arrival and not self._stopping.is_set():
                        self._progress.wait()
                if self._stopping.is_set():
                    return
                other = partner(self.topology, self.rank, self.size, event)
                if other is None:
                    continue
                with segment.lock:  # x as it stands: published, plus the averagings not taken yet
                    torch.add(segment.published, segment.pending, out=snapshot)
                started = time.perf_counter()
                theirs = segment.member.exchange(snapshot, event, [other], [other], codec="")[other]
                self.comm_s += time.perf_counter() - started
                dx, dgap = gap_averaging(theirs.sub_(snapshot), self.alpha)  # x_j - x
                with segment.lock:
                    segment.pending.add_(dx)
                    segment.pending_gap.add_(dgap)
                    segment.untaken += 1
                    segment.events += 1
        except BaseException as exc:  # the training thread raises it at its next step
            if not self._stopping.is_set():
                self._failure = exc

    def _take_finished(self, segment: _Segment) -> None:
        """Add the finished averagings' sums to x and d (holding the segment's lock)."""
        if segment.untaken:
            segment.gap.add_(segment.pending_gap)
            segment.layout.add_into(segment.pending, self.live, *self._companions())
            segment.pending.zero_()
            segment.pending_gap.zero_()
            segment.untaken = 0

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise RingError(f"acid averaging failed: {self._failure}") from self._failure
