"""`ravnest-node join --coordinator URL ...`: lend this machine to a Ravnest training network."""
from __future__ import annotations

import argparse
import os
import re
import signal
import ssl
import sys
import threading
from pathlib import Path

from node.identity import default_data_dir
from ravnest import __version__
from ravnest.relay.ports import port_range
from ravnest.tls_options import add_tls_options, check_tls_options

# torch, gRPC and the daemon are imported once the arguments are parsed: --help and --version at once


def _size(text: str) -> int:
    from node.profiler import parse_size
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _offered(text: str) -> tuple[str, Path]:
    name, _, path = text.partition("=")
    if not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise argparse.ArgumentTypeError(f"{path}: no such file")
    return name, file


def _offers(files: list[tuple[str, Path]]) -> dict[str, Path]:
    """Datasets and model files share one namespace: a job names what it reads, never a path."""
    from ravnest.spec import DATASET_NAME  # (torch: checked once the join token is, `_token_refused`)

    offered: dict[str, Path] = {}
    for name, path in files:
        if not re.match(DATASET_NAME, name):
            raise ValueError(f"{name}={path}: NAME must be like 'gpl3' (letters, digits, _ . -)")
        if offered.get(name, path) != path:
            raise ValueError(f"{name!r} is offered twice, as {offered[name]} and {path}")
        offered[name] = path
    return offered


def _token_refused(url: str, token: str | None, verify: ssl.SSLContext | bool) -> str | None:
    """The coordinator's words where it refuses the join token, asked before the node loads torch (seconds
    of imports on a busy machine), so a wrong token is told at once; None where it takes the token or
    cannot be asked yet (the start goes on and waits for it: --wait)."""
    from ravnest.client.api import Api, ApiError  # (httpx only)

    api = Api(url, token, 5.0, verify)
    try:
        api.request("GET", "/v1/probe", token=token, params={"bytes": 1})
    except ApiError as e:
        return str(e) if e.status in (401, 403) else None
    finally:
        api.close()
    return None


def read_offers(path: Path | None) -> list[tuple[str, Path]]:
    """The NAME=PATH lines of an offers file (blank lines and # comments skipped)."""
    if path is None:
        return []
    lines = [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()]
    try:
        return [_offered(line) for line in lines if line]
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"{path}: {e}") from None


def _faults(text: str):
    from ravnest.wire.faults import LinkFaults
    try:
        return LinkFaults.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ravnest-node", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    join = commands.add_parser("join", help="join a coordinator and train what it assigns")
    join.add_argument("--coordinator", required=True,
                      help="coordinator URL, e.g. http://127.0.0.1:8470; several, separated by commas, for "
                           "coordinator processes on one store: the next is used when one does not answer")
    join.add_argument("--token", default=os.environ.get("RAVNEST_JOIN_TOKEN"),
                      help="the coordinator's join token (default: $RAVNEST_JOIN_TOKEN); its operator finds it "
                           "in the coordinator's data directory, file join_token")
    join.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    join.add_argument("--host", default="127.0.0.1",
                      help="address the gRPC server binds to (default: 127.0.0.1, reachable from this machine only)")
    join.add_argument("--port", type=int, default=0, help="gRPC port (default: any free port)")
    join.add_argument("--advertise", default=None, help="host peers should dial (default: --host)")
    join.add_argument("--no-relay", dest="use_relay", action="store_false",
                      help="where peers cannot dial this node (behind a NAT or a firewall), use no relay: "
                           "it gets no work then (default: use the relay the coordinator offers)")
    join.add_argument("--relay", nargs="?", type=int, const=0, default=None, metavar="PORT",
                      help="relay for volunteers that peers cannot dial, at PORT of --host (default: any free "
                           "port), each of them on another free port there: peers must reach those ports too. "
                           "Used only while peers can dial this node")
    join.add_argument("--relay-ports", type=port_range, default=None, metavar="LOW-HIGH",
                      help="with --relay: the ports opened for those volunteers, one each, for a firewall to let "
                           "in (default: any free port)")
    join.add_argument("--peer-relay-port", type=int, default=0, metavar="PORT",
                      help="where peers in a job that nobody can dial connect to this node, to be sent to over that "
                           "connection (a port of --host; default: any free port). Let it in with the gRPC port")
    join.add_argument("--no-peer-relay", dest="peer_relay_port", action="store_const", const=None,
                      help="open no such port: this node sends to peers that nobody can dial through their relay")
    join.add_argument("--name", default="", help="a name shown in the coordinator's node list (default: none)")
    join.add_argument("--data-dir", type=Path, default=None, metavar="DIR",
                      help="this node's own folder, which keeps its identity (file `identity`, made at first "
                           "start): started again, the node is the same node, with its id and history. One "
                           "node process per folder (default: $RAVNEST_NODE_DIR, else ~/.local/share/ravnest/node)")
    join.add_argument("--identity", type=Path, default=None, metavar="FILE",
                      help="keep the identity in FILE instead, made on first use (a secret: keep it private; "
                           "default: $RAVNEST_NODE_IDENTITY, else DIR/identity)")
    join.add_argument("--ephemeral", action="store_true",
                      help="no identity: a new node at every start, whose row and history stay behind when it ends")
    join.add_argument("--max-memory", type=_size, default=None, metavar="SIZE",
                      help="most memory this node offers for training, e.g. 6GiB (default: 80%% of what is "
                           "free now); no stage that needs more is assigned here. The node's own process takes "
                           "about 0.5 GB more when idle (torch), shown as idle in `ravnest nodes`")
    join.add_argument("--reprofile-every", type=float, default=600.0, metavar="SECONDS",
                      help="measure this machine's compute again after this long idle, and tell the coordinator "
                           "(default: 600; 0: never). Jobs' measured step times correct the figure too")
    join.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's, one per core)")
    join.add_argument("--dataset", action="append", type=_offered, default=[], metavar="NAME=PATH",
                      help="offer a file to jobs under NAME (repeatable): jobs name datasets, never paths, so "
                           "nothing else on this machine can be read (default: only the built-in datasets)")
    join.add_argument("--offers", type=Path, default=None, metavar="FILE",
                      help="a file of NAME=PATH lines, datasets and model weights alike (as --dataset and "
                           "--model-file offer them); the node reads it again on SIGHUP and tells the "
                           "coordinator, keeping its id: no restart")
    join.add_argument("--model-file", action="append", type=_offered, default=[], metavar="NAME=PATH",
                      help="offer a model's weights (a safetensors file: a Hugging Face checkpoint's or a `ravnest "
                           "download`) under NAME to jobs that start from it (model.weights.source; repeatable)")
    join.add_argument("--inject-fault", type=_faults, default=None, metavar="SPEC",
                      help="for fault tests: 'delay=SECONDS,sever_after=N,to=HOST:PORT' slows this node's "
                           "outbound messages and cuts one stream off (see ravnest/wire/faults.py; default: off)")
    add_tls_options(join, "gRPC over TLS", "plaintext")
    join.add_argument("--tls-ca", type=Path, default=None, metavar="PEM",
                      help="verify peers' gRPC servers and an https:// coordinator against this CA certificate; "
                           "peers are then dialled over TLS only (default: none)")
    join.add_argument("--wait", type=float, default=60.0,
                      help="seconds to keep trying while the coordinator is not reachable yet (default: 60)")
    join.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                      help="serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (0: any free port, "
                           "printed at start; default: off)")
    join.add_argument("--metrics-host", default="127.0.0.1",
                      help="address the metrics server binds to (default: 127.0.0.1, this machine only)")
    return parser


