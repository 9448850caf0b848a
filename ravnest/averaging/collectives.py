"""Collectives of one segment's group on one flat fp32 vector over the peer wire: the ring all-reduce,
or its two halves, reduce-scatter and all-gather, called apart; and a gossip exchange with chosen
members.

The vector is cut into one share per member (sized by `weights`), each share into chunks. In a ring
of n members, at step L (0 <= L < 2n-2) member r sends share (r - L) mod n to r+1 and receives share
(r - 1 - L) mod n from r-1; steps < n-1 add what arrives (reduce-scatter), later steps copy it
(all-gather). Nothing waits for a whole step: chunk c received at step L is reduced and sent on at
step L+1 at once, so receiving chunk c+1 overlaps sending chunk c, and data flows through the ring
as a pipeline. The owner of a share divides it by n before the all-gather, so every member ends
with the owner's exact bits.

All rings of a node share one `RingHub` per router: it owns the "ring" message kind, one mailbox
keyed by (segment, round, step, chunk), and one long-lived outbound stream per neighbour address.
Per-ring streams would add threads, not bandwidth (the shared channel is one TCP connection per
address anyway), and the keyed mailbox keeps interleaved rings and rounds apart. `lanes` > 1 spreads
chunks over that many streams, each on its own connection (it did not help on loopback here: the
cost is CPU per byte, not one connection's window).
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Iterator

import grpc
import torch

from ravnest.averaging.mailbox import Mailbox
from ravnest.averaging.shares import share_bounds
from ravnest.errors import RavnestError
from ravnest.failures import FailureKind, KnownFailure, NotFinite
from ravnest.timeouts import FAILED_FLUSH_S
from ravnest.wire import Message, OutboundStream, PeerError, Router, WireError, require_finite, wait_authorized
from ravnest.wire.dtypes import NotFiniteValues
from ravnest.wire import codecs
from ravnest.wire.tensors import decode, encode
from ravnest.wire.transport import AUTH_GRACE_S, new_pool

KIND = "ring"
TENSOR = "x"
DEFAULT_CHUNK_BYTES = 4 << 20  # the wire's largest frame: one frame per ring message
_TAGS = ("segment", "round", "step", "chunk", "numel", "sender")
EARLY_BYTES = 64 << 20  # chunks held for segments this node is about to join (see RingHub._early)


class RingError(RavnestError, RuntimeError):
    """A ring round failed; the message names the segment, round, step and peer."""


class RingTimeout(RingError, KnownFailure, TimeoutError):
    """A ring step's data did not arrive before its deadline; `address`: the member that sent nothing."""

    def __init__(self, message: str, *, address: str | None = None):
        super().__init__(message)
        self.address = address

    @property
    def failure_kind(self) -> FailureKind | None:
        return FailureKind.TIMEOUT if self.address else None

    @property
    def peer_address(self) -> str | None:
        return self.address


class RingRefused(RingError, NotFinite):
    """A ring member sent values that are not finite; `address`: that member (the failure names it)."""

    def __init__(self, message: str, *, address: str):
        super().__init__(message)
        self.address = address

    @property
    def peer_address(self) -> str | None:
        return self.address


