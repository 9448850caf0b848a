"""Group nodes into clusters of similar machines: k-means over their log-bandwidth, log-compute and
log-memory, then repaired so that every cluster can hold the whole model.

Similar machines in one pipeline keep its stages balanced and keep a slow link from throttling fast
nodes; clusters are data-parallel replicas, so each must hold a full copy of the model.

Where the planner picks the number of clusters, k-means' own choice (the k of best silhouette) is one
candidate among a few (`candidate_groupings`), and the planner takes the one whose plan predicts most:
on a busy host the compute figures of alike machines differ 2-4x from one probe to the next, which
blurred three bandwidth tiers into "one group" in 8 of 40 simulated draws, and that group was then
dealt into pipelines that each held a slow host.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from sklearn.cluster import KMeans
from sklearn.metrics import silhouette_score
from threadpoolctl import threadpool_limits

from ravnest.errors import RavnestError
from ravnest.partition import MESSAGE_OVERHEAD_S

MAX_AUTO_CLUSTERS = 8
SIMILAR_LOG_SPREAD = math.log(2.0)  # nodes within 2x of each other on every measure form one cluster
MIN_SILHOUETTE = 0.5  # weaker structure than this is not worth splitting on
SAMPLE = 1000  # k is chosen on a sample of this many nodes, so choosing stays fast for 10,000 nodes
# up to this many nodes the planner also weighs other groupings than k-means' own (each a whole plan:
# a few ms here, seconds at 10,000 nodes, where so many figures leave the silhouette little to chance)
ALTERNATIVES_UP_TO = 256


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    flops: float
    memory_bytes: int
    bandwidth: float  # bytes/s, measured to the coordinator
    latency: float = 0.0  # round trip to the coordinator, seconds
    address: str = ""  # host:port of its gRPC server
    slowdown: float = 1.0  # its stages' compute seconds as measured over as its `flops` predict (calibration.py)
    # reached through a volunteer's relay: the bytes/s of that relay's link it may count on, shared with
    # the relay's other nodes (service/reachability.py `relay_shares`); inf: dialled directly
    relay_share: float = math.inf
    hidden: bool = False  # nobody can dial it: it listens at a relay
    peer_relay: bool = False  # it can be dialled and runs a relay for its peers (node/relaying.py)
    message_s: float = MESSAGE_OVERHEAD_S  # one message's cost beyond bytes and latency, as its jobs measured

    @property
    def effective_flops(self) -> float:
        """What it computes like: its figure over what its jobs measured."""
        return self.flops / self.slowdown


class ClusteringError(RavnestError, ValueError):
    """The nodes cannot be grouped as asked; the message says why."""


def log_features(nodes: Sequence[NodeInfo]) -> np.ndarray:
    return np.log(np.array([[n.bandwidth, n.effective_flops, n.memory_bytes] for n in nodes], dtype=np.float64))


def standardise(raw: np.ndarray) -> np.ndarray:
    """Each log feature centred and scaled by its spread, but never by less than SIMILAR_LOG_SPREAD: a
    measure on which the nodes differ by less than 2x (free memory that differs by a few MiB, compute
    measured a little apart) must not be blown up into a difference k-means would split on."""
    std = raw.std(axis=0)
    return (raw - raw.mean(axis=0)) / np.maximum(std, SIMILAR_LOG_SPREAD)


def _kmeans(x: np.ndarray, k: int, seed: int, n_init: int = 3) -> KMeans:
    # one thread: for a few thousand 3-d points OpenMP start-up and contention cost 10-100x the work
    with threadpool_limits(1):
        return KMeans(n_clusters=k, n_init=n_init, random_state=seed).fit(x)


def _alike(raw: np.ndarray) -> bool:
    return bool(np.ptp(raw, axis=0).max() < SIMILAR_LOG_SPREAD)


def choose_k(raw: np.ndarray, x: np.ndarray, seed: int = 0, least_silhouette: float = MIN_SILHOUETTE) -> int:
    """1 when the nodes are alike, else the k in 2..8 with the best silhouette (on a sample), where that
    is above `least_silhouette` (else 1)."""
    n = len(x)
    if n <= 2 or _alike(raw):
        return 1
    rng = np.random.default_rng(seed)
    sample = x if n <= SAMPLE else x[rng.choice(n, SAMPLE, replace=False)]
    best_k, best_score = 1, least_silhouette
    distinct = len(np.unique(sample, axis=0))  # (more clusters than distinct points: k-means warns, and repeats)
    for k in range(2, min(MAX_AUTO_CLUSTERS, len(sample) - 1, distinct) + 1):
        labels = _kmeans(sample, k, seed, n_init=1).labels_
        if len(set(labels)) < 2:
            continue
        with threadpool_limits(1):
            score = silhouette_score(sample, labels)
        if score > best_score:
            best_k, best_score = k, score
    return best_k


def candidate_groupings(nodes: Sequence[NodeInfo], memory_need: int, seed: int = 0,
                        min_size: int = 1) -> list[tuple[str, list[list[int]]]]:
    """Groupings for the planner to weigh where it picks the number of clusters, each named, k-means'
    own (`cluster_nodes`) first; for up to ALTERNATIVES_UP_TO nodes also the best k of any silhouette
    and the grouping by bandwidth alone (a link's figure is repeated until its repeats agree; a compute
    figure on a busy host is one moment's share of a core). Each is repaired as `cluster_nodes` repairs
    its own; the same grouping is not listed twice."""
    candidates = [("k-means on bandwidth, compute and memory",
                   cluster_nodes(nodes, memory_need, None, seed, min_size))]
    if len(nodes) > ALTERNATIVES_UP_TO:
        return candidates
    memory = np.array([node.memory_bytes for node in nodes], dtype=np.float64)
    raw = log_features(nodes)
    everything = standardise(raw)  # (small clusters merge into their nearest on all three)
    for name, features, x in (("k-means on all three at its best k", raw, everything),
                              ("k-means on bandwidth alone", raw[:, :1], standardise(raw[:, :1]))):
        k = choose_k(features, x, seed, least_silhouette=-1.0)
        labels = _kmeans(x, k, seed).labels_ if k > 1 else np.zeros(len(nodes), dtype=int)
        groups = _merge_small(everything, labels, memory, memory_need, min_size)
        if all(sorted(map(sorted, groups)) != sorted(map(sorted, known)) for _, known in candidates):
            candidates.append((name, groups))
    return candidates


def cluster_nodes(nodes: Sequence[NodeInfo], memory_need: int, clusters: int | None = None,
                  seed: int = 0, min_size: int = 1) -> list[list[int]]:
    """Indices of `nodes` per cluster. `clusters=None` picks the number (and merges clusters that
    cannot hold `memory_need` bytes, or have fewer than `min_size` nodes, into their nearest
    neighbour); an int gives exactly that many,
    from k-means unless its groups are lopsided (largest > 2x smallest), then by dealing the nodes
    out by compute so replicas run at similar speeds; nodes then move until each holds the model."""
    n = len(nodes)
    if n == 0:
        raise ClusteringError("no nodes to cluster")
    memory = np.array([node.memory_bytes for node in nodes], dtype=np.float64)
    if memory.sum() < memory_need:
        raise ClusteringError(f"all {n} nodes together have {memory.sum() / 2**20:.0f} MiB of memory; "
                              f"the model needs {memory_need / 2**20:.0f} MiB")
    raw = log_features(nodes)
    x = standardise(raw)
    if clusters is None:
        k = choose_k(raw, x, seed)
        labels = _kmeans(x, k, seed).labels_ if k > 1 else np.zeros(n, dtype=int)
        return _merge_small(x, labels, memory, memory_need, min_size)
    if clusters < 1 or clusters > n:
        raise ClusteringError(f"{clusters} clusters asked for, but only {n} usable nodes")
    if memory.sum() < clusters * memory_need:
        raise ClusteringError(f"{clusters} clusters need {clusters * memory_need / 2**20:.0f} MiB in all "
                              f"(a full model each); the {n} nodes have {memory.sum() / 2**20:.0f} MiB")
    if clusters == 1:
        groups: list[list[int]] | None = [list(range(n))]
    elif _alike(raw):  # nothing for k-means to separate: deal the nodes out evenly instead
        groups = _balance_greedy(memory, clusters, memory_need)
    else:
        labels = _kmeans(x, clusters, seed).labels_.copy()
        sizes = np.bincount(labels, minlength=clusters)
        if sizes.max() > 2 * sizes.min():
            # lopsided tiers (say 1 + 3 nodes) make replicas of very unequal speed: mix them evenly
            labels = _snake_deal(raw[:, 1], clusters)
        groups = _balance(x, labels, clusters, memory, memory_need)
    if groups is None:
        groups = _balance_greedy(memory, clusters, memory_need)
    if groups is None:
        raise ClusteringError(f"cannot split the {n} nodes into {clusters} clusters that each hold the "
                              f"model ({memory_need / 2**20:.0f} MiB): their memories do not add up that way")
    return groups


def _groups(labels: np.ndarray) -> list[list[int]]:
    return [np.flatnonzero(labels == label).tolist() for label in np.unique(labels)]


def _merge_small(x: np.ndarray, labels: np.ndarray, memory: np.ndarray, need: float,
                 min_size: int = 1) -> list[list[int]]:
    """Merge every cluster too small for the model, or with fewer than `min_size` nodes (the stages a
    job asked for), into the cluster with the nearest centroid."""
    groups = _groups(labels)
    while len(groups) > 1:
        totals = [memory[g].sum() for g in groups]
        small = min(range(len(groups)), key=lambda i: (len(groups[i]) >= min_size, totals[i]))
        if totals[small] >= need and len(groups[small]) >= min_size:
            break
        centroids = np.array([x[g].mean(axis=0) for g in groups])
        distance = np.linalg.norm(centroids - centroids[small], axis=1)
        distance[small] = np.inf
        target = int(distance.argmin())
        groups[target] = sorted(groups[target] + groups[small])
        del groups[small]
    return groups


def _balance(x: np.ndarray, labels: np.ndarray, k: int, memory: np.ndarray,
             need: float) -> list[list[int]] | None:
    """Move nodes into clusters short of memory, each time the donor node nearest to the short
    cluster whose departure leaves its own cluster able to hold the model. None if stuck."""
    totals = np.bincount(labels, weights=memory, minlength=k)
    sizes = np.bincount(labels, minlength=k)
    for _ in range(len(labels)):
        short = np.flatnonzero((totals < need) | (sizes == 0))
        if len(short) == 0:
            return _groups(labels)
        target = int(short[0])
        spare = totals[labels] - memory  # what each node's cluster keeps if the node leaves
        movable = (labels != target) & (spare >= need) & (sizes[labels] > 1)
        if not movable.any():
            return None
        members = labels == target
        centre = x[members].mean(axis=0) if members.any() else x[movable].mean(axis=0)
        distance = np.where(movable, np.linalg.norm(x - centre, axis=1), np.inf)
        moved = int(distance.argmin())
        source = labels[moved]
        totals[source] -= memory[moved]
        sizes[source] -= 1
        totals[target] += memory[moved]
        sizes[target] += 1
        labels[moved] = target
    return None


def _snake_deal(values: np.ndarray, k: int) -> np.ndarray:
    """Labels dealing nodes in descending `values` as 0..k-1, k-1..0, ...: similar sums per label."""
    labels = np.empty(len(values), dtype=int)
    for position, index in enumerate(np.argsort(-values)):
        turn, offset = divmod(position, k)
        labels[index] = offset if turn % 2 == 0 else k - 1 - offset
    return labels


def _balance_greedy(memory: np.ndarray, k: int, need: float) -> list[list[int]] | None:
    """Largest-memory-first into the emptiest cluster: the fallback when k-means groups are lopsided."""
    groups: list[list[int]] = [[] for _ in range(k)]
    totals = np.zeros(k)
    for index in np.argsort(-memory):
        target = int(totals.argmin())
        groups[target].append(int(index))
        totals[target] += memory[index]
    return [sorted(g) for g in groups] if (totals >= need).all() else None
