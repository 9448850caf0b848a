"""Spot checks of pipeline stages (ravnest/pipeline/audits.py): the sketch, the rule, the reveal, and
three clusters of three stages, every stage a thread on loopback gRPC, where a stage that sends noise
of the honest scale (which the scale check lets through) is refused by the stage after it."""
from __future__ import annotations

import pytest
import torch

import ravnest.pipeline.audits as audits
from ravnest.failures import FailureKind
from ravnest.pipeline.audits import AUDIT_EVERY, FAR, FLOOR, AuditCheck, AuditPicker, audits_for, off_by, sketch
from ravnest.pipeline.executor import StageExecutor
from ravnest.pipeline.inbox import PipelineError
from ravnest.pipeline.local import make_cluster_assignments, run_threaded_clusters
from ravnest.pipeline.stage import StageRunner
from ravnest.spec import JobSpec
from ravnest.wire import Router
from tests.attacks import Attack

RANGES = [(0, 1), (1, 2), (2, 4)]


def test_a_sketch_keeps_distances_and_needs_its_key():
    torch.manual_seed(0)
    a, b = torch.randn(16, 8, 8), torch.randn(16, 8, 8)
    ratios = [float((sketch(a, k) - sketch(b, k)).norm() / (a - b).norm()) for k in range(50)]
    assert 0.8 < sum(ratios) / len(ratios) < 1.2  # random projection: on average the distance itself
    assert not torch.equal(sketch(a, 1), sketch(a, 2))
    assert torch.equal(sketch(a, 7), sketch(a.clone(), 7))


def test_the_rule_finds_the_odd_input_out_and_tolerates_drift():
    torch.manual_seed(0)
    base = torch.randn(32)
    scale = float(base.norm())
    drifted = [base + 0.05 * torch.randn(32) for _ in range(3)]
    assert all(off_by(d, [o for o in drifted if o is not d], scale) is None for d in drifted)
    noise = torch.randn(32) * scale / 32 ** 0.5
    assert off_by(noise, drifted[:2], scale) is not None
    assert off_by(drifted[0], [drifted[1], noise], scale) is None  # an honest stage beside a liar's peer
    # a change smaller than FLOOR of the input's norm is drift, however tight the others agree
    assert off_by(base + 0.9 * FLOOR * base, [base, base.clone()], scale) is None
    assert off_by(base + 1.1 * FLOOR * base, [base, base.clone()], scale) is not None
    assert FAR > 1


