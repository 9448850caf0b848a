"""One-time login links for the dashboard (`ravnest dashboard`): a script or a terminal opens the page
without ever putting a key in a URL, where browser history, proxies and logs would keep it.

A caller with an API key asks for a link; the coordinator keeps (code -> that key) in memory for
LINK_S seconds. The first visit to /login?once=<code> turns it into the HttpOnly cookie the login
form sets, and forgets it: a second visit, or one after LINK_S, gets the login form and is told why.
Codes live in this process only, so a restart ends every unused link (soft state, core.py).
"""
from __future__ import annotations

import secrets
import threading
from collections.abc import Callable

LINK_S = 60.0  # long enough to click, short enough that a leaked link is useless
MAX_OPEN = 1000  # unused links kept at once; the oldest go first


class LoginLinks:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._open: dict[str, tuple[str, float]] = {}  # code -> (API key, expiry)
        self._lock = threading.Lock()

    def create(self, key: str) -> str:
        """A fresh code standing for `key` until it is used or LINK_S pass."""
        code = secrets.token_urlsafe(24)
        with self._lock:
            now = self._clock()
            self._open = {c: kept for c, kept in self._open.items() if kept[1] > now}
            while len(self._open) >= MAX_OPEN:
                del self._open[next(iter(self._open))]
            self._open[code] = (key, now + LINK_S)
        return code

    def redeem(self, code: str) -> str | None:
        """The key behind an unused, unexpired code (used up now), else None."""
        with self._lock:
            key, expiry = self._open.pop(code, ("", 0.0))
        return key if key and self._clock() < expiry else None
