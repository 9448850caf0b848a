"""Ring collectives and the "ring" averaging strategy, with every member a PeerServer on 127.0.0.1 in
this process; the strategy registry."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import pytest
import torch
from prometheus_client import REGISTRY
from torch import nn

from ravnest.averaging import (AveragingStrategy, RingError, RingMember, RingTimeout, StageContext, StrategyError,
                               available_strategies, balanced_shares, canonical_keys, make_strategy,
                               reference_average, reference_mean, register_strategy, ring_link_loads,
                               ring_time_bound, segment_rings, share_bounds)
from ravnest.averaging import registry as registry_module
from ravnest.averaging.strategies.ring import RingAveraging
from ravnest.averaging.signatures import public_key
from ravnest.averaging.torch_group import TorchMember
from ravnest.spec import (AveragingSettings, DatasetRef, ModelRef, Ring, StageAssignment, StagePeer,
                          TrainingSettings)
from ravnest.wire import PeerError, PeerServer, Router

TOKEN = "job-token"
WAIT = 60.0  # generous bound on any concurrent call; the rings themselves take well under a second


def run_all(calls: list[Callable[[], object]]) -> list[object]:
    """Run the calls concurrently (one thread each); return results or raised exceptions."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.exception(timeout=WAIT) or f.result() for f in futures]


class Nodes:
    """n routers, each served by its own PeerServer."""

    def __init__(self, n: int):
        self.routers = [Router() for _ in range(n)]
        self.servers = [PeerServer(r, token=TOKEN) for r in self.routers]
        self.addresses = [s.address for s in self.servers]

    def ring(self, **kwargs) -> list[RingMember]:
        kwargs.setdefault("keys", [public_key(TOKEN)] * len(self.routers))  # (one token here: one key for all)
        return [RingMember(i, self.addresses, r, TOKEN, **kwargs) for i, r in enumerate(self.routers)]

    def torch_group(self, segment: int = 0) -> list[TorchMember]:
        return [TorchMember(i, self.addresses, r, TOKEN, segment=segment) for i, r in enumerate(self.routers)]

    def stop(self) -> None:
        for server in self.servers:
            server.stop(0)


@pytest.fixture
def nodes():
    made: list[Nodes] = []

    def make(n: int) -> Nodes:
        made.append(Nodes(n))
        return made[-1]
    yield make
    for n in made:
        n.stop()


def allreduce_all(members: list[RingMember], tensors: list[torch.Tensor], round: int = 0) -> list[torch.Tensor]:
    results = run_all([lambda m=m, t=t: m.allreduce(t, round) for m, t in zip(members, tensors)])
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


# --- the ring --------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_reduce_scatter_then_all_gather_is_the_all_reduce_bit_for_bit(nodes, n):
    """The two halves run apart (as DeAR needs): after the reduce-scatter each member holds the mean
    of its own share, the shares partition the vector, and the all-gather makes the all-reduce."""
    group = nodes(n)
    weights = [1.0 + i for i in range(n)]
    tensors = [torch.randn(50_001) * (i + 1) for i in range(n)]
    whole = allreduce_all(group.ring(chunk_bytes=4096, weights=weights), tensors, round=0)
    members = group.ring(chunk_bytes=4096, weights=weights, segment=1)
    scattered = run_all([lambda m=m, t=t: m.reduce_scatter(t, 1) for m, t in zip(members, tensors)])
    assert not any(isinstance(r, BaseException) for r in scattered), scattered
    expected = reference_mean(tensors)
    owned = sorted(bounds for _, bounds in scattered)
    assert owned[0][0] == 0 and owned[-1][1] == 50_001 and all(a[1] == b[0] for a, b in zip(owned, owned[1:]))
    for buf, (a, b) in scattered:
        assert torch.allclose(buf[a:b], expected[a:b], atol=1e-5)
    gathered = run_all([lambda m=m, buf=buf: m.all_gather(buf, 1) for m, (buf, _) in zip(members, scattered)])
    for result in gathered:
        assert torch.equal(result, whole[0])


def test_exchange_delivers_each_neighbours_vector_by_the_topology(nodes):
    from ravnest.averaging.topology import mixing_row, sends_to
    n = 5
    members = nodes(n).ring(chunk_bytes=4096)
    vectors = [torch.full((10_001,), float(i)) for i in range(n)]
    for round in range(3):  # one-peer-exp: rank i hears i - 2^(round mod 3)
        heard = run_all([lambda m=m, v=v, i=i, r=round: m.exchange(
            v, r, sends_to("one-peer-exp", i, n, r), [j for j in mixing_row("one-peer-exp", i, n, r) if j != i])
            for i, (m, v) in enumerate(zip(members, vectors))])
        for i, got in enumerate(heard):
            assert not isinstance(got, BaseException), got
            source = (i - 2 ** round) % n
            assert list(got) == [source] and torch.equal(got[source], vectors[source])


