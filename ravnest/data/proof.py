"""Proof that a node holds the file it offers: a volunteer's word is not proof.

A node offering a file under a name (`ravnest-node join --dataset NAME=PATH`) also reports its
fingerprint, "<size>:<sha256>". A fingerprint alone proves nothing (a published hash can be copied),
so before a node is placed on a job that reads that content, the coordinator challenges it:

    challenge = (nonce: 16 random bytes, ranges: RANGES (offset, length) pairs inside the file)
    answer    = HMAC-SHA256(key = nonce, message = file[o1 : o1+l1] || ... || file[o8 : o8+l8])

A holder answers at once (eight reads of at most 4 KiB); without those bytes the answer is a 256-bit
guess, and the fresh nonce means no answer can be collected once and replayed. The coordinator holds
no data, so it checks an answer against another holder's: the first node to offer a fingerprint
answers a bank of challenges, and each later claimant must match one of them, used once. Whoever was
first defines the content for that fingerprint; a liar that was first can only lock honest holders
out of *its* fingerprint (they fail its bank and are never placed with it), never read their bytes.

Worked example: a 35,149-byte file; the challenge asks for ranges (0, 4096), (12000, 4096), ...,
(35000, 149). The holder reads those bytes and returns 64 hex digits; a node that offered an empty
file under the same name, or the same fingerprint without the file, returns something else.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from pathlib import Path

RANGES = 8  # byte ranges per challenge
RANGE_BYTES = 4096  # at most this many bytes per range
CHUNK = 1 << 20  # bytes read at a time when fingerprinting


@dataclass(frozen=True)
class Challenge:
    nonce: str  # 32 hex digits
    ranges: tuple[tuple[int, int], ...]  # (offset, length), inside the file


def fingerprint(path: str | Path) -> str:
    """"<size>:<sha256 hex>" of the file's bytes (read once, a megabyte at a time)."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
            size += len(block)
    return f"{size}:{digest.hexdigest()}"


def size_of(fingerprint_: str) -> int:
    return int(fingerprint_.split(":", 1)[0])


def make_challenge(size: int) -> Challenge:
    """A fresh challenge for a file of `size` bytes (an empty file has nothing to ask about)."""
    ranges = []
    for _ in range(RANGES if size else 0):
        offset = secrets.randbelow(size)
        ranges.append((offset, min(RANGE_BYTES, size - offset)))
    return Challenge(secrets.token_hex(16), tuple(ranges))


def answer(path: str | Path, challenge: Challenge) -> str:
    """What a holder of `path` answers."""
    mac = hmac.new(bytes.fromhex(challenge.nonce), digestmod=hashlib.sha256)
    with open(path, "rb") as f:
        for offset, length in challenge.ranges:
            f.seek(offset)
            mac.update(f.read(length))
    return mac.hexdigest()


def answers(path: str | Path, dataset: str, challenges: list[dict]) -> list[dict]:
    """Heartbeat `proofs` for the `challenges` of a heartbeat reply that concern `dataset` (JSON in and
    out: what a node played over REST, in tests and scripts, sends)."""
    return [{"dataset": dataset, "nonce": c["nonce"],
             "answer": answer(path, Challenge(c["nonce"], tuple((o, n) for o, n in c["ranges"])))}
            for c in challenges if c["dataset"] == dataset]


def matches(given: str, expected: str) -> bool:
    return hmac.compare_digest(given, expected)
