"""What went wrong, as data.

A node that fails (or leaves its averaging) reports a `Failure`: its kind, the peer it lost by node id
where it knows one, the step, a sentence, and the transport detail apart. The coordinator words the
reason a user reads from it, the lost node first (coordinator/failure_reasons.py), and keeps the event in the
job's recovery record. `classify` makes one from the exception that ended the stage: our errors say
what they are (`KnownFailure`: the pipeline's, the wire's, the ring's), and torch's are read once, in
`torch_failure_kind`.
"""
from __future__ import annotations

import re
from enum import Enum
from typing import Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field

from ravnest.errors import RavnestError
from ravnest.printable import Prose


class FailureKind(str, Enum):
    PEER_LOST = "peer_lost"  # a peer's stream broke, or it stopped answering, mid-job
    PEER_UNREACHABLE = "peer_unreachable"  # a peer could not be reached at all
    PEER_FAILED = "peer_failed"  # a neighbour stopped and said why: the failure is its own
    TIMEOUT = "timeout"  # nothing came from the peers for the peer timeout
    NAN = "nan"  # a value that is not finite, computed here or refused from a peer
    OUTLIER = "outlier"  # most of a robust round's members found a peer's contribution far beyond the others'
    OUT_OF_MEMORY = "out_of_memory"
    LOCAL_ERROR = "local_error"  # anything else on this node: bad data, a model that raised, a bug
    # the coordinator's own findings (coordinator/failure_rules)
    SLOW = "slow"  # a stage far slower than its prediction and its cluster
    SILENT = "silent"  # a node stopped sending heartbeats
    LEFT = "left"  # a node left, restarted or was revoked while it held work
    STALLED = "stalled"  # a stage alone in its cluster stopped reporting progress
    IMPLAUSIBLE = "implausible"  # what a node handed in cannot be believed (e.g. weights far beyond training's)


PEER_KINDS = (FailureKind.PEER_LOST, FailureKind.PEER_UNREACHABLE, FailureKind.TIMEOUT)  # the peer is to blame


class Failure(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: FailureKind
    message: Prose = Field(max_length=1000, description="what happened, in a sentence")
    peer_id: str | None = Field(None, max_length=64, description="the node it concerns, when one is known")
    peer_address: str | None = Field(None, max_length=300)
    step: int | None = Field(None, ge=0, le=10_000_000)
    detail: Prose = Field("", max_length=2000, description="the transport's or the library's own words")


class KnownFailure(RavnestError):
    """An error that says what failure it is: its kind, and the address of the peer to blame where it
    knows one. The pipeline's, the wire's and the ring's errors are such (`PipelineError`, `PeerError`,
    `RingTimeout`, `NotFinite`); `failure_kind` None: this one says nothing (e.g. this side ended a
    stream), and what caused it is asked instead."""

    @property
    def failure_kind(self) -> FailureKind | None:
        return FailureKind.LOCAL_ERROR

    @property
    def peer_address(self) -> str | None:
        return None

    @property
    def more_peer_addresses(self) -> tuple[str, ...]:
        """Further peers to blame for the same failure (a robust round that convicted several at once)."""
        return ()


class NotFinite(KnownFailure, ValueError):
    """A value that is not finite, computed here or refused from a peer."""

    @property
    def failure_kind(self) -> FailureKind | None:
        return FailureKind.NAN


# What torch says where it raises no type of its own: a CPU out of memory ("DefaultCPUAllocator: can't
# allocate memory"; a GPU's is torch.OutOfMemoryError, "CUDA out of memory"), and anomaly detection's
# NaN ("Function 'MulBackward0' returned nan values in its 0th output."). tests/test_failures.py holds
# one test per message.
_TORCH_WORDS = [
    (re.compile(r"out of memory|can't allocate memory|cannot allocate memory", re.IGNORECASE),
     FailureKind.OUT_OF_MEMORY),
    (re.compile(r"returned nan values", re.IGNORECASE), FailureKind.NAN),
]


def torch_failure_kind(exc: BaseException) -> FailureKind | None:
    """The kind of a failure torch (or Python) raised, from its type, else from its words: the one
    place text decides a kind, at the boundary with a library that has no type for it."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return FailureKind.OUT_OF_MEMORY
    if isinstance(exc, RuntimeError) and not isinstance(exc, RavnestError):
        return next((kind for words, kind in _TORCH_WORDS if words.search(str(exc))), None)
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return seen


def also_named(exc: BaseException, peers: Mapping[str, str], failure: Failure) -> list[Failure]:
    """`failure` (classify's of `exc`) again for each further peer the same error names, by id."""
    named = next((e.more_peer_addresses for e in _chain(exc) if isinstance(e, KnownFailure)), ())
    return [failure.model_copy(update={"peer_id": peers[address], "peer_address": address})
            for address in named if address in peers]


def classify(exc: BaseException, peers: Mapping[str, str] | None = None, step: int | None = None) -> Failure:
    """The failure `exc` (or what caused it) describes; `peers` maps the addresses of the stage's planned
    peers to their node ids, so the peer is named by id."""
    chain = _chain(exc)
    detail = "; ".join(dict.fromkeys(str(e) for e in chain if str(e)))[:2000]
    kind, address = FailureKind.LOCAL_ERROR, None
    for e in chain:
        found = e.failure_kind if isinstance(e, KnownFailure) else torch_failure_kind(e)
        if found is not None:
            kind, address = found, e.peer_address if isinstance(e, KnownFailure) else None
            break
    peer_id = (peers or {}).get(address) if address else None
    message = str(chain[0]).splitlines()[0][:1000] if str(chain[0]) else type(chain[0]).__name__
    return Failure(kind=kind, message=message, peer_id=peer_id, peer_address=address, step=step, detail=detail)
