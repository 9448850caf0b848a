"""Where ring messages wait for the member that needs them, keyed so rings and rounds never mix."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Hashable


class Mailbox:
    """Received items keyed by (segment, round, step, chunk). `take` blocks on a condition variable
    until its key is delivered or the deadline passes; nothing polls. Messages may arrive before the
    local member has started that round (a peer ahead of us): they are simply kept until taken."""

    def __init__(self):
        self._items: dict[Hashable, Any] = {}
        self._cond = threading.Condition()

    def put(self, key: Hashable, item: Any) -> None:
        with self._cond:
            if key in self._items:
                raise KeyError(f"duplicate ring message {key}")
            self._items[key] = item
            self._cond.notify_all()

    def take(self, key: Hashable, timeout: float, stop: threading.Event | None = None) -> Any | None:
        """The item for `key`, or None when `timeout` seconds pass first or `stop` is set (and
        `interrupt` called)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while key not in self._items:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (stop is not None and stop.is_set()):
                    return None
                self._cond.wait(remaining)
            return self._items.pop(key)

    def discard(self, predicate: Callable[[Any], bool]) -> int:
        """Drop every waiting item whose key matches (e.g. rounds that failed); returns how many."""
        with self._cond:
            stale = [k for k in self._items if predicate(k)]
            for k in stale:
                del self._items[k]
            return len(stale)

    def interrupt(self) -> None:
        """Wake every waiter so that those whose `stop` is set give up now."""
        with self._cond:
            self._cond.notify_all()
