"""Robust averaging (issue 43): the robust means themselves, and the all-to-all round that runs them over
real peer servers on loopback, with members that lie."""
from __future__ import annotations

import pytest
import torch

from ravnest.averaging import robust
from ravnest.averaging.collectives import RingMember
from ravnest.averaging.robust_round import RingOutlier, robust_allreduce
from ravnest.failures import FailureKind, also_named, classify
from ravnest.spec import AveragingSettings
from ravnest.averaging.signatures import Signatures, digest, public_key
from tests.test_averaging import TOKEN, nodes, run_all  # noqa: F401  (nodes: a fixture, an argument below)


def test_the_worked_example_of_centered_clip():
    stack = torch.tensor([[1.0], [2.0], [3.0], [-1000.0]])
    assert float(robust.centered_clip(stack)) == pytest.approx(1.5, abs=1e-3)
    assert float(robust.median(stack)) == 1.0
    assert float(robust.trimmed_mean(stack)) == pytest.approx(1.5)
    assert robust.outliers(stack, robust.centered_clip(stack)) == [False, False, False, True]


@pytest.mark.parametrize("rule", robust.RULES)
def test_honest_replicas_get_about_their_mean_and_nobody_is_an_outlier(rule):
    torch.manual_seed(0)
    base = torch.randn(1000)
    stack = torch.stack([base + 0.01 * torch.randn(1000) for _ in range(8)])
    center = robust.reducer(rule)(stack)
    spread = (stack - stack.mean(0)).norm(dim=1).max()
    assert (center - stack.mean(0)).norm() <= spread  # within the replicas' own spread of their mean
    assert not any(robust.outliers(stack, center))


@pytest.mark.parametrize("rule", robust.RULES)
@pytest.mark.parametrize("attack", ["sign_flip_x1000", "large_random", "same_lie_by_all_liars"])
@pytest.mark.parametrize("n,f", [(4, 1), (8, 3)])
def test_fewer_than_half_liars_move_the_robust_mean_little_and_are_named(rule, attack, n, f):
    if rule == "trimmed_mean" and f > robust.TRIM * n:
        pytest.skip("a trimmed mean stands only as many liars as it trims")
    torch.manual_seed(1)
    base = torch.randn(2000)
    honest = [base + 0.01 * torch.randn(2000) for _ in range(n - f)]
    lie = {"sign_flip_x1000": lambda x: -1000 * x, "large_random": lambda x: 100 * torch.randn_like(x) * x.norm(),
           "same_lie_by_all_liars": lambda x: -1000 * base}[attack]
    stack = torch.stack(honest + [lie(honest[i % len(honest)]) for i in range(f)])
    center = robust.reducer(rule)(stack)
    honest_mean = torch.stack(honest).mean(0)
    spread = (torch.stack(honest) - honest_mean).norm(dim=1).max()
    assert (center - honest_mean).norm() <= 2 * spread, "the liars moved the mean beyond the honest spread"
    assert robust.outliers(stack, center) == [False] * (n - f) + [True] * f


def test_clipped_gossip_is_the_plain_mix_among_alike_neighbours_and_clips_a_far_one():
    torch.manual_seed(2)
    own = torch.randn(500)
    alike = [own + 0.01 * torch.randn(500) for _ in range(2)]
    weights = [1 / 3, 1 / 3]
    mixed, far = robust.clipped_gossip(own, [a.clone() for a in alike], weights)
    plain = own / 3 + alike[0] / 3 + alike[1] / 3
    assert far == [False, False]
    # the nearer one as it is, the other clipped to its distance: within that of the plain mix
    assert (mixed - plain).norm() <= (alike[1] - alike[0]).norm() / 3 + 1e-6
    lie = -1000 * own
    mixed, far = robust.clipped_gossip(own, [alike[0].clone(), lie.clone()], weights)
    assert far == [False, True]
    assert (mixed - own).norm() <= 2 / 3 * (alike[0] - own).norm() + 1e-6  # the lie moved it no further
    # one neighbour: nobody can tell who is off, and nothing is clipped
    mixed, far = robust.clipped_gossip(own, [lie.clone()], [0.5])
    assert far == [False] and torch.allclose(mixed, (own + lie) / 2)


def test_strikes_name_a_member_only_when_it_was_far_off_in_strikes_rounds_in_a_row():
    strikes = robust.Strikes()
    assert robust.STRIKES == 3
    # twice in a row, then a round without it starts the count over
    assert [strikes.record("a", when) for when in (0, 1, 3, 4)] == [False, False, False, False]
    assert strikes.record("a", 4) is False  # the same round again (another group of dear's step) counts once
    assert strikes.record("a", 5) is True and strikes.record("b", 5) is False  # counted per member


