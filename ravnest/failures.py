"""What went wrong, as data.

A node that fails (or leaves its averaging) reports a `Failure`: its kind, the peer it lost by node id
where it knows one, the step, a sentence, and the transport detail apart. The coordinator words the
reason a user reads from it, the lost node first (coordinator/failures.py), and keeps the event in the
job's recovery record. `classify` makes one from the exception that ended the stage: the pipeline's
and the wire's errors say which peer they concern (`PipelineError.peer`, `PeerError.address`).
"""
from __future__ import annotations

import re
from enum import Enum
from typing import Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field


class FailureKind(str, Enum):
    PEER_LOST = "peer_lost"  # a peer's stream broke, or it stopped answering, mid-job
    PEER_UNREACHABLE = "peer_unreachable"  # a peer could not be reached at all
    PEER_FAILED = "peer_failed"  # a neighbour stopped and said why: the failure is its own
    TIMEOUT = "timeout"  # nothing came from the peers for the peer timeout
    NAN = "nan"  # a value that is not finite, computed here or refused from a peer
    OUT_OF_MEMORY = "out_of_memory"
    LOCAL_ERROR = "local_error"  # anything else on this node: bad data, a model that raised, a bug
    SLOW = "slow"  # the coordinator's own finding: a stage far slower than its prediction


PEER_KINDS = (FailureKind.PEER_LOST, FailureKind.PEER_UNREACHABLE, FailureKind.TIMEOUT)  # the peer is to blame


class Failure(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: FailureKind
    message: str = Field(max_length=1000, description="what happened, in a sentence")
    peer_id: str | None = Field(None, max_length=64, description="the node it concerns, when one is known")
    peer_address: str | None = Field(None, max_length=300)
    step: int | None = Field(None, ge=0, le=10_000_000)
    detail: str = Field("", max_length=2000, description="the transport's or the library's own words")


# a GPU's words ("CUDA out of memory"), and a CPU's (torch: "DefaultCPUAllocator: can't allocate memory")
_OUT_OF_MEMORY = re.compile(r"out of memory|can't allocate memory|cannot allocate memory", re.IGNORECASE)


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return seen


def classify(exc: BaseException, peers: Mapping[str, str] | None = None, step: int | None = None) -> Failure:
    """The failure `exc` (or what caused it) describes; `peers` maps the addresses of the stage's planned
    peers to their node ids, so the peer is named by id."""
    from ravnest.pipeline.inbox import PipelineError  # the pipeline imports this module's users
    from ravnest.wire import PeerError

    chain = _chain(exc)
    detail = "; ".join(dict.fromkeys(str(e) for e in chain if str(e)))[:2000]
    kind, address = FailureKind.LOCAL_ERROR, None
    for e in chain:
        if isinstance(e, (torch.OutOfMemoryError, MemoryError)) or _OUT_OF_MEMORY.search(str(e)):
            kind = FailureKind.OUT_OF_MEMORY
            break
        if isinstance(e, PipelineError) and e.kind is not None:
            kind, address = e.kind, e.peer
            break
        if isinstance(e, TimeoutError) and getattr(e, "address", None):  # a ring member that sent nothing
            kind, address = FailureKind.TIMEOUT, e.address  # type: ignore[attr-defined]
            break
        if isinstance(e, PeerError) and e.address is not None:
            kind = FailureKind.PEER_UNREACHABLE if e.unreachable else FailureKind.PEER_LOST
            address = e.address
            break
        if "not finite" in str(e) or "nan" in str(e).lower().split():
            kind = FailureKind.NAN
            break
    peer_id = (peers or {}).get(address) if address else None
    message = str(chain[0]).splitlines()[0][:1000] if str(chain[0]) else type(chain[0]).__name__
    return Failure(kind=kind, message=message, peer_id=peer_id, peer_address=address, step=step, detail=detail)