class RingHub:
    """The ring side of one node's router: inbound mailbox plus outbound streams, shared by rings."""

    _by_router: "weakref.WeakKeyDictionary[Router, RingHub]" = weakref.WeakKeyDictionary()
    _registry_lock = threading.Lock()

    def __init__(self, router: Router, token: str | None, lanes: int = 1):
        self.token = token
        self.lanes = lanes
        self.mailbox = Mailbox()
        self._segments: dict[int, int] = {}  # segment -> lowest round still accepted
        # chunks for a segment this node has not joined yet: a peer's first round can come before this
        # node's stage has set up all its rings (it joins them one by one); bounded, handed over at join
        self._early: list[tuple[int, tuple, tuple]] = []
        self._early_bytes = 0
        self._streams: dict[str, list[OutboundStream]] = {}
        self._address_locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        # Ring chunks are only read (added or copied into the round's buffer): no copy out of the frame.
        router.route(KIND, self._deliver, zero_copy=True)

    @classmethod
    def for_router(cls, router: Router, token: str | None, lanes: int = 1) -> RingHub:
        """The hub already serving this router for this job (`token`), or a new one. A node serves
        job after job: an idle hub of an earlier job is replaced, its streams carried the old token."""
        with cls._registry_lock:
            hub = cls._by_router.get(router)
            if hub is not None and hub.token != token:
                with hub._lock:
                    busy = sorted(hub._segments)
                if busy:
                    raise ValueError(f"this node still serves another job's rings (segments {busy})")
                hub = None
            if hub is None:
                hub = cls._by_router[router] = cls(router, token, lanes)
            return hub

    # --- membership ---------------------------------------------------------------------------

    def join(self, segment: int) -> None:
        with self._lock:
            if segment in self._segments:
                raise ValueError(f"this node already serves the ring of segment {segment}")
            self._segments[segment] = 0
            arrived = [(key, value) for s, key, value in self._early if s == segment]
            self._early = [entry for entry in self._early if entry[0] != segment]
            self._early_bytes -= sum(value[2].nbytes for _, value in arrived)
        for key, value in arrived:
            self.mailbox.put(key, value)

    def leave(self, segment: int) -> None:
        """Forget a segment; the last one to leave closes the outbound streams."""
        with self._lock:
            self._segments.pop(segment, None)
            last = not self._segments
        self.mailbox.discard(lambda key: key[0] == segment)
        if last:
            self.close()

    def end_round(self, segment: int, round: int) -> None:
        """No more messages of this or earlier rounds of the segment are wanted (late ones are dropped)."""
        with self._lock:
            if segment in self._segments:
                self._segments[segment] = max(self._segments[segment], round + 1)
        self.mailbox.discard(lambda key: key[0] == segment and key[1] <= round)

    # --- inbound --------------------------------------------------------------------------------

    def _deliver(self, msg: Message, peer: str) -> None:
        missing = [t for t in _TAGS if t not in msg.tags]
        if missing or list(msg.tensors) != [TENSOR]:
            raise WireError(f"ring message from {peer} lacks tags {missing} or its single tensor")
        tags = msg.tags
        key = (tags["segment"], tags["round"], tags["step"], tags["chunk"])
        value: tuple[int, int, torch.Tensor | NotFiniteValues]
        try:
            require_finite(msg.tensors[TENSOR], f"ring chunk (segment {tags['segment']}, round {tags['round']})")
            value = (tags["numel"], tags["sender"], msg.tensors[TENSOR])
        except NotFiniteValues as refused:
            # kept in the chunk's place, so the ring that waits for it fails now naming the member that
            # should have sent it; the sender's stream is not cut (its error would be its report against us)
            value = (tags["numel"], tags["sender"], refused)
        with self._lock:
            floor = self._segments.get(tags["segment"])
            if floor is None:
                if self._early_bytes + msg.tensors[TENSOR].nbytes > EARLY_BYTES:
                    raise WireError(f"no ring for segment {tags['segment']} on this node",
                                    grpc.StatusCode.FAILED_PRECONDITION)
                self._early.append((tags["segment"], key, value))
                self._early_bytes += msg.tensors[TENSOR].nbytes
                return
        if tags["round"] < floor:
            return  # a straggler of a round this node already finished or gave up
        try:
            self.mailbox.put(key, value)
        except KeyError as e:
            raise WireError(f"from {peer}: {e}") from None

    # --- outbound -------------------------------------------------------------------------------

    def send(self, address: str, msg: Message, codec: str, timeout: float) -> None:
        """Queue `msg` without a snapshot: its tensor is read when gRPC takes it (see `flush`)."""
        streams = self._outbound(address, timeout)
        try:
            streams[msg.tags["chunk"] % len(streams)].send(msg, codec=codec, timeout=timeout, copy=False)
        except PeerError:
            self._drop(address)
            raise

    def flush(self, address: str, timeout: float) -> None:
        """Return once everything queued to `address` has been framed, so its tensors may change.
        A stream that fails or does not get there in time is dropped: then nothing reads them later."""
        with self._lock:
            streams = self._streams.get(address, [])
        try:
            for stream in streams:
                stream.flush(timeout)
        except PeerError:
            self._drop(address)
            raise

    def _outbound(self, address: str, timeout: float) -> list[OutboundStream]:
        with self._lock:
            streams = self._streams.get(address)
            lock = self._address_locks.setdefault(address, threading.Lock())
        if streams is not None:
            return streams
        with lock:  # connect outside the hub lock: one unreachable peer must not stall other rings
            with self._lock:
                streams = self._streams.get(address)
            if streams is None:
                # a peer of this job may not have fetched its assignment (and the job's token) yet
                wait_authorized(address, self.token, min(timeout, AUTH_GRACE_S))
                # Extra lanes get their own channel (own TCP connection); the first uses the shared pool.
                streams = [OutboundStream(address, token=self.token, chunk_bytes=DEFAULT_CHUNK_BYTES,
                                          pool=None if lane == 0 else new_pool(), wait_ready=timeout)
                           for lane in range(self.lanes)]
                with self._lock:
                    self._streams[address] = streams
            return streams

    def _drop(self, address: str) -> None:
        with self._lock:
            streams = self._streams.pop(address, [])
        for stream in streams:
            stream.cancel()

    def close(self) -> None:
        with self._lock:
            streams = [s for lane in self._streams.values() for s in lane]
            self._streams.clear()
        for stream in streams:
            try:
                stream.close(timeout=5.0)
            except PeerError:
                stream.cancel()


