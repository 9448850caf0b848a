"""Gossip topologies: every mixing matrix keeps the mean, and repeated rounds reach it."""
from __future__ import annotations

import pytest
import torch

from ravnest.averaging.topology import TOPOLOGIES, circulant, mixing_matrix, mixing_row, sends_to


def product(topology: str, size: int, rounds: int) -> torch.Tensor:
    """W(rounds - 1) ... W(1) W(0): what `rounds` mixing rounds do to the members' vectors."""
    total = torch.eye(size, dtype=torch.float64)
    for t in range(rounds):
        total = torch.tensor(mixing_matrix(topology, size, t), dtype=torch.float64) @ total
    return total


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("size", range(1, 10))
def test_every_round_is_doubly_stochastic(topology: str, size: int) -> None:
    for t in range(6):
        w = torch.tensor(mixing_matrix(topology, size, t), dtype=torch.float64)
        assert (w >= 0).all()
        assert torch.allclose(w.sum(dim=1), torch.ones(size, dtype=torch.float64))  # a weighted mean
        assert torch.allclose(w.sum(dim=0), torch.ones(size, dtype=torch.float64))  # keeps the group's mean
        for i in range(size):  # whom i sends to is exactly who hears i
            assert set(sends_to(topology, i, size, t)) == {j for j in range(size) if j != i and w[j, i] > 0}


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("size", [2, 3, 5, 8, 9])
def test_repeated_rounds_reach_the_average(topology: str, size: int) -> None:
    x = torch.randn(size, 4, dtype=torch.float64)
    mixed = product(topology, size, 200) @ x  # a ring of 9 contracts by 0.84 a round
    assert torch.allclose(mixed, x.mean(dim=0).expand_as(x), atol=1e-6)


def test_one_peer_exponential_averages_exactly_in_log2_n_rounds() -> None:
    for size in (2, 4, 8, 16):
        rounds = size.bit_length() - 1
        assert torch.allclose(product("one-peer-exp", size, rounds), torch.full((size, size), 1 / size,
                                                                                dtype=torch.float64))
    assert mixing_row("one-peer-exp", 5, 8, round=2) == {5: 0.5, 1: 0.5}  # hears 5 - 2^2


def test_shapes_of_the_static_graphs() -> None:
    assert mixing_row("ring", 0, 5) == pytest.approx({4: 1 / 3, 0: 1 / 3, 1: 1 / 3})
    assert mixing_row("complete", 2, 4) == pytest.approx({j: 0.25 for j in range(4)})
    assert set(mixing_row("torus", 0, 9)) == {0, 6, 3, 2, 1}  # a 3 x 3 grid
    assert set(mixing_row("exponential", 0, 8)) == {0, 7, 6, 4}  # 0 - 1, 0 - 2, 0 - 4
    assert mixing_row("alternating-exp-ring", 3, 8, round=1) == mixing_row("ring", 3, 8)


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown topology 'star'; choose one of complete, ring"):
        mixing_row("star", 0, 4)
    with pytest.raises(ValueError, match="rank 4 outside a group of 4"):
        mixing_row("ring", 4, 4)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_circulant_says_whether_every_member_hears_the_same_rank_offsets(topology: str) -> None:
    for size in range(1, 13):
        for t in range(4):
            offsets = {frozenset((j - i) % size for j in mixing_row(topology, i, size, t)) for i in range(size)}
            assert circulant(topology, size, t) == (len(offsets) == 1), (size, t)
