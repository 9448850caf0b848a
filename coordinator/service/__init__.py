"""The coordinator's operations, independent of HTTP: components with one concern each, given the
components they call (and nothing else) when they are built.

    Credentials   who a token belongs to; join tokens and API keys
    Artifacts     weights, checkpoints, snapshots, the merged model; where a re-plan continues from
    Recoveries    re-planning after a loss, a grow or a resume            (Artifacts)
    Rulings       carrying out what the failure rules decide               (Recoveries)
    Offers        the files nodes offer, and their proofs of holding them
    Placement     planning pending jobs onto idle nodes; growing jobs     (Offers, Recoveries)
    Membership    nodes join, beat and leave; the liveness tick           (Credentials, Offers, Placement,
                  (with its LinkProbes: which links a node measures,       Recoveries, Rulings)
                  Presence: beats that change nothing, the interval,
                  and Admission: a join, with keyed locks)
    JobLifecycle  submit, view, cancel, resume; metrics, failure reports  (Placement, Recoveries, Artifacts,
                                                                           Rulings, LinkProbes)

Each is given the `Core` too (core.py: settings, store, lock, clock, failure rules, lookups), which
also says what per-process state there is and why losing it is safe.
"""
from __future__ import annotations

from ..config import Settings
from ..db_locks import Lease
from ..store import Store
from .artifacts import Artifacts
from .core import Core
from .credentials import Credentials, Principal
from .lifecycle import JobLifecycle
from .membership import Membership
from .offers import Offers
from .placement import Placement
from .recovery import Recoveries
from .rulings import Rulings


class Coordinator:
    """Everything the REST API calls, by component."""

    def __init__(self, settings: Settings) -> None:
        self.core = Core(settings)
        self.lease = Lease(settings.database_url)  # whether this process runs the tick (db_locks.py)
        self.credentials = Credentials(self.core)
        self.artifacts = Artifacts(self.core)
        self.recoveries = Recoveries(self.core, self.artifacts)
        self.offers = Offers(self.core)
        self.placement = Placement(self.core, self.offers, self.recoveries)
        self.rulings = Rulings(self.core, self.recoveries)
        self.membership = Membership(self.core, self.credentials, self.offers, self.placement, self.recoveries,
                                     self.rulings)
        self.jobs = JobLifecycle(self.core, self.placement, self.recoveries, self.artifacts, self.rulings,
                                 self.membership.links)

    @property
    def store(self) -> Store:
        return self.core.store

    def close(self) -> None:
        self.membership.reachability.close()
        self.lease.close()
        self.core.lock.close()
        self.store.close()

    def tick(self) -> None:
        """What the coordinator does once per heartbeat interval (Membership.tick), in the process that
        holds the lease; the others only write their sightings. Every process writes its join tokens' uses."""
        if self.lease.held():
            self.membership.tick()
        else:
            self.membership.presence.flush()
        self.credentials.flush_uses()


__all__ = ["Coordinator", "Principal"]
