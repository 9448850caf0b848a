"""The reason a user reads when a node reports a failure: what happened first, in words, naming the
node that was lost rather than the survivor that noticed. The node's own words and the transport's
detail stay in the event (`Failure`), which the job's recovery record keeps."""
from __future__ import annotations

from typing import Protocol

from ravnest.failures import PEER_KINDS, Failure, FailureKind

from .store import COORDINATOR_RELAY, NodeRow, StageRow

_LOST_VERB = {FailureKind.PEER_LOST: "stopped answering", FailureKind.PEER_UNREACHABLE: "could not be reached",
              FailureKind.TIMEOUT: "went silent"}


class Named(Protocol):
    """A node as `who` names it: a NodeRow, or those columns alone."""
    id: str
    name: str
    address: str


def who(node: Named) -> str:
    """'c (2f8c1a0b3d4e5f60)': the name a volunteer chose, then the id `ravnest node revoke` takes."""
    return f"{node.name} ({node.id})" if node.name else f"{node.id} at {node.address}"


def relay_words(relay: str, relays: dict[str, NodeRow]) -> str:
    """"node d (3f2a…)'s relay", "the coordinator's relay", or "a relay" for one that is gone."""
    return f"node {who(relays[relay])}'s relay" if relay in relays else \
        "the coordinator's relay" if relay == COORDINATOR_RELAY else "a relay"


def failure_reason(failure: Failure | None, said: str, reporter: NodeRow, stage: StageRow,
                   nodes: dict[str, NodeRow], relays: dict[str, NodeRow] | None = None) -> str:
    """The headline of a failure report. `said` is the report's free text, all an older node sends;
    `relays`: the volunteers relaying for `nodes`, by id."""
    where = f"cluster {stage.cluster} stage {stage.stage} on node {who(reporter)}"
    if failure is None:
        return f"{where} failed: {said}"
    lost = nodes.get(failure.peer_id) if failure.peer_id else None
    if lost is not None and lost.id != reporter.id and failure.kind in PEER_KINDS:
        through = f" (peers reach it through {relay_words(lost.relayed_by, relays or {})}, which may be what " \
                  f"failed)" if lost.relayed_by else ""
        return f"node {who(lost)} {_LOST_VERB[failure.kind]}{through}: {where} lost it"
    if lost is not None and lost.id != reporter.id and failure.kind == FailureKind.NAN:
        return f"node {who(lost)} sent values that are not finite: {where} refused them"
    if lost is not None and lost.id != reporter.id and failure.kind == FailureKind.OUTLIER:
        return f"node {who(lost)} sent values that cannot be honest, and is left out as an outlier: {where} " \
               f"found {failure.message}"
    if failure.kind == FailureKind.OUT_OF_MEMORY:
        return f"node {who(reporter)} ran out of memory in cluster {stage.cluster} stage {stage.stage}"
    if failure.kind == FailureKind.NAN:
        return (f"{where} stopped on a value that is not finite (training may have diverged: a lower learning "
                f"rate or training.grad_clip may help): {failure.message}")
    if failure.kind == FailureKind.PEER_FAILED:
        return f"{where} stopped because a neighbouring stage failed: {failure.message}"
    if failure.kind == FailureKind.TIMEOUT:
        return f"{where} heard nothing from its neighbours: {failure.message}"
    return f"{where} failed: {failure.message}"
