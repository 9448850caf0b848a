"""The sending end of one of a stage's pipeline links, which outlives a broken connection.

A stream whose connection breaks (a router restarted, a NAT mapping dropped, a Wi-Fi hiccup) is
resumed: the sender dials again for up to LINK_RESUME_S and sends its last messages again on the new
stream, and the receiver drops what it already has (neighbours.py, `Neighbours._in_turn`). Every
message carries its place on the link (tag `link_seq`: 1, 2, 3, ...), so it arrives once and in order,
or a gap ends the stream. At most K micro-batches are owed an answer on either side of a link (the
window), so what a break can lose is among the last K + RECEIVE_SLACK messages, which the link keeps.

A peer whose port refuses connections for CLOSED_PORT_S is gone (its process ended), not behind a link
that is down: that is reported at once, so a killed node is re-planned around without waiting out the
resume window.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

from ravnest.partition import SEND_QUEUE
from ravnest.relay.dial import port_closed
from ravnest.timeouts import LINK_RESUME_S
from ravnest.wire import Message, OutboundStream, PeerError, wait_authorized
from ravnest.wire.transport import DIALER

LINK_SEQ = "link_seq"  # a message's place on its link, from 1
CLOSED_PORT_S = 2.0
log = logging.getLogger(__name__)


class OutboundLink:
    """Messages to one neighbour at `address`, in order, on a stream opened on first use and opened
    again after a break (`name` says which link in the log). `on_lost(reason, peers_doing)` is called
    (from a gRPC or resume thread) when the stream ends other than by this side's close: the peer
    refused or ended it, or it broke and could not be resumed."""

    def __init__(self, address: str, *, token: str, codec: str, keep: int, peer_timeout: float,
                 on_lost: Callable[[str, bool], None], name: str):
        self.address, self.token, self.codec, self.peer_timeout = address, token, codec, peer_timeout
        self.on_lost, self.name = on_lost, name
        self.recent: deque[Message] = deque(maxlen=keep)  # what a break may have lost
        self.resume_s = LINK_RESUME_S
        self._stream: OutboundStream | None = None
        self._sent = 0  # messages numbered so far
        self._sent_on_closed = 0  # bytes sent on streams closed already
        self._busy: float | None = None  # the last busy share seen (kept once a stream closes)
        self._lock = threading.RLock()  # the worker's sends and a resume after a break take turns
        self._closing = False  # streams ending from now on are ours closing them
        self._draining = False  # `close` is waiting for the last messages to arrive

    def send(self, msg: Message) -> None:
        with self._lock:
            self._sent += 1
            msg.tags[LINK_SEQ] = self._sent
            self.recent.append(msg)
            if self._stream is None:  # opened on first use, then kept for the whole run
                wait_authorized(self.address, self.token)
                self._open()
            stream = self._stream
            assert stream is not None
            try:
                # copy=False: frames are cut on gRPC's thread; nothing writes to sent tensors afterwards
                stream.send(msg, timeout=self.peer_timeout, copy=False)
            except PeerError as broken:
                if not broken.link_broken or self._closing:
                    raise
                self._resume(stream, broken)  # sends `msg` again with the others a break may have lost

    @property
    def sent_bytes(self) -> int:
        """Bytes sent so far, as the codec encoded them."""
        return self._sent_on_closed + (self._stream.sent_bytes if self._stream is not None else 0)

    @property
    def busy(self) -> float | None:
        """The share of time the stream had something to send (None before it opened)."""
        if self._stream is not None:
            self._busy = self._stream.busy
        return self._busy

    def _open(self, wait_ready: float = 30.0) -> OutboundStream:
        """A new stream (the lock held), replacing the one before."""
        stream = OutboundStream(self.address, token=self.token, codec=self.codec, max_pending=SEND_QUEUE,
                                wait_ready=wait_ready)
        if self._stream is not None:
            self._sent_on_closed += self._stream.sent_bytes
        self._stream = stream
        # A send only queues, so a stream the peer failed must wake the worker by itself.
        stream.add_done_callback(self._ended)
        return stream

    def _resume(self, broken: OutboundStream, why: PeerError) -> None:
        """With the lock held: a new stream in place of `broken`, carrying again the messages the break
        may have lost (the module docstring); PeerError where none could be opened."""
        if self._stream is not broken:
            return  # resumed already
        started, closed_since = time.monotonic(), None
        while True:
            now = time.monotonic()
            left = started + self.resume_s - now
            if left <= 0 or self._closing:
                raise PeerError(f"the link to {self.address} broke ({why}) and did not come back within "
                                f"{self.resume_s:.0f}s", address=self.address)
            if closed_since is not None and now - closed_since >= CLOSED_PORT_S:
                raise PeerError(f"the link to {self.address} broke ({why}) and its port has refused connections "
                                f"for {now - closed_since:.0f}s: the node there is gone", address=self.address)
            try:
                stream = self._open(wait_ready=min(left, 1.0))
                for msg in list(self.recent):
                    stream.send(msg, timeout=self.peer_timeout, copy=False)
                break
            except PeerError as again:
                if not (again.link_broken or again.unreachable):
                    raise
                why = again
                closed = port_closed(DIALER.dialled(self.address, 0.0))  # (a relayed peer: its tunnel's port)
                closed_since = (closed_since or time.monotonic()) if closed else None
        if self._closing:  # the stage stopped meanwhile (`abort` or `cut`, which do not wait for the lock)
            stream.cancel()
            raise PeerError(f"peer {self.address}: stream cancelled by this side")
        log.warning("%s broke (%s); a new stream took over after %.1f s, sending the last %d messages again",
                    self.name, why, time.monotonic() - started, len(self.recent))

    def _ended(self, stream: OutboundStream) -> None:
        if self._closing or self._stream is not stream:  # ours closing, or one a resume replaced
            return
        try:
            stream.close(timeout=1.0)
            if self._draining:
                return  # closed as `close` asked
            reason, peers_doing = "it closed the stream", True
        except PeerError as exc:
            if exc.link_broken:  # the worker may not send here for a while: resume now
                threading.Thread(target=self._resume_later, args=(stream, exc), daemon=True,
                                 name="link-resume").start()
                return
            reason, peers_doing = str(exc), exc.address is not None  # not where this side ended it
        self.on_lost(reason, peers_doing)

    def _resume_later(self, stream: OutboundStream, why: PeerError) -> None:
        with self._lock:
            try:
                self._resume(stream, why)
            except PeerError as exc:
                if not self._closing:
                    self.on_lost(str(exc), exc.address is not None)

    def close(self) -> None:
        """Wait until the neighbour has received everything sent (resuming the link if it breaks)."""
        self._draining = True
        with self._lock:
            while (stream := self._stream) is not None:
                self._busy = stream.busy  # (its life as training saw it, not the close's wait)
                try:
                    stream.close(timeout=self.peer_timeout)
                except PeerError as broken:
                    if not broken.link_broken:
                        raise
                    self._resume(stream, broken)
                    continue
                self._sent_on_closed += stream.sent_bytes
                self._stream = None
        self._closing = True

    def cut(self) -> None:
        """From any thread, on a stop: end the stream at once, so a send blocked on a neighbour that
        reads nothing returns now rather than after `peer_timeout`."""
        self._closing = True
        if (stream := self._stream) is not None:
            stream.cancel()

    def abort(self, said: Message) -> None:
        """Best effort: tell the neighbour why this stage stops (`said`, sent unnumbered), so it fails
        fast with the reason."""
        self._closing = True
        stream, self._stream = self._stream, None
        try:
            if stream is None or stream.ended:  # e.g. the neighbour refused what we sent: it is alive
                stream = OutboundStream(self.address, token=self.token, wait_ready=2.0)
            stream.send(said, timeout=2.0)
            stream.close(timeout=2.0)
        except PeerError:
            if stream is not None:
                stream.cancel()  # the neighbour is gone or failing already
