"""`ravnest-coordinator`: run the coordinator service."""
from __future__ import annotations

import argparse
from pathlib import Path

import uvicorn

from .app import create_app
from .config import Settings
from .store import SchemaError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ravnest-coordinator", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8470)
    parser.add_argument("--data-dir", type=Path, default=Path("ravnest-data"),
                        help="database (by default), uploaded weights and trained models")
    parser.add_argument("--db", default=None, help="SQLAlchemy URL, e.g. postgresql+psycopg://user@host/ravnest "
                                                   "(default: sqlite file in --data-dir)")
    parser.add_argument("--token", default=None, help="join token; nodes must send 'Authorization: Bearer <token>'")
    parser.add_argument("--heartbeat-interval", type=float, default=2.0, help="seconds between node heartbeats")
    parser.add_argument("--heartbeat-timeout", type=float, default=None,
                        help="seconds without a heartbeat before a node is declared lost and its job re-planned "
                             "(default: 3 intervals)")
    parser.add_argument("--recovery-wait", type=float, default=120.0,
                        help="most seconds a re-planned job waits for its live nodes to hand in their state")
    parser.add_argument("--tls-cert", type=Path, default=None, metavar="PEM",
                        help="serve HTTPS with this certificate (with --tls-key; see docs/security.md)")
    parser.add_argument("--tls-key", type=Path, default=None, metavar="PEM", help="the certificate's private key")
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        raise SystemExit("ravnest-coordinator: --tls-cert and --tls-key go together")
    timeout = args.heartbeat_timeout or 3 * args.heartbeat_interval
    if args.heartbeat_interval <= 0 or timeout <= args.heartbeat_interval:
        raise SystemExit("ravnest-coordinator: --heartbeat-timeout must exceed --heartbeat-interval (> 0)")
    settings = Settings(data_dir=args.data_dir, db_url=args.db, join_token=args.token,
                        heartbeat_interval_s=args.heartbeat_interval,
                        heartbeat_timeout_factor=timeout / args.heartbeat_interval, recovery_wait_s=args.recovery_wait)
    try:
        app = create_app(settings)
    except SchemaError as e:
        raise SystemExit(f"ravnest-coordinator: {e}") from None
    data = settings.data_dir.resolve()
    print(f"ravnest-coordinator: data in {data}; operator token in {data / 'operator_token'} (jobs, nodes, "
          f"dashboard); join token " + ("given with --token" if args.token else f"in {data / 'join_token'}")
          + " (ravnest-node join --token ...)", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                ssl_certfile=str(args.tls_cert) if args.tls_cert else None,
                ssl_keyfile=str(args.tls_key) if args.tls_key else None)


if __name__ == "__main__":
    main()
