"""Heartbeats that change nothing, answered before the framework sees them.

At ten thousand volunteers nearly every request is a quiet heartbeat (service/presence.py), and most
of what a request costs here is the framework around it: routing, the authentication gate's lookup,
validation and serialisation took about twice the work of the answer itself. This ASGI middleware,
the outermost, takes POST /v1/nodes/{id}/heartbeat with a bearer token. It reads nothing of the body
before the token is found to be that node's own (`vouched`: from memory for a node seen before, else
from its row), then reads it as limits.BodyLimit would (up to the same size, at the same floor rate)
and hands it to `answer` (Presence.answer_raw), which checks the credential again with the rest.

Whatever `answer` declines (a wrong credential, a body that does not validate, a beat with news) goes
on to the application unchanged, body and all, as if never looked at: the gate, the limit and the
route give it the reply they always did, refusals and their reasons included. A stranger's beat goes
there unread: the gate refuses it from its headers.
"""
from __future__ import annotations

from collections.abc import Callable

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .limits import read_or_refuse

# (node id, the Authorization header, the body) -> the reply's JSON, or None: the application answers
Answer = Callable[[str, str, bytes], bytes | None]
# (node id, the Authorization header) -> whether it is that node's credential (True, False), or None where
# that is not known without the node's row; `vouched` reads the row
Vouched = Callable[[str, str], bool | None]


class QuietBeats:
    def __init__(self, app: ASGIApp, *, answer: Answer, known: Vouched, vouched: Callable[[str, str], bool],
                 max_bytes: int, grace_s: float) -> None:
        self.app, self.answer, self.known, self.vouched = app, answer, known, vouched
        self.max_bytes, self.grace_s = max_bytes, grace_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        node_id = _heartbeat_of(scope)
        authorization = Headers(scope=scope).get("authorization", "") if node_id else ""
        if not node_id or not authorization.lower().startswith("bearer "):
            await self.app(scope, receive, send)
            return
        vouched = self.known(node_id, authorization)
        if vouched is None:
            vouched = await run_in_threadpool(self.vouched, node_id, authorization)
        if not vouched:  # (the gate refuses it, from its headers)
            await self.app(scope, receive, send)
            return
        body = await read_or_refuse(scope, receive, send, self.max_bytes, self.grace_s)
        if body is None:
            return
        reply = await run_in_threadpool(self.answer, node_id, authorization, body.data)
        if reply is None:
            await self.app(scope, _replaying(body.messages, receive), send)
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(reply)).encode())]})
        await send({"type": "http.response.body", "body": reply})


def _heartbeat_of(scope: Scope) -> str | None:
    """The node id of a POST /v1/nodes/{id}/heartbeat, else None."""
    if scope["type"] != "http" or scope["method"] != "POST":
        return None
    parts = scope["path"].split("/")
    if len(parts) == 5 and parts[0] == "" and parts[1:3] == ["v1", "nodes"] and parts[4] == "heartbeat" and parts[3]:
        return parts[3]
    return None


def _replaying(messages: list[Message], receive: Receive) -> Receive:
    """`receive`, with `messages` (already read from it) given first."""
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()
    return replay
