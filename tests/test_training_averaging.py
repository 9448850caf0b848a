"""Training with averaging on: three clusters that cut the CNN differently (1, 2 and 2 stages), every
stage a thread of this process on loopback gRPC, against the single-process reference.

The reference is plain synchronous training for the same number of optimizer steps at the same batch
size: the bar is that asynchronous pipelines (stale weights) plus periodic averaging of disjoint
shards learn at least as well as one replica stepping synchronously, i.e. averaging neither breaks
nor slows convergence per step. (Each cluster sees its own third of the data; a reference with three
times the samples per step would be a data-parallel bound, not what averaging every few steps claims.)
"""
from __future__ import annotations

import math
import time

import pytest
import torch

from ravnest.averaging.strategies.acid import acid_constants, gap_averaging, gap_mixing, mix, neighbours, partner
from ravnest.averaging.strategies.ada import consensus_distance
from ravnest.averaging.robust import STRIKES
from ravnest.averaging.robust_round import RingOutlier
from ravnest.averaging.strategies.diloco import outer_step
from ravnest.data import load_dataset
from ravnest.models import build_model
from ravnest.pipeline.inbox import TrainedAlone
from ravnest.pipeline.local import run_single_process, run_threaded_clusters
from ravnest.pipeline.feed import data_seed
from ravnest.spec import JobSpec

CLUSTER_RANGES = [[(0, 4)], [(0, 2), (2, 4)], [(0, 1), (1, 4)]]  # segments (0,1) (1,2) (2,4)
STEPS = 150


def job(averaging: dict, optimizer: dict | None = None, eval_every: int = 0) -> JobSpec:
    # whole batches per micro-batch: every cluster steps at the same pace
    training = {"steps": STEPS, "batch_size": 32, "seed": 0, "staleness": "none", "eval_every": eval_every}
    return JobSpec.model_validate({"model": {"name": "cnn"}, "dataset": {"name": "digits"},
                                   "training": {**training, **({"optimizer": optimizer} if optimizer else {})},
                                   "averaging": averaging})


@pytest.fixture(scope="module")
def reference() -> dict[str, float]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_single_process(job({}))["metrics"]
    finally:
        torch.set_num_threads(threads)


def steps_during_rounds(runner, averager) -> tuple[int, int]:
    """(optimizer steps this stage completed while one of its rounds was in flight, rounds run).
    A stage only steps on its worker thread, so an averager that blocked it for a round (a drained
    pipeline) would leave no step inside any window."""
    windows = [(r.started, r.ended) for r in averager.history]
    inside = sum(any(start < t < end for start, end in windows) for t, _ in runner.clock.steps)
    return inside, len({r.number for r in averager.history})