@pytest.mark.parametrize("averaging,words", [
    ({"strategy": "acid", "robust": "centered_clip"}, "is built for .*, not 'acid'"),
    ({"strategy": "ring", "robust": "median", "backend": "torch"}, "takes backend 'grpc'"),
    ({"strategy": "ring", "robust": "mean"}, "robust"),
])
def test_a_robust_setting_that_cannot_run_is_refused_with_the_reason(averaging, words):
    with pytest.raises(ValueError, match=words):
        AveragingSettings.model_validate(averaging)


def robust_all(members: list[RingMember], tensors: list[torch.Tensor], rule: str = "centered_clip", round: int = 0):
    return run_all([lambda m=m, t=t: robust_allreduce(m, t, round, rule) for m, t in zip(members, tensors)])


@pytest.mark.parametrize("n,numel,chunk_bytes,codec", [(3, 10_001, 4096, ""), (4, 70_001, 4 << 20, ""),
                                                      (5, 3, 4096, ""), (4, 10_001, 4096, "bf16")])
def test_a_robust_round_of_honest_members_gives_every_member_the_same_mean(nodes, n, numel, chunk_bytes, codec):
    """Raw, the higher rank of a pair commits on its share's first piece; under a codec, every commitment
    goes alone."""
    members = nodes(n).ring(chunk_bytes=chunk_bytes, codec=codec)
    base = torch.randn(numel)
    tensors = [base + 0.01 * torch.randn(numel) for _ in range(n)]
    originals = [t.clone() for t in tensors]
    results = robust_all(members, tensors)
    assert not any(isinstance(r, BaseException) for r in results), results
    for result in results:
        assert torch.equal(result, results[0]), "every member must hold the owners' exact bits"
    spread = max(float((t - torch.stack(tensors).mean(0)).norm()) for t in tensors)
    assert float((results[0] - torch.stack(tensors).mean(0)).norm()) <= spread
    assert all(torch.equal(t, o) for t, o in zip(tensors, originals)), "inputs must be left untouched"
    # and the next round runs on the same members
    assert not any(isinstance(r, BaseException) for r in robust_all(members, tensors, round=1))


def test_a_member_that_sends_its_weights_times_minus_1000_is_named_by_every_honest_member(nodes):
    members = nodes(4).ring()
    base = torch.randn(5000)
    tensors = [base + 0.01 * torch.randn(5000) for _ in range(3)] + [-1000 * base]
    results = robust_all(members, tensors)
    for result in results[:3]:
        assert isinstance(result, RingOutlier) and result.addresses == (members[3].addresses[3],), result
        assert f"{members[3].addresses[3]} (rank 3, by 3) far beyond" in str(result)
    assert isinstance(results[3], RingOutlier) and results[3].address == members[3].addresses[3]  # itself too


def test_two_liars_of_six_are_both_named_in_the_same_round_and_each_reported(nodes):
    """Every honest member names both liars at once (one report each: failures.also_named), so f liars
    leave in one round rather than f."""
    members = nodes(6).ring()
    base = torch.randn(3000)
    tensors = [base + 0.01 * torch.randn(3000) for _ in range(4)] + [-1000 * base, 50 * torch.randn(3000)]
    results = robust_all(members, tensors)
    liars = (members[0].addresses[4], members[0].addresses[5])
    for result in results[:4]:
        assert isinstance(result, RingOutlier) and result.addresses == liars, result
    peers = {address: f"node-{rank}" for rank, address in enumerate(members[0].addresses)}
    first = classify(results[0], peers)
    assert first.kind == FailureKind.OUTLIER and first.peer_id == "node-4"
    assert [f.peer_id for f in also_named(results[0], peers, first)] == ["node-5"]


@pytest.mark.parametrize("accusers", [{3}, {2, 3}])
def test_one_liar_alone_cannot_convict_an_honest_member_and_half_of_them_can(nodes, monkeypatch, accusers):
    members = nodes(4).ring()
    base = torch.randn(3000)
    tensors = [base + 0.01 * torch.randn(3000) for _ in range(4)]
    send = RingMember._send

    def accusing(self, round, step, chunk, part, *args, **kwargs):  # they vote 1000 times against all others
        if self.rank in accusers and -1 - 4 * self.size >= step > -1 - 5 * self.size:  # its mean, votes at the end
            part = torch.cat([part[:-self.size], 1000.0 * (torch.arange(self.size) != self.rank).float()])
        return send(self, round, step, chunk, part, *args, **kwargs)
    monkeypatch.setattr(RingMember, "_send", accusing)
    results = robust_all(members, tensors)
    if len(accusers) == 1:
        assert not any(isinstance(r, BaseException) for r in results), results
    else:  # 2 of the 3 other owners: a majority, which f < n / 2 liars never are
        assert isinstance(results[0], RingOutlier) and results[0].address == members[0].addresses[0], results