def _waiting_steps(member: RingMember, round: int, until: Callable[[set[int]], bool]) -> set[int]:
    """The steps of the messages of `round` waiting in the member's mailbox, once `until` holds of
    them (a condition wait, at most WAIT seconds)."""
    box = member.hub.mailbox
    with box._cond:
        steps = lambda: {key[2] for key in box._items if key[1] == round}  # noqa: E731
        assert box._cond.wait_for(lambda: until(steps()), WAIT), steps()
        return steps()


def test_paced_gossip_sends_only_to_members_that_entered_the_round(nodes):
    """Paced, a member's vector leaves only once its receiver has entered the round (it says so with
    a one-element message): a member ahead cannot load a link still carrying the previous round.
    Unpaced, the vector is sent at once and waits in the receiver's mailbox."""
    a, b = nodes(2).ring(chunk_bytes=4096)
    va, vb = torch.full((10_000,), 1.0), torch.full((10_000,), 2.0)
    entered, data = -1 - 2 - 0, -1 - 0  # a's messages: "entered the round", its vector
    with ThreadPoolExecutor(1) as pool:
        ahead = pool.submit(a.exchange, va, 0, [1], [1], paced=True)
        assert _waiting_steps(b, 0, lambda steps: entered in steps) == {entered}
        assert not ahead.done()  # waiting for b to enter, its vector not sent
        heard_b = b.exchange(vb, 0, [0], [0], paced=True)
        heard_a = ahead.result(timeout=WAIT)
        assert torch.equal(heard_a[1], vb) and torch.equal(heard_b[0], va)
        ahead = pool.submit(a.exchange, va, 1, [1], [1])
        assert data in _waiting_steps(b, 1, lambda steps: data in steps)  # unpaced: there before b entered
        b.exchange(vb, 1, [0], [0])
        ahead.result(timeout=WAIT)


def test_paced_gossip_delivers_every_neighbours_vector_on_every_topology(nodes):
    """Paced rounds go neighbour by neighbour, each member in its own order (sources nearest below
    first, targets nearest above); where every member hears the same rank offsets those orders meet,
    so no round waits for ever. A torus of 2 x 3 is not such a graph: it runs unpaced."""
    from ravnest.averaging.topology import TOPOLOGIES, circulant, mixing_row, sends_to
    n = 6
    members = nodes(n).ring(chunk_bytes=4096)
    vectors = [torch.full((5_000,), float(i)) for i in range(n)]
    assert [t for t in TOPOLOGIES if not circulant(t, n)] == ["torus"]
    for index, topology in enumerate(TOPOLOGIES):
        for round in (2 * index, 2 * index + 1):
            hears = [[j for j in mixing_row(topology, i, n, round) if j != i] for i in range(n)]
            heard = run_all([lambda i=i, r=round: members[i].exchange(
                vectors[i], r, sends_to(topology, i, n, r), hears[i], paced=circulant(topology, n, r))
                for i in range(n)])
            for i, got in enumerate(heard):
                assert not isinstance(got, BaseException), (topology, got)
                assert sorted(got) == sorted(hears[i]) and all(torch.equal(got[j], vectors[j]) for j in got)


