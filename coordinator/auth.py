"""Who may call what, decided from the request line and headers alone, before any body is read.

    open       /healthz, the API docs and their assets, /login, /logout
    join       POST /v1/nodes (joining), GET /v1/probe (bandwidth, before joining): a join token
    node       a node's own calls: heartbeat, offers and leave (/v1/nodes/{id}/...), its job reports and
               uploads (/v1/jobs/{id}/metrics|fail|weights|checkpoint|state): that node's credential
    reader     seeing jobs and nodes (GET /v1/jobs[/{id}[/curve|/events]], GET /v1/nodes, the dashboard,
               /metrics, GET /v1/whoami), a one-time dashboard link (POST /v1/dashboard-link): any API
               key; a submitter's key sees its own jobs only
    submitter  submitting, and cancelling, resuming and downloading a job: a submitter key (its own
               jobs, checked by the service) or an operator key
    operator   everything else (join tokens, keys, revoking nodes): an operator key

A call no endpoint answers passes through to 404 or 405 (no body is read). A key is sent as a
bearer header, or as the cookie /login sets for the dashboard. An operator key
may also join. The principal the token belongs to is handed on in `scope["state"]["principal"]`;
the service checks finer rules on top (a node reports only on its own stage, a submitter acts on
its own jobs). A stranger never gets as far as a parsed body.
"""
from __future__ import annotations

from typing import Callable, Literal

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = {"/healthz", "/docs", "/redoc", "/openapi.json", "/login", "/logout"}
OPEN_PREFIXES = ("/static/",)  # the docs' assets
NODE_REPORTS = {"metrics", "fail", "weights", "checkpoint", "state"}
NODE_CALLS = {"heartbeat", "offers"}  # /v1/nodes/{id}/heartbeat|offers
SUBMITTER_ACTIONS = {"cancel", "resume", "model"}
JOB_VIEWS = {"curve", "events"}  # GET /v1/jobs/{id}/curve|events: what the job view shows, live
COOKIE = "ravnest_key"


# what a call needs: nothing, a join token, a node's own credential, or an API key of at least a role
Need = Literal["open", "join", "node", "reader", "submitter", "operator"]


def required(method: str, path: str) -> Need:
    """What a call needs."""
    if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
        return "open"
    parts = path.strip("/").split("/")
    if (path in ("/", "/metrics", "/v1/whoami") and method == "GET") or (path == "/v1/dashboard-link"
                                                                         and method == "POST"):
        return "reader"
    if parts == ["v1", "probe"]:
        return "join"
    if parts[:2] == ["v1", "nodes"]:
        if len(parts) == 2:
            return "join" if method == "POST" else "reader"
        if (len(parts) == 3 and method == "DELETE") or (len(parts) == 4 and parts[3] in NODE_CALLS):
            return "node"
    if parts[:2] == ["v1", "jobs"]:
        if len(parts) == 4 and parts[3] in NODE_REPORTS:
            return "node"
        if len(parts) == 2:
            return "submitter" if method == "POST" else "reader"
        if method == "GET" and (len(parts) == 3 or (len(parts) == 4 and parts[3] in JOB_VIEWS)):
            return "reader"
        if len(parts) == 4 and parts[3] in SUBMITTER_ACTIONS:
            return "submitter"
    return "operator"


def refusal(needed: str, who) -> str | None:
    """Why `who` (a Principal) may not make a call that needs `needed`; None if it may."""
    allowed = {"join": who.kind == "join" or who.is_operator,
               "node": who.kind == "node",
               "reader": who.kind == "key",
               "submitter": who.kind == "key" and who.role in ("submitter", "operator"),
               "operator": who.is_operator}[needed]
    if allowed:
        return None
    needs = {"join": "a join token", "node": "the node's own credential", "reader": "an API key",
             "submitter": "a submitter or operator key", "operator": "an operator key"}[needed]
    return f"this needs {needs}, not the {who.describe()}"


class Authentication:
    """ASGI middleware: 401 with the reason for a missing, unknown, expired or revoked token, 403 for
    a known one that may not make this call. `identify(token)` returns the Principal or a refusal."""

    def __init__(self, app: ASGIApp, *, identify: Callable[[str], object], routed: Callable[[str, str], bool]):
        self.app = app
        self.identify = identify
        self.routed = routed  # (method, path) -> is there an endpoint? If not, the app answers 404 or 405

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        needed = required(scope["method"], scope["path"])
        if needed == "open" or not self.routed(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        scheme, _, token = headers.get("authorization", "").partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        if not token and needed in ("reader", "submitter", "operator"):
            token = _cookie(headers.get("cookie", ""), COOKIE)
        who = (await run_in_threadpool(self.identify, token) if token
               else "missing 'Authorization: Bearer <token>' header")
        reason: str | None
        if isinstance(who, str):
            status, reason = 401, who
        else:
            status, reason = 403, refusal(needed, who)
        if reason is None:
            scope.setdefault("state", {})["principal"] = who
            await self.app(scope, receive, send)
            return
        response: Response
        if scope["path"] == "/" and scope["method"] == "GET" and status == 401:  # a person: log in first
            response = RedirectResponse("/login", status_code=303)
        else:
            # closed after it: the body, unread, is not waited for (nor held) while the caller keeps sending
            response = JSONResponse({"detail": reason}, status_code=status,
                                    headers={"WWW-Authenticate": "Bearer", "Connection": "close"})
        await response(scope, receive, send)


def _cookie(header: str, name: str) -> str:
    for part in header.split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return ""
