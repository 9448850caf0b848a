"""`ravnest-coordinator`: run the coordinator service (REST API, dashboard, Prometheus metrics)."""
from __future__ import annotations

import argparse
import logging
import math
import os
from pathlib import Path

from ravnest import __version__
from ravnest.relay.ports import port_range, span
from ravnest.tls_options import add_tls_options, check_tls_options

QUIET_PATHS = ("/heartbeat ", "/metrics ", "/events ", "/healthz ")  # path ends: access lines only at --log-level debug


class QuietRoutine(logging.Filter):
    """Drops uvicorn's access lines for heartbeats, metric reports and scrapes, and event streams unless
    the coordinator logs at DEBUG: with many nodes they are most of the log and say nothing new."""

    def filter(self, record: logging.LogRecord) -> bool:
        line = record.getMessage()
        return not any(part in line for part in QUIET_PATHS) or logging.getLogger().isEnabledFor(logging.DEBUG)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ravnest-coordinator", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=8470, help="port to listen on (default: 8470)")
    parser.add_argument("--data-dir", type=Path, default=Path("ravnest-data"),
                        help="database (by default), tokens, uploaded weights and trained models "
                             "(default: ./ravnest-data)")
    parser.add_argument("--db", default=os.environ.get("RAVNEST_DB"),
                        help="SQLAlchemy URL, e.g. postgresql+psycopg://user:pw@host/ravnest (default: $RAVNEST_DB, "
                             "else a SQLite file in --data-dir)")
    parser.add_argument("--token", default=os.environ.get("RAVNEST_JOIN_TOKEN"),
                        help="join token; nodes must send 'Authorization: Bearer <token>' (default: "
                             "$RAVNEST_JOIN_TOKEN, else one made once and kept in DATA_DIR/join_token)")
    parser.add_argument("--operator-token", default=os.environ.get("RAVNEST_OPERATOR_TOKEN"),
                        help="the operator's API key (default: $RAVNEST_OPERATOR_TOKEN, else one made once and kept "
                             "in DATA_DIR/operator_token); prefer the variable: other users can read command lines")
    parser.add_argument("--heartbeat-interval", type=float, default=2.0,
                        help="seconds between node heartbeats (default: 2)")
    parser.add_argument("--heartbeat-timeout", type=float, default=None,
                        help="seconds without a heartbeat before a node is suspect: not placed; it is lost (its "
                             "job re-planned) once its pipeline also stops stepping, or after 10 intervals of "
                             "silence (default: 3 intervals)")
    parser.add_argument("--heartbeat-rate", type=float, default=100.0, metavar="PER_S",
                        help="beats a second all nodes together send at most: past rate x interval nodes, the interval "
                             "grows (up to 40 s idle, 10 s busy), and so does the time to notice a lost node "
                             "(default: 100)")
    parser.add_argument("--recovery-wait", type=float, default=120.0,
                        help="most seconds a re-planned job waits for its live nodes to hand in their state "
                             "(default: 120)")
    parser.add_argument("--grow-gain", type=float, default=0.2, metavar="FRACTION",
                        help="a running job takes in nodes that join mid-job only where the planner predicts at "
                             "least this much more throughput with them (default: 0.2; 0: any gain)")
    relay = parser.add_mutually_exclusive_group()
    relay.add_argument("--relay-port", type=int, default=None, metavar="PORT",
                       help="the relay's port: volunteers that peers cannot dial (behind a NAT or a firewall) are "
                            "reached through it, each on a free port of its own on --host, so let those in too "
                            "(default: --port + 1; 0: any free port)")
    relay.add_argument("--no-relay", action="store_true",
                       help="no relay: volunteers that peers cannot dial are not given work")
    parser.add_argument("--relay-bandwidth", type=float, default=None, metavar="MBIT",
                        help="the coordinator's link in Mbit/s: the planner shares it among the links it relays, "
                             "each byte crossing it in and out (default: not counted)")
    parser.add_argument("--relay-ports", type=port_range, default=None, metavar="LOW-HIGH",
                        help="the ports the relay opens for the volunteers it serves, one each, for a firewall to "
                             "let in (default: any free port)")
    parser.add_argument("--dial-allow", default=None, metavar="NETWORKS",
                        help="the networks whose addresses the coordinator dials back to check that peers can reach "
                             "a node, e.g. 10.0.0.0/8,2001:db8::/32 (default: any a volunteer may advertise but "
                             "loopback, dialled only where the coordinator listens on loopback itself)")
    parser.add_argument("--body-grace", type=float, default=10.0, metavar="SECONDS",
                        help="a request body must come within this plus its length at 16 KiB/s, else it is cut "
                             "with 408 (default: 10)")
    add_tls_options(parser, "HTTPS", "plain HTTP")
    parser.add_argument("--revoke-outliers", action="store_true",
                        help="revoke the credential of a node that a job's robust averaging (averaging.robust) "
                             "found sending contributions far beyond the other replicas' (default: only leave it "
                             "out of that job)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="job and node events at info, every request at debug (default: info)")
    args = parser.parse_args(argv)
    check_tls_options(parser, args)
    if not 0 < args.heartbeat_rate < math.inf:
        parser.error("--heartbeat-rate is beats a second: a positive number")
    if not 0 <= args.grow_gain < math.inf:
        parser.error("--grow-gain is a fraction of the job's predicted throughput: 0 or more")
    if args.dial_allow is not None:
        from .dial_rules import networks
        try:
            args.dial_allow = networks(args.dial_allow)
        except ValueError as e:
            parser.error(f"--dial-allow: {e}")
    if not 0 < args.body_grace < math.inf:
        parser.error("--body-grace is seconds: a positive number")
    if args.relay_bandwidth is not None and not 0 < args.relay_bandwidth < math.inf:
        parser.error("--relay-bandwidth is the relay's link in Mbit/s: a positive number")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)  # before the heavy imports: --help and --version answer at once
    # every file it writes is its owner's alone, whatever the umask it was started with: the database and
    # the files SQLite keeps beside it (-wal, -shm) hold node records, job specs and credentials' hashes
    os.umask(0o077)
    timeout = args.heartbeat_timeout or 3 * args.heartbeat_interval
    if args.heartbeat_interval <= 0 or timeout <= args.heartbeat_interval:
        raise SystemExit("ravnest-coordinator: --heartbeat-timeout must exceed --heartbeat-interval (> 0)")
    import uvicorn
    from sqlalchemy.engine import make_url

    from ravnest.printable import PrintableRecords

    from .app import create_app
    from .config import Settings
    from .store import SchemaError, StoreInUse

    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(PrintableRecords())  # one line per record, whatever a volunteer's text holds
    for name in ("uvicorn.access", "uvicorn.error"):  # (uvicorn gives these handlers of their own)
        logging.getLogger(name).addFilter(PrintableRecords())
    logging.getLogger("uvicorn.access").addFilter(QuietRoutine())
    settings = Settings(data_dir=args.data_dir, db_url=args.db, join_token=args.token,
                        operator_token=args.operator_token,
                        heartbeat_interval_s=args.heartbeat_interval,
                        heartbeat_timeout_factor=timeout / args.heartbeat_interval, recovery_wait_s=args.recovery_wait,
                        heartbeat_rate=args.heartbeat_rate, body_grace_s=args.body_grace,
                        grow_gain=args.grow_gain, revoke_outliers=args.revoke_outliers,
                        host=args.host, dial_allow=args.dial_allow,
                        relay_host=args.host, relay_port=None if args.no_relay else
                        args.port + 1 if args.relay_port is None else args.relay_port,
                        relay_node_ports=args.relay_ports,
                        relay_bytes_per_s=args.relay_bandwidth * 1e6 / 8 if args.relay_bandwidth else None)
    try:
        app = create_app(settings)
    except (SchemaError, StoreInUse) as e:
        raise SystemExit(f"ravnest-coordinator: {e}") from None
    except OSError as e:  # the relay's port is taken
        raise SystemExit(f"ravnest-coordinator: {e} (choose another with --relay-port, or --no-relay)") from None
    data = settings.data_dir.resolve()
    database = make_url(settings.database_url).render_as_string(hide_password=True)
    operator = "given (--operator-token)" if args.operator_token else f"in {data / 'operator_token'}"
    join = "given (--token)" if args.token else f"in {data / 'join_token'}"
    relay = app.state.service.membership.reachability.relay
    url = f"{'https' if args.tls_cert else 'http'}://{args.host}:{args.port}"
    token_file = data / "join_token"
    nodes_join = (f"    a node joins with RAVNEST_JOIN_TOKEN=$(cat {token_file}) \\\n"
                  f"      ravnest-node join --coordinator {url}" if not args.token else
                  f"    a node joins with the token in $RAVNEST_JOIN_TOKEN: ravnest-node join --coordinator {url}")
    relayed = f"{relay.address},\n    and {span(relay.node_ports)} for them" if relay else "off (--no-relay)"
    # lines for people: 80 columns (a path longer than that stays whole, on a line of its own)
    print(f"ravnest-coordinator {__version__}\n"
          f"  data in {data}\n"
          f"  database {database}\n"
          f"  authentication is on: every call but /healthz needs a token\n"
          f"    operator key {operator}\n"
          f"      (jobs, nodes, dashboard, metrics)\n"
          f"    join token {join}\n{nodes_join}\n"
          f"  that join token admits any number of nodes until revoked: hand out\n"
          f"  limited ones with `ravnest token create --uses N --expires 7d`,\n"
          f"  then `ravnest token revoke join`\n"
          f"  relay for volunteers that peers cannot dial: {relayed}\n"
          f"  dashboard at {url}/", flush=True)
    # asyncio's own event loop, not uvloop: under uvloop a node's bandwidth probe of the coordinator
    # measured 214-236 Mbit/s on a 400 Mbit/s link in 3 of 4 runs of tests/test_testbed.py (340-372 without)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, loop="asyncio",
                ssl_certfile=str(args.tls_cert) if args.tls_cert else None,
                ssl_keyfile=str(args.tls_key) if args.tls_key else None)


if __name__ == "__main__":
    main()
