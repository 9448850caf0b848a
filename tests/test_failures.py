"""A failure as data: the exception that ended a stage, classified into its kind and the peer it
lost, by node id."""
from __future__ import annotations

import pytest
import torch

from ravnest.averaging.ring import RingTimeout
from ravnest.failures import FailureKind, classify
from ravnest.pipeline.inbox import Inbox, PipelineError
from ravnest.wire import PeerError

PEERS = {"10.0.0.2:7000": "node-b", "10.0.0.3:7000": "node-c"}


def _raised(make):  # an exception with its chain, as `raise ... from ...` leaves it
    try:
        make()
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError("nothing raised")


def test_a_broken_stream_names_the_peer_by_id_and_keeps_the_transport_words() -> None:
    def send():
        try:
            raise PeerError("peer 10.0.0.3:7000: UNAVAILABLE: Socket closed", address="10.0.0.3:7000")
        except PeerError as e:
            raise PipelineError("stage 1 failed: sending failed") from e
    failure = classify(_raised(send), PEERS, step=17)
    assert (failure.kind, failure.peer_id, failure.step) == (FailureKind.PEER_LOST, "node-c", 17)
    assert failure.message == "stage 1 failed: sending failed" and "UNAVAILABLE" in failure.detail


@pytest.mark.parametrize("exc, kind, peer", [
    (PeerError("peer 10.0.0.2:7000 not reachable within 30s", address="10.0.0.2:7000", unreachable=True),
     FailureKind.PEER_UNREACHABLE, "node-b"),
    (RingTimeout("ring segment 0 round 3: nothing from 10.0.0.2:7000 (rank 1) within 60s", address="10.0.0.2:7000"),
     FailureKind.TIMEOUT, "node-b"),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), FailureKind.OUT_OF_MEMORY, None),
    (ValueError("activations of forward message 3 are not finite"), FailureKind.NAN, None),
    (KeyError("weight"), FailureKind.LOCAL_ERROR, None),
    (PeerError("peer 10.9.9.9:1: closed the stream", address="10.9.9.9:1"), FailureKind.PEER_LOST, None),
], ids=["unreachable", "ring-timeout", "oom", "nan", "local", "not-a-planned-peer"])
def test_each_kind_is_told_apart(exc, kind, peer) -> None:
    failure = classify(exc, PEERS)
    assert failure.kind == kind and failure.peer_id == peer


def test_the_inbox_keeps_what_closed_it_as_data() -> None:
    inbox = Inbox(forward_capacity=2)
    inbox.fail(PipelineError("stage 0 lost its next stage: it closed the stream", FailureKind.PEER_LOST,
                             "10.0.0.2:7000"))
    inbox.fail("a later reason loses")
    with pytest.raises(PipelineError) as raised:
        inbox.next_forward(timeout=1)
    assert classify(raised.value, PEERS).peer_id == "node-b"
    with pytest.raises(PipelineError, match="no message from the neighbouring stages") as silent:
        Inbox(forward_capacity=2).next_backward(timeout=0.01)
    assert classify(silent.value).kind == FailureKind.TIMEOUT
