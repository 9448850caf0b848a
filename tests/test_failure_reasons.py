"""The reasons a user reads for the failures volunteers meet, against a golden list: each starts with
what happened, in words, and names the node at fault first (the survivor that noticed comes after).
The exceptions are the real ones each failure raises: torch's when an allocation fails under a memory
limit, the wire's for a peer that is gone or cannot be reached, the pipeline's for a lost stream."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

from coordinator.failure_reasons import failure_reason
from ravnest.averaging.collectives import RingRefused
from coordinator.store import NodeRow, StageRow
from ravnest.failures import FailureKind, classify
from ravnest.pipeline.inbox import PipelineError
from ravnest.wire import OutboundStream, PeerError, WireError, require_finite

A, B = "127.0.0.1:7001", "127.0.0.1:7002"
NODES = {"id-a": NodeRow(id="id-a", name="a", address=A), "id-b": NodeRow(id="id-b", name="b", address=B)}
PEERS = {A: "id-a", B: "id-b"}  # a stage's planned peers: address -> node id


def cpu_out_of_memory() -> RuntimeError:
    """torch's own words when an allocation fails on a CPU: a child under a 2 GiB address-space limit."""
    child = subprocess.run([sys.executable, "-c", (
        "import resource, torch\n"
        "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
        "try:\n    torch.empty(4 << 30, dtype=torch.uint8)\n"
        "except RuntimeError as e:\n    print(e)\n")], capture_output=True, text=True, timeout=120)
    assert "allocate" in child.stdout, child.stdout + child.stderr
    return RuntimeError(child.stdout.strip())


def unreachable(address: str) -> PeerError:
    with pytest.raises(PeerError) as caught:
        OutboundStream(address, wait_ready=0.5)
    return caught.value


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def not_finite() -> WireError:
    with pytest.raises(WireError) as caught:
        require_finite(torch.tensor([1.0, float("nan")]), "stage 1: activations of forward message 7")
    return caught.value


def reason(exc: BaseException, peers: dict[str, str] = PEERS) -> str:
    return failure_reason(classify(exc, peers, step=12), str(exc), NODES["id-a"], StageRow(cluster=0, stage=1),
                          NODES)


def test_each_failure_reads_as_what_happened_naming_the_node_at_fault_first():
    gone = closed_port()
    golden = {  # scenario: (the exception it raises, the reason a user reads)
        "a killed neighbour": (
            PipelineError("stage 1 lost its next stage: peer 127.0.0.1:7002: UNAVAILABLE: Socket closed",
                          FailureKind.PEER_LOST, B),
            "node b (id-b) stopped answering: cluster 0 stage 1 on node a (id-a) lost it"),
        "a lost link: the neighbour cannot be reached": (
            unreachable(gone),
            "node b (id-b) could not be reached: cluster 0 stage 1 on node a (id-a) lost it"),
        "out of memory on a CPU": (
            cpu_out_of_memory(),
            "node a (id-a) ran out of memory in cluster 0 stage 1"),
        "out of memory on a GPU": (
            torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
            "node a (id-a) ran out of memory in cluster 0 stage 1"),
        "a NaN from a neighbour": (
            not_finite(),
            "cluster 0 stage 1 on node a (id-a) stopped on a value that is not finite (training may have "
            "diverged: a lower learning rate or training.grad_clip may help): stage 1: activations of forward "
            "message 7 holds NaN or infinite values; refused"),
        "a ring member that sent a NaN": (
            RingRefused("ring segment 0 round 1 step 0 chunk 0: 127.0.0.1:7002 (rank 1) sent values that are not "
                        "finite; refused", address=B),
            "node b (id-b) sent values that are not finite: cluster 0 stage 1 on node a (id-a) refused them"),
        "a neighbour that failed and said why": (
            PipelineError("stage 1: its neighbour at 127.0.0.1:7002 reported a failure ('disk full')",
                          FailureKind.PEER_FAILED, B),
            "cluster 0 stage 1 on node a (id-a) stopped because a neighbouring stage failed: "
            "stage 1: its neighbour at 127.0.0.1:7002 reported a failure ('disk full')"),
    }
    peers = {**PEERS, gone: "id-b"}
    for scenario, (exc, expected) in golden.items():
        assert reason(exc, peers) == expected, scenario


def test_a_lost_peer_reached_through_a_relay_says_the_relay_may_be_what_failed():
    relayed = {**NODES, "id-b": NodeRow(id="id-b", name="b", address=B, relayed_by="id-r")}
    lost = PipelineError("stage 1 lost its next stage: peer 127.0.0.1:7002: UNAVAILABLE: Socket closed",
                         FailureKind.PEER_LOST, B)
    assert failure_reason(classify(lost, PEERS, step=12), str(lost), NODES["id-a"], StageRow(cluster=0, stage=1),
                          relayed) == ("node b (id-b) stopped answering (peers reach it through a relay, which may "
                                       "be what failed): cluster 0 stage 1 on node a (id-a) lost it")
