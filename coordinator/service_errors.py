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
    """What a node handed in cannot be what it says it is (the job re-plans without the node)."""

    def __init__(self, detail: str, node_id: str) -> None:
        super().__init__(detail)
        self.node_id = node_id


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
