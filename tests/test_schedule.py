"""The pipeline's schedule: a pure function that never deadlocks, bounds what is in flight and fixes
which weights each computation uses; the split backward sends input gradients before weight
gradients are computed; and a seeded run over real processes is reproducible bit for bit."""
from __future__ import annotations

import threading
from collections import deque

import pytest
import torch

from ravnest.pipeline import StageRunner, run_local_pipeline, run_threaded_pipeline
from ravnest.pipeline.single_process import two_stage_reference
from ravnest.pipeline.stash import StageCompute
from ravnest.pipeline.schedule import (B, F, RECV_B, RECV_F, SEND_B, SEND_F, STEP, W, Action, ScheduleError,
                                       batch_parts, check_stage_schedule, stage_actions, staleness,
                                       steps_before_next_forward, validate_schedule, warmup)
from ravnest.spec import JobSpec

SHAPES = [(S, K, acc, n) for S in (1, 2, 3, 4) for K in (1, 2, 4, 6) for acc in (1, 3) for n in (1, 5, 12)]


def simulate(num_stages: int, window: int, micro_batches: int, accumulation: int) -> list[list[tuple[str, int, int]]]:
    """Run every stage's actions with FIFO links between neighbours, any stage that can move moving
    (round robin); returns per stage the (action, micro-batch, optimizer steps so far) it did, and
    fails on a deadlock."""
    actions = [deque(stage_actions(s, num_stages, window, micro_batches, accumulation)) for s in range(num_stages)]
    forward = [deque() for _ in range(num_stages)]   # forward[s]: activations waiting at stage s
    backward = [deque() for _ in range(num_stages)]  # backward[s]: gradients waiting at stage s
    steps, done = [0] * num_stages, [[] for _ in range(num_stages)]
    while any(actions):
        moved = False
        for s in range(num_stages):
            while actions[s]:
                action = actions[s][0]
                if action.kind == RECV_F and s > 0:
                    if not forward[s]:
                        break
                    assert forward[s].popleft() == action.micro_batch
                elif action.kind == RECV_B:
                    if not backward[s]:
                        break
                    assert backward[s].popleft() == action.micro_batch
                elif action.kind == SEND_F:
                    forward[s + 1].append(action.micro_batch)
                elif action.kind == SEND_B:
                    backward[s - 1].append(action.micro_batch)
                elif action.kind == STEP:
                    steps[s] += 1
                    assert steps[s] == action.micro_batch
                actions[s].popleft()
                done[s].append((action.kind, action.micro_batch, steps[s]))
                moved = True
        assert moved, f"deadlock: {[list(map(str, a))[:3] for a in actions]}"
    return done


@pytest.mark.parametrize("num_stages,window,accumulation,micro_batches", SHAPES)
def test_every_schedule_completes_and_keeps_its_promises(num_stages, window, accumulation, micro_batches) -> None:
    micro_batches *= accumulation
    done = simulate(num_stages, window, micro_batches, accumulation)
    for s, actions in enumerate(done):
        first, last = s == 0, s == num_stages - 1
        kinds = [kind for kind, _, _ in actions]
        assert kinds.count(F) == kinds.count(W) == micro_batches
        assert kinds.count(STEP) == micro_batches // accumulation
        assert kinds.count(B) == kinds.count(SEND_B) == (0 if first else micro_batches)
        assert kinds.count(SEND_F) == kinds.count(RECV_B) == (0 if last else micro_batches)
        position = {(kind, m): i for i, (kind, m, _) in enumerate(actions)}
        in_flight = 0
        for kind, m, steps in actions:
            in_flight += (kind == F) - (kind == W)
            assert in_flight <= warmup(s, num_stages, window) <= window
        for m in range(micro_batches):
            assert position[(F, m)] < position[(W, m)]
            if not first:  # the input gradient leaves before the weight gradient is computed
                assert position[(B, m)] < position[(SEND_B, m)] < position[(W, m)]
            # the staleness the schedule promises is the number of steps between forward and W
            at_forward = actions[position[(F, m)]][2]
            at_weights = actions[position[(W, m)]][2]
            assert at_weights - at_forward == staleness(m, s, num_stages, window, accumulation)
            assert at_weights - at_forward <= window - 1
            # the version's last forward, which takes weight prediction's copy for the step
            next_forward = position.get((F, m + 1), len(actions))
            stepped = any(kind == STEP for kind, _, _ in actions[position[(F, m)]:next_forward])
            assert steps_before_next_forward(m, s, num_stages, window, micro_batches, accumulation) == stepped


def test_stage_zero_of_two_warms_up_with_k_forwards_then_alternates() -> None:
    assert " ".join(map(str, stage_actions(0, 2, 2, 3))) == (
        "RECV_F0 F0 SEND_F0 RECV_F1 F1 SEND_F1 RECV_B0 W0 STEP1 RECV_F2 F2 SEND_F2 RECV_B1 W1 STEP2 RECV_B2 W2 STEP3")
    assert " ".join(map(str, stage_actions(1, 2, 2, 2))) == "RECV_F0 F0 B0 SEND_B0 W0 STEP1 RECV_F1 F1 B1 SEND_B1 W1 STEP2"