def train(spec: JobSpec, cluster_ranges, **kwargs) -> list[dict]:
    """run_threaded_clusters with one torch thread per stage, as nodes run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_threaded_clusters(spec, cluster_ranges, timeout=300, **kwargs)
    finally:
        torch.set_num_threads(threads)


def assert_identical(clusters: list[dict]) -> None:
    """finish() left every replica with the same weights: parameters and buffers alike."""
    states = [c["state_dict"] for c in clusters]
    for state in states[1:]:
        assert state.keys() == states[0].keys()
        for key, value in state.items():
            assert torch.equal(value, states[0][key]), f"{key} differs between clusters"


@pytest.mark.parametrize("averaging", [{"every": 10}, {"every_seconds": 0.2, "average_optimizer_state": True}],
                         ids=["every-10-steps", "every-0.2s-with-adam-state"])
def test_clusters_with_different_cuts_train_average_and_end_identical(reference, averaging) -> None:
    clusters = train(job(averaging), CLUSTER_RANGES)

    accuracies = [c["metrics"]["test_accuracy"] for c in clusters]
    print(f"\naveraging {averaging}: test accuracy {accuracies} vs reference {reference['test_accuracy']:.4f}")
    assert reference["test_accuracy"] >= 0.95
    assert min(accuracies) >= reference["test_accuracy"] - 0.03

    assert_identical(clusters)
    if averaging.get("average_optimizer_state"):
        moments = [{k: v for r in c["runners"] for k, v in r.optimizer_tensors().items()} for c in clusters]
        assert moments[0] and all(m.keys() == moments[0].keys() for m in moments)
        for other in moments[1:]:
            assert all(torch.equal(v, moments[0][k]) for k, v in other.items())

    # the pipeline kept running while rings were in flight: steps completed inside round windows,
    # and the training threads spent little time waiting on the averager
    for c, cluster in enumerate(clusters):
        for runner, averager, metrics in zip(cluster["runners"], cluster["averagers"], cluster["stages"]):
            inside, rounds = steps_during_rounds(runner, averager)
            stall = metrics["avg_stall_s"] / metrics["elapsed_s"]
            print(f"cluster {c} stage {runner.assignment.stage}: {rounds} rounds (x{len(averager._segments)} "
                  f"rings) of {metrics['avg_round_s']:.3f}s, "
                  f"{inside} steps inside them, stall {stall:.1%}, utilization {metrics['utilization']:.2f}")
            assert rounds >= 3 and metrics["avg_rounds"] == len(averager.history)
            assert inside >= max(1, rounds // 4), "training must go on while averaging rounds are in flight"
            assert stall < 0.5


@pytest.mark.parametrize("averaging,optimizer,cluster_ranges", [
    ({"strategy": "dadam", "topology": "one-peer-exp", "every": 1},
     {"name": "AccumAdam", "kwargs": {"lr": 1e-3, "accumulation": 2}}, [[(0, 4)]] * 4),
    ({"strategy": "dsgd", "topology": "ring", "every": 2}, {"name": "Adam", "kwargs": {"lr": 1e-3}}, CLUSTER_RANGES),
], ids=["dadam-4-replicas-one-peer-exp", "dsgd-3-cuts-ring"])
def test_gossip_strategies_train_with_their_neighbours_and_end_identical(reference, averaging, optimizer,
                                                                          cluster_ranges) -> None:
    spec = job(averaging, optimizer, eval_every=50)
    clusters = train(spec, cluster_ranges)
    accuracies = [c["metrics"]["test_accuracy"] for c in clusters]
    print(f"\n{averaging} with {optimizer['name']}: test accuracy {accuracies} vs reference "
          f"{reference['test_accuracy']:.4f}")
    assert min(accuracies) >= reference["test_accuracy"] - 0.03
    assert_identical(clusters)  # finish() leaves the exact global average everywhere
    # the evaluations during the run are of the global average too: every cluster evaluated the same model
    periodic = [[h["test_accuracy"] for h in c["history"][-1] if "test_accuracy" in h] for c in clusters]
    print(f"evaluations per cluster (steps 50, 100, 150, then the final report): {periodic}")
    assert len(periodic[0]) >= 3 and all(p == periodic[0] for p in periodic)
    for cluster in clusters:
        for averager, metrics in zip(cluster["averagers"], cluster["stages"]):
            # every round mixed (counted per segment the stage holds), none skipped
            assert metrics["avg_rounds"] == STEPS // averaging["every"] * len(averager._segments)
            assert metrics["avg_stall_s"] < 0.5 * metrics["elapsed_s"]


def test_dear_updates_are_synchronous_data_parallel_sgd() -> None:
    """4 single-node clusters with "dear": after the run every replica's parameters equal one model
    trained by synchronous data-parallel SGD with momentum, each step on the mean gradient of the four
    shards' batches (two micro-batches each: the reduce-scatters start inside the backward of the
    step's second one), up to float reordering."""
    steps = 12
    spec = JobSpec.model_validate({
        "model": {"name": "cnn"}, "dataset": {"name": "digits"},
        "training": {"steps": steps, "batch_size": 16, "accumulation": 2, "seed": 0, "staleness": "none",
                     "optimizer": {"name": "SGD", "kwargs": {"lr": 0.05, "momentum": 0.9}}},
        "averaging": {"strategy": "dear", "fusion_mb": 0.02}})  # several groups even for this small model
    clusters = train(spec, [[(0, 4)]] * 4)
    for cluster in clusters:
        assert cluster["stages"][0]["avg_rounds"] == steps

    model_spec = build_model(spec.model.name, spec.model.config)
    model = model_spec.full_model(seed=spec.training.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dataset = load_dataset(spec.dataset)
    batches = [dataset.shard(c, 4).batches(16, seed=data_seed(spec.training.seed, cluster["runners"][0].assignment))
               for c, cluster in enumerate(clusters)]
    for _ in range(steps):
        optimizer.zero_grad()
        for shard in batches:
            for _ in range(2):
                x, y = next(shard)
                (model_spec.loss(model(x), y) / 8).backward()  # mean over 4 shards x 2 micro-batches
        optimizer.step()
    expected = dict(model.named_parameters())
    for cluster in clusters:
        for key, value in cluster["state_dict"].items():
            if key in expected:
                torch.testing.assert_close(value, expected[key].detach(), rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("backend", ["grpc", "torch"])
def test_dear_keeps_differently_cut_pipelines_equal(reference, backend) -> None:
    """Clusters cut 1, 2 and 2 ways: every stage averages its segments' gradients every step and all
    clusters end with the same weights, learning at least as well as the single process; over the
    peer wire or over gloo (backend "torch")."""
    spec = job({"strategy": "dear", "backend": backend}, {"name": "Adam", "kwargs": {"lr": 1e-3}})
    clusters = train(spec, CLUSTER_RANGES)
    accuracies = [c["metrics"]["test_accuracy"] for c in clusters]
    print(f"\ndear over {backend}, 3 cuts: test accuracy {accuracies} vs reference {reference['test_accuracy']:.4f}")
    assert min(accuracies) >= reference["test_accuracy"] - 0.03
    assert_identical(clusters)


def test_diloco_outer_step_is_sgd_with_nesterov_momentum_on_the_pseudo_gradient() -> None:
    start, delta = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0])
    momentum = torch.zeros(2)
    # first step: m = delta; direction = delta + 0.9 delta
    assert torch.allclose(outer_step(start, delta, momentum, lr=0.7, mu=0.9), start - 0.7 * 1.9 * delta)
    assert torch.equal(momentum, delta)
    second = outer_step(start, delta, momentum, lr=0.7, mu=0.9)  # m = 0.9 delta + delta = 1.9 delta
    assert torch.allclose(second, start - 0.7 * (delta + 0.9 * 1.9 * delta))
    # lr 1 and no momentum: the new start is the replicas' mean, start - mean(start - theta)
    plain = outer_step(start, delta, torch.zeros(2), lr=1.0, mu=0.0)
    assert torch.allclose(plain, start - delta)


