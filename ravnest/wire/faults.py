"""Faults injected on purpose into this process's outbound streams: for fault tests and drills.

`ravnest-node join --inject-fault "delay=0.005,sever_after=400,to=HOST:PORT"` slows every message this
node sends (optionally only to one peer) by `delay` seconds, and cuts the `sever_after`-th stream
message off by cancelling its stream, once per process: what a flaky or broken link does. Off unless
configured; nothing here runs on a normal node.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class LinkFaults:
    delay_s: float = 0.0
    sever_after: int = 0  # 0: never
    to: str | None = None  # only streams to this peer address
    _sent: int = field(default=0, repr=False)
    _severed: bool = field(default=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def parse(cls, spec: str) -> LinkFaults:
        """"delay=SECONDS,sever_after=N,to=HOST:PORT" (any subset); ValueError naming what is wrong."""
        faults = cls()
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, _, value = item.partition("=")
            if key == "delay":
                faults.delay_s = float(value)
            elif key == "sever_after":
                faults.sever_after = int(value)
            elif key == "to":
                faults.to = value
            else:
                raise ValueError(f"unknown fault {key!r}: expected delay=SECONDS, sever_after=N or to=HOST:PORT")
        if faults.delay_s < 0 or faults.sever_after < 0:
            raise ValueError("delay and sever_after must not be negative")
        return faults

    def before_send(self, address: str) -> bool:
        """Called for each message sent to `address`; sleeps the delay; True: sever this stream now."""
        if self.to is not None and address != self.to:
            return False
        if self.delay_s:
            time.sleep(self.delay_s)
        with self._lock:
            self._sent += 1
            if self.sever_after and not self._severed and self._sent >= self.sever_after:
                self._severed = True
                return True
        return False


_active: LinkFaults | None = None


def inject(faults: LinkFaults | None) -> None:
    """Apply `faults` to every outbound stream of this process from now on (None: stop)."""
    global _active
    _active = faults


def active() -> LinkFaults | None:
    return _active
