"""Dispatching received messages by kind to the parts of a node that own them."""
from __future__ import annotations

import threading
from typing import Collection

import grpc
import torch

from ravnest.wire.tensors import WireError
from ravnest.wire.messages import Message

from .peer_server import Handler


class Router:
    """A PeerServer handler that dispatches messages by kind to the parts of a node that own them
    (the pipeline stage, the averager, ...).

    Peers of one job start at slightly different moments, so a message may arrive before the part
    that handles it exists: it waits up to `wait_for_route` seconds for the route to be registered,
    and only then is it a protocol error for the sender. Only the kinds in `expected_kinds` (when
    given) may wait: any other is refused at once, so a peer cannot hold the server's call slots with
    made-up kinds. A message waiting when the routes are cleared (its job ended) is refused, never
    handed to the next job's routes.
    """

    def __init__(self, wait_for_route: float = 0.0, expected_kinds: Collection[str] | None = None,
                 decode_device: torch.device | None = None):
        self.wait_for_route = wait_for_route
        self.decode_device = decode_device  # the node's device: where on-device codecs decode (tensors.restore)
        self.expected_kinds = None if expected_kinds is None else frozenset(expected_kinds)
        self._routes: dict[str, Handler] = {}
        self._zero_copy: set[str] = set()
        self._changed = threading.Condition()
        self._cleared = 0  # how many times the routes were cleared
        self.waiting = 0  # messages waiting for their route right now

    def route(self, kind: str, handler: Handler, *, zero_copy: bool = False) -> None:
        """Send messages of `kind` to `handler`. With `zero_copy`, a tensor that arrived in one chunk
        shares the received frame's memory instead of being copied out of it: the handler must treat
        it as read-only (copy before modifying in place)."""
        with self._changed:
            self._routes[kind] = handler
            if zero_copy:
                self._zero_copy.add(kind)
            else:
                self._zero_copy.discard(kind)
            self._changed.notify_all()

    def zero_copy(self, kind: str) -> bool:
        """Whether the route of `kind` accepts read-only tensors viewing the received frames."""
        return kind in self._zero_copy

    def wait_until_waiting(self, count: int, timeout: float) -> bool:
        """Until `count` messages wait for their route (tests, diagnostics); False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: self.waiting >= count, timeout=timeout)

    def clear(self) -> None:
        """Forget every route, e.g. when the job they belonged to is over."""
        with self._changed:
            self._routes.clear()
            self._zero_copy.clear()
            self._cleared += 1
            self._changed.notify_all()

    def __call__(self, msg: Message, peer: str) -> None:
        if self.expected_kinds is not None and msg.kind not in self.expected_kinds:
            raise WireError(f"unknown message kind {msg.kind!r}", grpc.StatusCode.UNIMPLEMENTED)
        with self._changed:
            cleared = self._cleared
            self.waiting += 1
            self._changed.notify_all()
            try:
                self._changed.wait_for(lambda: msg.kind in self._routes or self._cleared != cleared,
                                       timeout=self.wait_for_route)
            finally:
                self.waiting -= 1
            if self._cleared != cleared:
                raise WireError(f"message kind {msg.kind!r} arrived for a job that has ended on this node",
                                grpc.StatusCode.UNAVAILABLE)
            handler = self._routes.get(msg.kind)
        if handler is None:
            raise WireError(f"no handler for message kind {msg.kind!r} on this node",
                            grpc.StatusCode.UNIMPLEMENTED)
        handler(msg, peer)
