"""Peer links as the planner prices them: measured where the nodes probed each other
(coordinator/service/link_probes.py), else estimated from both ends' links to the coordinator, and
never more than the relay a hidden node is reached through carries for one link."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from ravnest.partition import NodeCapacity

from .clustering import NodeInfo

# (node id, peer id) -> (bandwidth bytes/s, round-trip seconds) as measured from the node
Links = Mapping[tuple[str, str], tuple[float, float]]


def link(here: NodeInfo, after: NodeInfo, links: Links | None = None) -> tuple[float, float]:
    """(bandwidth, round trip) between two nodes: measured (slower direction) if either end probed it,
    else estimated from both ends' links to the coordinator (the round trip as through it: both ends'
    last miles, where a home link's delay is; the high side, which costs a plan memory for micro-batches
    in flight, not speed); no more than either end's share of the relay it is reached through (a probe
    measures a relayed link alone, not beside the relay's others).
    A hidden node and a peer with a relay for its peers take no relay hop (node/relaying.py): what the
    hidden one measured when it probed the other, both ways over the connection it opened, is the link."""
    links = links or {}
    hidden, shown = (here, after) if here.hidden else (after, here)
    if hidden.hidden and not shown.hidden and shown.peer_relay:
        measured_there = links.get((hidden.node_id, shown.node_id))
        return measured_there or (min(here.bandwidth, after.bandwidth), here.latency + after.latency)
    measured = [m for m in (links.get((here.node_id, after.node_id)), links.get((after.node_id, here.node_id)))
                if m is not None]
    relayed = min(here.relay_share, after.relay_share)
    if measured:
        return min(relayed, *(m[0] for m in measured)), max(m[1] for m in measured)
    return min(here.bandwidth, after.bandwidth, relayed), here.latency + after.latency


def capacities(chain: Sequence[NodeInfo], links: Links | None = None) -> list[NodeCapacity]:
    """Each node's capacity with its link to the next (see `link`)."""
    result = []
    for here, after in zip(chain, [*chain[1:], None]):
        bandwidth, latency = link(here, after, links) if after else (here.bandwidth, 0.0)
        result.append(NodeCapacity(here.flops, here.memory_bytes, bandwidth, latency, here.slowdown, here.message_s))
    return result
