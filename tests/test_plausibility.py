"""A neighbour's activations or gradients whose scale jumps are refused, naming it
(ravnest/pipeline/plausibility.py)."""
from __future__ import annotations

import pytest
import torch

from ravnest.failures import FailureKind, classify
from ravnest.pipeline.inbox import PipelineError
from ravnest.pipeline.plausibility import JUMP, PEAK_SLACK, STRIKES, WARMUP, WINDOW, ScaleWatch
from ravnest.spec import StagePeer

PEER = StagePeer(node_id="n0", address="127.0.0.1:5000")


def test_a_jump_of_the_scale_is_clipped_and_refused_at_the_third_in_a_row_naming_the_sender():
    watch = ScaleWatch("activations", PEER)
    torch.manual_seed(0)
    for m in range(WINDOW):  # training moves the scale by 10x, both ways: nothing refused
        sent = torch.randn(64, 32) * (1 + 9 * (m % 2))
        assert watch.check(sent, m) is sent
    for m in range(WINDOW, WINDOW + STRIKES - 1):  # clipped to the bound, direction kept
        sent = torch.randn(64, 32) * 1000
        taken = watch.check(sent, m)
        assert taken.norm() < sent.norm() / 1.5
        assert torch.allclose(taken / taken.norm(), sent / sent.norm(), atol=1e-6)
    with pytest.raises(PipelineError) as refused:
        watch.check(torch.randn(64, 32) * 1000, WINDOW + STRIKES)
    failure = classify(refused.value, {PEER.address: PEER.node_id})
    assert failure.kind == FailureKind.OUTLIER and failure.peer_id == "n0", failure
    assert "times the median of its last" in str(refused.value) and f"the {STRIKES}th such in a row" \
        in str(refused.value)


def test_a_jump_that_does_not_last_is_clipped_and_forgotten():
    """A stage resumed from a checkpoint knows only the scale since: an honest spike then is let
    through at the bound, and the count starts again after the next ordinary micro-batch."""
    watch = ScaleWatch("gradients", PEER)
    torch.manual_seed(0)
    for round_ in range(3):
        for m in range(WARMUP):
            watch.check(torch.randn(64, 32) * 1e-4, m)
        for _ in range(STRIKES - 1):
            watch.check(torch.randn(64, 32), m)


def test_a_heavy_tailed_gradient_is_let_through_up_to_the_largest_scale_seen():
    """Once a classifier is confident its gradients are mostly tiny, and the micro-batch it gets wrong
    brings one thousands of times the median (the honest case CI once refused), but no larger than the
    early ones, when every answer was wrong."""
    watch = ScaleWatch("gradients", PEER)
    torch.manual_seed(0)
    for m in range(WARMUP):  # early: all wrong, the largest gradients of the run
        watch.check(torch.randn(64, 32), m)
    for m in range(WARMUP, WARMUP + WINDOW):  # confident: almost nothing
        watch.check(torch.randn(64, 32) * 1e-4, m)
    honest = torch.randn(64, 32) * 1.2
    assert watch.check(honest, WARMUP + WINDOW) is honest  # 12,000 times the median: let through
    with pytest.raises(PipelineError, match="times the largest before"):
        for m in range(STRIKES):
            watch.check(torch.randn(64, 32) * PEAK_SLACK * 2, WARMUP + WINDOW + 1 + m)


def test_nothing_is_refused_before_warmup_nor_from_the_first_stage_nor_at_zero():
    watch = ScaleWatch("activations", PEER)
    for m in range(WARMUP):  # the first micro-batches are the only scale the stage knows
        watch.check(torch.ones(8) * 10.0 ** m, m)
    nobody = ScaleWatch("activations", None)  # stage 0: its data, not a peer
    for m in range(WARMUP + 2):
        nobody.check(torch.ones(8) * (JUMP * 10) ** m, m)
    zeros = ScaleWatch("gradients", PEER)
    for m in range(WARMUP + 2):
        zeros.check(torch.zeros(8), m)  # gradients of zeros (a dead branch): no scale to judge by
    zeros.check(torch.ones(8), WARMUP + 2)
