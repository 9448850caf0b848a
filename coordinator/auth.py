"""Who may call what, decided from the request line and headers alone, before any body is read.

    open       /healthz, the API docs and their assets, /login
    join       POST /v1/nodes (joining), GET /v1/probe (bandwidth, before joining): the join token
    node       a node's own calls: heartbeat and leave (/v1/nodes/{id}/...), its job reports and
               uploads (/v1/jobs/{id}/metrics|fail|weights|checkpoint|state): that node's token
    operator   everything else (jobs, the node list, the dashboard): the operator token, as a
               bearer header or the cookie /login sets

The operator token is also accepted for joining. The service checks finer rules on top (a node may
only report on its own stage); this gate makes sure a stranger never gets as far as a parsed body.
"""
from __future__ import annotations

from typing import Callable

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, RedirectResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .security import matches

OPEN_PATHS = {"/healthz", "/docs", "/openapi.json", "/login"}
OPEN_PREFIXES = ("/static/",)  # the docs' assets
NODE_REPORTS = {"metrics", "fail", "weights", "checkpoint", "state"}
COOKIE = "ravnest_operator"


def required(method: str, path: str) -> tuple[str, str | None]:
    """("open" | "join" | "node" | "operator", the node id the path names, if any)."""
    if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
        return "open", None
    parts = path.strip("/").split("/")
    if parts[:2] == ["v1", "nodes"]:
        if len(parts) == 2 and method == "POST":
            return "join", None
        if (len(parts) == 3 and method == "DELETE") or (len(parts) == 4 and parts[3] == "heartbeat"):
            return "node", parts[2]
    if parts == ["v1", "probe"]:
        return "join", None
    if parts[:2] == ["v1", "jobs"] and len(parts) == 4 and parts[3] in NODE_REPORTS:
        return "node", None
    return "operator", None


class Authentication:
    """ASGI middleware: refuses with 401 and the reason what `required` says needs a credential the
    request does not carry. `node_refusal(token, node_id)` looks a node's token up in the store and
    says why it is refused, or None."""

    def __init__(self, app: ASGIApp, *, operator_token: str, join_token: str,
                 node_refusal: Callable[[str, str | None], str | None]):
        self.app = app
        self.operator_token, self.join_token = operator_token, join_token
        self.node_refusal = node_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        kind, node_id = required(scope["method"], scope["path"])
        refusal = None if kind == "open" else await self._refusal(kind, node_id, Headers(scope=scope))
        if refusal is None:
            await self.app(scope, receive, send)
            return
        if scope["path"] == "/" and scope["method"] == "GET":  # a person at the dashboard: log in first
            response = RedirectResponse("/login", status_code=303)
        else:
            response = JSONResponse({"detail": refusal}, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    async def _refusal(self, kind: str, node_id: str | None, headers: Headers) -> str | None:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        if kind == "operator" and not token:
            token = _cookie(headers.get("cookie", ""), COOKIE)
        if not token:
            return "missing 'Authorization: Bearer <token>' header"
        if matches(token, self.operator_token):
            return None if kind in ("operator", "join") else "the operator's token is not a node's"
        if kind == "join":
            return None if matches(token, self.join_token) else "wrong join token"
        if kind == "node":
            return await run_in_threadpool(self.node_refusal, token, node_id)
        return "this needs the operator's token"


def _cookie(header: str, name: str) -> str:
    for part in header.split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return ""
