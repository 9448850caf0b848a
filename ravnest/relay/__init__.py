"""Relays: how peers reach a node behind a NAT or a firewall (server.py: the relay; tunnel.py: the node)."""
