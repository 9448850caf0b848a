"""The asynchronous pipeline engine: optimizer pieces, weight versioning, and whole pipelines run as
threads of this process over loopback gRPC (fast; the multi-process runs are in test_pipeline_e2e)."""
from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from ravnest.averaging import AveragingStrategy
from ravnest.models import build_model
from ravnest.pipeline import (PipelineError, StageOptimizer, StageRunner, build_optimizer, lr_factor,
                              run_single_process, run_threaded_pipeline)
from ravnest.pipeline.local import make_assignments
from ravnest.pipeline.stash import StageCompute
from ravnest.pipeline.weight_versions import PIECE, WeightVersions
from ravnest.spec import JobSpec, OptimizerRef, TrainingSettings
from ravnest.wire import Message, OutboundStream, PeerError, PeerGate, PeerServer, Router, credential_hash

TINY_MLP = {"name": "mlp", "config": {"input_dim": 64, "hidden": 32, "depth": 2, "num_classes": 10}}
MLP_RANGES = [(0, 2), (2, 3), (3, 4)]


def make_job(model: dict[str, Any] = TINY_MLP, **training: Any) -> JobSpec:
    settings = {"steps": 30, "batch_size": 16, "optimizer": {"name": "SGD", "kwargs": {"lr": 0.05}}, **training}
    return JobSpec.model_validate({"model": model, "dataset": {"name": "digits"}, "training": settings})


# --- optimizer, schedule, accumulation --------------------------------------------------------------

def test_lr_schedules_warm_up_then_follow_their_shape() -> None:
    def factors(schedule: str) -> list[float]:
        training = TrainingSettings(steps=10, warmup_steps=2, lr_schedule=schedule)
        return [lr_factor(step, training) for step in range(10)]

    assert factors("constant") == [0.5, 1.0] + [1.0] * 8
    cosine, linear = factors("cosine"), factors("linear")
    assert cosine[:3] == [0.5, 1.0, 1.0] and linear[:3] == [0.5, 1.0, 1.0]
    assert all(a > b for a, b in zip(cosine[2:], cosine[3:])) and cosine[-1] > 0
    assert linear[6] == pytest.approx(0.5)


def test_optimizer_is_chosen_by_name_and_bad_names_are_refused() -> None:
    params = [nn.Parameter(torch.zeros(3))]
    assert isinstance(build_optimizer(params, OptimizerRef(name="AdamW", kwargs={"lr": 0.1})), torch.optim.AdamW)
    for name in ("NoSuchOptimizer", "Optimizer", "lr_scheduler"):
        with pytest.raises(ValueError, match="unknown optimizer"):
            build_optimizer(params, OptimizerRef(name=name))
    with pytest.raises(ValueError, match="rejected kwargs"):
        build_optimizer(params, OptimizerRef(name="SGD", kwargs={"lr": 0.1, "bogus": 1}))
    for switch in ({"fused": "no"}, {"amsgrad": 1}, {"foreach": "false"}):  # torch would read "no" as true
        with pytest.raises(ValueError, match=f"{next(iter(switch))} must be true or false"):
            build_optimizer(params, OptimizerRef(name="Adam", kwargs=switch))
    assert build_optimizer(params, OptimizerRef(name="Adam", kwargs={"amsgrad": True, "foreach": None}))


def test_torch_optimizers_run_fused_unless_the_job_chooses() -> None:
    params = [nn.Parameter(torch.zeros(3))]
    for name in ("Adam", "AdamW", "SGD"):
        assert build_optimizer(params, OptimizerRef(name=name, kwargs={"lr": 0.1})).defaults["fused"] is True
    assert not build_optimizer(params, OptimizerRef(name="Adam", kwargs={"foreach": False})).defaults["fused"]
    # no fused kernel for these options or optimizers: the plain one, no error
    assert not build_optimizer(params, OptimizerRef(name="Adam", kwargs={"differentiable": True})).defaults["fused"]
    assert "fused" not in build_optimizer(params, OptimizerRef(name="RMSprop")).defaults


