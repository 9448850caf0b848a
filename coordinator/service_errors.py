"""Domain errors the service raises; the HTTP layer turns each into its status code and reason."""
from __future__ import annotations

from ravnest.errors import RavnestError


class CoordinatorError(RavnestError):
    status_code = 400

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class InvalidRequest(CoordinatorError):
    status_code = 422


class Implausible(InvalidRequest):
    """What a node handed in cannot be what it says it is. `blame`: it is the node's own doing (the job
    re-plans without it); else it may have reached the node from its peers, and nobody is left out."""

    def __init__(self, detail: str, node_id: str, blame: bool = True) -> None:
        super().__init__(detail)
        self.node_id, self.blame = node_id, blame


class Unauthorized(CoordinatorError):
    status_code = 401


class Forbidden(CoordinatorError):
    status_code = 403


class NotFound(CoordinatorError):
    status_code = 404


class Conflict(CoordinatorError):
    status_code = 409


class TooLarge(CoordinatorError):
    status_code = 413


class TooMany(CoordinatorError):
    status_code = 429