@pytest.mark.parametrize("n", [2, 3])
def test_the_torch_backend_gives_the_same_collectives_over_gloo(nodes, n):
    """backend "torch": the members meet through a TCPStore whose port travels over the peer wire,
    then gloo runs the all-reduce, its two halves and gossip's exchange, with the ring's results."""
    group = nodes(n)
    members = group.torch_group()
    tensors = [torch.randn(10_007) * (i + 1) for i in range(n)]
    expected = reference_mean(tensors)
    try:
        for result in allreduce_all(members, tensors):
            assert torch.allclose(result, expected, atol=1e-5)
        scattered = run_all([lambda m=m, t=t: m.reduce_scatter(t, 1) for m, t in zip(members, tensors)])
        assert not any(isinstance(r, BaseException) for r in scattered), scattered
        owned = sorted(bounds for _, bounds in scattered)
        assert owned[0][0] == 0 and owned[-1][1] == 10_007 and all(a[1] == b[0] for a, b in zip(owned, owned[1:]))
        for buf, (a, b) in scattered:
            assert torch.allclose(buf[a:b], expected[a:b], atol=1e-5)
        gathered = run_all([lambda m=m, buf=buf: m.all_gather(buf, 1) for m, (buf, _) in zip(members, scattered)])
        assert all(torch.equal(g, gathered[0]) for g in gathered) and torch.allclose(gathered[0], expected, atol=1e-5)
        heard = run_all([lambda m=m, i=i: m.exchange(tensors[i], 2, [(i + 1) % n], [(i - 1) % n])
                         for i, m in enumerate(members)])
        for i, got in enumerate(heard):
            assert not isinstance(got, BaseException), got
            assert list(got) == [(i - 1) % n] and torch.equal(got[(i - 1) % n], tensors[(i - 1) % n])
    finally:
        for member in members:
            member.close()
    with pytest.raises(RingError, match="left the group"):
        members[0].allreduce(tensors[0], 3)


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("numel,chunk_bytes", [(100_003, 4096), (70_001, 4 << 20), (3, 4096), (1, 4), (0, 4096)])
def test_ring_equals_reference_mean(nodes, n, numel, chunk_bytes):
    members = nodes(n).ring(chunk_bytes=chunk_bytes)
    tensors = [torch.randn(numel) * (i + 1) for i in range(n)]
    originals = [t.clone() for t in tensors]
    results = allreduce_all(members, tensors)
    expected = reference_mean(tensors)
    for result in results:
        torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-6)
        assert torch.equal(result, results[0]), "every member must hold the owner's exact bits"
    assert all(torch.equal(t, o) for t, o in zip(tensors, originals)), "inputs must be left untouched"


def test_ring_runs_consecutive_rounds_and_shapes(nodes):
    members = nodes(3).ring(chunk_bytes=1000)
    for round in range(3):
        tensors = [torch.randn(7, 11, 13) for _ in members]
        results = allreduce_all(members, tensors, round)
        torch.testing.assert_close(results[1], reference_mean(tensors).reshape(-1), rtol=1e-6, atol=1e-6)


def test_bandwidth_weighted_shares(nodes):
    weights = [1.0, 3.0, 0.0, 2.0]
    assert share_bounds(12, weights) == [(0, 2), (2, 8), (8, 8), (8, 12)]
    members = nodes(4).ring(weights=weights, chunk_bytes=8192)
    tensors = [torch.randn(50_001) for _ in members]
    for result in allreduce_all(members, tensors):
        torch.testing.assert_close(result, reference_mean(tensors), rtol=1e-6, atol=1e-6)


def test_link_loads_and_balanced_shares():
    for n in (2, 3, 5):
        assert ring_link_loads([1 / n] * n) == pytest.approx([2 * (n - 1) / n] * n)
    # One slow member (links 3->0 and 0->1 at 50, the rest at 200): equal shares load its links
    # with 1.5 S; owning the big share itself brings them to S, the cut bound S / 50.
    links = [50.0, 200.0, 200.0, 50.0]
    shares = balanced_shares(links)
    assert ring_time_bound(1.0, shares, links) == pytest.approx(1 / 50, rel=1e-3)
    assert ring_time_bound(1.0, [1.0] * 4, links) == pytest.approx(1.5 / 50)
    assert balanced_shares([100.0] * 3) == pytest.approx([1 / 3] * 3)
    # links 10^4 to 10^5 times slower than the fastest once underflowed every share to 0 (0/0)
    skewed = balanced_shares([1e9, 1e5, 1e9, 3e4], iterations=200)
    assert sum(skewed) == pytest.approx(1.0) and all(share > 0 for share in skewed)


@pytest.mark.parametrize("codec,tolerance", [("fp16", 2e-3), ("bf16", 2e-2), ("int8", 4e-2)])
def test_codecs_within_tolerance(nodes, codec, tolerance):
    members = nodes(3).ring(codec=codec, chunk_bytes=16384)
    tensors = [torch.randn(20_000) for _ in members]
    expected = reference_mean(tensors)
    scale = float(expected.abs().max())
    for result in allreduce_all(members, tensors):
        assert result.dtype == torch.float32
        error = float((result - expected).abs().max())
        assert 0 < error <= tolerance * scale, f"{codec}: max error {error} vs scale {scale}"


def test_topk_members_all_gather_the_same_mean_and_carry_what_they_left_out(nodes, n=3):
    """Top-k values cannot be summed hop by hop: members all-gather them, every member computes the
    same mean bit for bit (its own vector as the others received it), and what a round left out of
    a vector arrives in later rounds (error feedback): the running mean of the rounds' means
    approaches the true mean of vectors that stay the same."""
    members = nodes(n).ring(codec="topk", chunk_bytes=4 * 5000)  # pieces that are not whole top-k chunks
    tensors = [torch.randn(12_000) for _ in members]
    expected = reference_mean(tensors)
    total, errors = torch.zeros(12_000), {}
    for number in range(256):
        results = allreduce_all(members, tensors, number)
        assert all(torch.equal(r, results[0]) for r in results)
        total += results[0]
        errors[number + 1] = float((total / (number + 1) - expected).norm() / expected.norm())
    print({k: round(v, 3) for k, v in errors.items() if k in (1, 16, 64, 256)})
    assert errors[1] > 0.9 and errors[16] > 0.5  # a round sends 1 value in 64
    assert errors[256] < 0.1 and errors[256] < errors[64] / 2  # the rest follows, later