def test_stage_optimizer_steps_once_per_accumulation() -> None:
    weight = nn.Parameter(torch.zeros(2))
    optimizer = StageOptimizer([weight], TrainingSettings(
        accumulation=3, optimizer=OptimizerRef(name="SGD", kwargs={"lr": 1.0})))
    stepped = []
    for _ in range(6):
        weight.grad = torch.ones(2) if weight.grad is None else weight.grad + 1
        stepped.append(optimizer.micro_batch_done())
    assert stepped == [False, False, True, False, False, True]
    assert optimizer.steps == 2 and torch.equal(weight.detach(), torch.full((2,), -6.0))


# --- weight versions and recompute ------------------------------------------------------------------

def test_weight_versions_share_snapshots_and_recycle_them() -> None:
    module = nn.Linear(2, 2)
    versions = WeightVersions(module)
    v0, snap_a = versions.acquire()
    _, snap_b = versions.acquire()
    assert v0 == 0 and snap_a is snap_b and len(versions) == 1
    with torch.no_grad():
        module.weight.add_(1.0)
    versions.advance()
    v1, snap_c = versions.acquire()
    assert v1 == 1 and len(versions) == 2
    assert torch.equal(snap_c["weight"], module.weight) and not torch.equal(snap_a["weight"], module.weight)
    versions.release(0)
    versions.release(0)
    assert len(versions) == 1  # version 0 retired once its last micro-batch finished
    versions.release(1)
    assert len(versions) == 1  # the current version stays for the next forwards
    versions.advance()
    assert len(versions) == 0


def test_weight_prediction_extrapolates_the_last_update_only() -> None:
    module = nn.Linear(2, 2)
    versions = WeightVersions(module, predict=True)
    w0 = module.weight.detach().clone()
    assert torch.equal(versions.acquire(2)[1]["weight"], w0)  # no update yet: nothing to extrapolate
    versions.before_step()
    with torch.no_grad():
        module.weight.add_(0.5)  # the optimizer's update
    versions.advance()
    for lookahead in (0, 1, 3):
        assert torch.allclose(versions.acquire(lookahead)[1]["weight"], w0 + 0.5 * (1 + lookahead))
    versions.before_step()
    versions.advance()  # a step that changed nothing: the next prediction is the weights themselves
    with torch.no_grad():  # an averaging correction moves the live and the previous weights alike
        for tensor in (module.weight, versions.previous["weight"]):
            tensor.add_(-2.0)
    assert torch.allclose(versions.acquire(2)[1]["weight"], w0 + 0.5 - 2.0)


def test_second_order_prediction_continues_a_quadratic_path_exactly() -> None:
    """Order 2 is the second-order polynomial through the last three versions: weights moving as
    w_t = a + b t + c t^2 are predicted exactly at any lookahead (order 1 misses by c d (d + 1)), it is
    order 1 until two updates have been seen, and a correction moves all three versions alike."""
    module = nn.Linear(2, 2)
    a = module.weight.detach().clone()

    def path(t: float) -> torch.Tensor:
        return a + 0.3 * t - 0.05 * t * t

    versions = WeightVersions(module, predict=2)
    for t in (1, 2, 3):  # the third step rewrites the oldest buffer
        versions.before_step()
        with torch.no_grad():
            module.weight.copy_(path(t))
        versions.advance()
        if t == 1:  # one update seen: first order
            assert torch.allclose(versions.acquire(2)[1]["weight"], path(1) + 2 * (path(1) - path(0)))
            versions.release(1, 2)
    for lookahead in (1, 2, 3):
        predicted = versions.acquire(lookahead)[1]["weight"]
        assert torch.allclose(predicted, path(3 + lookahead), atol=1e-6), lookahead
    assert len(versions.history()) == 2
    with torch.no_grad():  # an averaging correction moves the live and the earlier weights alike
        for tensor in (module.weight, *(weights["weight"] for weights in versions.history())):
            tensor.add_(-2.0)
    versions.advance()  # a new version, so the prediction is computed afresh
    assert torch.allclose(versions.acquire(1)[1]["weight"], path(4) - 2.0, atol=1e-6)


