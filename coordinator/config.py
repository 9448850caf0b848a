"""Settings of one coordinator process."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .dial_rules import Network


@dataclass
class Settings:
    data_dir: Path = Path("ravnest-data")
    db_url: str | None = None  # SQLAlchemy URL; default: SQLite file in data_dir
    # Volunteers join with the join token; the operator's token opens every job and node endpoint (and
    # may join too). Unset: made once and kept in data_dir/join_token and data_dir/operator_token.
    join_token: str | None = None
    operator_token: str | None = None
    heartbeat_interval_s: float = 2.0
    node_credential_ttl_s: float = 86400.0  # a node silent this long must join again
    node_retention_s: float = 7 * 86400.0  # a node gone this long is forgotten (pruned from the store)
    # a node is suspect after this many missed intervals (its own), gone on more evidence or after
    # heartbeat_dead_factor of them (coordinator/failure_rules/heartbeat.py)
    heartbeat_timeout_factor: float = 3.0
    heartbeat_dead_factor: float = 10.0
    # beats a second all nodes together send at most: past heartbeat_rate x heartbeat_interval_s live nodes
    # the interval grows (service/presence.py), and so does the time it takes to notice a lost node
    heartbeat_rate: float = 100.0
    placement_debounce_s: float = 0.5  # joins and offers ask for a placement; it runs at most this often
    recovery_wait_s: float = 120.0  # a recovering job waits this long at most for its nodes' state
    recovery_silence_intervals: float = 2.0  # ... and not for a member silent this many heartbeat intervals
    # a re-plan waits this many of their intervals for the nodes its last run released to beat again
    # before it plans on fewer (a busy host's late beats are not a smaller crowd: service/placement.py)
    replan_wait_intervals: float = 3.0
    # a stage this many times slower than planned, and than its cluster's other stages, is re-planned
    # around (coordinator/failure_rules/slow_stage.py), once it is slow_after_steps in and has been slow in
    # every report for slow_window_s (nodes report every heartbeat interval)
    slow_factor: float = 8.0
    slow_after_steps: int = 20
    slow_window_s: float = 6.0
    # a stage alone in its job (no peers to compare with) this many times slower than its node's profile
    # promised: the profile was a lie (a tiny stage on a crowded machine measured up to 9.2x), corrected
    claim_factor: float = 100.0
    # a stage alone in its cluster that reports nothing for this long while its job runs (nobody else
    # would notice it stalled; a pipeline's neighbours time out after 300 s and name it) is left out
    stall_s: float = 900.0
    # handed-in weights are implausible where a tensor's RMS exceeds this many times its initial RMS
    # (at least 1): training does not grow weights a hundredfold without diverging first
    weight_growth_bound: float = 100.0
    # no single node decides a job's fate (failure_rules/reports.py): a job fails at a report that it cannot
    # start only once that many different nodes said so; a node whose reports caused quarantine_after
    # re-plans within quarantine_window_s is not placed for quarantine_s
    fail_after_nodes: int = 2
    quarantine_after: int = 3
    quarantine_window_s: float = 3600.0
    quarantine_s: float = 1800.0
    # a node most members of a robust averaging round found sending contributions far beyond theirs is left
    # out of the job (failure_rules/reports.py); once corroborate_after different nodes accused it within
    # quarantine_window_s it is blamed, and with revoke_outliers its credential is revoked (accusations.py)
    revoke_outliers: bool = False
    corroborate_after: int = 2
    # ... and an accusation nobody else made this long after it counts against its accuser (the other
    # members of a robust round report the same outliers within seconds)
    corroborate_within_s: float = 60.0
    grow_after_s: float = 10.0  # a job runs this long on its nodes before new ones may join it
    grow_gain: float = 0.2  # ... and only if the planner predicts this much more throughput with them
    max_upload_bytes: int = 8 << 30  # hard cap on one stage's weights upload
    # limits checked before any work (coordinator/limits.py): what one request or job may ask for
    max_request_bytes: int = 1 << 20  # a JSON body (a job spec is a few hundred bytes)
    body_grace_s: float = 10.0  # ... which must come within this, plus its length at 16 KiB/s (limits.py)
    max_blocks: int = 4096  # blocks in a model
    max_parameters: float = 20e9  # parameters in a model (from the meta-device profile)
    pipeline_cap: int = 16  # most stages in one pipeline; bigger groups become several replicas
    probe_peers: int = 2  # links an idle node is asked to measure at a time (0: never ask)
    probe_retry_s: float = 30.0  # ask again for a link that was asked for but not reported by then
    # the built-in relay (ravnest/relay) that nodes peers cannot dial listen on: on relay_host, at
    # relay_port (0: a free port), each such node getting a free port there too; None: no relay
    relay_port: int | None = None
    relay_node_ports: range | None = None  # the ports its nodes get (None: any free one)
    relay_bytes_per_s: float | None = None  # its link's bandwidth, shared by the nodes it relays (None: unknown)
    relay_host: str = "127.0.0.1"
    host: str = "127.0.0.1"  # where the coordinator listens (--host)
    # the networks it dials nodes' addresses in (--dial-allow); None: any address a volunteer may give but
    # loopback, which it dials only where it listens on loopback itself (coordinator/dial_rules.py)
    dial_allow: tuple[Network, ...] | None = None
    # run the periodic reaper/placer task and dial joining nodes back (tests drive `tick` themselves,
    # and their nodes at made-up addresses count as reachable: not known to be otherwise)
    background: bool = True
    clock: Callable[[], float] = field(default=time.time, repr=False)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)

    @property
    def database_url(self) -> str:
        return self.db_url or f"sqlite:///{(self.data_dir / 'coordinator.db').resolve()}"

    @property
    def silence_dead_factor(self) -> float:
        """Intervals of silence that convict a node on their own: never under twice the suspect's."""
        return max(self.heartbeat_dead_factor, 2 * self.heartbeat_timeout_factor)

    @property
    def heartbeat_timeout_s(self) -> float:
        return self.heartbeat_interval_s * self.heartbeat_timeout_factor

    @property
    def recovery_silence_s(self) -> float:
        """While its job recovers, a member silent this long is not waited for (nor its relay blamed)."""
        return self.heartbeat_interval_s * self.recovery_silence_intervals
