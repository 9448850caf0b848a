"""Ring all-reduce with every member in its own OS process, talking over loopback."""
from __future__ import annotations


import pytest

from bench.allreduce import MIB, run_ring

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("weights", [None, [1.0, 2.0, 0.5]])
def test_three_processes_reach_the_reference_mean(weights):
    numel = 3 * MIB // 4 + 5  # ~3 MiB of fp32, cut into 256 KiB chunks: several in flight per share
    result = run_ring(3, numel, rounds=2, chunk_bytes=256 * 1024, weights=weights, check=True)
    assert len(result["times"]) == 2 and all(t > 0 for t in result["times"])
    # member_input is standard normal: the mean of 3 has magnitude ~1, so this is ~1e-6 relative
    assert result["max_error"] is not None and result["max_error"] <= 1e-6
