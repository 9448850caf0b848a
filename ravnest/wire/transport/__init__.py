"""gRPC transport between peers: one server per node, one long-lived channel and stream per peer.

- `server`: `PeerServer`, a node's endpoint, and who may call it;
- `channels`: dialling peers (`Dialer`: channel pools, TLS names, routes to relayed peers);
- `outbound`: `OutboundStream`, the sending side;
- `probes`: pings, credential waits and link measurements;
- `router`: `Router`, which hands received messages to their owners by kind;
- `options`, `allocator`: the settings both ends agree on, and how buffers are kept.
"""
from .allocator import keep_freed_buffers
from .channels import (
                       DIALER,
                       ChannelPool,
                       Dialer,
                       PeerError,
                       close_channels,
                       name_peer,
                       new_pool,
                       route,
                       unroute,
                       use_tls,
)
from .options import GRPC_OPTIONS, SERVER_KEEPALIVE_OPTIONS
from .outbound import OutboundStream
from .probes import AUTH_GRACE_S, ProbeStopped, growing_probe, measure_link, ping, wait_authorized
from .router import Router
from .peer_server import Handler, PeerServer, TokenSource

__all__ = ["AUTH_GRACE_S", "DIALER", "GRPC_OPTIONS", "SERVER_KEEPALIVE_OPTIONS", "ChannelPool", "Dialer", "Handler",
           "OutboundStream", "PeerError", "PeerServer", "ProbeStopped", "Router", "TokenSource", "close_channels",
           "growing_probe", "keep_freed_buffers", "measure_link", "name_peer", "new_pool", "ping", "route", "unroute",
           "use_tls", "wait_authorized"]
