"""The robust round of one segment's group: a mean that fewer than half of the members cannot move far,
over the same peer wire and mailbox as the ring (collectives.py), and the outliers it finds.

A ring's partial sums hide who sent what, so a robust mean needs every contribution to a share to reach
that share's owner whole (BTARD's butterfly all-reduce, Gorbunov et al. 2022). The messages use steps
below the ring's and gossip's (-1 - (2 + phase) * n - sender), so rounds of all kinds share one mailbox.
"""
from __future__ import annotations

import weakref

import torch

from ravnest.averaging import robust
from ravnest.averaging.collectives import RingError, RingMember, _work_buffer
from ravnest.averaging.shares import share_bounds
from ravnest.averaging.signatures import DIGEST_BYTES, SIGNATURE_BYTES, Signatures, digest
from ravnest.failures import FailureKind, KnownFailure
from ravnest.wire.tensors import decode, encode

PHASES = ("commit", "scatter", "gather", "votes")
# An honest owner's mean of a share is about as far from any member's values as they moved since the last
# round (mean - x = (mean - last) - (x - last), both of a round's training); a mean further than this many
# times that is a lie of the owner's, which only the members it sent it to can see
OWNER_SLACK = 20.0
_LAST: "weakref.WeakKeyDictionary[RingMember, torch.Tensor]" = weakref.WeakKeyDictionary()  # its last result
# Changes (diloco's pseudo-gradients, dear's gradients) are heavy-tailed: a member whose micro-batches were
# easy holds a gradient thousands of times smaller than another's, and an honest mean of the two is far
# from its own by that much; so a member allows for the largest RMS it has sent in a vector of that size
_PEAK: "weakref.WeakKeyDictionary[RingMember, dict[int, float]]" = weakref.WeakKeyDictionary()
_SIGNATURES: "weakref.WeakKeyDictionary[RingMember, Signatures]" = weakref.WeakKeyDictionary()
VOUCHED = DIGEST_BYTES + SIGNATURE_BYTES  # a commitment as owners forward it: its digest and its signature


class RingOutlier(RingError, KnownFailure):
    """A majority of a robust round's share owners found a member's contribution far beyond the others'
    (ravnest/averaging/robust.py), or it sent a share other than the one it had committed to; `address`:
    that member; `by_vote`: named by the owners' majority (every honest member names it in the same
    round), not by this member alone; `also`: other members the same round convicted."""

    def __init__(self, message: str, *, address: str, by_vote: bool = False, also: tuple[str, ...] = ()):
        super().__init__(message)
        self.address, self.by_vote, self._also = address, by_vote, also

    @property
    def addresses(self) -> tuple[str, ...]:
        return self.address, *self._also

    @property
    def more_peer_addresses(self) -> tuple[str, ...]:
        return self._also

    @property
    def failure_kind(self) -> FailureKind | None:
        return FailureKind.OUTLIER

    @property
    def peer_address(self) -> str | None:
        return self.address


