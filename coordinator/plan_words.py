"""How a plan says itself in its reason: counts, rates and sizes, and a line per group of nodes
naming the clusters it became ('cluster 0: 2 nodes as 1 pipeline of 2 stages: 5,333 samples/s')."""
from __future__ import annotations

from collections import Counter


def named_groups(lines: list[str], replicas: list[int], kept: set[int]) -> list[str]:
    """Each group's line, naming the clusters its replicas became (the kept groups' replicas are
    numbered in order); groups said alike share a line: 'clusters 0-3: 4 groups, each 1 node as ...'."""
    clusters, first = {}, 0
    for group in sorted(kept):
        clusters[group], first = list(range(first, first + replicas[group])), first + replicas[group]
    alike: dict[str, list[int]] = {}
    for group, line in enumerate(lines):
        alike.setdefault(line, []).append(group)
    named = []
    for line, groups in alike.items():
        numbers = [c for group in groups for c in clusters.get(group, [])]
        several = f"{len(groups)} groups, each " if len(groups) > 1 else ""
        named.append(f"{clusters_named(numbers)}: {several}{line}" if numbers else f"{several}{line}")
    return named


def clusters_named(numbers: list[int]) -> str:
    """'cluster 2', 'clusters 0-3, 5'."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and runs[-1][1] == number - 1:
            runs[-1][1] = number
        else:
            runs.append([number, number])
    spans = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"cluster{'s' if len(numbers) > 1 else ''} {spans}"


def counted(lines: list[str]) -> list[str]:
    """Each line once, in order, those said of several groups with how many: '3 groups: 2 nodes -> ...'."""
    return [line if count == 1 else f"{count} groups: {line}" for line, count in Counter(lines).items()]


def plural(count: int, thing: str) -> str:
    """'1 stage', '2 stages'."""
    return f"{count} {thing}{'' if count == 1 else 's'}"


def rate(samples_per_s: float) -> str:
    return f"{samples_per_s:,.0f} samples/s" if samples_per_s >= 100 else f"{samples_per_s:.3g} samples/s"


def mib(count: float) -> str:
    return f"{count / 2**20:,.0f} MiB"