def test_a_share_other_than_the_committed_one_is_a_vote_against_its_sender(nodes, monkeypatch):
    members = nodes(3).ring()
    base = torch.randn(3000)
    tensors = [base + 0.01 * torch.randn(3000) for _ in range(3)]
    send = RingMember._send

    def switching(self, round, step, chunk, part, *args, **kwargs):  # member 2 commits, then sends another share
        if self.rank == 2 and -1 - 3 * self.size >= step > -1 - 4 * self.size:
            part = part.clone()
            part[0] += 1e-3  # (not the commitment that rides on a share to a lower rank)
        return send(self, round, step, chunk, part, *args, **kwargs)
    monkeypatch.setattr(RingMember, "_send", switching)
    results = robust_all(members, tensors)
    assert all(isinstance(r, RingOutlier) and r.address == members[2].addresses[2] for r in results[:2]), results


def test_a_member_that_commits_to_one_member_other_than_to_the_rest_is_named_by_every_honest_member(
        nodes, monkeypatch):
    """The gap signed commitments close: member 0 commits to member 3 (late, as if it had first seen the
    others' shares) to a share other than the one it bound itself to before the rest, and sends 3 that
    share. Member 3 finds nothing wrong with the share; but every owner forwards the commitments it got,
    so each honest member holds two of 0's signatures for one round: the proof."""
    members = nodes(4).ring()
    n, base = 4, torch.randn(4000)
    tensors = [base + 0.01 * torch.randn(4000) for _ in range(n)]
    liar = Signatures(TOKEN, members[0].keys, 0)
    send, shift = RingMember._send, 1e-3

    def two_faced(self, round, step, chunk, part, *args, to=None, **kwargs):
        if self.rank == 0 and to == 3 and step == -1 - 2 * n:  # its commitment to member 3 (alone: 0 < 3)
            digests = part[:32 * n].clone().reshape(n, 32)
            share = torch.tensor_split(tensors[0], n)[3] + shift
            digests[3] = torch.frombuffer(bytearray(digest(share.numpy().data)), dtype=torch.uint8)
            signature = liar.sign(self.segment, round, digest(digests.numpy().data))
            part = torch.cat([digests.reshape(-1), torch.frombuffer(bytearray(signature), dtype=torch.uint8)])
        elif self.rank == 0 and to == 3 and step == -1 - 3 * n:  # the share it committed to for 3
            part = part + shift
        return send(self, round, step, chunk, part, *args, to=to, **kwargs)
    monkeypatch.setattr(RingMember, "_send", two_faced)
    results = robust_all(members, tensors)
    for result in results[1:]:
        assert isinstance(result, RingOutlier) and result.addresses == (members[0].addresses[0],), result
        assert not result.by_vote and "signed two different commitments" in str(result)


