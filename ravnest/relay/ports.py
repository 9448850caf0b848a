"""The ports a relay opens for the nodes it serves, one each: any free port, or a range given on the
command line (`--relay-ports 40000-40099`) that a firewall lets in."""
from __future__ import annotations

from argparse import ArgumentTypeError


def port_range(text: str) -> range:
    """"40000-40099" -> the ports a relay opens for its nodes (for a firewall to let in); argparse's type."""
    low, _, high = text.partition("-")
    try:
        ports = range(int(low), int(high or low) + 1)
    except ValueError:
        raise ArgumentTypeError(f"{text!r} is not a port range: write LOW-HIGH, e.g. 40000-40099") from None
    if not ports or not 1 <= ports[0] <= ports[-1] <= 65535:
        raise ArgumentTypeError(f"{text!r} is not a port range: LOW <= HIGH, both within 1-65535")
    return ports


def span(ports: range | None) -> str:
    """In words: "ports 40000-40099", or "free ports" for any."""
    return f"ports {ports[0]}-{ports[-1]}" if ports else "free ports"