def test_a_topk_round_sends_over_100_times_fewer_bytes_than_a_float32_all_reduce(nodes):
    """Bytes on the wire (frames, headers included) for one round of 2 members over a vector of 1M values:
    the float32 ring all-reduce sends each member's half twice (4 MB in all per member), top-k 1.56% of
    the values at 17 bits each (36.9 kB)."""
    members = nodes(2).ring()
    vectors = [torch.randn(1 << 20) for _ in members]

    def sent_so_far() -> float:  # by this process: both members
        return sum(REGISTRY.get_sample_value("ravnest_peer_sent_bytes_total", {"peer": a}) or 0.0
                   for a in members[0].addresses)
    sent = {}
    for number, codec in enumerate(["", "topk"]):
        before = sent_so_far()
        results = run_all([lambda m=m, v=v: m.allreduce(v, number, codec=codec) for m, v in zip(members, vectors)])
        assert not any(isinstance(r, BaseException) for r in results), results
        sent[codec] = sent_so_far() - before
    print(f"bytes per round, 2 members, 1M values: float32 {sent['']:,.0f}, topk {sent['topk']:,.0f}: "
          f"{sent[''] / sent['topk']:.1f}x")
    assert sent[""] >= 2 * 4 * (1 << 20)  # every member sends 4 MB
    assert sent[""] / sent["topk"] >= 100


def test_a_ring_refuses_to_sum_top_k_hop_by_hop(nodes):
    member = nodes(2).ring(codec="topk")[0]
    with pytest.raises(ValueError, match="cannot be summed hop by hop"):
        member.reduce_scatter(torch.ones(8), 0)


def test_missing_member_times_out_naming_peer_and_step(nodes):
    net = nodes(3)
    members = net.ring(step_timeout=0.5)
    tensors = [torch.randn(1000) for _ in range(2)]
    results = run_all([lambda m=m, t=t: m.allreduce(t, 7) for m, t in zip(members[:2], tensors)])
    assert all(isinstance(r, RingTimeout) and isinstance(r, TimeoutError) for r in results)
    assert net.addresses[2] in str(results[0]) and "rank 2" in str(results[0])
    assert "round 7" in str(results[0]) and "step" in str(results[0])
    assert "rank 0" in str(results[1])  # member 1 starves because member 0 waits for member 2
    # the failed round leaves nothing behind: a full ring can go on with the next round
    tensors = [torch.randn(1000) for _ in members]
    for result in allreduce_all(members, tensors, 8):
        torch.testing.assert_close(result, reference_mean(tensors), rtol=1e-6, atol=1e-6)


def test_close_abandons_a_running_round_at_once(nodes):
    member = nodes(2).ring(step_timeout=WAIT)[0]  # its peer never joins the round
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(member.allreduce, torch.randn(100), 0)
        with pytest.raises(TimeoutError):
            running.result(timeout=0.3)  # still waiting for the peer
        member.close()
        with pytest.raises(RingError, match="closed"):
            running.result(timeout=5.0)


def test_unreachable_member_is_a_peer_error(nodes):
    net = nodes(2)
    net.servers[1].stop(0)
    member = net.ring(step_timeout=0.5)[0]
    with pytest.raises(PeerError, match=net.addresses[1]):
        member.allreduce(torch.randn(100), 0)


def test_mismatched_vector_lengths_are_a_clear_error(nodes):
    members = nodes(2).ring(step_timeout=2.0)
    results = run_all([lambda: members[0].allreduce(torch.randn(100), 0),
                       lambda: members[1].allreduce(torch.randn(120), 0)])
    assert any(isinstance(r, RingError) and "same blocks" in str(r) for r in results)


# --- canonical layout -------------------------------------------------------------------------------

def test_canonical_keys_sort_by_global_block_then_state_dict_order():
    state = {"10.weight": torch.zeros(1), "2.bias": torch.zeros(1), "2.weight": torch.zeros(1),
             "9.running_mean": torch.zeros(1), "9.num_batches_tracked": torch.tensor(3)}
    assert canonical_keys(state) == ["2.bias", "2.weight", "9.running_mean", "10.weight"]
    assert canonical_keys(state, (3, 10)) == ["9.running_mean"]