@pytest.mark.parametrize("averaging", [
    {"strategy": "ring", "every": 10, "robust": "centered_clip"},
    {"strategy": "diloco", "every": 10, "robust": "centered_clip", "codec": "fp16"},
    {"strategy": "dear", "robust": "centered_clip", "fusion_mb": 0.05},
    {"strategy": "dsgd", "every": 10, "robust": "centered_clip", "topology": "ring"},
], ids=["ring", "diloco-fp16", "dear", "dsgd"])
def test_honest_replicas_average_robustly_learn_as_with_the_plain_mean_and_nobody_is_named(reference, averaging):
    """Robust rounds (averaging.robust) of 3 differently cut clusters: every round applied (dear: every
    step's gradients, in several groups), no replica named an outlier (one would stop its stage),
    accuracy as the single process, the same final weights."""
    spec = job(averaging, {"name": "Adam", "kwargs": {"lr": 1e-3}})
    clusters = train(spec, CLUSTER_RANGES)
    accuracies = [c["metrics"]["test_accuracy"] for c in clusters]
    print(f"\n{averaging}: test accuracy {accuracies} vs reference {reference['test_accuracy']:.4f}")
    assert min(accuracies) >= reference["test_accuracy"] - 0.03
    assert_identical(clusters)
    for cluster in clusters:
        for averager, metrics in zip(cluster["averagers"], cluster["stages"]):
            rounds = STEPS if averaging["strategy"] == "dear" else STEPS // 10 * len(averager._segments)
            assert metrics["avg_rounds"] == rounds


