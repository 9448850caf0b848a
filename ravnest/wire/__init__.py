"""Tensors and messages on the wire, and the gRPC transport that carries them."""
from ravnest.wire.tensors import WireError, WireLimits, require_finite
from ravnest.wire.gate import PeerGate, credential_hash
from ravnest.wire.messages import Message
from ravnest.wire.transport import (ChannelPool, OutboundStream, PeerError, PeerServer, ProbeStopped, Router,
                                    close_channels, measure_link, name_peer, ping, route, unroute, use_tls,
                                    wait_authorized)

__all__ = ["ChannelPool", "Message", "OutboundStream", "PeerError", "PeerGate", "PeerServer", "ProbeStopped", "Router",
           "WireError", "WireLimits", "close_channels", "credential_hash", "require_finite", "measure_link",
           "name_peer", "ping", "route", "unroute", "use_tls", "wait_authorized"]