TINY_MLP = {"name": "mlp", "config": {"input_dim": 64, "hidden": 32, "depth": 2, "num_classes": 10}}


def make_job(**training) -> JobSpec:
    settings = {"steps": 30, "batch_size": 16, "optimizer": {"name": "SGD", "kwargs": {"lr": 0.05}}, **training}
    return JobSpec.model_validate({"model": TINY_MLP, "dataset": {"name": "digits"}, "training": settings})


def test_the_upstream_stage_receives_each_input_gradient_before_the_weight_gradient_is_computed() -> None:
    """Each W of the middle and last stages waits (with a deadline) until the stage before has received
    that micro-batch's input gradient: possible only because B's gradient leaves before W runs."""
    ranges = [(0, 2), (2, 3), (3, 4)]
    received = [dict() for _ in ranges]  # stage -> micro-batch -> Event set when its gradient arrived
    late: list[tuple[int, int]] = []

    def setup(runners: list[StageRunner]) -> None:
        for stage, runner in enumerate(runners):
            put = runner.inbox.put_backward

            def put_backward(msg, sender=None, put=put, stage=stage):
                put(msg, sender)
                received[stage].setdefault(msg.id, threading.Event()).set()
            runner.inbox.put_backward = put_backward
            if stage == 0:
                continue
            weights = runner.compute.backward_weights

            def backward_weights(m, weights=weights, stage=stage):
                arrived = received[stage - 1].setdefault(m, threading.Event())
                if not late and not arrived.wait(timeout=10):
                    late.append((stage, m))
                return weights(m)
            runner.compute.backward_weights = backward_weights

    run_threaded_pipeline(make_job(steps=20, microbatches_in_flight=3), ranges, setup=setup, timeout=120)
    assert not late, f"stage {late[0][0]} computed W of micro-batch {late[0][1]} before stage {late[0][0] - 1} had B"
    assert all(len(events) == 20 * 3 for events in received[:2])  # "2bw" cuts each batch into K = 3 parts


@pytest.mark.parametrize("predict", [False, True], ids=["none", "predict"])
def test_split_backward_gives_the_gradients_of_a_plain_backward(predict: bool) -> None:
    """The whole pipeline with the split backward and the one with a plain backward end bit-close."""
    job = make_job(steps=25, microbatches_in_flight=3, staleness="predict" if predict else "none")
    ranges = [(0, 2), (2, 3), (3, 4)]

    def unsplit(runners: list[StageRunner]) -> None:  # as a plan without room for the split makes them
        for runner in runners:
            runner.compute = StageCompute(runner.module, mode="stash", input_grad=not runner.is_first,
                                          device=runner.device, snapshots=runner.compute.versions.snapshots,
                                          predict=runner.predict, split=False)
            assert not runner.compute.split

    split = run_threaded_pipeline(job, ranges, timeout=120)["state_dict"]
    plain = run_threaded_pipeline(job, ranges, setup=unsplit, timeout=120)["state_dict"]
    for key, value in plain.items():
        assert torch.allclose(split[key], value, rtol=1e-4, atol=1e-6), key


def test_threaded_runs_are_identical_whatever_the_timing() -> None:
    """Threads of one process interleave differently every run; the weights do not."""
    job = make_job(steps=30, microbatches_in_flight=4, staleness="predict",
                   optimizer={"name": "Adam", "kwargs": {"lr": 1e-3}})
    ranges = [(0, 1), (1, 2), (2, 3), (3, 4)]
    first, second = (run_threaded_pipeline(job, ranges, timeout=120)["state_dict"] for _ in range(2))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("staleness, forward_weights", [("none", "stale"), ("predict", "predict"),
                                                       ("predict2", "predict2")])
def test_a_two_stage_pipeline_computes_exactly_the_stale_or_predicted_algorithm(staleness, forward_weights) -> None:
    """The pipeline's weights after 20 Adam steps are those of its algorithm done in one process, and far
    from synchronous training's: what it learns is what staleness and prediction make of it, no more."""
    job = make_job(steps=20, microbatches_in_flight=2, staleness=staleness, seed=3,
                   optimizer={"name": "Adam", "kwargs": {"lr": 1e-2}})
    piped = run_threaded_pipeline(job, [(0, 2), (2, 4)], timeout=120)["state_dict"]
    (expected, _), (sync, _) = two_stage_reference(job, 2, forward_weights), two_stage_reference(job, 2, "sync")
    assert piped.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.allclose(piped[key], value, rtol=1e-4, atol=1e-5), key
    assert max(float((piped[k] - sync[k]).abs().max()) for k in sync) > 1e-2  # the test can tell them apart