def test_the_pre_step_copy_may_be_taken_early_once() -> None:
    """A stage takes prediction's copy of the weights while it waits for the step's last gradient: the
    step then copies nothing more (it would cost the pass the early copy saves), a correction in
    between moves both alike, and the prediction extrapolates the optimizer's update alone."""
    module = nn.Linear(2, 2)
    versions = WeightVersions(module, predict=True)
    w0 = module.weight.detach().clone()
    versions.save_previous()
    with torch.no_grad():
        versions.previous["weight"].add_(7.0)  # marks the copy: a second one at the step would undo it
    versions.before_step()
    assert torch.equal(versions.previous["weight"], w0 + 7.0)
    versions.previous["weight"].copy_(w0)
    with torch.no_grad():
        for tensor in (module.weight, versions.previous["weight"]):  # an averaging correction
            tensor.add_(1.0)
        module.weight.add_(0.5)  # the optimizer's update
    versions.advance()
    assert torch.allclose(versions.acquire(1)[1]["weight"], w0 + 1.0 + 0.5 * 2)
    versions.save_previous()  # the next step's copy is taken afresh
    assert torch.equal(versions.previous["weight"], module.weight.detach())


@pytest.mark.parametrize("order", [1, 2])
def test_the_last_forward_of_a_version_takes_the_copy_with_the_same_result(order: int) -> None:
    """A version's last forward takes the step's copy while it predicts, piece by piece (the tensor
    spans several pieces): the predictions, the copies and the rotation of the buffers are bit for bit
    those of predicting, then copying before the step, from the first-order steps on."""
    torch.manual_seed(0)
    modules = [nn.Linear(600, 700), nn.Linear(600, 700)]
    modules[1].load_state_dict(modules[0].state_dict())
    assert modules[0].weight.numel() > 1.5 * PIECE
    fused, plain = (WeightVersions(module, predict=order) for module in modules)
    for step in range(4):
        taken = fused.acquire(1, last=True)[1], plain.acquire(1)[1]
        assert all(torch.equal(taken[0][k], taken[1][k]) for k in taken[1]), step
        assert fused._previous_saved == (step > 0)  # nothing to extrapolate from before the first step
        fused.before_step(), plain.before_step()
        assert len(fused.history()) == len(plain.history())
        for mine, theirs in zip(fused.history(), plain.history()):
            assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
        update = torch.randn_like(modules[0].weight)
        with torch.no_grad():
            for module in modules:  # the optimizer's step
                module.weight.add_(update)
        for versions in (fused, plain):
            versions.release(step, 1)
            versions.advance()


def test_recompute_replays_dropout_and_matches_stash() -> None:
    torch.manual_seed(1)
    x, grad_out = torch.randn(8, 6), torch.randn(8, 4)
    results = []
    for mode in ("stash", "recompute"):
        torch.manual_seed(2)
        module = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.5), nn.Linear(16, 4))
        compute = StageCompute(module, mode=mode, input_grad=True, device=torch.device("cpu"))
        torch.manual_seed(3)
        output = compute.forward(0, x)
        torch.rand(100)  # the global RNG moves on before the backward
        input_grad = compute.backward_input(0, grad_out)
        assert compute.backward_weights(0) == 0
        results.append((output, input_grad, [p.grad.clone() for p in module.parameters()]))
    (out_s, gin_s, grads_s), (out_r, gin_r, grads_r) = results
    assert torch.equal(out_s, out_r)
    assert torch.allclose(gin_s, gin_r) and all(torch.allclose(a, b) for a, b in zip(grads_s, grads_r))


# --- whole pipelines as threads -----------------------------------------------------------------------