# --- the ring strategy across clusters with different cut points ----------------------------------------

def make_blocks(seed: int) -> list[nn.Module]:
    """Six blocks (one without parameters), BatchNorm buffers perturbed so replicas differ."""
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()),
              nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)),
              nn.ReLU(),
              nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 16)),
              nn.Sequential(nn.BatchNorm1d(16), nn.ReLU()),
              nn.Linear(16, 10)]
    with torch.no_grad():
        for block in blocks:
            for name, buffer in block.named_buffers():
                if buffer.is_floating_point():
                    buffer.uniform_(0.5, 2.0)
    return blocks


class Stage:
    """One node: the live state of its block range, a server and an averager."""

    def __init__(self, blocks: list[nn.Module], cut: tuple[int, int]):
        self.cut = cut
        self.live = {f"{i}.{k}": v for i in range(*cut) for k, v in blocks[i].state_dict(keep_vars=True).items()}
        # stands in for StageRunner.optimizer_tensors(): Adam-like moments, different in every replica
        self.optimizer_state = {f"{k}:{name}": torch.randn_like(v) for k, v in self.live.items()
                                if isinstance(v, nn.Parameter) for name in ("exp_avg", "exp_avg_sq")}
        # stands in for weight prediction's earlier weights (two versions, as with `predict2`)
        self.history = [{k: v.detach() + offset for k, v in self.live.items() if isinstance(v, nn.Parameter)}
                        for offset in (0.1, -0.2)]
        self.router = Router()
        self.server = PeerServer(self.router, token=TOKEN)
        self.averager: RingAveraging | None = None


def build_job(cluster_ranges: list[list[tuple[int, int]]], every: int = 1,
              averaging: AveragingSettings | None = None,
              weights: list[float] | None = None) -> list[list[Stage]]:
    averaging = averaging or AveragingSettings(every=every)
    clusters = [[Stage(make_blocks(seed=c), cut) for cut in ranges] for c, ranges in enumerate(cluster_ranges)]
    rings = segment_rings(cluster_ranges)
    for c, stages in enumerate(clusters):
        for s, stage in enumerate(stages):
            mine = [Ring(segment=seg, blocks=blocks,
                         members=[StagePeer(node_id=f"c{k}s{holder}", address=clusters[k][holder].server.address)
                                  for k, holder in enumerate(holders)], weights=weights)
                    for seg, (blocks, holders) in enumerate(rings) if holders[c] == s]
            assignment = StageAssignment(
                job_id="job", token=TOKEN, cluster=c, num_clusters=len(cluster_ranges), stage=s,
                num_stages=len(stages), blocks=stage.cut, model=ModelRef(name="test"),
                dataset=DatasetRef(name="digits"), training=TrainingSettings(),
                averaging=averaging, rings=mine)
            context = StageContext(assignment, stage.router, stage.live,
                                   optimizer_state=lambda stage=stage: stage.optimizer_state,
                                   companions=lambda stage=stage: stage.history)
            stage.averager = RingAveraging(context, step_timeout=20.0)
    return clusters


def replica_state(stages: list[Stage]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for stage in stages for k, v in stage.live.items()}


def close_job(clusters: list[list[Stage]]) -> None:
    for stage in (s for stages in clusters for s in stages):
        stage.averager.close()
        stage.server.stop(0)


def all_stages(clusters: list[list[Stage]]) -> list[Stage]:
    return [s for stages in clusters for s in stages]


def check(results: list[object]) -> None:
    for r in results:
        if isinstance(r, BaseException):
            raise r


JOBS = {
    2: [[(0, 2), (2, 6)], [(0, 6)]],
    3: [[(0, 1), (1, 3), (3, 6)], [(0, 4), (4, 6)], [(0, 6)]],
    5: [[(0, 3), (3, 6)], [(0, 1), (1, 2), (2, 4), (4, 5), (5, 6)], [(0, 6)], [(0, 5), (5, 6)],
        [(0, 2), (2, 6)]],
}


@pytest.mark.parametrize("num_clusters", [2, 3, 5])
def test_finish_sets_every_replica_to_the_average(num_clusters):
    clusters = build_job(JOBS[num_clusters])
    try:
        before = [replica_state(stages) for stages in clusters]
        expected = reference_average(before)
        assert not torch.equal(before[0]["1.1.running_var"], before[1]["1.1.running_var"])
        check(run_all([stage.averager.finish for stage in all_stages(clusters)]))
        after = [replica_state(stages) for stages in clusters]
        for state in after:
            for key, value in expected.items():
                torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-6, msg=key)
                assert torch.equal(state[key], after[0][key]), f"{key} differs between clusters"
        assert after[0]["4.0.num_batches_tracked"] == before[0]["4.0.num_batches_tracked"]
    finally:
        close_job(clusters)