def test_a_dear_replica_sending_its_gradients_times_minus_1000_is_clipped_then_named() -> None:
    """Robust dear over 4 replicas, one of which flips and scales its gradients from its first step: the
    others' weights stay finite (clipped), and they name it after STRIKES steps in a row (an honest
    replica's odd micro-batch is clipped in one step but not named)."""
    spec = job({"strategy": "dear", "robust": "centered_clip"}, {"name": "Adam", "kwargs": {"lr": 1e-3}})
    kept, averagers = [], []

    def lie(runners) -> None:
        kept.extend(runner for (runner,) in runners)
        averagers.extend(runner.averager for runner in kept)
        averager = averagers[3]
        honest = averager._reduce

        def flipped(segment, group):
            group.flat.mul_(-1000)
            return honest(segment, group)
        averager._reduce = flipped
    with pytest.raises(RuntimeError) as stopped:
        train(spec, [[(0, 4)]] * 4, setup=lie)
    liar = kept[3].assignment.rings[0].members[3].address
    print(f"\n{stopped.value}; steps: {[r.optimizer.steps for r in kept]}")
    assert "far beyond the others'" in str(stopped.value) and liar in str(stopped.value)
    for runner, averager in zip(kept[:3], averagers):
        assert runner.optimizer.steps <= STRIKES + 1
        assert all(bool(torch.isfinite(p).all()) for p in averager.live.values())


def test_a_gossip_neighbour_sending_its_weights_times_minus_1000_is_clipped_then_named() -> None:
    """Robust dsgd over a ring of 4 replicas, one of which sends its weights times -1000 every round: its
    two neighbours clip it (their weights stay finite and of their honest size) and name it after
    STRIKES rounds in a row: the failure they leave their averaging for (a node reports it, naming the
    liar, and the coordinator re-plans without it; here the test stops every stage then)."""
    spec = job({"strategy": "dsgd", "every": 2, "topology": "ring", "robust": "centered_clip"},
               {"name": "SGD", "kwargs": {"lr": 0.05}})
    kept, averagers = [], []

    def left(reason: str) -> None:
        # the coordinator's re-plan, once both neighbours named the liar (the first to may be a round ahead)
        if all(kept[n].averaging.alone_cause is not None for n in (0, 2)) or kept[1].averaging.alone:
            for runner in kept:
                runner.stop("re-planned")

    def lie(runners) -> None:
        kept.extend(runner for (runner,) in runners)
        averagers.extend(runner.averager for runner in kept)
        for runner in kept:
            runner.on_alone = left
        honest = averagers[3]._mix
        averagers[3]._mix = lambda segment, snapshot, round, topology: honest(segment, snapshot * -1000, round,
                                                                              topology)
    with pytest.raises(RuntimeError) as stopped:
        train(spec, [[(0, 4)]] * 4, setup=lie)
    liar = kept[3].assignment.rings[0].members[3].address
    print(f"\n{stopped.value}; left for: {[str(r.averaging.alone_cause) for r in kept]}")
    for neighbour in (0, 2):
        cause = kept[neighbour].averaging.alone_cause
        assert isinstance(cause, RingOutlier) and cause.address == liar, cause
        assert f"{STRIKES} rounds in a row" in str(cause)
        assert all(bool(torch.isfinite(p).all()) and float(p.abs().max()) < 100
                   for p in averagers[neighbour].live.values())