@pytest.mark.parametrize("ranges", [MLP_RANGES, [(0, 4)]], ids=["3-stages", "1-stage"])
def test_one_micro_batch_in_flight_equals_single_process_training(ranges: list[tuple[int, int]]) -> None:
    """With K=1 the pipeline is plain synchronous SGD, so it must reproduce the single-process run."""
    job = make_job(steps=12, accumulation=2, lr_schedule="cosine", warmup_steps=3, microbatches_in_flight=1,
                   eval_every=5)
    piped = run_threaded_pipeline(job, ranges, timeout=60)
    single = run_single_process(job)
    assert piped["state_dict"].keys() == single["state_dict"].keys()
    for key, value in single["state_dict"].items():
        assert torch.allclose(piped["state_dict"][key], value, atol=1e-6), key
    assert piped["metrics"]["test_accuracy"] == pytest.approx(single["metrics"]["test_accuracy"])
    assert piped["metrics"]["test_loss"] == pytest.approx(single["metrics"]["test_loss"], rel=1e-5)
    evaluations = [m for m in piped["history"][-1] if "test_accuracy" in m]
    assert [m["step"] for m in evaluations] == [5, 10, 12, 12]  # eval_every, the final one, run()'s result
    assert all(trace["max_in_flight"] <= 1 for trace in piped["traces"])


class VersionRecorder(AveragingStrategy):
    """A stand-in averaging strategy: records the stage's live weights after every optimizer step."""

    def __init__(self) -> None:
        self.history: dict[int, dict[str, torch.Tensor]] = {}
        self.finished_after: int | None = None
        self.runner: StageRunner | None = None

    def attach(self, runner: StageRunner) -> None:
        self.runner = runner
        self.after_step(0)

    def after_step(self, step: int) -> None:
        self.history[step] = {k: v.clone() for k, v in self.runner.live_tensors().items()}

    def finish(self) -> None:
        self.finished_after = max(self.history)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_checkpoints_by_seconds_land_on_the_same_step_in_every_stage(accumulation: int) -> None:
    """Stage 0 picks the step when the time has come and forwards carry it: every stage checkpoints at
    exactly the same steps, although up to K micro-batches were already on their way untagged."""
    checkpoints: list[list[int]] = [[] for _ in MLP_RANGES]

    def setup(runners: list[StageRunner]) -> None:
        for runner, steps in zip(runners, checkpoints):
            runner.assignment = runner.assignment.model_copy(update={"checkpoint_every_s": 0.1})
            runner.on_checkpoint = steps.append

    job = make_job(steps=50, microbatches_in_flight=3, accumulation=accumulation)
    run_threaded_pipeline(job, MLP_RANGES, setup=setup, timeout=120)
    assert len(checkpoints[0]) >= 2 and all(steps == checkpoints[0] for steps in checkpoints), checkpoints
    assert checkpoints[0] == sorted(set(checkpoints[0])) and checkpoints[0][-1] < 50


