"""A failure as data: the exception that ended a stage, classified into its kind and the peer it
lost, by node id."""
from __future__ import annotations

import pytest
import torch

from ravnest.averaging.collectives import RingTimeout
from ravnest.failures import FailureKind, classify, torch_failure_kind
from ravnest.pipeline.inbox import Inbox, PipelineError
from ravnest.wire import PeerError
from ravnest.wire.dtypes import NotFiniteValues

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
    (NotFiniteValues("activations of forward message 3 hold NaN or infinite values; refused"), FailureKind.NAN,
     None),
    (ValueError("activations of forward message 3 are not finite"), FailureKind.LOCAL_ERROR, None),  # words alone
    (KeyError("weight"), FailureKind.LOCAL_ERROR, None),
    (PeerError("peer 10.9.9.9:1: closed the stream", address="10.9.9.9:1"), FailureKind.PEER_LOST, None),
], ids=["unreachable", "ring-timeout", "oom", "nan", "nan-in-words-only", "local", "not-a-planned-peer"])
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


@pytest.mark.filterwarnings("ignore:Error detected in")  # anomaly mode's own warning, with the forward's trace
@pytest.mark.parametrize("raise_it, kind", [
    # a CPU's allocator (torch raises a plain RuntimeError with these words)
    (lambda: torch.empty(1 << 62, dtype=torch.uint8), FailureKind.OUT_OF_MEMORY),
    # a GPU's (its own type, and the words it carries)
    (lambda: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")),
     FailureKind.OUT_OF_MEMORY),
    # anomaly detection's NaN in a backward
    (lambda: _nan_in_backward(), FailureKind.NAN),
    # a shape error is no failure kind of its own
    (lambda: torch.ones(2, 3) @ torch.ones(2, 3), None),
], ids=["cpu-oom", "cuda-oom", "anomaly-nan", "shape"])
def test_torchs_own_words_are_read_in_one_place(raise_it, kind) -> None:
    """Each message torch raises without a type of its own, raised by torch itself where this machine can."""
    assert torch_failure_kind(_raised(raise_it)) == kind


def _nan_in_backward() -> None:
    x = torch.tensor([0.0], requires_grad=True)
    with torch.autograd.detect_anomaly(check_nan=True):
        (x / x).sum().backward()


def test_our_errors_say_their_kind_whatever_their_words() -> None:
    """Rewording an error changes no kind: the words 'nan' or 'out of memory' in our own errors mean nothing."""
    assert classify(PipelineError("ran out of memory of patience, saw nan")).kind == FailureKind.LOCAL_ERROR
    assert classify(RuntimeError("the loss became nan")).kind == FailureKind.LOCAL_ERROR