def test_round_keeps_local_progress_made_meanwhile():
    clusters = build_job(JOBS[3], every=2)
    try:
        stages = all_stages(clusters)
        for stage in stages:
            stage.averager.after_step(1)  # not due: nothing starts
        snapshots = [replica_state(c) for c in clusters]
        for stage in stages:
            stage.averager.after_step(2)  # due: snapshot now, average in the background
        changes = []
        with torch.no_grad():  # local training during the round
            for c, cluster in enumerate(clusters):
                change = {}
                for stage in cluster:
                    for key, value in stage.live.items():
                        if value.is_floating_point():
                            change[key] = torch.full_like(value, 0.01 * (c + 1))
                            value.add_(change[key])
                changes.append(change)
        check(run_all([stage.averager.flush for stage in stages]))
        expected = reference_average(snapshots)
        for c, cluster in enumerate(clusters):
            state = replica_state(cluster)
            for key, change in changes[c].items():
                torch.testing.assert_close(state[key], expected[key] + change, rtol=1e-6, atol=1e-6, msg=key)
            for stage in cluster:  # weight prediction's earlier weights took the correction, not the progress
                for offset, history in zip((0.1, -0.2), stage.history):
                    for key, value in history.items():
                        torch.testing.assert_close(value, expected[key] + offset, rtol=1e-6, atol=1e-6, msg=key)
    finally:
        close_job(clusters)


def test_periodic_rounds_are_applied_by_later_steps():
    clusters = build_job(JOBS[2], every=2)
    try:
        stages = all_stages(clusters)
        expected = reference_average([replica_state(c) for c in clusters])
        for stage in stages:
            stage.averager.after_step(2)
        for stage in stages:
            # wait for the background round (the test's only look inside), then a step that is not
            # due applies it without blocking
            for segment in stage.averager._segments:
                segment.running.result(timeout=WAIT)
            stage.averager.after_step(3)
            assert all(segment.running is None for segment in stage.averager._segments)
        for c in clusters:
            for key, value in replica_state(c).items():
                torch.testing.assert_close(value, expected[key], rtol=1e-6, atol=1e-6, msg=key)
    finally:
        close_job(clusters)


def test_back_to_back_rounds_on_every_node_then_finish():
    clusters = build_job(JOBS[3], every=1)  # a round due at every step: they queue up behind each other
    try:
        expected = reference_average([replica_state(c) for c in clusters])

        def train(stage: Stage) -> None:
            for step in range(1, 6):
                stage.averager.after_step(step)
            stage.averager.finish()
        check(run_all([lambda s=s: train(s) for s in all_stages(clusters)]))
        after = [replica_state(c) for c in clusters]
        for state in after:
            for key, value in expected.items():
                torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)
                assert torch.equal(state[key], after[0][key]), f"{key} differs between clusters"
    finally:
        close_job(clusters)


def test_rings_outside_the_stage_are_rejected():
    ring = Ring(segment=0, blocks=(2, 4), members=[StagePeer(node_id="a", address="127.0.0.1:1"),
                                                  StagePeer(node_id="b", address="127.0.0.1:2")])
    assignment = StageAssignment(
        job_id="j", token=TOKEN, cluster=0, num_clusters=2, stage=0, num_stages=2, blocks=(0, 3),
        model=ModelRef(name="test"), dataset=DatasetRef(name="digits"), training=TrainingSettings(),
        averaging=AveragingSettings(), rings=[ring])
    with pytest.raises(ValueError, match="outside"):
        RingAveraging(StageContext(assignment, Router(), {}))


def test_strategy_is_none_without_work():
    base = dict(job_id="j", token=TOKEN, cluster=0, stage=0, num_stages=1, blocks=(0, 2),
                model=ModelRef(name="test"), dataset=DatasetRef(name="digits"), training=TrainingSettings())
    ring = Ring(segment=0, blocks=(0, 2), members=[StagePeer(node_id="a", address="127.0.0.1:1"),
                                                  StagePeer(node_id="b", address="127.0.0.1:2")])
    alone = StageAssignment(num_clusters=1, averaging=AveragingSettings(), **base)
    off = StageAssignment(num_clusters=2, averaging=AveragingSettings(strategy="none"), rings=[ring], **base)
    assert make_strategy(StageContext(alone, Router(), {})) is None
    assert make_strategy(StageContext(off, Router(), {})) is None
    two = StageAssignment(num_clusters=2, averaging=AveragingSettings(), rings=[ring], **base)
    router = Router()
    strategy = make_strategy(StageContext(two, router, {}))
    try:
        assert isinstance(strategy, RingAveraging) and strategy.name == "ring"
    finally:
        strategy.close()