class RingMember:
    """This node's place in the ring of one segment.

    `addresses[i]` is member i's gRPC address (i = its cluster index); this node is `rank`. The
    all-reduce passes shares around the ring `order` (member indices; default 0, 1, ..., n-1): the
    planner orders members so the slowest link is as fast as it can be (coordinator/ring_order.py).
    Every member must use the same `order`, `weights` (share sizes in ring order; default equal) and
    vector length. Gossip (`exchange`) addresses members by index, whatever the order. `keys`: the
    members' public keys, which robust rounds sign their commitments for (robust_round.py)."""

    def __init__(self, rank: int, addresses: list[str], router: Router, token: str | None = None, *,
                 segment: int = 0, weights: list[float] | None = None, codec: str = "",
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, step_timeout: float = 60.0, lanes: int = 1,
                 order: list[int] | None = None, keys: list[str] | None = None):
        if not 0 <= rank < len(addresses):
            raise ValueError(f"rank {rank} outside a ring of {len(addresses)} members")
        order = list(range(len(addresses))) if order is None else list(order)
        if sorted(order) != list(range(len(addresses))):
            raise ValueError(f"ring order {order} is not an order of the {len(addresses)} members")
        codecs.codec(codec)  # ValueError naming the known ones
        if chunk_bytes < 4:
            raise ValueError("chunk_bytes must hold at least one fp32 element")
        self.rank, self.addresses, self.size = rank, list(addresses), len(addresses)
        self.segment, self.codec, self.step_timeout, self.keys = segment, codec, step_timeout, keys
        self.weights = list(weights) if weights is not None else [1.0] * self.size
        if len(self.weights) != self.size:
            raise ValueError(f"{len(self.weights)} weights for a ring of {self.size} members")
        self.chunk_elems = chunk_bytes // 4
        self.hub = RingHub.for_router(router, token, lanes)
        self.hub.join(segment)
        self.order, self.position = order, order.index(rank)  # where this member sits in the ring
        self._next = self.addresses[order[(self.position + 1) % self.size]]
        self._prev = order[(self.position - 1) % self.size]
        self._closed = threading.Event()
        self._residual: torch.Tensor | None = None  # what a top-k round left out of this member's vector
        self.sent_bytes = 0  # payload bytes this member has sent, as its codecs encode them

    def allreduce(self, flat: torch.Tensor, round: int, *, codec: str | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """The element-wise mean of every member's `flat`, as fp32: written into `out` when given (a
        contiguous fp32 CPU tensor of the same size, reused across rounds to spare page faults; may be
        `flat` itself), else into a new tensor. `flat` is otherwise left untouched.

        `round` tags the messages: every member must call with the same round number, each round
        once, in increasing order. `codec` overrides the member's codec for this round. Raises
        RingTimeout/RingError/PeerError naming the peer and the step."""
        if not codecs.codec(self.codec if codec is None else codec).reduces:
            return self._gathered_mean(flat, round, self.codec if codec is None else codec, out)
        # one pass over all 2n - 2 steps: a share completed by the reduce-scatter is sent on at once
        return self._steps(_work_buffer(flat, out), round, range(2 * self.size - 2), codec, ends_round=True)

    def _gathered_mean(self, flat: torch.Tensor, round: int, codec: str, out: torch.Tensor | None) -> torch.Tensor:
        """The mean of a codec whose values cannot be summed hop by hop (top-k): every member sends its
        encoded vector to every other and averages what arrived with what the others got from it, so
        all compute the same mean. Error feedback is this member's: what its vector left out this round
        is added to its next (the link state of a broadcast, one direction, every peer alike)."""
        fed = flat.detach().reshape(-1).float()
        if self._residual is not None and self._residual.shape == fed.shape:
            fed = fed + self._residual
        own = torch.empty_like(fed)
        for a, b in self._chunk_bounds(0, fed.numel()):  # the pieces the wire encodes, one by one
            header, view = encode(TENSOR, fed[a:b], codec)
            own[a:b] = decode(header, view)
        self._residual = fed - own
        others = [r for r in range(self.size) if r != self.rank]
        received = self.exchange(fed, round, others, others, codec=codec)
        received[self.rank] = own
        total = sum(self.weights)
        mean = torch.zeros_like(own) if out is None else out.zero_()
        for rank in range(self.size):  # in one order everywhere: the same sum to the last bit
            mean.add_(received[rank], alpha=self.weights[rank] / total)
        return mean

    def reduce_scatter(self, flat: torch.Tensor, round: int, *, codec: str | None = None,
                       out: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[int, int]]:
        """The first half of `allreduce`: (the work buffer, the bounds [a, b) of the share whose mean
        this member now holds; elsewhere the buffer holds partial sums). Member r holds share
        (r + 1) mod n (`owned_share`), r its position in the ring order. Every member must follow with
        `all_gather` of the same round."""
        buf = self._steps(_work_buffer(flat, out), round, range(self.size - 1), codec, ends_round=False)
        return buf, self.owned_share(buf.numel())

    def all_gather(self, buf: torch.Tensor, round: int, *, codec: str | None = None) -> torch.Tensor:
        """The second half of `allreduce`: every member's own share of `buf` (a contiguous fp32 CPU
        tensor, see `owned_share`) is copied into the others', in place; returns `buf`."""
        return self._steps(_work_buffer(buf, buf), round, range(self.size - 1, 2 * self.size - 2), codec,
                           ends_round=True)

    def exchange(self, flat: torch.Tensor, round: int, sends_to: list[int], hears_from: list[int], *,
                 codec: str | None = None, paced: bool = False) -> dict[int, torch.Tensor]:
        """Gossip: send `flat` (left untouched until this returns) to the members `sends_to`; return
        what each member of `hears_from` sent in this round, as fp32 vectors of the same size. Every
        member must call with the same round number, each round once, in increasing order. The
        messages carry step -(1 + sender): the keyed mailbox keeps senders apart, and apart from the
        all-reduce's steps (>= 0).

        `paced` (only where every member hears the same rank offsets, `topology.circulant`): a member
        hears one neighbour at a time, nearest below first, and asks for each vector with a
        one-element message (step -(1 + size + receiver)); it sends to one neighbour at a time,
        nearest above first, once asked. Unpaced, every vector leaves at once, and a round ends when
        they were handed to gRPC, not when they arrived: a member ahead of its peers then pushes its
        next round into links still carrying this one, and several vectors share one download. On
        tbf-shaped links both cost twice the time per round (TCP loses packets where several flows
        meet one slow link) and put the rounds further out of step. Paced, each link carries one
        vector at a time, at the cost of one small message's latency per neighbour."""
        codec = self.codec if codec is None else codec
        flat = flat.detach().reshape(-1)
        chunks = self._chunk_bounds(0, flat.numel())
        received: dict[int, torch.Tensor] = {}
        if paced:  # phase k: ask sources[k], send to targets[k] when asked, hear sources[k]
            sources = sorted(hears_from, key=lambda j: (self.rank - j) % self.size)
            targets = sorted(sends_to, key=lambda j: (j - self.rank) % self.size)
            phases = [(sources[k:k + 1], targets[k:k + 1]) for k in range(max(len(sources), len(targets)))]
        else:
            phases = [([], sends_to), (hears_from, [])]
        with self._sending(round, sends_to):
            for hear, send in phases:
                for source in hear if paced else ():
                    self._send(round, -1 - self.size - self.rank, 0, torch.ones(1), 1, "", to=source)
                for target in send:
                    if paced:
                        self._receive(round, -1 - self.size - target, 0, 1, 1, sender=target)
                    for c, (a, b) in enumerate(chunks):
                        self._send(round, -1 - self.rank, c, flat[a:b], flat.numel(), codec, to=target)
                for source in hear:
                    buf = received[source] = torch.empty(flat.numel())
                    for c, (a, b) in enumerate(chunks):
                        buf[a:b] = self._receive(round, -1 - source, c, b - a, flat.numel(), sender=source)
        return received

    def owned_share(self, numel: int) -> tuple[int, int]:
        """Bounds of the share of a `numel`-element vector that this member reduces and gathers from."""
        return share_bounds(numel, self.weights)[(self.position + 1) % self.size]

    def close(self) -> None:
        """Leave the ring; a round still running here fails at once with RingError."""
        self._closed.set()
        self.hub.mailbox.interrupt()
        self.hub.leave(self.segment)

    # --- internals ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _sending(self, round: int, targets: list[int], flush: bool = True) -> Iterator[None]:
        """Around a round that sends to `targets`: once it is done, wait until all it queued was framed
        (so its tensors may change; not with `flush=False`); if it fails, only release what it queued;
        either way the round ends (late messages of it are dropped)."""
        try:
            yield
            for target in targets if flush else ():
                self._flush(round, to=target)
        except BaseException:
            with contextlib.suppress(PeerError):  # the round failed anyway; just release its tensors
                for target in targets:
                    self.hub.flush(self.addresses[target], min(self.step_timeout, FAILED_FLUSH_S))
            raise
        finally:
            self.hub.end_round(self.segment, round)

    def _steps(self, buf: torch.Tensor, round: int, steps: range, codec: str | None,
               ends_round: bool) -> torch.Tensor:
        """Run ring steps `steps` on `buf` (see the module docstring): at step L send share (r - L)
        and receive share (r - 1 - L); reduce below n - 1, copy from there on."""
        codec = self.codec if codec is None else codec
        if not codecs.codec(codec).reduces and steps.start < self.size - 1:
            raise ValueError(f"codec {codec!r} cannot be summed hop by hop in a ring; its replicas all-gather")
        n, r = self.size, self.position
        if n == 1:
            return buf
        chunks = [self._chunk_bounds(a, b) for a, b in share_bounds(buf.numel(), self.weights)]
        first, last = steps.start, steps.stop - 1
        failed = False
        try:
            for c, (a, b) in enumerate(chunks[(r - first) % n]):
                self._send(round, first, c, buf[a:b], buf.numel(), codec)
            for step in steps:
                for c, (a, b) in enumerate(chunks[(r - 1 - step) % n]):
                    part, received = buf[a:b], self._receive(round, step, c, b - a, buf.numel())
                    if step < n - 1:
                        part.add_(received)
                        if step == n - 2:  # this share is complete here: its owner makes it the mean
                            part.div_(n)
                    else:
                        part.copy_(received)
                    if step < last:  # `part` is not written again before the flush below
                        self._send(round, step + 1, c, part, buf.numel(), codec)
        except BaseException:
            failed = True
            with contextlib.suppress(PeerError):  # the round failed anyway; just release `buf`
                self.hub.flush(self._next, min(self.step_timeout, FAILED_FLUSH_S))
            raise
        else:
            self._flush(round)
        finally:
            if ends_round or failed:
                self.hub.end_round(self.segment, round)
        return buf

    def _chunk_bounds(self, start: int, end: int) -> list[tuple[int, int]]:
        return [(a, min(a + self.chunk_elems, end)) for a in range(start, end, self.chunk_elems)]

    def _where(self, round: int, step: int, chunk: int) -> str:
        n = self.size
        if step < -2 * n:  # robust_round.py's phases
            phase = ("commit", "scatter", "gather", "votes")[(-1 - step) // n - 2] + f" from rank {(-1 - step) % n}"
        elif step < 0:
            phase = f"exchange from rank {-1 - step}"
        else:
            phase = f"reduce-scatter step {step}" if step < n - 1 else f"all-gather step {step - n + 1}"
        return f"ring segment {self.segment} round {round} {phase} chunk {chunk}"

    def _send(self, round: int, step: int, chunk: int, part: torch.Tensor, numel: int,
              codec: str, to: int | None = None) -> None:
        address = self._next if to is None else self.addresses[to]
        tags = {"segment": self.segment, "round": round, "step": step, "chunk": chunk,
                "numel": numel, "sender": self.rank}
        try:
            self.hub.send(address, Message(KIND, step, {TENSOR: part}, tags), codec, self.step_timeout)
            self.sent_bytes += codecs.codec(codec).wire_bytes(part.numel(), part.element_size())
        except PeerError as e:
            raise PeerError(f"{self._where(round, step, chunk)}: sending to {address}: {e}", address=address) from None

    def _flush(self, round: int, to: int | None = None) -> None:
        address = self._next if to is None else self.addresses[to]
        try:
            self.hub.flush(address, self.step_timeout)
        except PeerError as e:
            raise PeerError(f"ring segment {self.segment} round {round}: sending to {address}: {e}",
                            address=address) from None

    def _receive(self, round: int, step: int, chunk: int, size: int, numel: int,
                 sender: int | None = None, raw: bool = False) -> torch.Tensor:
        expected = self._prev if sender is None else sender
        item = self.hub.mailbox.take((self.segment, round, step, chunk), self.step_timeout, self._closed)
        peer = f"{self.addresses[expected]} (rank {expected})"
        if self._closed.is_set():
            raise RingError(f"{self._where(round, step, chunk)}: this ring member was closed")
        if item is None:
            raise RingTimeout(f"{self._where(round, step, chunk)}: nothing from {peer} within "
                              f"{self.step_timeout:g}s", address=self.addresses[expected])
        their_numel, sender, tensor = item
        if isinstance(tensor, NotFiniteValues):
            raise RingRefused(f"{self._where(round, step, chunk)}: {peer} sent values that are not finite; refused",
                              address=self.addresses[expected])
        if sender != expected or their_numel != numel or tensor.numel() != size:
            raise RingError(f"{self._where(round, step, chunk)}: rank {sender} sent {tensor.numel()} of "
                            f"{their_numel} elements, expected {size} of {numel} from {peer}; do all "
                            f"members hold the same blocks and use the same weights?")
        return tensor.reshape(-1) if raw else tensor.reshape(-1).float()


def _work_buffer(flat: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`out` (checked) holding a copy of `flat`, or a fresh fp32 copy of it."""
    flat = flat.detach().reshape(-1)
    if out is None:
        return flat.to(device="cpu", dtype=torch.float32, copy=True)
    if out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous() \
            or out.numel() != flat.numel():
        raise ValueError(f"out must be a contiguous fp32 CPU tensor of {flat.numel()} elements")
    buf = out.view(-1)
    if buf.data_ptr() != flat.data_ptr():
        buf.copy_(flat)
    return buf
