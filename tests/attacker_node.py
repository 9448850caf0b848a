"""A volunteer who lies, as a real `ravnest-node` process: `python -m tests.attacker_node join ...` takes
the flags of `ravnest-node join` and runs it with two lies patched in.

- It claims a link of CLAIMED_BANDWIDTH B/s (what `ravnest-node` measured of its link is thrown away).
- Every ring chunk it sends holds NaN: its averaging contribution goes non-finite.

Its training, pipeline streams and reports are an honest node's. Only tests run it
(tests/test_lying_volunteers.py)."""
import sys

import torch

import node.daemon
from node.cli import main
from ravnest.averaging.collectives import RingMember

CLAIMED_BANDWIDTH = 1e10  # bytes/s: more than loopback carries here, within what a profile may say


def _claiming_a_fast_link(profile_node):
    def profile(*args, **kwargs):
        return profile_node(*args, **kwargs).model_copy(update={"bandwidth_bytes_per_s": CLAIMED_BANDWIDTH})
    return profile


def _poisoning(send):
    def poisoned(self, round, step, chunk, part, *args, **kwargs):
        return send(self, round, step, chunk, torch.full_like(part, float("nan")), *args, **kwargs)
    return poisoned


node.daemon.profile_node = _claiming_a_fast_link(node.daemon.profile_node)
RingMember._send = _poisoning(RingMember._send)

if __name__ == "__main__":
    sys.exit(main())