def test_strategies_register_by_name_and_unknown_names_are_refused_with_the_known_ones(monkeypatch):
    monkeypatch.setattr(registry_module, "_REGISTRY", registry_module._REGISTRY.copy())  # undone after the test
    assert {"none", "auto", "ring", "dsgd", "dadam", "dear", "diloco", "ada", "acid"} <= set(available_strategies())
    with pytest.raises(ValueError, match=r"unknown averaging strategy 'gossip'; known: acid, ada, auto, dadam, dear, diloco, dsgd, none, ring"):
        AveragingSettings(strategy="gossip")
    with pytest.raises(StrategyError, match="reserved"):
        register_strategy("none")

    @register_strategy("test-recorder")
    class Recorder(AveragingStrategy):
        name = "test-recorder"

        def __init__(self, context: StageContext):
            self.context = context

    assert "test-recorder" in available_strategies()
    assert AveragingSettings(strategy="test-recorder").strategy == "test-recorder"


def test_ring_weights_reach_the_members_and_the_average_is_unchanged():
    weights = [1.0, 3.0, 2.0]
    clusters = build_job(JOBS[3], weights=weights)
    try:
        assert all(seg.member.weights == weights for stage in all_stages(clusters) for seg in stage.averager._segments)
        expected = reference_average([replica_state(c) for c in clusters])
        check(run_all([stage.averager.finish for stage in all_stages(clusters)]))
        for cluster in clusters:
            for key, value in replica_state(cluster).items():
                torch.testing.assert_close(value, expected[key], rtol=1e-6, atol=1e-6, msg=key)
    finally:
        close_job(clusters)


@pytest.mark.parametrize("enabled", [True, False])
def test_optimizer_state_is_averaged_only_when_asked(enabled):
    clusters = build_job(JOBS[3], averaging=AveragingSettings(every=1, average_optimizer_state=enabled))
    try:
        before = [{k: v.clone() for s in c for k, v in s.optimizer_state.items()} for c in clusters]
        expected = reference_average(before)
        check(run_all([stage.averager.finish for stage in all_stages(clusters)]))
        for c, cluster in enumerate(clusters):
            for key, value in ((k, v) for s in cluster for k, v in s.optimizer_state.items()):
                target = expected[key] if enabled else before[c][key]
                torch.testing.assert_close(value, target, rtol=1e-6, atol=1e-6, msg=key)
    finally:
        close_job(clusters)


def test_runner_exposes_adam_moments_keyed_by_parameter():
    from ravnest.pipeline.local import make_assignments
    from ravnest.pipeline.stage import StageRunner
    from ravnest.spec import JobSpec

    job = JobSpec.model_validate({"model": {"name": "mlp", "config": {"depth": 1}}, "dataset": {"name": "digits"}})
    assignment = make_assignments(job, [(0, 3)], ["127.0.0.1:9"], TOKEN)[0]
    runner = StageRunner(assignment, Router())
    assert runner.optimizer_tensors() == {}  # Adam creates its state at the first step
    x, y = next(runner.feed.batches)
    runner._loss(runner.module(x), y).backward()
    assert runner.optimizer.micro_batch_done()
    tensors = runner.optimizer_tensors()
    params = dict(runner.module.named_parameters())
    assert set(tensors) == {f"{k}:{name}" for k in params for name in ("exp_avg", "exp_avg_sq")}
    assert all(t.shape == params[k.split(":")[0]].shape for k, t in tensors.items())
    assert tensors is not runner.optimizer_tensors() and all(  # live: the optimizer's own tensors
        t is runner.optimizer.optimizer.state[params[k.split(":")[0]]][k.split(":")[1]] for k, t in tensors.items())


