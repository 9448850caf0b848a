"""How large a request body may be and how slowly it may come, checked as the body is read; how many
bandwidth probes a credential may hold open.

FastAPI reads a JSON body whole before validating it, so a 50 MB job name would be parsed, stored and
served back on every dashboard refresh. Every body but the streamed uploads (weights, checkpoints:
written to disk against their own per-stage limit) is read here up to `max_bytes` and refused with
413 beyond it, and with 408 where it comes slower than a floor rate: a caller that sends a large
Content-Length and then one byte a minute would hold its connection, and what it sent, for ever.
Runs after the authentication gate: a stranger's body is never read at all (quiet_beats.py, the one
door before the gate, checks the credential from the headers first too).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

STREAMED_UPLOADS = ("/weights", "/checkpoint")
# a body must come within a grace (Settings.body_grace_s: 10 s) plus its length at BODY_FLOOR_BYTES_PER_S (a 1 MiB
# job spec: 74 s; a heartbeat: ~10 s); the slowest honest link a node is planned on (1 Mbit/s) is eight times it
BODY_FLOOR_BYTES_PER_S = 16 << 10


@dataclass
class Body:
    """A request body as read: what came (`messages`, to hand on unread), and why reading stopped short,
    if it did (`refusal`: (status, reason); `gone`: the caller went)."""
    messages: list[Message] = field(default_factory=list)
    data: bytes = b""
    refusal: tuple[int, str] | None = None
    gone: bool = False


async def read_body(scope: Scope, receive: Receive, max_bytes: int, grace_s: float,
                    floor_bytes_per_s: float = BODY_FLOOR_BYTES_PER_S) -> Body:
    """The body of a request, up to `max_bytes`, refused (413) beyond it or (408) where it comes slower
    than the floor rate allows for its declared length (`max_bytes` where it declares none)."""
    declared = Headers(scope=scope).get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        return Body(refusal=(413, f"request body exceeds {max_bytes:,} bytes"))
    length = int(declared) if declared.isdigit() else max_bytes
    allowed_s = grace_s + length / floor_bytes_per_s
    deadline = asyncio.get_running_loop().time() + allowed_s
    body, chunks, more = Body(), [], True
    size = 0
    while more:
        try:
            async with asyncio.timeout_at(deadline):
                message = await receive()
        except TimeoutError:
            body.refusal = (408, f"the request body came too slowly: {size:,} of {length:,} bytes in "
                                 f"{allowed_s:.0f} s (at least {floor_bytes_per_s / 1024:.0f} KiB/s after the first "
                                 f"{grace_s:.0f} s)")
            return body
        body.messages.append(message)
        if message["type"] == "http.disconnect":
            body.gone = True
            return body
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        more = message.get("more_body", False)
        if size > max_bytes:
            body.refusal = (413, f"request body exceeds {max_bytes:,} bytes")
            return body
    body.data = b"".join(chunks)
    return body


async def read_or_refuse(scope: Scope, receive: Receive, send: Send, max_bytes: int, grace_s: float) -> Body | None:
    """`read_body`, with its refusal sent (the connection closes after it: the rest of the body is never
    read) or nothing where the caller went: then None."""
    body = await read_body(scope, receive, max_bytes, grace_s)
    if body.refusal:
        status, reason = body.refusal
        refusal = JSONResponse({"detail": reason}, status_code=status, headers={"Connection": "close"})
        await refusal(scope, receive, send)
    return None if body.refusal or body.gone else body


class BodyLimit:
    def __init__(self, app: ASGIApp, *, max_bytes: int, grace_s: float):
        self.app, self.max_bytes, self.grace_s = app, max_bytes, grace_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD") or (
                scope["method"] == "PUT" and scope["path"].endswith(STREAMED_UPLOADS)):
            await self.app(scope, receive, send)
            return
        body = await read_or_refuse(scope, receive, send, self.max_bytes, self.grace_s)
        if body is None:
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # what follows the body: a disconnect
            replayed = True
            return {"type": "http.request", "body": body.data, "more_body": False}

        await self.app(scope, replay, send)


class ProbeSlots:
    """How many bandwidth probes one credential may have open at once. A probe is streamed (one
    shared zero chunk, sent as the reader takes it), so an unread probe costs a connection, not its
    size; the limit bounds the connections. A slot is freed when its probe ends, or after `expire_s`
    whatever happened (a client that vanished before the body started never ends it)."""

    def __init__(self, per_credential: int, expire_s: float, clock: Callable[[], float] = time.monotonic):
        self.per_credential, self.expire_s, self.clock = per_credential, expire_s, clock
        self._open: dict[str, list[float]] = {}

    def take(self, who: str) -> bool:
        now = self.clock()
        self._open = {k: live for k, started in self._open.items()
                      if (live := [t for t in started if now - t < self.expire_s])}
        started = self._open.setdefault(who, [])
        if len(started) >= self.per_credential:
            return False
        started.append(now)
        return True

    def release(self, who: str) -> None:
        started = self._open.get(who)
        if started:
            started.pop(0)
