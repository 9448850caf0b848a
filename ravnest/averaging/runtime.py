"""The runtime model: predicted seconds per optimizer step under each averaging strategy.

Each strategy declares its own figure where it registers (`cost` in `registry.py`); the formulas are
collected here, and the helpers they share (`half_allreduce_s`, `ring_round_s`, `slowest_of`) live here.

Inputs: `step_s`, the compute seconds of one optimizer step of the slowest replica (every strategy
here waits for its peers, so the slowest one sets the pace), and per averaging group (one per
segment: the stage holding it in every cluster) its `Group`: members n, parameter bytes P, and the
slowest link around it, bandwidth B (bytes/s) and latency L (s). The groups of a stage run side by
side, so a step costs what its slowest group costs. With the ring all-reduce's two halves,

    RS(P) = AG(P) = (n - 1) (P / (n B) + L)          AR(P) = RS + AG    (bandwidth-optimal ring)

the strategies cost (T = step_s):

- `ring`, every E steps: the round started after step s is applied after step s + D, D = max(1, E // 2),
  so it stalls only past D steps of compute, once per E steps: T + max(0, AR - D T) / E. `diloco`
  (H = E) the same with `streaming`, else D = 0: T + AR / E.
- `allreduce` (reference only, no strategy: bucketed all-reduce of the gradients after the backward,
  as DDP without overlap): T + AR + (k - 1) 2 (n - 1) L, with k fusion groups.
- `dear`: with k groups, RS = AG = (n - 1) (P / (n B) + k L). With the fine-grained overlap (one-stage
  clusters) the reduce-scatter hides behind the backward, b = 2/3 of T, except at least its last
  group's part, and the all-gather behind the forward, f = 1/3 of T, except its first group's part:
  T + max(RS / k, RS - b T) + max(AG / k, AG - f T). Inside deeper pipelines: T + RS + AG.
- `dsgd` / `dadam` with a topology, every E steps: in round t a member sends its segment to its
  out-neighbours and hears from its in-neighbours, d(t) = the larger count, one at a time, each
  asked for first where paced (`link_bound`; see `RingMember.exchange`), costing d(t) (P / B + 2 L)
  (unpaced: d(t) (P / B + L));
  the exchange is applied before the next step, so it hides behind one step: T + max(0, X - T) / E,
  with X the mean over a period of rounds of the slowest member's d(t) (P / B + 2 L).

Stragglers: a step's compute time varies (sd `step_sd_s`, measured; 0 when unknown), and whatever waits
for m members waits for the slowest, on average e(m) sd later than the mean, with e(m) the expected
largest of m standard normals (Blom: e(m) = Phi^-1((m - 0.375) / (m + 0.25)); e(1) = 0, e(4) = 1.05,
e(8) = 1.43). So a round that needs all n members (ring, diloco, dear, the reference all-reduce) lasts
e(n) sd longer, sd sqrt(E) when E steps of compute lie between rounds; a gossip round waits for the
member and its in-neighbours, e(1 + degree) sd.

Overlap needs a core to spare: where every core of a node is computing (several nodes sharing one
machine, as in tests and benchmarks here) communication takes its CPU from the compute, and each
strategy costs T plus all it moves per step (`spare_core=False`; ring: T + AR / E, dear: T + RS + AG,
gossip: T + X / E). The planner assumes one node per machine, with a core to spare.

`auto` picks the fastest predicted strategy among those that declare an `auto_rank` (registry.py);
within 5% it prefers the more synchronous one (the lower rank: dear, then ring, then gossip): exact
averages cost nothing extra there.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from statistics import NormalDist

from typing import Any, Callable

from ravnest.averaging.fusion import MB
from ravnest.averaging.registry import NO_AVERAGING, CostInputs, Group, auto_candidates, strategy_info
from ravnest.averaging.topology import TOPOLOGIES, mixing_row

BACKWARD_SHARE = 2 / 3  # of a step's compute: the backward costs about twice the forward
AUTO_TOLERANCE = 1.05
DEFAULT_FUSION_BYTES = 25 * MB  # the reference all-reduce's buckets (DDP's default)


def half_allreduce_s(group: Group, messages: int = 1) -> float:
    """Seconds of a reduce-scatter (or an all-gather) of the group's parameters in `messages` groups."""
    n = group.members
    return (n - 1) * (group.param_bytes / (n * group.bandwidth) + messages * group.latency)


def slowest_of(members: float) -> float:
    """e(m): how many standard deviations the slowest of m members' step times lies above their mean."""
    return NormalDist().inv_cdf((members - 0.375) / (members + 0.25)) if members > 1 else 0.0


def link_bound(step_s: float, groups: Sequence[Group]) -> bool:
    """Whether some group's segment takes longer on its slowest link than a step's compute: there gossip
    is paced (`averaging.paced`): a vector pushed early would only share the link with the last one."""
    return any(g.members > 1 and g.param_bytes / g.bandwidth > step_s for g in groups)


def fusion_count(param_bytes: float, fusion_bytes: float) -> int:
    return max(1, math.ceil(param_bytes / fusion_bytes))


