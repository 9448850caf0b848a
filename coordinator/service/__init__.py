"""The coordinator's operations, independent of HTTP, one concern per module: credentials (who a
token belongs to; join tokens and API keys), membership (nodes join, beat and leave), placement
(liveness tick, placing and growing jobs), the job lifecycle, recovery (re-planning after losses)
and artifacts (weights, checkpoints, models)."""
from .artifacts import Artifacts
from .credentials import Credentials, Principal
from .lifecycle import JobLifecycle
from .membership import Membership
from .placement import Placing
from .recovery import Recoveries


class Coordinator(Credentials, Membership, Placing, JobLifecycle, Recoveries, Artifacts):
    """Everything the REST API calls; see each base class."""


__all__ = ["Coordinator", "Principal"]
