"""Which addresses the coordinator dials, and how often one node may make it dial somewhere new.

A volunteer names the address that the coordinator dials back (service/reachability.py), and every
dial tells it one bit: connected or not. Left alone, that lets anyone with the join token point the
coordinator at any host and port, from the coordinator's own host: a port scan of its loopback, or of
the private network it sits in. Two rules bound it.

- **Networks.** The coordinator dials only addresses in `--dial-allow` (networks, `10.0.0.0/8,
  2001:db8::/32`). By default, every address a volunteer may advertise except those that can only
  mean the coordinator's own machine or nobody's (loopback, unspecified, link-local, multicast),
  unless the coordinator itself listens on loopback: a cluster on one machine (the demo, the
  tests), whose nodes are on loopback too. A name is resolved once, and the address checked is the
  one dialled (a name cannot point elsewhere between the check and the dial).
- **Pace.** A heartbeat that moves a node to an address of its own choosing is dialled at most once
  every MOVE_EVERY_S per node; a later move waits (the reply says until when). A move into the relay
  the coordinator offered that node is dialled at once: that address came from the coordinator.
"""
from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MOVE_EVERY_S = 60.0
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def networks(text: str) -> tuple[Network, ...]:
    """`--dial-allow`'s value ("10.0.0.0/8,192.168.1.7") as networks; ValueError naming a bad one."""
    found = []
    for part in (p.strip() for p in text.split(",")):
        try:
            found.append(ipaddress.ip_network(part, strict=False))
        except ValueError:
            raise ValueError(f"{part!r} is not a network (like 10.0.0.0/8 or 2001:db8::/32)") from None
    return tuple(found)


@dataclass(frozen=True)
class Target:
    """Where to dial for an address a node gave: `at` (an IP and port), or `refused` (why not, in words)."""
    at: tuple[str, int] | None
    refused: str = ""


class DialRules:
    def __init__(self, allow: Sequence[Network] | None, listens_on: str, clock: Callable[[], float]) -> None:
        self.allow, self.clock = tuple(allow) if allow is not None else None, clock
        self.local = _is_loopback(listens_on)  # a cluster on one machine: its nodes are on loopback too
        self.listens_on = listens_on
        self._moved_at: dict[str, float] = {}  # node id -> when a move of its own choosing was last dialled

    def target(self, address: str) -> Target:
        """Where to dial `address` ("host:port", "[v6]:port"), or why the coordinator will not."""
        host, _, port = address.rpartition(":")
        try:
            found = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
        except (OSError, ValueError) as e:
            return Target(None, f"could not resolve {address}: {e}")
        refusals = []
        for *_, sockaddr in found:
            ip = ipaddress.ip_address(str(sockaddr[0]).partition("%")[0])
            refused = self._refusal(ip)
            if refused is None:
                return Target((str(sockaddr[0]), int(sockaddr[1])))
            refusals.append(refused)
        return Target(None, f"does not dial {address}: {refusals[0] if refusals else 'it resolves to nothing'}")

    def _refusal(self, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
        if self.allow is not None:
            return None if any(ip in net for net in self.allow if net.version == ip.version) else (
                f"{ip} is outside --dial-allow {','.join(map(str, self.allow))}")
        if ip.is_loopback and not self.local:
            return (f"{ip} is loopback, which from here is the coordinator's own machine (it listens on "
                    f"{self.listens_on}; --dial-allow lets it dial such addresses)")
        if ip.is_unspecified or ip.is_link_local or ip.is_multicast:
            return f"{ip} is not an address a peer can dial (--dial-allow lets the coordinator try)"
        return None

    def move_waits(self, node_id: str, offered: bool) -> float:
        """Seconds until a move of `node_id` may be dialled (0: now, and the move counts from now).
        `offered`: into the relay address the coordinator gave it, dialled at once and not counted."""
        if offered:
            return 0.0
        now = self.clock()
        last = self._moved_at.get(node_id)
        if last is not None and now - last < MOVE_EVERY_S:
            return MOVE_EVERY_S - (now - last)
        if len(self._moved_at) > 10_000:  # (forget moves that no longer hold anything back)
            self._moved_at = {n: t for n, t in self._moved_at.items() if now - t < MOVE_EVERY_S}
        self._moved_at[node_id] = now
        return 0.0


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"

