"""Segments and rings: how clusters that cut the model differently still average it together.

The union of all clusters' cut points splits the blocks into segments; inside each cluster exactly
one stage holds a given segment, so each segment's ring has one member per cluster.
"""
from __future__ import annotations


def segment_rings(cluster_ranges: list[list[tuple[int, int]]]) -> list[tuple[tuple[int, int], list[int]]]:
    """For each segment, its block range and the stage index holding it in every cluster.

    `cluster_ranges[c]` lists cluster c's stage block ranges, contiguous and covering the same blocks.
    """
    if not cluster_ranges:
        return []
    ends = {r[1] for ranges in cluster_ranges for r in ranges}
    start_all = cluster_ranges[0][0][0]
    for ranges in cluster_ranges:
        if ranges[0][0] != start_all or ranges[-1][1] != cluster_ranges[0][-1][1]:
            raise ValueError("every cluster must cover the same blocks")
        if any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
            raise ValueError(f"stage ranges are not contiguous: {ranges}")
    rings = []
    start = start_all
    for end in sorted(ends):
        stages = [next(i for i, (a, b) in enumerate(ranges) if a <= start and end <= b)
                  for ranges in cluster_ranges]
        rings.append(((start, end), stages))
        start = end
    return rings
