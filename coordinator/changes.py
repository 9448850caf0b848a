"""A counter of committed changes to the store, which live views (server-sent events) wait on.

Bumped from whatever thread commits; waiters are coroutines on the server's event loop, woken
through `call_soon_threadsafe`, so a watching browser holds no thread while nothing changes.
"""
from __future__ import annotations

import asyncio
import threading


class Changes:
    def __init__(self) -> None:
        self.version = 0
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    def bump(self) -> None:
        with self._lock:
            self.version += 1
            waiters = list(self._waiters)
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that loop has closed (the server is stopping)
                pass

    async def wait(self, seen: int, timeout: float) -> int:
        """The version once it is past `seen`, or after `timeout` seconds, whichever comes first."""
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            if self.version > seen:
                return self.version
            self._waiters.add(waiter)
        try:
            await asyncio.wait_for(waiter[1].wait(), timeout)
        except TimeoutError:
            pass
        finally:
            with self._lock:
                self._waiters.discard(waiter)
        return self.version
