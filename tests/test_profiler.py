"""The node's compute profile measures the hardware, not the moment it joined."""
import subprocess
import sys

import pytest
import torch

from node.profiler import matmul_flops

BUSY = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass"  # stops by itself


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_single_threaded_node_measures_the_same_on_a_crowded_host(one_thread):
    """A node that joins while others train beside it (a demo, a test, a shared machine) must not be
    profiled as slower than its peers: the planner would leave it out of a job as a laggard."""
    idle = matmul_flops(torch.device("cpu"))
    hogs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(3)]  # more than this host's cores
    try:
        crowded = matmul_flops(torch.device("cpu"))
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    print(f"idle {idle / 1e9:.1f} GFLOP/s, crowded {crowded / 1e9:.1f}")
    assert crowded >= 0.8 * idle