@pytest.mark.parametrize("mode", ["stash", "recompute"])
def test_backward_uses_the_weights_of_its_forward_despite_staleness(mode: str) -> None:
    window = 3
    job = make_job(steps=40, microbatches_in_flight=window, weight_stash=mode, staleness="none")
    recorders = [VersionRecorder() for _ in MLP_RANGES]
    captured: list[dict[int, tuple]] = [{}, {}]

    def observer(store: dict[int, tuple]):
        def observe(micro_batch, version, weights, inputs, grad_output, grads):
            store[micro_batch] = (version, {k: w.detach().clone() for k, w in weights.items()}, inputs.detach().clone(),
                                  grad_output.clone(), {k: g.clone() for k, g in grads.items()})
        return observe

    def setup(runners: list[StageRunner]) -> None:
        for recorder, runner in zip(recorders, runners):
            recorder.attach(runner)
        for stage in (0, 1):
            runners[stage].compute.observer = observer(captured[stage])

    result = run_threaded_pipeline(job, MLP_RANGES, averagers=recorders, setup=setup, timeout=60)
    traces = result["traces"]
    assert traces[0]["max_in_flight"] == window  # stage 0 filled the window but never overfilled it
    assert all(trace["max_in_flight"] <= window for trace in traces)
    for trace in traces:
        assert len(trace["records"]) == 40
        assert all(fwd == bwd for _, fwd, bwd, _ in trace["records"])
    stale = [r for r in traces[0]["records"] if r[3] > r[1]]
    assert len(stale) >= 20, "the optimizer must have stepped between forward and backward"
    assert all(r.finished_after == 40 for r in recorders)  # finish() after the last step

    spec = build_model(job.model.name, job.model.config)
    for stage in (0, 1):
        stage_versions = {r[0]: r[3] for r in traces[stage]["records"]}
        history = recorders[stage].history
        module = spec.blocks(*MLP_RANGES[stage])
        assert len(captured[stage]) == 40
        for micro_batch, (version, weights, inputs, grad_output, grads) in captured[stage].items():
            for name, weight in weights.items():  # the forward's weights are that version's weights
                assert torch.equal(weight, history[version][name])
            if stage_versions[micro_batch] > version:  # ... and not the stage's weights at backward time
                assert any(not torch.equal(w, history[stage_versions[micro_batch]][k]) for k, w in weights.items())
            # an independent gradient with plain autograd on those weights
            module.load_state_dict(weights)
            inputs = inputs.clone().requires_grad_(stage > 0)
            expected = torch.autograd.grad(module(inputs), list(module.parameters()), grad_output)
            for (name, _), want in zip(module.named_parameters(), expected):
                assert torch.allclose(grads[name], want, atol=1e-6), (stage, micro_batch, name)


@pytest.mark.parametrize("mode", ["stash", "recompute"])
def test_batchnorm_statistics_count_each_micro_batch_once(mode: str) -> None:
    job = make_job({"name": "cnn", "config": {"channels": [4, 8]}}, steps=15, weight_stash=mode,
                   optimizer={"name": "Adam", "kwargs": {"lr": 1e-3}})
    state = run_threaded_pipeline(job, [(0, 1), (1, 2), (2, 4)], timeout=60)["state_dict"]
    micro_batches = 15 * 3  # "2bw" cuts each batch into K = 3 parts
    assert int(state["0.1.num_batches_tracked"]) == micro_batches == int(state["1.1.num_batches_tracked"])
    initial = build_model("cnn", {"channels": [4, 8]}).full_model(seed=0).state_dict()
    assert not torch.equal(state["0.1.running_mean"], initial["0.1.running_mean"])


@pytest.mark.parametrize("codec", ["fp16", "q8", "q4", "q4g3"])
def test_a_compressed_link_trains(codec: str) -> None:
    job = make_job(steps=100, codec=codec, microbatches_in_flight=1, optimizer={"name": "Adam", "kwargs": {"lr": 1e-2}})
    result = run_threaded_pipeline(job, MLP_RANGES, timeout=60)
    assert result["metrics"]["test_accuracy"] > 0.7


def test_wrong_shaped_activation_gets_a_clear_error_and_the_server_keeps_serving() -> None:
    token = "t0ken"
    router = Router()
    server = PeerServer(router, "127.0.0.1", 0, token=token)
    try:
        assignment = make_assignments(make_job(), [(0, 2), (2, 4)], ["127.0.0.1:9", server.address], token)[1]
        runner = StageRunner(assignment, router)
        labels = torch.zeros(4, dtype=torch.int64)

        def refused(msg: Message, pattern: str) -> None:
            stream = OutboundStream(server.address, token=token)
            stream.send(msg)
            with pytest.raises(PeerError, match=pattern):
                stream.close(timeout=10)

        refused(Message("forward", 0, {"x": torch.zeros(4, 7), "y": labels}),
                r"INVALID_ARGUMENT: stage 1 \(blocks \[2, 4\)\) expects activations float32 of shape \['B', 32\]")
        refused(Message("forward", 0, {"x": torch.zeros(4, 32)}), "needs tensors 'x' and 'y'")
        refused(Message("forward", 0, {"x": torch.zeros(4, 32), "y": labels[:3]}), "targets must be integers")
        refused(Message("forward", 3, {"x": torch.zeros(4, 32), "y": labels}), "micro-batch 3, expected 0 ")
        refused(Message("backward", 0, {"grad": torch.zeros(4, 32)}), "UNIMPLEMENTED")  # the last stage

        good = OutboundStream(server.address, token=token)
        good.send(Message("forward", 0, {"x": torch.zeros(4, 32), "y": labels}))
        assert good.close(timeout=10).messages == 1
        assert runner.inbox.next_forward(timeout=5).id == 0  # it reached the worker's queue
    finally:
        server.stop(0)


