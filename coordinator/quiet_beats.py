"""Heartbeats that change nothing, answered before the framework sees them.

At ten thousand volunteers nearly every request is a quiet heartbeat (service/presence.py), and most
of what a request costs here is the framework around it: routing, the authentication gate's lookup,
validation and serialisation took about twice the work of the answer itself. This ASGI middleware,
the outermost, takes POST /v1/nodes/{id}/heartbeat with a bearer token: it reads the body (up to the
same limit as limits.BodyLimit) and hands it to `answer` (Presence.answer_raw), which checks the
node's own credential against its row before it parses a byte of the body, as the gate would.

Whatever `answer` declines (a wrong credential, a body that does not validate, a beat with news) goes
on to the application unchanged, body and all, as if never looked at: the gate, the limit and the
route give it the reply they always did, refusals and their reasons included.
"""
from __future__ import annotations

from collections.abc import Callable

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# (node id, the Authorization header, the body) -> the reply's JSON, or None: the application answers
Answer = Callable[[str, str, bytes], bytes | None]


class QuietBeats:
    def __init__(self, app: ASGIApp, *, answer: Answer, max_bytes: int) -> None:
        self.app, self.answer, self.max_bytes = app, answer, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        node_id = _heartbeat_of(scope)
        authorization = Headers(scope=scope).get("authorization", "") if node_id else ""
        if not node_id or not authorization.lower().startswith("bearer "):
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []  # what was read, to hand on if the application must answer
        body, more = b"", True
        while more and len(body) <= self.max_bytes:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # (a disconnect)
            body += message.get("body", b"")
            more = message.get("more_body", False)
        whole = not more and len(body) <= self.max_bytes  # (else BodyLimit refuses it, with its reason)
        reply = await run_in_threadpool(self.answer, node_id, authorization, body) if whole else None
        if reply is None:
            await self.app(scope, _replaying(messages, receive), send)
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