def identity_file(args: argparse.Namespace) -> Path | None:
    """Where this node's identity is kept, or None for an ephemeral node."""
    if args.ephemeral:
        return None
    chosen = args.identity or os.environ.get("RAVNEST_NODE_IDENTITY")
    return Path(chosen) if chosen else (args.data_dir or default_data_dir()) / "identity"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    check_tls_options(parser, args)
    os.umask(0o077)  # its identity, checkpoints and downloads are its owner's alone, whatever the umask
    if args.ephemeral and (args.identity or args.data_dir):
        parser.error("--ephemeral keeps no identity: leave out --identity and --data-dir")
    verify = ssl.create_default_context(cafile=args.tls_ca) if args.tls_ca else True
    if refused := _token_refused(args.coordinator, args.token, verify):
        print(f"error: the coordinator at {args.coordinator} refuses this node's join token ({refused}): "
              f"ask its operator for one ($RAVNEST_JOIN_TOKEN or --token)", file=sys.stderr)
        return 1
    import httpx
    import torch

    from node import exporter
    from node.client import CoordinatorClient
    from ravnest.client.api import ApiError
    from node.daemon import NodeDaemon
    from node.identity import hold_identity
    from node.profiler import pick_device
    from node.progress import Progress
    from ravnest import wire
    from ravnest.wire import faults

    if args.tls_ca:
        wire.use_tls(args.tls_ca.read_bytes())
    if args.threads:
        torch.set_num_threads(args.threads)
    progress = Progress()
    if args.inject_fault:
        faults.inject(args.inject_fault)
        progress.log(f"injecting faults into this node's outbound streams: {args.inject_fault}")
    if args.metrics_port is not None:
        port = exporter.serve(args.metrics_host, args.metrics_port)
        progress.log(f"metrics at http://{args.metrics_host}:{port}/metrics")
    stop = threading.Event()
    # Ctrl-C and SIGTERM end the node gracefully: stop the stage, tell the coordinator, exit.
    def offered_now() -> dict[str, Path]:
        return _offers(args.dataset + args.model_file + read_offers(args.offers))
    try:
        offered = offered_now()
    except (OSError, ValueError) as e:
        parser.error(str(e))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    client = CoordinatorClient(args.coordinator, join_token=args.token, verify=verify)
    held = None
    try:
        client.wait_until_reachable(args.wait, stop)
        client.check_join_token()
        kept = identity_file(args)
        identity, held = hold_identity(kept, progress.log) if kept else ("", None)
        daemon = NodeDaemon(client, device=pick_device(args.device), host=args.host, port=args.port,
                            advertise=args.advertise, name=args.name, progress=progress,
                            max_memory=args.max_memory, datasets=offered, identity=identity,
                            reload_offers=offered_now, reprofile_every=args.reprofile_every,
                            use_relay=args.use_relay, relay_port=args.relay, relay_ports=args.relay_ports,
                            peer_relay_port=args.peer_relay_port,
                            tls=(args.tls_cert.read_bytes(), args.tls_key.read_bytes()) if args.tls_cert else None)
        signal.signal(signal.SIGHUP, lambda *_: daemon.offers.reread())  # kill -HUP after editing --offers
        daemon.serve(stop)
    except (ApiError, httpx.HTTPError) as e:
        progress.log(f"error: cannot work with the coordinator at {args.coordinator}: {e}")
        return 1
    finally:
        client.close()
        if held:
            held.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