def strategy_step_s(strategy: str, step_s: float, groups: Sequence[Group], *, every: int = 1,
                    topology: str = "one-peer-exp", spare_core: bool = True, step_sd_s: float = 0.0,
                    paced: bool | None = None, settings: Any = None) -> float:
    """Predicted seconds per optimizer step (see the module docstring) under `strategy`, a registered
    strategy with a `cost`, "none", or the reference "allreduce". Without `spare_core` (every core of
    the node is computing, e.g. several nodes sharing one machine) nothing hides: each strategy pays its
    communication in full, T + (what it moves per step). `step_sd_s`: the spread of one step's compute
    time, which rounds that wait for several members pay. `paced`: whether gossip rounds are paced
    (None: as the planner decides, `link_bound`). `settings`: the strategy's own (None: its defaults)."""
    if strategy == NO_AVERAGING or not groups or all(g.members < 2 for g in groups):
        return step_s
    if strategy == "allreduce":  # in buckets of `settings.fusion_mb` (dear's settings), else DDP's default
        fusion = DEFAULT_FUSION_BYTES if settings is None else settings.fusion_mb * MB
        return max(allreduce_step_s(step_s, g, fusion, step_sd_s) for g in groups if g.members > 1)
    info = strategy_info(strategy)
    if info.cost is None:
        raise ValueError(f"the runtime model has no figure for strategy {strategy!r}")
    settings = info.settings() if settings is None else settings
    paced = link_bound(step_s, groups) if paced is None else paced
    return max(info.cost(CostInputs(step_s, g, every, topology, spare_core, step_sd_s, paced, settings))
               for g in groups if g.members > 1)


def straggler_s(c: CostInputs) -> float:
    """How late the last member of a group comes to a round that waits for all of them."""
    return c.step_sd_s * slowest_of(c.group.members) * math.sqrt(c.every)


def ring_round_s(c: CostInputs, delay: int) -> float:
    """A ring all-reduce every E steps, applied `delay` steps after it started: T + max(0, AR - D T) / E."""
    return c.step_s + max(0.0, 2 * half_allreduce_s(c.group) + straggler_s(c) - delay * c.step_s) / c.every


def allreduce_step_s(t: float, g: Group, fusion_bytes: float, sd: float = 0.0) -> float:
    """The reference: a bucketed all-reduce of the gradients after the backward (DDP without overlap)."""
    k = fusion_count(g.param_bytes, fusion_bytes)
    return t + 2 * half_allreduce_s(g) + (k - 1) * 2 * (g.members - 1) * g.latency + sd * slowest_of(g.members)


@lru_cache(maxsize=256)
def mean_degree(topology: str, members: int) -> float:
    """A member's messages per round, averaged over enough rounds to cover a time-varying topology's
    period. In every topology here member i hears i minus a fixed set of offsets (on the grid for the
    torus), so each member sends as many messages as it hears and member 0 stands for all: O(degree)
    per round, not O(n^2)."""
    rounds = 2 * max(1, math.ceil(math.log2(max(members, 2))))
    return sum(len(mixing_row(topology, 0, members, t)) - 1 for t in range(rounds)) / rounds


def candidates(optimizer: str) -> list[tuple[str, str]]:
    """(strategy, topology) pairs `auto` chooses among, most synchronous first, as the strategies
    declare (`auto_rank`, `fits`: dear, ring, then gossip, "dadam" for Adam-type optimizers, else
    "dsgd"); a gossip strategy once per topology."""
    return [(info.name, topology) for info in auto_candidates(optimizer)
            for topology in (TOPOLOGIES if info.gossip else ("",))]


def predictions(step_s: float, groups: Sequence[Group], *, every: int, optimizer: str, spare_core: bool = True,
                step_sd_s: float = 0.0, settings: Callable[[str], Any] | None = None) -> dict[str, float]:
    """Predicted seconds per step for each candidate ("dear", "ring", "dadam:ring", ...) and the
    reference "allreduce" (in buckets of dear's fusion size). `settings(name)`: a strategy's own
    settings (None: every strategy's defaults)."""
    own = settings or (lambda name: strategy_info(name).settings())
    table = {(f"{strategy}:{topology}" if topology else strategy): strategy_step_s(
        strategy, step_s, groups, every=every, topology=topology or "one-peer-exp", spare_core=spare_core,
        step_sd_s=step_sd_s, settings=own(strategy)) for strategy, topology in candidates(optimizer)}
    table["allreduce"] = strategy_step_s("allreduce", step_s, groups, step_sd_s=step_sd_s, settings=own("dear"))
    return table


def pick(table: dict[str, float]) -> tuple[str, str]:
    """The (strategy, topology) `auto` runs: the fastest candidate, preferring the earlier (more
    synchronous) one within AUTO_TOLERANCE."""
    choices = [name for name in table if name != "allreduce"]
    best = min(table[name] for name in choices)
    name = next(name for name in choices if table[name] <= AUTO_TOLERANCE * best)
    strategy, _, topology = name.partition(":")
    return strategy, topology
