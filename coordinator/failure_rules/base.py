"""What every failure rule sees and says: observations in, decisions out.

An observation is one timestamped fact the coordinator learned (a stage's pace, a silent node, a stage
that stopped progressing, a failure report, a re-plan a node's word caused). A rule is a class that
observes one kind of them and answers with typed decisions; the services carry the decisions out (and
only they touch the store), so a rule is tested with plain values and a clock of its own.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Generic, TypeVar

from ravnest.failures import Failure

from ..config import Settings


# --- observations ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Observation:
    at: float  # wall-clock seconds (the coordinator's clock) when it was seen


@dataclass(frozen=True)
class StagePace(Observation):
    """What one stage of a running job measured in its latest report, and what the plan predicted."""
    job_id: str
    node_id: str
    who: str
    cluster: int
    stage: int
    step: int
    compute_s: float | None  # measured busy seconds per micro-batch, recent (None: not reported yet)
    predicted_s: float  # the plan's seconds per micro-batch
    flops: float  # its node's figure the plan used
    work_flops: float  # the stage's FLOPs per micro-batch, forward and backward


@dataclass(frozen=True)
class JobPace(Observation):
    """Every stage of one running job, as its latest reports left them (a pace is only slow next to others)."""
    job_id: str
    stages: tuple[StagePace, ...]


@dataclass(frozen=True)
class Silence(Observation):
    """A node that missed at least one heartbeat, and whether its cluster still steps."""
    node_id: str
    who: str  # how a user knows it: "c (2f8c...)"
    last_seen: float
    interval_s: float  # the heartbeat interval it was told: it grows with the number of nodes
    job_id: str | None = None  # the running job it holds a stage of
    cluster_step: int | None = None  # the furthest step its cluster's other stages reported (None: no such stage)
    usual_gap: tuple[float, float] | None = None  # its recent beats' mean gap and its spread, s (beat_history.py)


@dataclass(frozen=True)
class Stall(Observation):
    """A stage alone in its cluster, in a running job: when it (or the job) last changed."""
    job_id: str
    node_id: str
    who: str
    cluster: int
    stage: int
    step: int
    last_progress: float


@dataclass(frozen=True)
class Member:
    """A job's node as a report's rules see it."""
    id: str
    last_seen: float
    relayed_by: str | None = None  # the volunteer (or the coordinator) its peers reach it through
    interval_s: float | None = None  # the heartbeat interval it was told (None: the configured one)


@dataclass(frozen=True)
class Report(Observation):
    """A node's failure report on its job, with what the coordinator knows around it."""
    job_id: str
    reporter_id: str
    reason: str  # the headline a user reads (failure_reasons.py)
    failure: Failure | None
    recoverable: bool  # False: the stage could not start at all
    still_training: bool  # its stage trains on alone
    members: Mapping[str, Member]
    could_not_start_on: Collection[str]  # nodes whose earlier reports said the stage could not start
    peers: Collection[str] = ()  # the members the reporter exchanges values with (it can refuse only theirs)


@dataclass(frozen=True)
class Accusation(Observation):
    """A node refused a peer's values (not finite, or an outlier) and so says the peer lied; with what the
    coordinator remembers of earlier accusations (within `quarantine_window_s` or older: the rule looks)."""
    job_id: str
    accuser_id: str
    accused_id: str
    reason: str
    outlier: bool  # (not: values that were not finite)
    accusers: tuple[tuple[str, float], ...]  # who accused the accused before, and when
    accused: tuple[tuple[str, float, bool], ...]  # whom the accuser accused before, when, and whether another did too


@dataclass(frozen=True)
class Blamed(Observation):
    """A node's word (a report, handed-in weights) just caused a re-plan; `caused`: when its earlier ones did;
    `quarantined_until`: its last quarantine's end (the re-plans that began it were served)."""
    node_id: str
    reason: str
    caused: tuple[float, ...]
    quarantined_until: float | None = None


# --- decisions ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Decision:
    pass


@dataclass(frozen=True)
class NodeGone(Decision):
    node_id: str
    reason: str
    failure: Failure


@dataclass(frozen=True)
class Replan(Decision):
    """Re-plan the job without `left_out`; `failure` says why as data, `reason` in words."""
    job_id: str
    reason: str
    failure: Failure | None
    left_out: tuple[str, ...] = ()


@dataclass(frozen=True)
class FailJob(Decision):
    job_id: str
    reason: str


@dataclass(frozen=True)
class Spare(Decision):
    """Whatever else a rule decided, do not leave this node out (it is not the one that failed)."""
    node_id: str


@dataclass(frozen=True)
class AccusationRecord(Decision):
    """What to remember of accusations: who accused `node_id` (`accusers`), and whom it accused (`accused`),
    each with when, within the window."""
    node_id: str
    accusers: tuple[tuple[str, float], ...] | None = None  # None: leave as it is
    accused: tuple[tuple[str, float], ...] | None = None


@dataclass(frozen=True)
class Blame(Decision):
    """The re-plan counts against this node (its word or its relay caused it)."""
    node_id: str
    reason: str


@dataclass(frozen=True)
class Revoke(Decision):
    """The node's credential stops working (an operator setting asked for it on such a finding)."""
    node_id: str
    reason: str


@dataclass(frozen=True)
class CorrectFlops(Decision):
    """The node computes like `flops`, whatever its profile claimed: the planner believes this from now on."""
    node_id: str
    flops: float


@dataclass(frozen=True)
class BlameRecord(Decision):
    """When the re-plans the node's word caused happened, as far as they still count."""
    node_id: str
    caused: tuple[float, ...]


@dataclass(frozen=True)
class Quarantine(Decision):
    """Not placed and not believed until `until`."""
    node_id: str
    until: float
    reason: str


# --- rules ----------------------------------------------------------------------------------------

Seen = TypeVar("Seen", bound=Observation)


@dataclass
class Rule(Generic[Seen]):
    """One rule: what it observes, and what it decides. Thresholds are named settings (config.py)."""
    observes: ClassVar[type[Observation]]
    settings: Settings
    memory: dict = field(default_factory=dict)  # per-job state a rule keeps, keyed (job id, ...)

    def decide(self, observation: Seen) -> list[Decision]:
        raise NotImplementedError

    def forget(self, job_id: str) -> None:
        """The job was re-planned or ended: what was remembered of it no longer holds."""
        self.memory = {key: value for key, value in self.memory.items() if key[0] != job_id}