def robust_allreduce(member: RingMember, flat: torch.Tensor, round: int, rule: str, *, codec: str | None = None,
                     out: torch.Tensor | None = None, changes: bool = False) -> torch.Tensor:
    """A mean of every member's `flat` that no minority of liars can move far (`rule`, one of
    robust.RULES), written like `RingMember.allreduce`'s. Every member sends share k of its vector
    straight to member k (equal shares by rank), which reduces all n copies robustly and sends the
    result to everyone (an all-to-all reduce-scatter, then an all-gather: the same bytes per member
    as the ring, in 2.5 (n - 1) messages per member where the ring sends 2 (n - 1)):

        commit   each member commits to the SHA-256 of each of its shares, as owners will decode them,
                 signed (signatures.py); it sends member k a share only once it holds k's commitment
        scatter  share k to owner k; one that does not match its commitment is a lie. Of each pair of
                 members the lower rank commits alone, and the higher rank's commitment rides on the
                 first piece of its share (raw: a pair exchanges 3 messages, not 4)
        reduce   owner k: the robust mean of the n copies, and a vote against each copy far off
        gather   owner k sends every member its mean, the commitments it got (a digest and a signature
                 each) and its votes (in one message where they fit)

    Every member then counts the same votes: a member that more than half of the other owners
    voted against is an outlier, and the round raises RingOutlier naming every such member (after `out`
    holds the robust mean), so every honest member reports the same peers in the same round. Nobody
    adapts its shares to what others sent: a member sees shares only from members that hold its
    commitment, so one that holds it back from a member until it has seen shares, then commits that
    member to another share, has signed two commitments for one round; the owners' gathers show both
    to every honest member, and each names it. An owner that
    sends a mean of its share far from the member's own values (OWNER_SLACK times their movement
    since the last round) is named by each member it sent that to. The last result is kept for
    that: one more copy of the vector per segment, from the second round on. `changes`: the vectors
    are changes themselves (diloco's pseudo-gradients, dear's gradients), whose movement is measured
    from zero, and at least as the largest this member sent before (`_PEAK`)."""
    codec = member.codec if codec is None else codec
    n, r = member.size, member.rank
    signatures = _signatures(member)
    buf = _work_buffer(flat, out)
    shares = share_bounds(buf.numel(), [1.0] * n)
    # each member sends to r + 1, r + 2, ... first: were all to start with member 0, a slow one, each would
    # wait on its link before it sends to the others
    others = [(r + i) % n for i in range(1, n)]
    steps = {phase: -1 - (2 + p) * n for p, phase in enumerate(PHASES)}
    # No flush at the end (a wait per peer, about a tenth of the round on 2 cores): nothing queued here
    # changes later. Digests and means are tensors of the round's own, and share k of `buf` is overwritten
    # only by owner k's mean, which k sends once it has received (so this side had framed) that share.
    with member._sending(round, others, flush=False):
        # the digests of all its shares, which bind this member before it sees anyone's share
        digests = torch.zeros(n, DIGEST_BYTES, dtype=torch.uint8)
        for k in others:
            digests[k] = _digest(_as_received(buf[slice(*shares[k])], codec, member.chunk_elems))
        # vouched[j]: the digest of member j's commitment and j's signature of it, as this member got it
        vouched = torch.zeros(n, VOUCHED, dtype=torch.uint8)
        own = _digest(digests)
        signature = _uint8(signatures.sign(member.segment, round, bytes(own.numpy())))
        vouched[r] = torch.cat([own, signature])
        signed = torch.cat([digests.reshape(-1), signature])
        # raw, a higher rank's commitment rides on its first piece of share to a lower one (messages cost
        # more than bytes); under a codec, which cannot carry its bytes, it comes alone
        ride = not codec
        riding = _as_floats(signed) if ride else signed[:0].float()
        ahead = [k for k in others if k > r] if ride else others  # those this member commits to alone, first
        behind = [j for j in others if j < r] if ride else others  # those whose commitment comes alone
        for k in ahead:
            member._send(round, steps["commit"] - r, 0, signed, signed.numel(), "", to=k)
        a, b = shares[r]
        stack = torch.empty(n, b - a)
        stack[r] = buf[a:b]
        mine, committed = _pieces(member, a, b), {}

        def take_commitment(j: int, got: torch.Tensor) -> None:
            committed[j] = got[:DIGEST_BYTES * n].reshape(n, DIGEST_BYTES)
            vouched[j] = torch.cat([_digest(got[:DIGEST_BYTES * n]), got[DIGEST_BYTES * n:]])

        def send_share(k: int, first: int, end: int | None) -> None:  # pieces first..end - 1 of share k
            pieces = _pieces(member, *shares[k])
            for c in range(first, len(pieces) if end is None else end):
                ca, cb = pieces[c]
                part = torch.cat([buf[ca:cb], riding]) if ride and k < r and c == 0 else buf[ca:cb]
                member._send(round, steps["scatter"] - r, c, part, buf.numel(), codec, to=k)

        def receive_share(j: int, first: int, end: int) -> None:  # pieces first..end - 1 of j's share of mine
            for c in range(first, end):
                ca, cb = mine[c]
                carries = ride and j > r and c == 0  # j's commitment, on its first piece
                got = member._receive(round, steps["scatter"] - j, c, cb - ca + riding.numel() * carries,
                                      buf.numel(), sender=j)
                stack[j, ca - a:cb - a] = got[:cb - ca]
                if carries:
                    take_commitment(j, _as_bytes(got[cb - ca:]))

        for j in behind:  # first pieces first, so that no lower rank waits long to send its share
            take_commitment(j, member._receive(round, steps["commit"] - j, 0, signed.numel(), signed.numel(),
                                               sender=j, raw=True))
            send_share(j, 0, 1)
        for k in others:  # then the rest, in the order of `others`
            if k in behind:
                send_share(k, 1, None)
            else:  # a higher rank's commitment rides on its first piece
                receive_share(k, 0, 1)
                send_share(k, 0, None)
        votes = torch.zeros(n)
        for j in others:
            receive_share(j, 1 if ride and j > r else 0, len(mine))
            if not torch.equal(_digest(stack[j]), committed[j][r]):
                votes[j] = 1.0  # it broke its word: a lie only this owner can see, so a vote like the others
        reference = torch.zeros_like(buf) if changes else _LAST.get(member)
        moved = _movement(buf, reference, shares)  # (before the means overwrite this member's values)
        if changes and moved is not None:  # heavy-tailed: allow for the largest this member has sent
            peaks = _PEAK.setdefault(member, {})
            peaks[buf.numel()] = peak = max(peaks.get(buf.numel(), 0.0), float(moved.max()))
            moved = moved.clamp(min=peak)
        mean = robust.reducer(rule)(stack) if b > a else stack[r]
        votes = torch.maximum(votes, torch.tensor(robust.outliers(stack, mean), dtype=torch.float32))
        buf[a:b] = _as_received(mean, codec, member.chunk_elems)  # (every member, this one too, holds the same bits)
        # then the commitments it got, as evidence, and its votes: raw, they ride at the end of the last
        # piece of the mean, else in a message of their own
        tail = torch.cat([_as_floats(vouched), votes])
        payloads = [mean[ca - a:cb - a] for ca, cb in mine]
        if ride:
            payloads[-1] = torch.cat([payloads[-1], tail])
        for k in others:
            for c, payload in enumerate(payloads):
                member._send(round, steps["gather"] - r, c, payload, buf.numel(), codec, to=k)
            if not ride:
                member._send(round, steps["votes"] - r, 0, tail, tail.numel(), "", to=k)
        ballots = torch.zeros(n, n)  # ballots[owner][member]: owner voted against member
        ballots[r] = votes
        forwarded = torch.zeros(n, n, VOUCHED, dtype=torch.uint8)  # [owner][member]: what the owner got
        off = torch.zeros(n)  # per owner: the squared distance of its mean from this member's values
        for j in others:
            pieces = _pieces(member, *shares[j])
            for c, (ca, cb) in enumerate(pieces):
                last = c == len(pieces) - 1
                got = member._receive(round, steps["gather"] - j, c, cb - ca + tail.numel() * (ride and last),
                                      buf.numel(), sender=j)
                off[j] += float(torch.dist(got[:cb - ca], buf[ca:cb])) ** 2
                buf[ca:cb] = got[:cb - ca]
                if ride and last:
                    forwarded[j], ballots[j] = _as_bytes(got[cb - ca:-n]).reshape(n, VOUCHED), got[-n:]
            if not ride:
                got = member._receive(round, steps["votes"] - j, 0, tail.numel(), tail.numel(), sender=j)
                forwarded[j], ballots[j] = _as_bytes(got[:-n]).reshape(n, VOUCHED), got[-n:]
    two_faced = _two_faced(signatures, member, round, vouched, forwarded)
    if two_faced:
        whom = ", ".join(f"{member.addresses[j]} (rank {j})" for j in two_faced)
        raise RingOutlier(f"ring segment {member.segment} round {round}: {whom} signed two different commitments "
                          f"to its shares, one sent to this member and another to an owner, which forwarded it: it "
                          f"could fit a share to what others had sent", address=member.addresses[two_faced[0]],
                          also=tuple(member.addresses[j] for j in two_faced[1:]))
    for j in others if moved is not None else ():
        if (float(off[j]) / max(1, shares[j][1] - shares[j][0])) ** 0.5 > OWNER_SLACK * float(moved[j]):  # type: ignore[index]
            raise RingOutlier(f"ring segment {member.segment} round {round}: {member.addresses[j]} (rank {j}) sent a "
                              f"mean of its share more than {OWNER_SLACK:g} times as far from this member's values "
                              f"as they moved since the last round", address=member.addresses[j])
    if not changes:
        kept = _LAST.get(member)
        _LAST[member] = kept.copy_(buf) if kept is not None and kept.shape == buf.shape else buf.clone()
    # a vote is one vote whatever number an owner sent, and an owner's vote on itself does not count
    against = (ballots > 0.5).float().fill_diagonal_(0).sum(dim=0)
    convicted = [j for j in range(n) if against[j] > (n - 1) / 2]
    if convicted:  # (every one of them: f liars leave in one round)
        whom = ", ".join(f"{member.addresses[j]} (rank {j}, by {int(against[j])})" for j in convicted)
        raise RingOutlier(f"ring segment {member.segment} round {round}: more than half of the {n - 1} other members "
                          f"found the contribution of {whom} far beyond the others' ({rule})",
                          address=member.addresses[convicted[0]], by_vote=True,
                          also=tuple(member.addresses[j] for j in convicted[1:]))
    return buf


