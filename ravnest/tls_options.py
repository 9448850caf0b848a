"""The certificate options both servers take (`ravnest-coordinator`: HTTPS; `ravnest-node join`: gRPC
over TLS), written once, and their one check (docs/security.md)."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_tls_options(parser: argparse.ArgumentParser, serves: str, otherwise: str) -> None:
    """--tls-cert and --tls-key: serve `serves` with this certificate, else `otherwise`."""
    parser.add_argument("--tls-cert", type=Path, default=None, metavar="PEM",
                        help=f"serve {serves} with this certificate (with --tls-key; make them with "
                             f"scripts/make_certs.py, see docs/security.md; default: {otherwise})")
    parser.add_argument("--tls-key", type=Path, default=None, metavar="PEM", help="the certificate's private key")


def check_tls_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Both or neither, and files that are there: said at once, not when the first client connects."""
    if (args.tls_cert is None) != (args.tls_key is None):
        parser.error("--tls-cert and --tls-key go together")
    for path in (args.tls_cert, args.tls_key, getattr(args, "tls_ca", None)):
        if path is not None and not path.is_file():
            parser.error(f"{path}: no such file")
