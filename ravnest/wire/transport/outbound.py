"""The sending side of a peer connection: a bounded queue of messages drained by gRPC's own request
iterator. Frames cross gRPC as bytes (identity serializers) so that data chunks skip protobuf objects;
the bytes are still exactly `ravnest.v1.Frame`s, and any client of the generated stubs interoperates."""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Iterable, Iterator

import grpc

from ravnest.v1 import peer_pb2
from ravnest.wire import faults, traffic
from ravnest.wire.messages import DEFAULT_CHUNK_BYTES, Message, bundled, chunked_frames, prepare_message

from .allocator import keep_freed_buffers
from .channels import DIALER, ChannelPool, PeerError, peer_error
from .options import STREAM_METHOD, metadata


class OutboundStream:
    """A long-lived stream of messages to one peer, fed from a bounded queue.

    `send` serializes the message in the caller's thread, so the caller may reuse or modify its
    tensors as soon as `send` returns (unless copy=False), and encoding errors raise right there
    (ValueError). It blocks
    while `max_pending` messages are queued (back-pressure) and raises PeerError once the peer has
    failed the stream, with the peer's reason.
    """

    _END = object()

    def __init__(self, address: str, *, token: str | None = None, codec: str = "",
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_pending: int = 8,
                 pool: ChannelPool | None = None, wait_ready: float = 30.0):
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        keep_freed_buffers()
        self.address = address
        self.codec = codec
        self.chunk_bytes = chunk_bytes
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._closed = False
        self._severed = False  # cancelled by fault injection, as a broken link would end it
        self.sent_bytes = 0  # frames handed to gRPC, as encoded (what the link carries)
        self._opened, self._idle_s = time.monotonic(), 0.0  # time with nothing queued to send
        channel = (pool or DIALER.pool).get(DIALER.dialled(address, min(DIALER.route_wait_s, wait_ready)))
        ready = grpc.channel_ready_future(channel)
        try:
            ready.result(timeout=wait_ready)
        except grpc.FutureTimeoutError:
            ready.cancel()
            raise PeerError(f"peer {address} not reachable within {wait_ready:.0f}s", address=address,
                            unreachable=True) from None
        call = channel.stream_unary(STREAM_METHOD, request_serializer=None,
                                    response_deserializer=peer_pb2.StreamSummary.FromString)
        self._future = call.future(traffic.counted(self._frames(), traffic.SENT.labels(address)),
                                   metadata=metadata(token))
        self._future.add_done_callback(self._on_done)

    @property
    def busy(self) -> float:
        """The share of the stream's life it had something to send: near 1, the link sets the pace (gRPC
        takes frames as the link's flow control lets it, a window ahead at most)."""
        alive = time.monotonic() - self._opened
        return max(0.0, 1.0 - self._idle_s / alive) if alive > 0 else 0.0

    @property
    def pending(self) -> int:
        """Messages queued and not yet taken by gRPC."""
        return self._queue.qsize()

    def _frames(self) -> Iterator[bytes]:
        while True:
            waiting = time.monotonic()
            frames = self._queue.get()
            self._idle_s += time.monotonic() - waiting
            if frames is self._END:
                return
            if isinstance(frames, threading.Event):  # a flush marker: everything before it is out
                frames.set()
                continue
            for frame in bundled(frames):
                self.sent_bytes += len(frame)
                yield frame

    def _on_done(self, _future) -> None:
        # The stream is over: release senders blocked on a full queue and end the frame generator,
        # so no thread stays parked on a queue nobody will ever drain.
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        try:
            self._queue.put_nowait(self._END)
        except queue.Full:
            pass

    def _raise_if_failed(self) -> None:
        if self._future.done():
            try:
                self._future.result()
            except grpc.RpcError as e:
                raise peer_error(self.address, e) from None
            except grpc.FutureCancelledError:  # not the peer's doing
                how = "severed by fault injection" if self._severed else "cancelled by this side"
                raise PeerError(f"peer {self.address}: stream {how}", link_broken=self._severed) from None
            raise PeerError(f"peer {self.address} closed the stream", address=self.address)

    def _put(self, item: object, deadline: float | None) -> None:
        while True:
            self._raise_if_failed()
            # Wake up now and then as a safety net; a failing stream also wakes us via _on_done.
            wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if wait <= 0:
                raise PeerError(f"peer {self.address}: send timed out", address=self.address)
            try:
                self._queue.put(item, timeout=wait)
                return
            except queue.Full:
                continue

    def send(self, msg: Message, codec: str | None = None, timeout: float | None = None, *,
             copy: bool = True) -> None:
        """Queue one message. `copy=False` skips the snapshot: data is cut into frames only when gRPC
        sends it, which is faster for large tensors, and the caller must then leave the tensors
        unchanged until the stream is closed (e.g. freshly computed activations)."""
        if self._closed:
            self._raise_if_failed()  # the peer's reason, when it has one, says more than "closed"
            raise PeerError(f"peer {self.address}: stream already closed")  # by this side
        injected = faults.active()
        if injected is not None and injected.before_send(self.address):
            self._severed = True  # what a broken connection does to a stream
            self.cancel()
            raise PeerError(f"peer {self.address}: stream severed by fault injection", link_broken=True)
        parts = prepare_message(msg, self.codec if codec is None else codec)
        frames: Iterable[bytes] = chunked_frames(parts, self.chunk_bytes)
        if copy:
            frames = list(frames)
        self._put(frames, None if timeout is None else time.monotonic() + timeout)
        self._raise_if_failed()  # the stream may have failed while we waited

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every message queued so far has been cut into frames and handed to gRPC, after
        which the tensors of `send(copy=False)` are free to change. PeerError if the stream fails."""
        deadline = None if timeout is None else time.monotonic() + timeout
        marker = threading.Event()
        self._put(marker, deadline)
        while not marker.wait(1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))):
            self._raise_if_failed()
            if deadline is not None and time.monotonic() >= deadline:
                raise PeerError(f"peer {self.address}: flush timed out", address=self.address)

    def close(self, timeout: float = 60.0) -> peer_pb2.StreamSummary:
        """Finish the stream after everything queued was sent; returns the peer's summary."""
        if not self._closed:
            self._closed = True
            try:
                self._put(self._END, time.monotonic() + timeout)
            except PeerError:
                pass  # the stream already ended: its result below says how
        try:
            return self._future.result(timeout=timeout)
        except grpc.RpcError as e:
            raise peer_error(self.address, e) from None
        except grpc.FutureTimeoutError:
            self._future.cancel()
            raise PeerError(f"peer {self.address}: stream did not finish within {timeout:.0f}s",
                            address=self.address) from None

    def add_done_callback(self, callback: Callable[["OutboundStream"], None]) -> None:
        """Call `callback(stream)` once the stream has ended (closed, failed or cancelled): a send only
        queues, so this is how a sender learns promptly that its peer dropped the stream."""
        self._future.add_done_callback(lambda _: callback(self))

    def cancel(self) -> None:
        self._closed = True
        self._future.cancel()

    @property
    def ended(self) -> bool:
        """The stream is over (closed, failed or cancelled): nothing sent on it arrives any more."""
        return self._future.done()

    def __enter__(self) -> OutboundStream:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:
            self.cancel()
