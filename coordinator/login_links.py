"""One-time login links for the dashboard (`ravnest dashboard`): a script or a terminal opens the page
without ever putting a key in a URL, where browser history, proxies and logs would keep it.

A caller with an API key asks for a link; the store keeps (code -> that key) for LINK_S seconds, so
that any coordinator process on it honours the link. The first visit to /login?once=<code> turns it
into the HttpOnly cookie the login form sets, and deletes it (one DELETE ... RETURNING: of two visits
at once, at two processes, one gets it); a second visit, or one after LINK_S, gets the login form and
is told why.

The store holds neither the code nor the key: the row is found by the code's hash, and the key is
sealed with a pad drawn from the code (SHA-256 in counter mode), so someone who reads the database
learns no key from an unused link.
"""
from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable

from sqlalchemy import delete, func, select

from .store import LoginLinkRow, Store

LINK_S = 60.0  # long enough to click, short enough that a leaked link is useless
MAX_OPEN = 1000  # unused links kept at once; the oldest go first


class LoginLinks:
    def __init__(self, store: Store, clock: Callable[[], float]) -> None:
        self._store, self._clock = store, clock

    def create(self, key: str) -> str:
        """A fresh code standing for `key` until it is used or LINK_S pass."""
        code, now = secrets.token_urlsafe(24), self._clock()
        with self._store.session(quiet=True) as session:
            session.execute(delete(LoginLinkRow).where(LoginLinkRow.expires_at <= now))
            extra = (session.scalar(select(func.count()).select_from(LoginLinkRow)) or 0) - MAX_OPEN + 1
            if extra > 0:
                oldest = select(LoginLinkRow.code_hash).order_by(LoginLinkRow.expires_at).limit(extra)
                session.execute(delete(LoginLinkRow).where(LoginLinkRow.code_hash.in_(oldest)))
            session.add(LoginLinkRow(code_hash=_hash(code), sealed_key=_seal(key.encode(), code).hex(),
                                     expires_at=now + LINK_S))
        return code

    def redeem(self, code: str) -> str | None:
        """The key behind an unused, unexpired code (used up now), else None."""
        with self._store.session(quiet=True) as session:
            row = session.execute(delete(LoginLinkRow).where(LoginLinkRow.code_hash == _hash(code))
                                  .returning(LoginLinkRow.sealed_key, LoginLinkRow.expires_at)).first()
        if row is None or self._clock() >= row.expires_at:
            return None
        return _seal(bytes.fromhex(row.sealed_key), code).decode()


def _hash(code: str) -> str:
    return hashlib.sha256(code.encode()).hexdigest()


def _seal(data: bytes, code: str) -> bytes:
    """`data` XOR a pad as long, drawn from the code (sealing twice opens)."""
    pad = b"".join(hashlib.sha256(f"ravnest login link {i} {code}".encode()).digest()
                   for i in range(len(data) // 32 + 1))
    return bytes(a ^ b for a, b in zip(data, pad))
