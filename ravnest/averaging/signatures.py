"""Signed commitments: what lets a robust round (robust_round.py) prove that a member told two members two
different things.

A robust round's members commit to their shares before any share leaves (the SHA-256 of each, sent to
everyone). Unsigned, a member could hold its commitment back from one member, see the shares the others
sent it, and only then commit, to that one member, to a share fitted to them. Signed, it cannot do that
unseen: every owner forwards, with its mean, the commitments it received, and a member holding two
different commitments signed by one member for one round holds the proof that this member lied, which
anyone can check with its public key, and nobody can forge.

Keys: Ed25519 (`cryptography`), each node's derived from its credential for the job generation (the
assignment's `token`), which only it and the coordinator know; the coordinator gives every ring member the
others' public keys (`StagePeer.signing_key`). A signature covers the segment, the round and the SHA-256
of the committed bytes, so it proves nothing about another round, and a new generation has new keys.
"""
from __future__ import annotations

import functools
import hashlib

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

KEY_HEX = 64  # an Ed25519 public key, as hex
SIGNATURE_BYTES = 64
DIGEST_BYTES = 32  # SHA-256


def _private_key(token: str) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(b"ravnest commitments:" + token.encode()).digest())


@functools.lru_cache(maxsize=4096)  # (the coordinator names each ring member's in each assignment it sends)
def public_key(token: str) -> str:
    """The public key (hex) of the node whose job-generation credential is `token`."""
    return _private_key(token).public_key().public_bytes_raw().hex()


def digest(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


class Signatures:
    """One member's signing key (from its `token`) and its group's public keys (`keys`, hex, by rank)."""

    def __init__(self, token: str, keys: list[str], rank: int):
        try:
            self._keys = [Ed25519PublicKey.from_public_bytes(bytes.fromhex(key)) for key in keys]
        except ValueError:
            raise ValueError(f"the members' signing keys must be {KEY_HEX} hex digits each") from None
        if keys[rank] != public_key(token):
            raise ValueError(f"signing key {rank} is not this member's: the assignment and the credential disagree")
        self._own = _private_key(token)

    def sign(self, segment: int, round: int, committed: bytes) -> bytes:
        """This member's signature of `committed`, the SHA-256 of what it commits to in `round` of `segment`."""
        return self._own.sign(_statement(segment, round, committed))

    def valid(self, rank: int, segment: int, round: int, committed: bytes, signature: bytes) -> bool:
        """Whether member `rank` signed the digest `committed` in `round` of `segment`."""
        try:
            self._keys[rank].verify(signature, _statement(segment, round, committed))
            return True
        except InvalidSignature:
            return False


def _statement(segment: int, round: int, committed: bytes) -> bytes:
    return f"ravnest robust commitment: segment {segment} round {round}: ".encode() + committed