def _movement(values: torch.Tensor, last: torch.Tensor | None, shares: list[tuple[int, int]]
              ) -> torch.Tensor | None:
    """Per share, the RMS of how far this member's `values` moved from the last round's result, at
    least their RMS over the whole vector (a share its training barely touched, such as embedding rows
    it saw no token of, still allows for the others' movement); None in a first round."""
    if last is None or last.numel() != values.numel():
        return None
    squares = (values - last).square_()  # (one temporary: a segment can be large)
    overall = float(squares.mean()) ** 0.5 if values.numel() else 0.0
    return torch.tensor([max(overall, float(squares[a:b].mean()) ** 0.5 if b > a else 0.0)
                         for a, b in shares]) + 1e-12


def _signatures(member: RingMember) -> Signatures:
    if member.keys is None:
        raise ValueError("a robust round signs its members' commitments: give the ring member its group's "
                         "signing keys (RingMember keys=, the assignment's StagePeer.signing_key)")
    if member not in _SIGNATURES:
        _SIGNATURES[member] = Signatures(member.hub.token or "", member.keys, member.rank)
    return _SIGNATURES[member]


def _two_faced(signatures: Signatures, member: RingMember, round: int, vouched: torch.Tensor,
               forwarded: torch.Tensor) -> list[int]:
    """The members that signed, for this round, a commitment other than the one this member got from them:
    where an owner forwarded a digest unlike this member's, its signature decides (one that does not
    verify proves nothing against the member, and only costs the owner's word)."""
    r = member.rank
    differs = (forwarded[:, :, :DIGEST_BYTES] != vouched[:, :DIGEST_BYTES]).any(dim=2)
    differs[r] = False  # (its own row: nothing forwarded)
    differs[:, r] = False  # (this member knows what it signed)
    found = set()
    for owner, j in differs.nonzero().tolist():
        row = forwarded[owner, j].numpy()  # its digest, then its signature
        if j not in found and signatures.valid(j, member.segment, round, row[:DIGEST_BYTES].tobytes(),
                                               row[DIGEST_BYTES:].tobytes()):
            found.add(j)
    return sorted(found)


