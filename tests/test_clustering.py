"""Clustering: k-means over log-bandwidth/compute/memory finds the tiers, then repairs memory."""
from __future__ import annotations

import time

import numpy as np
import pytest

from coordinator.clustering import ClusteringError, NodeInfo, cluster_nodes

GIB = 1 << 30
# (flops, memory, bandwidth): three tiers that differ by 10-100x in compute and bandwidth
TIERS = {"fast": (2e13, 16 * GIB, 1e9), "mid": (1e12, 8 * GIB, 1e8), "slow": (5e10, 4 * GIB, 1e7)}


def tiered(counts: dict[str, int], seed: int = 0, memory: dict[str, int] | None = None) -> list[NodeInfo]:
    rng = np.random.default_rng(seed)
    nodes = []
    for tier, count in counts.items():
        flops, mem, bandwidth = TIERS[tier]
        mem = (memory or {}).get(tier, mem)
        for i in range(count):
            j = rng.lognormal(0, 0.1, 3)
            nodes.append(NodeInfo(f"{tier}{i}", flops * j[0], int(mem * j[1]), bandwidth * j[2]))
    return nodes


def tier_sets(nodes: list[NodeInfo], groups: list[list[int]]) -> set[frozenset[str]]:
    return {frozenset(nodes[i].node_id.rstrip("0123456789") for i in g) for g in groups}


def test_three_obvious_tiers_land_in_three_clusters() -> None:
    nodes = tiered({"fast": 6, "mid": 9, "slow": 12})
    groups = cluster_nodes(nodes, memory_need=GIB)
    assert len(groups) == 3
    assert tier_sets(nodes, groups) == {frozenset({"fast"}), frozenset({"mid"}), frozenset({"slow"})}
    assert sorted(len(g) for g in groups) == [6, 9, 12]
    assert sorted(i for g in groups for i in g) == list(range(len(nodes)))


def test_similar_nodes_form_one_cluster() -> None:
    nodes = tiered({"mid": 12})
    assert cluster_nodes(nodes, memory_need=GIB) == [list(range(12))]


def test_a_cluster_too_small_in_memory_is_merged_into_its_nearest_neighbour() -> None:
    # 3 slow nodes of 1 GiB cannot hold a 5 GiB model; the slow tier is nearer to "mid" than to "fast"
    nodes = tiered({"fast": 6, "mid": 6, "slow": 3}, memory={"slow": GIB})
    groups = cluster_nodes(nodes, memory_need=5 * GIB)
    assert tier_sets(nodes, groups) == {frozenset({"fast"}), frozenset({"mid", "slow"})}
    assert all(sum(nodes[i].memory_bytes for i in g) >= 5 * GIB for g in groups)


def test_exact_cluster_count_is_balanced_to_hold_the_model() -> None:
    # k-means would put the two fast nodes apart from the slow ones; the slow group alone is too small
    nodes = tiered({"fast": 2, "slow": 4}, memory={"fast": 16 * GIB, "slow": 2 * GIB})
    need = 10 * GIB
    groups = cluster_nodes(nodes, memory_need=need, clusters=2)
    assert len(groups) == 2
    assert all(sum(nodes[i].memory_bytes for i in g) >= need for g in groups)
    assert sorted(i for g in groups for i in g) == list(range(len(nodes)))


def test_alike_nodes_split_evenly_into_the_asked_clusters() -> None:
    nodes = [NodeInfo(f"n{i}", 1e10, GIB, 1e8) for i in range(4)]
    assert sorted(len(g) for g in cluster_nodes(nodes, memory_need=GIB // 2, clusters=2)) == [2, 2]


@pytest.mark.parametrize("clusters, need, reason", [(3, 30 * GIB, "clusters need"), (7, GIB, "only 6"),
                                                   (None, 100 * GIB, "all 6 nodes")])
def test_impossible_clusterings_say_why(clusters: int | None, need: int, reason: str) -> None:
    with pytest.raises(ClusteringError, match=reason):
        cluster_nodes(tiered({"mid": 6}), memory_need=need, clusters=clusters)


def test_ten_thousand_nodes_cluster_fast() -> None:
    nodes = tiered({"fast": 1000, "mid": 3000, "slow": 6000})
    start = time.perf_counter()
    groups = cluster_nodes(nodes, memory_need=GIB)
    elapsed = time.perf_counter() - start
    assert len(groups) == 3 and sorted(len(g) for g in groups) == [1000, 3000, 6000]
    assert elapsed < 3.0  # about 0.1 s on an idle core; loose for a shared CI machine


def test_lopsided_tiers_are_mixed_into_even_replicas_when_a_count_is_asked() -> None:
    nodes = tiered({"fast": 1, "slow": 7})
    groups = cluster_nodes(nodes, memory_need=GIB, clusters=2)
    assert sorted(len(g) for g in groups) == [4, 4]
