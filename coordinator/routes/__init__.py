"""The REST API by concern, each an APIRouter over the one `Coordinator` service (`app.state.service`):
`site` (health, docs, login, dashboard, Prometheus), `nodes`, `credentials`, `jobs`, and `reports`
(what nodes send and fetch while they train). coordinator/app.py puts them together."""
from __future__ import annotations

from fastapi import Header, Query, Request
from fastapi.responses import Response

from ..service import Coordinator, Principal

AUTH = Header(None, description="Bearer <token>: the join token for POST /v1/nodes, else the node token")
LIMIT = Query(100, ge=1, le=1000, description="most items in this page")
OFFSET = Query(0, ge=0, le=1 << 31, description="items to skip (the page starts after them)")


def service(request: Request) -> Coordinator:
    return request.app.state.service


def principal(request: Request) -> Principal:
    return request.state.principal  # set by the Authentication gate


def own_jobs(request: Request) -> str | None:
    """The key whose jobs alone this caller may see and act on; None: every job."""
    who = principal(request)
    return None if who.reads_every_job else who.id


def acting_on(request: Request) -> str | None:
    """Cancelling, resuming, downloading: an operator acts on any job, a submitter on its own."""
    who = principal(request)
    return None if who.is_operator else who.id


def paged(response: Response, items: list, total: int) -> list:
    response.headers["X-Total-Count"] = str(total)
    return items