@pytest.mark.parametrize("averaging,cluster_ranges", [
    ({"strategy": "diloco", "every": 10, "codec": "int8"}, [[(0, 4)]] * 4),
    ({"strategy": "diloco", "every": 10, "codec": "fp16", "streaming": True}, CLUSTER_RANGES),
    ({"strategy": "diloco", "every": 10, "codec": "topk"}, [[(0, 4)]] * 4),
], ids=["4-replicas-int8", "3-cuts-fp16-streaming", "4-replicas-topk"])
def test_diloco_trains_with_an_outer_optimizer_and_ends_identical(reference, averaging, cluster_ranges) -> None:
    """H = 10 local Adam steps, then the int8 (fp16) mean pseudo-gradient and one Nesterov outer
    step: the replicas learn as well as the single process and end with the same weights."""
    spec = job(averaging, {"name": "Adam", "kwargs": {"lr": 1e-3}})
    clusters = train(spec, cluster_ranges)
    accuracies = [c["metrics"]["test_accuracy"] for c in clusters]
    print(f"\n{averaging}: test accuracy {accuracies} vs reference {reference['test_accuracy']:.4f}")
    assert min(accuracies) >= reference["test_accuracy"] - 0.03
    assert_identical(clusters)
    replicas = len(cluster_ranges)
    for cluster in clusters:
        for averager, metrics in zip(cluster["averagers"], cluster["stages"]):
            assert metrics["avg_rounds"] == STEPS // 10 * len(averager._segments)  # every round applied
            # against a float32 ring all-reduce, which sends 2 (n - 1) / n x 4 bytes per value
            values = sum(segment.layout.numel for segment in averager._segments) / len(averager._segments)
            fewer = 2 * (replicas - 1) / replicas * 4 * values / metrics["avg_round_bytes"]
            expected = {"int8": 4, "fp16": 2, "topk": 113.8 * 2 / replicas}[averaging["codec"]]
            assert expected * 0.9 <= fewer <= expected * 1.01, (averaging["codec"], fewer)


def test_consensus_distance_from_the_all_reduced_sample() -> None:
    samples = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 2.0])]
    mean = torch.stack(samples).mean(0)
    mean_square = sum(float(s.dot(s)) for s in samples) / 2
    spread = sum(float((s - mean).dot(s - mean)) for s in samples) / 2  # 1.0 around (2, 2)
    assert consensus_distance(mean, mean_square) == pytest.approx(spread / float(mean.dot(mean)))


def test_ada_moves_to_a_denser_graph_while_replicas_drift_and_back_as_they_settle(reference) -> None:
    """Starting at one-peer-exp with the default thresholds, the measured spread early in training is
    above ada_high (a denser graph) and later below ada_low (a sparser one)."""
    spec = job({"strategy": "ada", "every": 1, "topology": "one-peer-exp"}, {"name": "Adam", "kwargs": {"lr": 1e-3}})
    clusters = train(spec, [[(0, 4)]] * 4)
    graphs = [h["avg_graph"] for h in clusters[0]["history"][0] if "avg_graph" in h]
    print(f"\nada: graph on the ladder per report {graphs}, accuracy {clusters[0]['metrics']['test_accuracy']:.4f}")
    assert max(graphs) > 0 and graphs[-1] < max(graphs)  # went denser, then sparser again
    assert all(c["stages"][0]["avg_graph_changes"] == clusters[0]["stages"][0]["avg_graph_changes"] for c in clusters)
    assert min(c["metrics"]["test_accuracy"] for c in clusters) >= reference["test_accuracy"] - 0.03
    assert_identical(clusters)


