"""Who may call a node's gRPC server, and why a call is refused.

Every node of a job generation holds a credential of its own (the coordinator derives it from its
secret, the job, the generation and the node) and learns only the SHA-256 of the others'. So a stage
can prove who it is, and cannot pose as another stage, not even of its own job.

A call is accepted when its credential belongs to a job this node serves right now AND its sender is
one of the peers this node's plan names (its pipeline neighbours and ring peers):

    a credential of no job held here (a stranger, a forgery, an ended job)   UNAUTHENTICATED
    a member of the job that this node's plan does not name                   PERMISSION_DENIED

Ping (no data) also accepts the coordinator's probe tokens, so idle nodes can measure their links, while
this node serves no job (RESOURCE_EXHAUSTED while it does).
"""
from __future__ import annotations

import hashlib
import threading
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import grpc

Refusal = tuple[grpc.StatusCode, str]


def credential_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class _Job:
    members: Mapping[str, str]  # credential hash -> node id, every node of the job generation
    allowed: frozenset[str]     # node ids this node's plan names


class PeerGate:
    """The jobs a node serves and the probe tokens it accepts; `check` is the server's interceptor rule."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}
        self._probe_hashes: frozenset[str] = frozenset()

    def admit(self, key: str, credentials: Mapping[str, str], allowed: Collection[str]) -> None:
        """Serve job `key`: `credentials` maps node id -> hash of its credential; `allowed` names the
        peers that may call."""
        with self._lock:
            self._jobs[key] = _Job({digest: node for node, digest in credentials.items()}, frozenset(allowed))

    def dismiss(self, key: str) -> None:
        with self._lock:
            self._jobs.pop(key, None)

    def set_probe_tokens(self, tokens: Iterable[str]) -> None:
        self._probe_hashes = frozenset(credential_hash(t) for t in tokens)

    def check(self, authorization: str, ping: bool) -> Refusal | None:
        scheme, _, token = authorization.partition(" ")
        if scheme != "Bearer" or not token:
            return grpc.StatusCode.UNAUTHENTICATED, "missing or wrong peer token"
        digest = credential_hash(token)
        with self._lock:
            jobs = list(self._jobs.values())
        if ping and digest in self._probe_hashes:
            # an idle peer's probe of a node that trains would take the job's link and be counted in the
            # stage's peak memory (payloads of up to 16 MiB); the coordinator asks for it once both are idle
            return (grpc.StatusCode.RESOURCE_EXHAUSTED, "this node is training: its links are probed once it is "
                    "idle again") if jobs else None
        for job in jobs:
            sender = job.members.get(digest)
            if sender is None:
                continue
            if sender in job.allowed:
                return None
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"node {sender} is not a pipeline neighbour or ring peer of this node's stage")
        return grpc.StatusCode.UNAUTHENTICATED, "missing or wrong peer token"
