"""Whether an address can be dialled: one TCP connection, nothing sent (TLS or not, a NAT or a firewall
that drops inbound connections stops it before any protocol). The coordinator's dial-back uses it, a
node whose link probe timed out asks it whether the peer was out of reach or only slow, and a stage whose
link broke whether its neighbour's port is closed (its process gone) or the link only down."""
from __future__ import annotations

import socket

DIAL_BACK_S = 3.0  # a connect that takes longer is as good as dropped (a home NAT drops, it does not refuse)


def host_of(address: str) -> str:
    """"host:port" -> "host", "[v6]:port" -> "v6"."""
    return address.rpartition(":")[0].strip("[]")


def dial(address: str, timeout: float = DIAL_BACK_S, at: tuple[str, int] | None = None) -> tuple[bool, str]:
    """(connected, what happened in words) for a TCP connection to `address` ("host:port", "[v6]:port");
    `at`: the IP and port to connect to for it, where they were resolved and checked already."""
    try:
        with socket.create_connection(at or (host_of(address), int(address.rpartition(":")[2])), timeout=timeout):
            return True, f"connected to {address}"
    except socket.timeout:
        return False, f"no answer from {address} within {timeout:g} s (a NAT or a firewall drops inbound connections)"
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        return False, f"could not connect to {address}: {reason.lower()}"


def port_closed(address: str, timeout: float = 1.0) -> bool:
    """Whether `address` refuses connections: its host answers and nothing listens there (a process
    that ended), as opposed to a link that is down or slow (no answer), or a port that accepts."""
    try:
        with socket.create_connection((host_of(address), int(address.rpartition(":")[2])), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False