def test_acid_mixing_keeps_the_sum_and_matches_the_closed_form() -> None:
    x, tilde = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 4.0])
    mix(x, tilde, eta=0.3, tau=2.0)
    e = math.exp(-2 * 0.3 * 2.0)
    assert torch.allclose(x, (1 + e) / 2 * torch.tensor([1.0, -2.0]) + (1 - e) / 2 * torch.tensor([3.0, 4.0]))
    assert torch.allclose(tilde, (1 - e) / 2 * torch.tensor([1.0, -2.0]) + (1 + e) / 2 * torch.tensor([3.0, 4.0]))
    assert torch.allclose(x + tilde, torch.tensor([4.0, 2.0]))  # the mean of x and x~ is kept


def test_acid_on_the_gap_gives_what_the_closed_forms_give() -> None:
    """The strategy keeps d = x~ - x (one pass per event): mixing and a pairwise averaging on (x, d)
    land where `mix` and x~ += alpha~ (x_j - x), x <- (x + x_j) / 2 land."""
    x, tilde, theirs, alpha = torch.tensor([1.0, -2.0]), torch.tensor([3.0, 4.0]), torch.tensor([0.5, 7.0]), 0.8
    reference_x, reference_tilde = x.clone(), tilde.clone()
    mix(reference_x, reference_tilde, eta=0.3, tau=2.0)
    shift, decay = gap_mixing(0.3, tau=2.0)
    gap = tilde - x
    mixed = x + shift * gap
    gap = gap * decay
    assert torch.allclose(mixed, reference_x) and torch.allclose(mixed + gap, reference_tilde)

    dx, dgap = gap_averaging(theirs - mixed, alpha)
    averaged, gap = mixed + dx, gap + dgap
    assert torch.allclose(averaged, (reference_x + theirs) / 2)
    assert torch.allclose(averaged + gap, reference_tilde + alpha * (theirs - reference_x))


@pytest.mark.parametrize("n", [4, 6, 9])
def test_acid_constants_of_a_cycle_match_its_laplacian(n) -> None:
    """L = rate (I - W) on the cycle: lambda_2 = rate (1 - cos(2 pi / n)); neighbours' effective
    resistance in L is 2 (n - 1) / (rate n), so chi2 = (n - 1) / (rate n)."""
    rate = 2.0
    chi1 = 1 / (rate * (1 - math.cos(2 * math.pi / n)))
    chi2 = (n - 1) / (rate * n)
    eta, alpha = acid_constants("ring", n, rate)
    assert eta == pytest.approx(0.5 / math.sqrt(chi1 * chi2)) and alpha == pytest.approx(0.5 * math.sqrt(chi1 / chi2))


def test_acid_matchings_pair_both_ends_of_every_event() -> None:
    for topology, n in [("ring", 4), ("ring", 5), ("ring", 6), ("exponential", 8)]:
        for event in range(6):
            for i in range(n):
                j = partner(topology, i, n, event)
                assert j is None or (partner(topology, j, n, event) == i and j in neighbours(topology, i, n))


