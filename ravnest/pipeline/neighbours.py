"""A stage's links to the stages before and after it in its pipeline.

Inbound: gRPC handler threads validate each message (shape, dtype, order, finiteness) and queue it in
the inbox (inbox.py); nothing reaches the worker that its first block cannot take. Outbound: one
long-lived stream per side, opened on first use. When the stage stops, the neighbours are told why
(an "abort" message) so they fail fast with the reason instead of waiting out a timeout.

A broken connection costs nothing: the sending end opens a new stream and sends its last messages
again (outbound_link.py), and the receiving end takes each message once and in its place on the link
(`_in_turn`).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from ravnest.partition import RECEIVE_SLACK
from ravnest.failures import FailureKind
from ravnest.pipeline.inbox import Inbox, PipelineError
from ravnest.spec import StageAssignment, StagePeer
from ravnest.pipeline.outbound_link import LINK_SEQ, OutboundLink
from ravnest.timeouts import LINK_RESUME_S
from ravnest.wire import Message, Router, WireError, require_finite
from ravnest.wire.dtypes import NotFiniteValues

FORWARD, BACKWARD, EVAL, EVAL_END, ABORT = "forward", "backward", "eval", "eval_end", "abort"
MESSAGE_KINDS = (FORWARD, BACKWARD, EVAL, EVAL_END, ABORT)
PREV, NEXT = "prev", "next"
log = logging.getLogger(__name__)
TARGET_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)  # what targets may travel as


def target_dtype(limit: int | None) -> torch.dtype:
    """The narrowest dtype for targets below `limit` (a language model's vocabulary): a token costs 1
    or 2 bytes on the wire rather than int64's 8. Classes (limit None) are one per sample: int64."""
    if limit is None:
        return torch.int64
    return torch.uint8 if limit <= 256 else torch.int16 if limit <= 32768 else torch.int32


class Neighbours:
    """The inbox this stage's worker takes from and the streams it sends on."""

    def __init__(self, assignment: StageAssignment, *, task: str, window: int,
                 total_micro_batches: int, peer_timeout: float, codec: str, target_limit: int | None = None):
        a = self.assignment = assignment
        self.is_first, self.is_last = a.is_first, a.is_last
        for needed, peer, side in ((not self.is_first, a.prev, PREV), (not self.is_last, a.next, NEXT)):
            if needed and peer is None:
                raise ValueError(f"stage {a.stage} of {a.num_stages} needs a '{side}' peer")
        if not self.is_first and a.input_shape is None:
            raise ValueError(f"stage {a.stage} needs the shape of its input activations (input_shape)")
        self._input_dtype = getattr(torch, a.input_dtype, None)
        if not isinstance(self._input_dtype, torch.dtype):
            raise ValueError(f"unknown input dtype {a.input_dtype!r}")
        self.task, self.total_micro_batches = task, total_micro_batches
        self.peer_timeout, self.codec = peer_timeout, codec
        self._target_dtype = target_dtype(target_limit)
        self.inbox = Inbox(forward_capacity=window + RECEIVE_SLACK)  # bounds what the planner counts
        self._links = {side: self._link(side, peer, keep=window + RECEIVE_SLACK)
                       for side, peer in ((PREV, a.prev), (NEXT, a.next)) if peer is not None}
        self._heard = {PREV: 0, NEXT: 0}  # the last link_seq taken from each side
        self._in_order = {PREV: threading.Condition(), NEXT: threading.Condition()}
        self.link_resume_s = LINK_RESUME_S  # how long a message waits for the ones before it (`_in_turn`)
        self._next_forward_id = 0
        self._forward_lock = threading.Lock()

    def listen(self, router: Router) -> None:
        """The message kinds this stage takes; the others stay unknown here (UNIMPLEMENTED). Handlers
        look the inbox up when called, so a test may wrap its methods."""
        router.route(ABORT, self._on_abort)
        if not self.is_first:
            router.route(FORWARD, self._on_forward)
            router.route(EVAL, self._on_eval)
            router.route(EVAL_END, lambda msg, peer: self._in_turn(PREV, msg, self.inbox.put_forward))
        if not self.is_last:
            router.route(BACKWARD, self._on_backward)

    # --- outbound (the worker thread) -------------------------------------------------------------

    def _peer(self, side: str) -> StagePeer | None:
        return self.assignment.prev if side == PREV else self.assignment.next

    def _link(self, side: str, peer: StagePeer, keep: int) -> OutboundLink:
        return OutboundLink(peer.address, token=self.assignment.token, keep=keep, peer_timeout=self.peer_timeout,
                            codec=self.codec if peer.codec is None else peer.codec,  # the planner's pick for it
                            on_lost=lambda reason, peers_doing: self._lost(side, reason, peers_doing),
                            name=f"stage {self.assignment.stage}'s link to its {side} stage ({peer.address})")

    def send(self, side: str, msg: Message) -> None:
        if "y" in msg.tensors:
            msg.tensors["y"] = msg.tensors["y"].to(self._target_dtype)
        self._links[side].send(msg)

    def sent_bytes(self, side: str) -> int:
        """Bytes sent to the stage on `side` so far, as the codec encoded them."""
        link = self._links.get(side)
        return link.sent_bytes if link is not None else 0

    def busy(self, side: str) -> float | None:
        """The share of time the stream to `side` had something to send (None before it opened)."""
        link = self._links.get(side)
        return link.busy if link is not None else None

    def _lost(self, side: str, reason: str, peers_doing: bool) -> None:
        peer = self._peer(side) if peers_doing else None
        self.inbox.fail(PipelineError(f"stage {self.assignment.stage} lost its {side} stage: {reason}",
                                      FailureKind.PEER_LOST if peer else None, peer.address if peer else None))

    def close(self) -> None:
        """Wait until every neighbour has received everything we sent."""
        for link in self._links.values():
            link.close()

    def cut(self) -> None:
        """From any thread, on a stop: end our streams at once, so a send blocked on a neighbour that
        reads nothing returns now rather than after `peer_timeout`."""
        for link in self._links.values():
            link.cut()

    def abort(self, reason: str) -> None:
        """Best effort: tell both neighbours why we stop, so they fail fast with the reason."""
        for link in self._links.values():
            link.abort(Message(ABORT, note=reason[:1000]))

    # --- inbound (gRPC handler threads): validate, then queue -------------------------------------

    def _in_turn(self, side: str, msg: Message, take: Callable[[Message], None]) -> None:
        """Hand `msg` from `side` to `take` once and in its place on the link: one sent again after a
        break is dropped, and one that comes before a message still on its way (on the broken stream)
        waits for it; where that never comes, the messages between were lost, which ends the stream."""
        seq = msg.tags.get(LINK_SEQ)
        if seq is None:  # (an abort, sent on a stream of its own)
            take(msg)
            return
        turn = self._in_order[side]
        with turn:
            if not turn.wait_for(lambda: seq <= self._heard[side] + 1, timeout=self.link_resume_s):
                raise WireError(f"message {seq} on the link from the {side} stage came after message "
                                f"{self._heard[side]}: the ones between were lost")
            if seq <= self._heard[side]:
                return  # sent again after a break: taken already
            take(msg)
            self._heard[side] = seq
            turn.notify_all()

    def _on_forward(self, msg: Message, peer: str) -> None:
        self._in_turn(PREV, msg, self._take_forward)

    def _on_eval(self, msg: Message, peer: str) -> None:
        self._in_turn(PREV, msg, self._take_eval)

    def _on_backward(self, msg: Message, peer: str) -> None:
        self._in_turn(NEXT, msg, self._take_backward)

    def _take_forward(self, msg: Message) -> None:
        if not self._fit_to_queue(msg, PREV):
            return
        with self._forward_lock:  # the one previous stage sends micro-batches 0, 1, 2, ... in order
            if msg.id != self._next_forward_id or msg.id >= self.total_micro_batches:
                raise WireError(f"forward for micro-batch {msg.id}, expected {self._next_forward_id} "
                                f"(of {self.total_micro_batches})")
            self._next_forward_id += 1
        self.inbox.put_forward(msg)

    def _take_eval(self, msg: Message) -> None:
        if self._fit_to_queue(msg, PREV):
            self.inbox.put_forward(msg)

    def _take_backward(self, msg: Message) -> None:
        sender = self._peer(NEXT)
        self.inbox.put_backward(msg, sender.address if sender else None)

    def _fit_to_queue(self, msg: Message, side: str) -> bool:
        """Whether `msg`'s activations are fit to queue; a malformed message raises (its stream ends)."""
        try:
            self._check_activation(msg)
            return True
        except NotFiniteValues as refused:
            self._refuse(side, refused)
            return False

    def _refuse(self, side: str, refused: NotFiniteValues) -> None:
        """Non-finite values end the run naming their sender (kind nan), so the coordinator leaves out
        the source, not this stage. The sender's stream is not cut: its failure would be its report
        that this stage was lost, the messenger blamed (the inbox does the same for gradients)."""
        peer, which = self._peer(side), "previous" if side == PREV else "next"
        self.inbox.fail(PipelineError(f"stage {self.assignment.stage} refused what the {which} stage sent: {refused}",
                                      FailureKind.NAN, peer.address if peer else None))

    def _on_abort(self, msg: Message, peer: str) -> None:
        """Only planned neighbours reach here (the node's gate); what one says is its own account, so it
        is logged in full and passed on shortened to one printable line."""
        log.warning("stage %d: neighbour %s reports a failure: %r", self.assignment.stage, peer, msg.note)
        first_line = msg.note.strip().splitlines()[0] if msg.note.strip() else "no reason given"
        said = "".join(ch if ch.isprintable() else " " for ch in first_line)[:500]
        self.inbox.fail(PipelineError(f"stage {self.assignment.stage}: its neighbour at {peer} reported a failure "
                                      f"({said!r})", FailureKind.PEER_FAILED))

    def _check_activation(self, msg: Message) -> None:
        """Reject activations this stage's first block cannot take, before they reach the worker."""
        a = self.assignment
        x, y, expected = msg.tensors.get("x"), msg.tensors.get("y"), a.input_shape
        assert expected is not None  # checked in __init__ for every stage that takes activations
        where = f"stage {a.stage} (blocks [{a.blocks[0]}, {a.blocks[1]}))"
        if x is None or y is None:
            raise WireError(f"{where}: {msg.kind} message {msg.id} needs tensors 'x' and 'y'")
        free = 2 if self.task == "lm" else 1  # batch (and sequence) dimensions may be smaller
        ok = (x.dtype == self._input_dtype and x.dim() == len(expected) and list(x.shape[free:]) == expected[free:]
              and all(1 <= n <= limit for n, limit in zip(x.shape[:free], expected[:free])))
        if not ok:
            shape = ["B", *(["T"] if free == 2 else []), *expected[free:]]
            limits = ", ".join(f"{name} <= {limit}" for name, limit in zip(shape, expected[:free]))
            raise WireError(f"{where} expects activations {a.input_dtype} of shape {shape} with "
                            f"{limits}, got {str(x.dtype).removeprefix('torch.')}{list(x.shape)}")
        if y.dtype not in TARGET_DTYPES or y.is_floating_point() or y.shape != x.shape[:free]:
            raise WireError(f"{where}: targets must be integers of shape {list(x.shape[:free])}, "
                            f"got {str(y.dtype).removeprefix('torch.')}{list(y.shape)}")
        require_finite(x, f"{where}: activations of {msg.kind} message {msg.id}")
        msg.tensors["y"] = y.long()  # (what the loss takes)