def test_a_failing_stage_stops_every_stage_with_its_reason() -> None:
    calls = itertools.count()

    def setup(runners: list[StageRunner]) -> None:
        original = runners[2].compute.backward_input

        def failing(micro_batch, grad):
            if next(calls) == 5:
                raise RuntimeError("boom in the last stage")
            return original(micro_batch, grad)

        runners[2].compute.backward_input = failing

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="stage 0 failed.*boom in the last stage"):
        run_threaded_pipeline(make_job(), MLP_RANGES, setup=setup, timeout=60)
    assert time.monotonic() - start < 30  # neighbours were told, nobody waited for a timeout


def test_a_nan_gradient_from_a_neighbour_is_refused_and_never_applied() -> None:
    """The last stage sends a NaN input gradient once: stage 1 refuses it (the pipeline fails with that
    reason), and no weight anywhere ever holds a NaN."""
    calls = itertools.count()

    def setup(runners: list[StageRunner]) -> None:
        original = runners[2].compute.backward_input

        def poisoned(micro_batch, grad):
            input_grad = original(micro_batch, grad)
            return input_grad.fill_(float("nan")) if next(calls) == 5 else input_grad

        runners[2].compute.backward_input = poisoned
        captured.extend(runners)

    captured: list[StageRunner] = []
    with pytest.raises(RuntimeError, match="NaN or infinite values; refused"):
        run_threaded_pipeline(make_job(), MLP_RANGES, setup=setup, timeout=60)
    assert all(bool(torch.isfinite(p).all()) for runner in captured[:2] for p in runner.module.parameters())


def test_an_abort_is_passed_on_as_one_short_printable_line() -> None:
    """What a neighbour says when it aborts is its own account: logged in full, passed on shortened."""
    assignment = make_assignments(make_job(), [(0, 2), (2, 4)], ["127.0.0.1:9", "127.0.0.1:9"], "x")[1]
    runner = StageRunner(assignment, Router())
    runner.neighbours._on_abort(Message("abort", note="first line \x1b[31m" + "x" * 5000 + "\nsecond line"), "10.0.0.1:5")
    with pytest.raises(PipelineError) as failure:
        runner.inbox.next_forward(timeout=1)
    reason = str(failure.value)
    assert "neighbour at 10.0.0.1:5 reported a failure ('first line" in reason
    assert "\x1b" not in reason and "second line" not in reason and len(reason) < 700


def test_non_finite_values_fail_the_stage_naming_their_sender_and_leave_its_stream_open() -> None:
    """A refusal names the sender (kind nan, its address), so the coordinator blames the source; the
    handler returns normally, so the sender's stream stays open and its own failure is no report that
    the refusing stage was lost (issue 47)."""
    from ravnest.failures import FailureKind, classify

    first, last = make_assignments(make_job(), [(0, 2), (2, 4)], ["10.0.0.1:5", "10.0.0.2:5"], "x")
    nan = torch.full((4, 32), float("nan"))
    for assignment, kind, message in ((last, "forward", Message("forward", 0, {"x": nan, "y": torch.zeros(4).long()})),
                                      (last, "eval", Message("eval", 0, {"x": nan, "y": torch.zeros(4).long()})),
                                      (first, "backward", Message("backward", 0, {"grad": nan}))):
        runner = StageRunner(assignment, Router())
        runner.inbox.expect_gradient(0, nan.shape)
        handler = {"forward": runner.neighbours._on_forward, "eval": runner.neighbours._on_eval,
                   "backward": runner.neighbours._on_backward}[kind]
        handler(message, "10.0.0.9:1")  # returns: the stream is not cut
        with pytest.raises(PipelineError) as refused:
            runner.inbox.next_backward(timeout=1) if kind == "backward" else runner.inbox.next_forward(timeout=1)
        sender = (assignment.prev or assignment.next).address
        failure = classify(refused.value, {sender: "the-sender"})
        assert (failure.kind, failure.peer_id) == (FailureKind.NAN, "the-sender"), (kind, failure)
        assert "NaN or infinite values; refused" in str(refused.value)