def test_rounds_every_few_seconds_agree_across_clusters_of_unequal_speed():
    """Clusters step at different rates and for different counts within the same time; they still
    run the same rounds on every ring, never wait on a round a peer will not start, and end equal."""
    clusters = build_job(JOBS[3], averaging=AveragingSettings(every_seconds=0.05))
    try:
        def train(stage: Stage, cluster: int) -> None:
            pause, steps = [(0.004, 60), (0.01, 30), (0.03, 8)][cluster]
            for step in range(1, steps + 1):
                with torch.no_grad():
                    for value in stage.live.values():
                        if value.is_floating_point():
                            value.add_(0.001 * (cluster + 1))
                stage.averager.after_step(step)
                time.sleep(pause)
            stage.averager.finish()
        check(run_all([lambda s=s, c=c: train(s, c) for c, cluster in enumerate(clusters) for s in cluster]))
        after = [replica_state(c) for c in clusters]
        for state in after[1:]:
            for key, value in state.items():
                assert torch.equal(value, after[0][key]), f"{key} differs between clusters"
        rounds: dict[int, set[tuple[int, ...]]] = {}
        for stage in all_stages(clusters):
            for segment in {r.segment for r in stage.averager.history}:
                numbers = tuple(r.number for r in stage.averager.history if r.segment == segment)
                assert numbers == tuple(range(len(numbers))), "rounds run in order, none skipped"
                rounds.setdefault(segment, set()).add(numbers)
        assert all(len(variants) == 1 for variants in rounds.values()), rounds  # same rounds on every member
        assert min(len(next(iter(v))) for v in rounds.values()) >= 2  # periodic rounds did happen
        assert all(stage.averager.metrics()["avg_rounds"] >= 2 for stage in all_stages(clusters))
    finally:
        close_job(clusters)


def test_a_ring_chunk_holding_nan_is_refused_and_never_averaged_in(nodes) -> None:
    """Member 1's vector holds a NaN: member 0 refuses the chunk that carries it, so the NaN never
    reaches member 0's average; its round fails at once (not at the step timeout), naming member 1 as
    the sender, a failure of kind nan about that peer (member 1's NaN is its own)."""
    from ravnest.averaging.collectives import RingRefused
    from ravnest.failures import FailureKind, classify

    group = nodes(2)
    members = group.ring(step_timeout=30.0)
    poisoned = torch.ones(1000)
    poisoned[17] = float("nan")
    started = time.monotonic()
    results = run_all([lambda: members[0].allreduce(torch.ones(1000), 0),
                       lambda: members[1].allreduce(poisoned, 0)])
    assert isinstance(results[0], RingRefused) and time.monotonic() - started < 10, results[0]
    assert f"{group.addresses[1]} (rank 1) sent values that are not finite; refused" in str(results[0])
    failure = classify(results[0], {group.addresses[1]: "sender-id"})
    assert (failure.kind, failure.peer_id) == (FailureKind.NAN, "sender-id")


@pytest.mark.parametrize("order", [[0, 2, 1, 3], [3, 1, 0, 2]])
def test_a_ring_in_another_order_gives_the_same_mean_and_shares_that_partition_the_vector(nodes, order):
    """Members pass shares around `order` (the planner's widest-slowest-link ring), not by index."""
    group = nodes(4)
    weights = [1.0, 2.0, 3.0, 4.0]  # in ring order
    members = group.ring(chunk_bytes=4096, weights=weights, order=order)
    assert [m.addresses.index(m._next) for m in members] == [order[(order.index(i) + 1) % 4] for i in range(4)]
    tensors = [torch.randn(30_001) * (i + 1) for i in range(4)]
    for result in allreduce_all(members, tensors):
        torch.testing.assert_close(result, reference_mean(tensors), rtol=1e-6, atol=1e-6)
    scattered = run_all([lambda m=m, t=t: m.reduce_scatter(t, 1) for m, t in zip(members, tensors)])
    owned = sorted(bounds for _, bounds in scattered)
    assert owned[0][0] == 0 and owned[-1][1] == 30_001 and all(a[1] == b[0] for a, b in zip(owned, owned[1:]))
    run_all([lambda m=m, buf=buf: m.all_gather(buf, 1) for m, (buf, _) in zip(members, scattered)])
    with pytest.raises(ValueError, match="not an order"):
        RingMember(0, group.addresses, group.routers[0], TOKEN, order=[0, 1, 1, 2])


def test_a_chunk_for_a_segment_this_node_joins_a_moment_later_waits_for_it():
    """A peer's first round can reach a node that is still setting up its rings, one segment at a time
    (CI once saw 'no ring for segment 2 on this node' re-plan a healthy job): the chunk is held, bounded,
    and handed over when the segment joins; one past the bound is refused as before."""
    from ravnest.averaging.collectives import EARLY_BYTES, KIND, TENSOR, RingHub
    from ravnest.wire import Message, WireError

    hub = RingHub(Router(), "t")

    def chunk(segment: int, numel: int = 4) -> Message:
        return Message(KIND, tensors={TENSOR: torch.ones(numel)},
                       tags={"segment": segment, "round": 1, "step": 0, "chunk": 0, "numel": numel, "sender": 1})

    hub._deliver(chunk(2), "peer")  # segment 2 is not joined yet
    hub.join(2)
    assert hub.mailbox.take((2, 1, 0, 0), timeout=1)[0] == 4
    with pytest.raises(WireError, match="no ring for segment 3"):
        hub._deliver(chunk(3, EARLY_BYTES // 4 + 1), "peer")
