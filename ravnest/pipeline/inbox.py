"""A stage's inbox: gRPC handler threads put messages in, the stage's worker thread takes them out.

Two lanes, activations and gradients, each in arrival order; the worker takes from the lane its
schedule names (schedule.py), so arrival timing never changes what it computes. Activations sit in a
bounded lane: a full lane blocks the handler, which stops reading the stream, so HTTP/2 flow control
pushes back on the sender. Gradients need no bound: stage 0 admits at most K micro-batches, so at most
K gradients can ever be owed.
"""
from __future__ import annotations

import threading
import time
from collections import deque

import grpc
import torch

from ravnest.failures import FailureKind, KnownFailure, NotFinite
from ravnest.wire import Message, WireError, require_finite
from ravnest.wire.codecs import GRADIENT


class PipelineError(KnownFailure, RuntimeError):
    """The pipeline cannot go on: a peer failed, the run was stopped, or peers went silent. `kind` and
    `peer` (its address), where known, say so as data (ravnest/failures.py)."""

    def __init__(self, message: str, kind: FailureKind | None = None, peer: str | None = None):
        super().__init__(message)
        self.kind, self.peer = kind, peer

    @property
    def failure_kind(self) -> FailureKind | None:
        return self.kind

    @property
    def peer_address(self) -> str | None:
        return self.peer


class TrainedAlone(PipelineError):
    """A stage trained alone (its averaging left: the job is being re-planned) as far as replicas may
    drift apart, and stops to hand in its state."""


class Inbox:
    def __init__(self, forward_capacity: int):
        lock = threading.Lock()
        self._ready = threading.Condition(lock)  # the worker waits for messages
        self._space = threading.Condition(lock)  # handlers wait for room in the forward lane
        self._backward: deque[Message] = deque()
        self._forward: deque[Message] = deque()
        self._capacity = forward_capacity
        self._owed: dict[int, torch.Size] = {}  # micro-batch -> shape of the gradient we expect
        self._failure: PipelineError | None = None

    def expect_gradient(self, micro_batch: int, shape: torch.Size) -> None:
        with self._ready:
            self._owed[micro_batch] = shape

    def put_backward(self, msg: Message, sender: str | None = None) -> None:
        """Accept a gradient only for a micro-batch we sent and only with the shape we sent. A malformed
        one raises (its stream ends); a non-finite one fails the run naming `sender` (the next stage's
        address) and leaves its stream open, so the sender's failure is not a report against us."""
        with self._ready:
            self._raise_if_closed()
            grad = msg.tensors.get(GRADIENT)
            shape = self._owed.get(msg.id)
            if shape is None:
                raise WireError(f"backward for micro-batch {msg.id}, which is not awaiting a gradient here")
            try:
                if grad is None or grad.shape != shape or not grad.is_floating_point():
                    got = "no 'grad' tensor" if grad is None else f"{grad.dtype}{list(grad.shape)}"
                    raise WireError(f"backward for micro-batch {msg.id}: expected a float 'grad' of shape "
                                    f"{list(shape)}, got {got}")
                require_finite(grad, f"gradient for micro-batch {msg.id}")
            except WireError as refused:  # the schedule waits for exactly this gradient: it will not come
                not_finite = isinstance(refused, NotFinite)
                self._failure = self._failure or PipelineError(f"a neighbour sent a bad gradient: {refused}",
                                                               *((FailureKind.NAN, sender) if not_finite else ()))
                self._ready.notify_all()
                if not_finite:
                    return
                raise
            del self._owed[msg.id]
            self._backward.append(msg)
            self._ready.notify()

    def put_forward(self, msg: Message) -> None:
        """Queue an activation (or evaluation) message, waiting while the lane is full."""
        with self._ready:
            while self._failure is None and len(self._forward) >= self._capacity:
                self._space.wait()
            self._raise_if_closed()
            self._forward.append(msg)
            self._ready.notify()

    def fail(self, reason: str | PipelineError) -> None:
        """Close the inbox: the worker's `get` raises PipelineError(reason), later puts are refused.
        The first reason wins."""
        with self._ready:
            if self._failure is None:
                self._failure = reason if isinstance(reason, PipelineError) else PipelineError(reason)
            self._ready.notify_all()
            self._space.notify_all()

    def check(self) -> None:
        """Raise PipelineError once the inbox is closed: a stop, a lost neighbour, a refused message.
        A plain read, no lock: the worker asks before every action."""
        if self._failure is not None:
            raise self._failed()

    def _failed(self) -> PipelineError:
        """A fresh exception each time (an exception raised twice keeps growing its traceback)."""
        assert self._failure is not None
        return PipelineError(str(self._failure), self._failure.kind, self._failure.peer)

    def next_backward(self, timeout: float) -> Message:
        """The oldest gradient, waiting for one; gradients arrive in the order the stage asks for them
        (the next stage runs the same schedule)."""
        return self._take(self._backward, timeout)

    def next_forward(self, timeout: float) -> Message:
        """The oldest activation or evaluation message, waiting for one."""
        return self._take(self._forward, timeout)

    def _take(self, lane: deque[Message], timeout: float) -> Message:
        deadline = time.monotonic() + timeout
        with self._ready:
            while True:
                if self._failure is not None:
                    raise self._failed()
                if lane:
                    self._space.notify()
                    return lane.popleft()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PipelineError(f"no message from the neighbouring stages for {timeout:.0f}s; "
                                        "a peer has probably failed", FailureKind.TIMEOUT)
                self._ready.wait(remaining)

    def _raise_if_closed(self) -> None:
        if self._failure is not None:
            raise WireError(f"stage is not accepting messages: {self._failure}", grpc.StatusCode.ABORTED)