@pytest.mark.slow
@pytest.mark.parametrize("ranges", [[(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]], ids=["2-stages", "3-stages"])
def test_a_seeded_pipeline_over_real_processes_is_reproducible_bit_for_bit(ranges) -> None:
    job = JobSpec.model_validate({"model": {"name": "cnn"}, "dataset": {"name": "digits"}, "training": {
        "steps": 60, "batch_size": 32, "seed": 7, "optimizer": {"name": "Adam", "kwargs": {"lr": 1e-3}}}})
    runs = [run_local_pipeline(job, ranges, timeout=300) for _ in range(2)]
    first, second = (run["state_dict"] for run in runs)
    assert first.keys() == second.keys() and len(first) > 0
    different = [k for k in first if not torch.equal(first[k], second[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"
    assert runs[0]["metrics"]["test_loss"] == runs[1]["metrics"]["test_loss"]
    assert any(r[3] > r[1] for r in runs[0]["traces"][0]["records"])  # the weights were stale: async for real



def test_a_model_that_reads_another_modules_weight_falls_back_to_a_plain_backward(caplog) -> None:
    """The split backward is exact only when each parameter is used inside its owner: the first
    micro-batch finds out, and the gradients are right either way."""
    from torch import nn

    from ravnest.pipeline.stash import StageCompute

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.b(torch.relu(self.a(x))) @ self.a.weight  # a.weight read outside `a`

    for model, splits in ((Tied(), False), (nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), True)):
        reference = type(model)() if isinstance(model, Tied) else nn.Sequential(nn.Linear(8, 8), nn.ReLU(),
                                                                                 nn.Linear(8, 8))
        reference.load_state_dict(model.state_dict())
        compute = StageCompute(model, mode="stash", input_grad=True, device=torch.device("cpu"), snapshots=False)
        for micro_batch in range(2):  # the first is checked; the second runs as the check decided
            x = torch.randn(4, 8)
            grad = torch.randn_like(compute.forward(micro_batch, x))
            input_grad = compute.backward_input(micro_batch, grad)
            compute.backward_weights(micro_batch)
            x = x.clone().requires_grad_(True)
            (reference(x) * grad).sum().backward()
            assert torch.allclose(input_grad, x.grad, atol=1e-6)
        assert compute.split is splits
        for mine, want in zip(model.parameters(), reference.parameters()):
            assert torch.allclose(mine.grad, want.grad, atol=1e-5)
    assert "uses parameters outside the module that owns them" in caplog.text


@pytest.mark.parametrize("num_stages,window,accumulation,micro_batches", SHAPES)
def test_every_schedule_passes_its_validation_and_a_stage_checks_it_when_built(num_stages, window, accumulation,
                                                                                micro_batches) -> None:
    micro_batches *= accumulation
    for s in range(num_stages):
        validate_schedule(stage_actions(s, num_stages, window, micro_batches, accumulation), s, num_stages, window,
                          micro_batches, accumulation)
        check_stage_schedule(s, num_stages, window, 10**7 * accumulation, accumulation)  # a twin, at once


def _broken(stage: int, change) -> list[Action]:
    actions = list(stage_actions(stage, 2, 2, 6, 1))
    change(actions)
    return actions


@pytest.mark.parametrize("stage,change,reason", [
    (0, lambda a: a.insert(a.index(Action(STEP, 1)), a.pop(a.index(Action(F, 2)))), "step 1 must come first"),
    (1, lambda a: a.remove(Action(SEND_B, 3)), "SEND_B3 comes next for micro-batch 3"),
    (0, lambda a: a.insert(2, Action(RECV_F, 2)), "micro-batch 1 starts next"),
    (0, lambda a: a.insert(4, a.pop(a.index(Action(RECV_F, 2)))), "more than K = 2 micro-batches"),
    (1, lambda a: a.append(Action(SEND_F, 9)), "this stage has no SEND_F actions"),
    (0, lambda a: a.pop(), "ends with 6 of 6 micro-batches done and 5 of 6 steps"),
], ids=["forward-before-step", "missing-send", "out-of-order", "over-K", "last-sends-forward", "step-missing"])
def test_a_broken_schedule_is_refused_naming_the_action(stage, change, reason) -> None:
    with pytest.raises(ScheduleError, match=reason):
        validate_schedule(_broken(stage, change), stage, 2, 2, 6, 1)


def test_2bw_cuts_a_batch_only_as_far_as_a_step_needs_to_cover_the_micro_batches_in_flight() -> None:
    """PipeDream-2BW keeps at most one update between a forward and its gradient by giving a step at
    least K micro-batches: a batch cut in K parts, or fewer parts where the step accumulates batches
    (whole batches once it has K of them); other methods never cut, and no part is under one sample."""
    assert [batch_parts("2bw+predict2", 4, 32, accumulation) for accumulation in (1, 2, 3, 4, 64)] == \
        [4, 2, 2, 1, 1]
    assert batch_parts("2bw", 24, 32, 16) == 2 and batch_parts("2bw", 64, 8) == 8
    assert batch_parts("predict2", 24, 32, 1) == batch_parts("none", 4, 32, 1) == 1
