"""What relay code takes of a node's memory beside its stage: the planner fits stages on what is left."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .clustering import NodeInfo

# what relay code holds on a node whose links run through it (node/relaying.py): a hidden node's tunnels, or the
# relay for its peers of a node sent to hidden ones; with 2 of 4 nodes hidden, the digits CNN's stages measured
# 0.9-3 MiB above their prediction on either side, and within it with no node hidden
RELAYING_BYTES = 2 << 20


def relaying_bytes(node: NodeInfo, hidden_in_job: bool) -> int:
    """What relay code takes on `node` in a job that has hidden nodes (or not), beside its stage."""
    return RELAYING_BYTES if node.hidden or (node.peer_relay and hidden_in_job) else 0


def less_relaying(nodes: Sequence[NodeInfo]) -> list[NodeInfo]:
    """The nodes as the planner fits stages on them: their offers less what relay code will hold there."""
    hidden = any(n.hidden for n in nodes)
    return [dataclasses.replace(n, memory_bytes=max(0, n.memory_bytes - relaying_bytes(n, hidden)))
            if relaying_bytes(n, hidden) else n for n in nodes]
