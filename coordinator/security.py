"""Credentials: random tokens handed out once, stored only as hashes, compared in constant time."""
from __future__ import annotations

import hashlib
import hmac
import secrets

from .errors import Unauthorized


def new_token() -> str:
    return secrets.token_urlsafe(32)


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


def check_join_token(authorization: str | None, expected: str | None) -> None:
    if expected is None:
        return
    if not hmac.compare_digest(bearer_token(authorization).encode(), expected.encode()):
        raise Unauthorized("wrong join token")