def test_a_stage_that_starts_late_is_waited_for_and_the_job_runs() -> None:
    """Per-node credentials, as node daemons use them: stage 1 learns its assignment seconds after
    stage 0 (its next heartbeat). Until then it refuses stage 0's credential; stage 0 waits for it
    (with a deadline) instead of failing, and the pipeline trains."""
    routers, gates = [Router(wait_for_route=60.0), Router(wait_for_route=60.0)], [PeerGate(), PeerGate()]
    servers = [PeerServer(router, gate=gate) for router, gate in zip(routers, gates)]
    try:
        base = make_assignments(make_job(steps=20), [(0, 2), (2, 4)], [s.address for s in servers], "unused")
        tokens = {"cluster0-stage0": "rvn_0-secret", "cluster0-stage1": "rvn_1-secret"}
        hashes = {node: credential_hash(token) for node, token in tokens.items()}
        assignments = [a.model_copy(update={"token": tokens[f"cluster0-stage{a.stage}"], "peer_credentials": hashes})
                       for a in base]
        outcomes: dict[int, Any] = {}

        def run(stage: int, delay: float) -> None:
            time.sleep(delay)  # the late node's heartbeat, not a wait for a condition
            a = assignments[stage]
            gates[stage].admit("job/0", a.peer_credentials, a.planned_peers())
            try:
                outcomes[stage] = StageRunner(a, routers[stage]).run()
            except BaseException as e:
                outcomes[stage] = e

        threads = [threading.Thread(target=run, args=(0, 0.0)), threading.Thread(target=run, args=(1, 3.0))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert all(isinstance(outcomes[s], dict) and outcomes[s]["step"] == 20 for s in (0, 1)), outcomes
    finally:
        for server in servers:
            server.stop(0)


def test_stop_event_ends_a_waiting_stage() -> None:
    router = Router()
    server = PeerServer(router, "127.0.0.1", 0)
    try:
        assignment = make_assignments(make_job(), [(0, 2), (2, 4)], ["127.0.0.1:9", server.address], "x")[1]
        runner = StageRunner(assignment, router)
        stop = threading.Event()
        outcome: list[BaseException] = []
        thread = threading.Thread(target=lambda: outcome.append(pytest.raises(PipelineError, runner.run, stop)))
        thread.start()
        stop.set()
        thread.join(timeout=10)
        assert not thread.is_alive()
        assert "stopped" in str(outcome[0].value)
    finally:
        server.stop(0)


def test_a_neighbour_refusing_the_stream_fails_the_stage_promptly() -> None:
    own_router = Router()
    own, stranger = PeerServer(own_router, "127.0.0.1", 0), PeerServer(Router(), "127.0.0.1", 0)
    try:  # the next "stage" is a node that runs no stage of this job
        assignment = make_assignments(make_job(), [(0, 2), (2, 4)], [own.address, stranger.address], "")[0]
        runner = StageRunner(assignment, own_router, peer_timeout=60)
        start = time.monotonic()
        with pytest.raises(PipelineError, match="stage 0 .*UNIMPLEMENTED"):  # via send() or the stream callback
            runner.run()
        assert time.monotonic() - start < 20
    finally:
        own.stop(0)
        stranger.stop(0)


def test_a_stage_continues_from_its_saved_state_exactly(tmp_path) -> None:
    """save_state at a checkpoint, then a runner resumed from it: same weights, same optimizer state
    (Adam's moments and step), same point in the LR schedule, and steps counted on to the end."""
    job = make_job(steps=20, lr_schedule="cosine", optimizer={"name": "Adam", "kwargs": {"lr": 1e-2}})
    first = make_assignments(job, [(0, 4)], ["127.0.0.1:9"], "t")[0].model_copy(update={"checkpoint_every": 10})
    saved = tmp_path / "step-10.safetensors"
    runner = StageRunner(first, Router(), on_checkpoint=lambda step: runner.save_state(saved))
    runner.run()
    assert saved.exists() and runner.optimizer.steps == 20

    resumed = first.model_copy(update={"resume_step": 10, "checkpoint_every": 0})
    again = StageRunner(resumed, Router(), initial_state=saved)
    state = load_file(saved)
    assert all(torch.equal(again.module.state_dict()[k], state[k]) for k in again.module.state_dict())
    moments = again.optimizer_tensors()
    assert moments and all(torch.equal(value, state[key]) for key, value in moments.items())
    assert again.optimizer.lr == pytest.approx(1e-2 * lr_factor(10, job.training))
    reported = []
    again.on_metrics = reported.append
    again.run()
    assert again.optimizer.steps == 20 and reported[-1]["step"] == 20
    assert not all(torch.equal(v, state[k]) for k, v in again.module.state_dict().items())  # it trained on

    with pytest.raises(ValueError, match="no state"):
        StageRunner(resumed, Router())


@pytest.mark.parametrize("sever_after", [9, 40], ids=["early", "mid-run"])
def test_a_stream_cut_mid_run_is_resumed_and_the_weights_are_those_of_an_unbroken_run(sever_after, caplog) -> None:
    """A broken connection costs the run nothing: the sender opens a new stream and sends its last
    messages again, the receiver drops what it had (each message's link_seq), and the seeded run ends
    with the weights of a run whose links never broke, bit for bit."""
    from ravnest.wire import faults

    job = make_job(steps=24, microbatches_in_flight=2, eval_every=10)
    clean = run_threaded_pipeline(job, MLP_RANGES, timeout=60)
    injected = faults.LinkFaults(sever_after=sever_after)
    faults.inject(injected)
    try:
        with caplog.at_level("WARNING", logger="ravnest.pipeline.neighbours"):
            cut = run_threaded_pipeline(job, MLP_RANGES, timeout=60)
    finally:
        faults.inject(None)
    assert injected._severed
    assert any("a new stream took over" in r.getMessage() for r in caplog.records), caplog.text
    for key, value in clean["state_dict"].items():
        assert torch.equal(cut["state_dict"][key], value), key
    assert cut["metrics"]["test_loss"] == clean["metrics"]["test_loss"]


def test_a_message_after_a_gap_on_its_link_ends_the_stream_and_a_repeat_is_dropped() -> None:
    """What a break lost beyond what the sender kept cannot be made up: the next message names the gap."""
    from ravnest.wire import WireError

    last = make_assignments(make_job(), MLP_RANGES, ["10.0.0.1:5", "10.0.0.2:5", "10.0.0.3:5"], "x")[1]
    runner = StageRunner(last, Router())
    runner.neighbours.link_resume_s = 0.2  # (how long a message waits for the ones before it)
    x, y = torch.zeros(4, 32), torch.zeros(4).long()
    first = Message("forward", 0, {"x": x, "y": y}, tags={"link_seq": 1})
    runner.neighbours._on_forward(first, "10.0.0.1:5")
    runner.neighbours._on_forward(Message("forward", 0, {"x": x, "y": y}, tags={"link_seq": 1}), "10.0.0.1:5")
    assert runner.inbox.next_forward(timeout=1).id == 0
    with pytest.raises(WireError, match="message 3 on the link from the prev stage came after message 1"):
        runner.neighbours._on_forward(Message("forward", 2, {"x": x, "y": y}, tags={"link_seq": 3}), "10.0.0.1:5")