@pytest.mark.parametrize("strategy", ["acid", "dsgd"])
def test_acid_keeps_fast_replicas_busy_beside_a_3x_slower_one(reference, strategy) -> None:
    """One of 4 replicas sleeps twice its own step's time after every step (3x slower). With acid the
    other three keep their pace (communication waits, computation does not); with dsgd every round
    waits for the slow one. Both learn and end with the same weights."""
    spec = job({"strategy": strategy, "every": 1, "topology": "ring"}, {"name": "Adam", "kwargs": {"lr": 1e-3}})

    def slow_down(runners) -> None:
        optimizer = runners[3][0].optimizer
        step, last = optimizer.step, [time.perf_counter()]

        def three_times_slower(*args, **kwargs):
            step(*args, **kwargs)
            now = time.perf_counter()
            time.sleep(2 * (now - last[0]))
            last[0] = time.perf_counter()
        optimizer.step = three_times_slower
    clusters = train(spec, [[(0, 4)]] * 4, setup=slow_down)
    elapsed = [c["runners"][0].clock.steps[-1][0] - c["runners"][0].clock.started for c in clusters]
    fast = max(elapsed[:3])
    print(f"\n{strategy}: seconds to the last step per replica {[round(e, 2) for e in elapsed]}, "
          f"accuracy {[round(c['metrics']['test_accuracy'], 4) for c in clusters]}")
    if strategy == "acid":
        assert elapsed[3] >= 1.7 * fast  # the fast ones did not wait for the slow one (about 2.4x measured)
    else:
        assert elapsed[3] <= 1.3 * fast  # synchronous rounds: everyone at the slow one's pace
    assert min(c["metrics"]["test_accuracy"] for c in clusters) >= reference["test_accuracy"] - 0.03
    assert_identical(clusters)


def test_stages_train_alone_when_averaging_fails_or_they_are_told_to() -> None:
    """A job being re-planned around a loss elsewhere: at step 50 replica 1's averaging fails under it
    (its group member is closed) and replica 0 is told to train alone (the coordinator's `train_alone`).
    Both leave their averaging and train on instead of failing, each telling its node why once, for as
    many steps as the averaging lets replicas drift apart (`every`: 20), then stop to hand in."""
    spec = job({"every": 20}, {"name": "Adam", "kwargs": {"lr": 1e-3}})
    told: dict[int, list[str]] = {0: [], 1: []}
    kept = []

    def fail_at_step_50(runners) -> None:
        kept.extend(runner for (runner,) in runners)
        for cluster, runner in enumerate(kept):
            runner.on_alone = told[cluster].append
        optimizer = kept[1].optimizer
        step = optimizer.step

        def step_and_fail(*args, **kwargs):
            step(*args, **kwargs)
            if optimizer.steps == 50:
                kept[1].averager.abort()  # what a peer that vanished leaves behind
                assert kept[0].train_alone("the job is being re-planned")
        optimizer.step = step_and_fail
    with pytest.raises(RuntimeError) as stopped:
        train(spec, [[(0, 4)]] * 2, setup=fail_at_step_50)
    assert isinstance(stopped.value.__cause__, TrainedAlone), stopped.value
    assert told[0] == ["the job is being re-planned"] and kept[0].alone == told[0][0]
    assert len(told[1]) == 1 and told[1][0].startswith("averaging failed: ") and "closed" in told[1][0]
    for runner in kept:  # each stopped 20 steps after it left (replica 1 at its next round), long before the end
        assert runner.averager is None and runner.metrics()["training_alone"] == 1.0
        assert runner.optimizer.steps == runner.averaging.alone_until and 20 + 20 < runner.optimizer.steps <= 70 + 20


def test_a_replica_without_averaging_trains_alone_to_the_end_when_told() -> None:
    """Strategy none: nothing to leave, and no drift to bound; told to train alone, it says so and trains
    on until its node stops it (here: to the end)."""
    clusters = train(job({"strategy": "none"}), [[(0, 4)]] * 2,
                     setup=lambda runners: [r.train_alone("re-planned") for (r,) in runners])
    for c in clusters:
        assert c["runners"][0].alone == "re-planned" and c["runners"][0].optimizer.steps == STEPS


def test_a_strategy_that_applies_the_update_cannot_be_left() -> None:
    """DeAR's all-gather lands the optimizer's update: leaving it would lose updates, so the stage
    refuses to train alone (its node hands in its state instead)."""
    spec = job({"strategy": "dear"})
    answers = []
    clusters = train(spec, [[(0, 4)]] * 2,
                     setup=lambda runners: answers.extend(r.train_alone("re-planned") for (r,) in runners))
    assert answers == [False, False]
    assert all(not c["runners"][0].alone for c in clusters)
    assert_identical(clusters)
