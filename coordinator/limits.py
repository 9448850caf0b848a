"""How large a request body may be, checked before the application reads it; how many bandwidth
probes a credential may hold open.

FastAPI reads a JSON body whole before validating it, so a 50 MB job name would be parsed, stored and
served back on every dashboard refresh. Every body but the streamed uploads (weights, checkpoints:
written to disk against their own per-stage limit) is read here up to `max_bytes` and refused with
413 beyond it. Runs after the authentication gate: a stranger's body is never read at all.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

STREAMED_UPLOADS = ("/weights", "/checkpoint")


class BodyLimit:
    def __init__(self, app: ASGIApp, *, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD") or (
                scope["method"] == "PUT" and scope["path"].endswith(STREAMED_UPLOADS)):
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # what follows the body: a disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = JSONResponse({"detail": f"request body exceeds {self.max_bytes:,} bytes"}, status_code=413)
        await response(scope, receive, send)


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