def _as_floats(data: torch.Tensor) -> torch.Tensor:
    """Bytes as fp32 values that cross the wire exactly (two bytes each, as int16: never NaN)."""
    return data.reshape(-1).view(torch.int16).float()


def _as_bytes(values: torch.Tensor) -> torch.Tensor:
    """`_as_floats`'s inverse; values out of int16's range (a liar's) wrap."""
    return values.to(torch.int32).to(torch.int16).view(torch.uint8)


def _pieces(member: RingMember, start: int, end: int) -> list[tuple[int, int]]:
    """The chunks a share crosses in: one at least, which an empty share's commitment or votes ride on."""
    return member._chunk_bounds(start, end) or [(start, start)]


def _digest(values: torch.Tensor) -> torch.Tensor:
    """SHA-256 of a tensor's bytes (an fp32 share's, as the wire carries it), as 32 uint8 values."""
    return _uint8(digest(values.detach().contiguous().view(torch.uint8).numpy().data))


def _uint8(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _as_received(values: torch.Tensor, codec: str, chunk: int) -> torch.Tensor:
    """`values` as a receiver decodes them under `codec`, chunk by chunk as they cross (itself for raw fp32)."""
    if not codec:
        return values
    return torch.cat([decode(*encode("x", piece, codec)).reshape(-1).float() for piece in values.split(chunk)]
                     or [values[:0]])