def test_an_owner_that_forwards_a_commitment_nobody_signed_frames_nobody(nodes, monkeypatch):
    n = 4
    members = nodes(n).ring()
    base = torch.randn(3000)
    tensors = [base + 0.01 * torch.randn(3000) for _ in range(n)]
    send = RingMember._send

    def forging(self, round, step, chunk, part, *args, **kwargs):  # owner 2 alters member 1's, as it forwards it
        if self.rank == 2 and -1 - 4 * n >= step > -1 - 5 * n:  # its mean, then the commitments, then the votes
            part = part.clone()
            part[-n - 96 // 2 * n + 96 // 2] += 1.0  # the first two bytes of member 1's digest
        return send(self, round, step, chunk, part, *args, **kwargs)
    monkeypatch.setattr(RingMember, "_send", forging)
    results = robust_all(members, tensors)
    assert not any(isinstance(r, BaseException) for r in results), results


def test_a_robust_round_without_its_members_signing_keys_is_refused_with_the_reason(nodes):
    members = nodes(2).ring(keys=None)
    with pytest.raises(ValueError, match="signs its members' commitments"):
        robust_allreduce(members[0], torch.zeros(4), 0, "centered_clip")


def test_a_signing_key_that_is_not_the_members_own_is_refused():
    with pytest.raises(ValueError, match="not this member's"):
        Signatures(TOKEN, [public_key(TOKEN), public_key("another")], 1)
    signatures = Signatures(TOKEN, [public_key(TOKEN), public_key("another")], 0)
    signed = signatures.sign(0, 5, b"x" * 32)
    assert signatures.valid(0, 0, 5, b"x" * 32, signed)
    assert not signatures.valid(0, 0, 6, b"x" * 32, signed), "a signature speaks for its own round only"
    assert not signatures.valid(1, 0, 5, b"x" * 32, signed), "nor for another member"


def test_an_owner_that_sends_a_wrong_mean_of_its_share_is_named_by_the_members_it_sent_it_to(nodes, monkeypatch):
    members = nodes(4).ring()
    base = torch.randn(4000)
    before = [base + 0.01 * torch.randn(4000) for _ in range(4)]
    assert not any(isinstance(r, BaseException) for r in robust_all(members, before, round=0))
    send = RingMember._send

    def lying(self, round, step, chunk, part, *args, **kwargs):  # member 3 sends its mean times -1, to 0 and 1
        to = kwargs.get("to")
        if self.rank == 3 and to in (0, 1) and -1 - 4 * self.size >= step > -1 - 5 * self.size:
            part = torch.cat([-part[:-self.size], part[-self.size:]])
        return send(self, round, step, chunk, part, *args, **kwargs)
    monkeypatch.setattr(RingMember, "_send", lying)
    after = [t + 0.01 * torch.randn(4000) for t in before]  # a round of training later
    results = robust_all(members, after, round=1)
    for result in results[:2]:
        assert isinstance(result, RingOutlier) and result.address == members[3].addresses[3], result
        assert "sent a mean of its share" in str(result)
    assert not isinstance(results[2], BaseException), results[2]  # it got the true mean: nothing to see


def test_honest_replicas_on_shards_by_label_are_not_named_and_a_liar_among_them_is() -> None:
    """Non-iid replicas (each holds one or two digits' examples) drift apart far more than iid ones
    between rounds, all alike: no honest one is named an outlier, and a liar among them still is
    (bench.byzantine --shards by-label measures the same at 8 replicas)."""
    from bench.byzantine import run
    assert run(6, [], None, True, steps=60, every=10, seed=0, by_label=True).detected_at == {}
    assert list(run(6, [5], "sign_flip", True, steps=60, every=10, seed=0, by_label=True).detected_at) == [5]


def test_a_gossip_replica_names_every_neighbour_struck_out_in_the_same_round():
    """dsgd, like a ring's round, names every neighbour far off STRIKES rounds in a row at once (one
    report each), not the first of them a round."""
    from types import SimpleNamespace

    from ravnest.averaging.strategies.dsgd import GossipMixing
    addresses = [f"127.0.0.1:{5000 + j}" for j in range(6)]
    segment = SimpleNamespace(strikes=robust.Strikes(), member=SimpleNamespace(segment=0, addresses=addresses))
    me = SimpleNamespace(rank=0)
    base = torch.randn(1000)
    heard = {1: base + 0.01 * torch.randn(1000), 2: base + 0.01 * torch.randn(1000),
             3: base + 0.01 * torch.randn(1000), 4: -1000 * base, 5: 50 * torch.randn(1000)}
    row = {j: 1 / 6 for j in range(6)}
    outcome = None
    for round in range(robust.STRIKES):
        try:
            GossipMixing._clipped(me, segment, base.clone(), row, heard, round)  # type: ignore[arg-type]
        except RingOutlier as named:
            outcome = round, named
    assert outcome is not None and outcome[0] == robust.STRIKES - 1
    assert outcome[1].addresses == (addresses[4], addresses[5])
    told = also_named(outcome[1], {a: f"node{j}" for j, a in enumerate(addresses)},
                      classify(outcome[1], {a: f"node{j}" for j, a in enumerate(addresses)}, 1))
    assert [f.peer_id for f in told] == ["node5"]


@pytest.mark.parametrize("farther", [6, 50])
def test_of_three_an_honest_replica_farther_off_is_not_named_and_a_liar_is(farther: int):
    """Of 3 contributions the median distance is half the nearer pair's gap: at OUTLIER_RATIO an honest
    third replica 6 gaps away would be named (a 3 x 3 robust ring named one so), and at OUTLIER_RATIO_OF_3
    one 50 gaps away, whose shard holds harder examples (a 4,000-step digits job named one so); but it
    lies within the weights' norm, and liars lie far beyond it."""
    torch.manual_seed(0)
    base = torch.randn(1000)
    step = 0.01 * torch.randn(1000)
    honest = torch.stack([base, base + step, base + farther * step])
    assert robust.outliers(honest, robust.centered_clip(honest)) == [False, False, False]
    for lie in (-1000 * base, base + 100 * base.norm() * torch.nn.functional.normalize(torch.randn(1000), dim=0)):
        lying = torch.stack([base, base + step, lie])
        assert robust.outliers(lying, robust.centered_clip(lying)) == [False, False, True]