def test_stage_0_reveals_an_audit_only_once_it_came_back_and_every_cluster_runs_the_same():
    class Data:
        train_x, train_y = torch.arange(200.).reshape(100, 2), torch.arange(100)
    pickers = [AuditPicker(secret=11, seed=3, window=2) for _ in range(2)]
    swapped = [[m for m in range(64) if picker.swap(m, (torch.zeros(4, 2), torch.full((4,), -1)), Data())[1][0] >= 0]
               for picker in pickers]  # type: ignore[arg-type]
    assert swapped[0] == swapped[1] and [m // AUDIT_EVERY for m in swapped[0]] == [0, 1, 2, 3]
    other = AuditPicker(secret=12, seed=3, window=2)
    assert [m for m in range(64) if other.swap(m, (torch.zeros(4, 2), torch.full((4,), -1)), Data())[1][0] >= 0] \
        != swapped[0], "the place comes from the secret"
    first = swapped[0][0]
    assert pickers[0].tags(first) == pickers[0].tags(first + 1) == {}
    reveal, same = pickers[0].tags(first + 2), pickers[1].tags(first + 2)
    assert reveal == same and reveal["audit_of"] == first and reveal["audit_no"] == 0
    assert 0 <= reveal["audit_key"] < 2 ** 62


@pytest.mark.parametrize("cuts,audited", [
    ([RANGES] * 3, {(c, s) for c in range(3) for s in (1, 2)}),
    ([[(0, 4)], [(0, 2), (2, 4)], [(0, 2), (2, 4)]], set()),  # the whole model in one: 2 pipelines alike
    ([[(0, 4)], *[[(0, 2), (2, 4)]] * 3], {(c, 1) for c in (1, 2, 3)}),
], ids=["3-alike", "1-and-2-alike", "1-and-3-alike"])
def test_a_stage_is_audited_only_against_ring_peers_whose_stage_starts_at_its_block(cuts, audited):
    """A stage that holds the whole model is in the ring of every segment, but has no input to compare:
    it is no aligned peer, so of it and 2 pipelines alike nobody audits (nor waits for its sketches)."""
    assignments = make_cluster_assignments(job(10), cuts, [[f"127.0.0.1:{c}{s}" for s in range(len(r))]
                                                           for c, r in enumerate(cuts)], token="t" * 32)
    checks = {(a.cluster, a.stage): audits_for(a, Router(), window=2, parts=1) for cluster in assignments
              for a in cluster}
    assert {where for where, check in checks.items() if isinstance(check, AuditCheck)} == audited
    for check in checks.values():
        if isinstance(check, AuditCheck):
            check.close()


def job(steps: int) -> JobSpec:
    return JobSpec.model_validate({
        "model": {"name": "cnn"}, "dataset": {"name": "digits"},
        "training": {"steps": steps, "batch_size": 16, "seed": 0, "eval_every": 0},
        "averaging": {"strategy": "ring", "every": 10, "robust": "centered_clip"}})


def run(monkeypatch, liar: tuple[int, int] | None, steps: int):
    """Three clusters cut alike, `liar` (cluster, stage) sending noise of its activations' RMS: what each
    stage raised first, each verdict's distance from the median in its input's norm, and the results
    (None where a stage failed)."""
    raised: dict[tuple[int, int], BaseException] = {}
    judged: list[float] = []
    plain_run, plain_off, send_forward = StageRunner.run, audits.off_by, StageExecutor._send_forward
    everyone: list[StageRunner] = []

    def recorded_run(self, *args, **kwargs):
        try:
            return plain_run(self, *args, **kwargs)
        except BaseException as exc:
            raised.setdefault((self.assignment.cluster, self.assignment.stage), exc)
            for runner in everyone:  # as a re-plan would: the others need not wait for the lost cluster
                runner.stop("the test is over")
            raise

    def measured(own, others, scale):
        judged.append(float((own - torch.stack([own, *others]).median(0).values).norm()) / scale)
        return plain_off(own, others, scale)

    attack = Attack("noise_activations")

    def lying_send(self, m):
        if (self.assignment.cluster, self.assignment.stage) == liar:
            self._output = attack.activations(self._output, 0)
        return send_forward(self, m)
    monkeypatch.setattr(StageRunner, "run", recorded_run)
    monkeypatch.setattr(audits, "off_by", measured)
    monkeypatch.setattr(StageExecutor, "_send_forward", lying_send)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = run_threaded_clusters(job(steps), [RANGES] * 3, timeout=300,
                                        setup=lambda runners: everyone.extend(r for c in runners for r in c))
    except (RuntimeError, TimeoutError):  # the liar's cluster stopped; the others' averaging then fails
        results = None
    finally:
        torch.set_num_threads(threads)
    return raised, judged, results


@pytest.mark.slow
def test_three_honest_clusters_pass_their_audits(monkeypatch):
    raised, judged, results = run(monkeypatch, None, steps=80)  # ~15 audits a stage: 5 are asked
    assert not raised and results is not None
    for cluster in results:  # stage 0 runs them, the later stages judge them
        passed = [metrics.get("audits_passed") for metrics in cluster["stages"]]
        assert passed[0] is None and all(p >= 5 for p in passed[1:]), passed
    assert len(judged) >= 8, "each later stage judged some audits"
    judged.sort()
    print(f"honest drift: distance from the median, in the input's norm: median {judged[len(judged) // 2]:.3f}, "
          f"largest {judged[-1]:.3f} (FLOOR {FLOOR}), over {len(judged)} verdicts")
    assert judged[int(0.95 * len(judged))] < FLOOR / 2, "honest drift keeps well under the bar"


@pytest.mark.slow
def test_a_stage_that_sends_noise_of_the_honest_scale_is_refused_by_the_next(monkeypatch):
    raised, judged, _ = run(monkeypatch, (1, 1), steps=200)
    refusals = {where: exc for where, exc in raised.items()
                if isinstance(exc, PipelineError) and exc.kind == FailureKind.OUTLIER}
    assert list(refusals) == [(1, 2)], raised
    said = str(refusals[1, 2])
    assert said.startswith("audit ") and "cluster1-stage1" in said and "in 2 audits in a row" in said
    print(f"refused at {said.split(':')[0]} (one audit per {AUDIT_EVERY} micro-batches): {said}")
