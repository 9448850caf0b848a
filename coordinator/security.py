"""Credentials: random tokens handed out once, stored only as hashes, compared in constant time;
the coordinator's own tokens kept in files only their owner can read."""
from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from pathlib import Path

from .service_errors import Unauthorized


def new_token() -> str:
    # the prefix keeps tokens from starting with '-' (a command line would read one as a flag)
    # and lets secret scanners recognise a leaked one
    return "rvn_" + secrets.token_urlsafe(32)


def new_id() -> str:
    return secrets.token_hex(8)


def hash_token(token: str) -> str:
    # tokens are 256 random bits, so a plain SHA-256 is enough (no password stretching needed)
    return hashlib.sha256(token.encode()).hexdigest()


def token_matches(token: str | None, token_hash: str | None) -> bool:
    if not token or not token_hash:
        return False
    return hmac.compare_digest(hash_token(token), token_hash)


def bearer_token(authorization: str | None) -> str:
    """The token of an `Authorization: Bearer <token>` header; Unauthorized if missing or malformed."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("missing 'Authorization: Bearer <token>' header")
    return token.strip()


def derive_token(secret: str, *parts: str) -> str:
    """A credential computed from the coordinator's secret and what it is for (e.g. a job and its
    generation): the same after a restart, never stored, different for every job and generation."""
    digest = hmac.new(secret.encode(), ":".join(parts).encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def matches(offered: str | None, expected: str | None) -> bool:
    """Constant-time comparison of an offered token with an expected one (None never matches)."""
    if not offered or not expected:
        return False
    return hmac.compare_digest(offered.encode(), expected.encode())


def token_file(path: Path) -> str:
    """The token kept in `path`, created (random, readable by the owner only) on first use, so it
    outlives a restart."""
    if not path.exists():  # written aside, then linked in place: coordinator processes sharing the data
        path.parent.mkdir(parents=True, exist_ok=True)  # directory and starting at once agree on one token
        aside = path.with_name(f".{path.name}.{os.getpid()}")
        handle = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(handle, "w") as out:
            out.write(new_token() + "\n")
        try:
            os.link(aside, path)
        except FileExistsError:
            pass  # another process made it first: its token is the one
        finally:
            os.unlink(aside)
    return path.read_text().strip()
