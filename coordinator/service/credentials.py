"""Credentials: who a bearer token belongs to, and the join tokens and API keys the operator hands
out. Every token is kept only as its hash; every refusal says why (expired, revoked, used up).

    operator token  (file in the data directory)  an API key with the operator role
    join token      (file, or --token)            a join token without expiry or use limit
    node credential (one per joined node)         pushed on by every heartbeat; revocable
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Protocol, cast, get_args

from sqlalchemy import CursorResult, bindparam, func, select, update
from sqlalchemy.orm import Session

from ..service_errors import Conflict, NotFound
from ..schemas import CredentialCreated, CredentialView, JoinTokenRequest, KeyRequest, Role
from ..security import hash_token, new_id, new_token
from ..store import CredentialRow, NodeRow
from .core import Core, node_refusal

JOIN, KEY, NODE = "join", "key", "node"
REREAD_S = 1.0  # how long a credential without a use limit is believed without reading it again
MAX_KEPT = 10_000  # credentials kept so at most (past that, all are read again)


@dataclass(frozen=True)
class Principal:
    """Who is calling: an API key (with its role), a join token, or a joined node."""
    kind: str
    id: str
    role: Role | None = None
    name: str = ""

    @property
    def is_operator(self) -> bool:
        return self.kind == KEY and self.role == "operator"

    @property
    def reads_every_job(self) -> bool:
        return self.kind == KEY and self.role in ("operator", "reader")

    def describe(self) -> str:
        what = f"{self.role} key" if self.kind == KEY else "join token" if self.kind == JOIN else "credential of node"
        return f"{what} {self.name or self.id!r}" if self.kind != NODE else f"{what} {self.id}"


def _role(stored: str | None) -> Role | None:
    """A key's role as the store keeps it (text; KeyRequest lets only roles in)."""
    return cast(Role, stored) if stored in get_args(Role) else None


class Checked(Protocol):
    """What decides whether a credential still works: a CredentialRow, or those columns alone (CHECKED)."""
    id: str
    kind: str
    role: str | None
    name: str
    revoked_at: float | None
    expires_at: float | None
    uses_left: int | None
    used: int


def credential_refusal(row: Checked, now: float) -> str | None:
    what = f"{'join token' if row.kind == JOIN else 'key'} {row.name or row.id}"
    if row.revoked_at is not None:
        return f"{what} was revoked"
    if row.expires_at is not None and now >= row.expires_at:
        return f"{what} expired"
    if row.uses_left is not None and row.uses_left <= 0:
        return f"{what} has been used up ({row.used} joins)"
    return None


class Credentials:
    def __init__(self, core: Core) -> None:
        self.core = core
        self._uses: Counter[str] = Counter()  # unlimited join tokens' uses not yet written (flush_uses)
        self._lock = threading.Lock()  # guards _uses only
        self._kept: dict[str, tuple[float, Checked]] = {}  # unlimited credentials, by hash: (read at, row)

    def identify(self, token: str) -> Principal | str:
        """The principal `token` belongs to, or why it is refused."""
        digest, now = hash_token(token), self.core.clock()
        with self.core.store.reading() as session:
            row = self._checked(session, digest, now)
            if row is not None:
                return credential_refusal(row, now) or Principal(row.kind, row.id, _role(row.role), row.name)
            node = session.execute(select(NodeRow.id, NodeRow.name, NodeRow.credential_ended, NodeRow.token_expires_at)
                                   .where(NodeRow.token_hash == digest)).first()  # (not the whole row: most calls)
            if node is not None:
                return node_refusal(node, now) or Principal(NODE, node.id, name=node.name)
        return "unknown token"

    def _checked(self, session: Session, digest: str, now: float) -> Checked | None:
        """The credential with this hash (CHECKED's columns), or None. One without a use limit (the
        crowd's join token, an API key) is read again at most every REREAD_S: a storm of joins on one
        token reads it twice a second, not twice a join. So a revocation reaches the other coordinator
        processes within REREAD_S (this one's at once); an expiry is exact (checked against its time)."""
        kept = self._kept.get(digest)
        if kept is not None and 0 <= now - kept[0] < REREAD_S:
            return kept[1]
        row = session.execute(select(*CHECKED).where(CredentialRow.token_hash == digest)).first()
        if row is not None and row.uses_left is None:
            if len(self._kept) >= MAX_KEPT:
                self._kept.clear()
            self._kept[digest] = (now, row)
        return row

    def create_credential(self, request: JoinTokenRequest | KeyRequest) -> CredentialCreated:
        kind = KEY if isinstance(request, KeyRequest) else JOIN
        token, now = new_token(), self.core.clock()
        row = CredentialRow(id=new_id(), kind=kind, role=getattr(request, "role", None), name=request.name,
                            token_hash=hash_token(token), created_at=now, used=0,
                            expires_at=now + request.expires_in_s if request.expires_in_s else None,
                            uses_left=getattr(request, "uses", None))
        with self.core.lock, self.core.store.session() as session:
            session.add(row)
        return CredentialCreated(**_view(row).model_dump(), token=token)

    def list_credentials(self, kind: str, limit: int | None = None,
                         offset: int = 0) -> tuple[list[CredentialView], int]:
        """A page of the join tokens or keys, oldest first, and how many there are."""
        with self.core.store.session() as session:
            total = session.scalar(select(func.count()).select_from(CredentialRow).where(CredentialRow.kind == kind))
            rows = session.scalars(select(CredentialRow).where(CredentialRow.kind == kind)
                                   .order_by(CredentialRow.created_at, CredentialRow.id).limit(limit).offset(offset))
            return [_view(row) for row in rows], total or 0

    def revoke_credential(self, kind: str, credential_id: str, by: Principal) -> None:
        if credential_id == by.id:
            raise Conflict("you cannot revoke the key you are using; revoke it with another operator key")
        with self.core.lock, self.core.store.session() as session:
            row = session.get(CredentialRow, credential_id)
            if row is None or row.kind != kind:
                raise NotFound(f"no {'join token' if kind == JOIN else 'key'} {credential_id}")
            row.revoked_at = row.revoked_at or self.core.clock()
        self._kept.pop(row.token_hash, None)  # (the other processes read it again within REREAD_S)

    def consume_join(self, session: Session, token: str) -> Principal | str:
        """At a join: the join token (or operator key) it was made with, one use counted; or why not.

        A token with uses left loses one in a single UPDATE that counts down only what is left, so joins
        at once in any number of processes never spend a single-use token twice. An unlimited one (what a
        crowd joins with, thousands at once after an outage) has its uses counted in memory and written
        by `flush_uses`: one row every join updated would make all joins, in all processes, take turns."""
        row = self._checked(session, hash_token(token), self.core.clock())
        if row is None or not (row.kind == JOIN or row.role == "operator"):
            return "wrong join token"
        refusal = credential_refusal(row, self.core.clock())
        if refusal:
            return refusal
        if row.uses_left is None:
            with self._lock:
                self._uses[row.id] += 1
            if not self.core.settings.background:  # no loop to write it (tests drive the coordinator)
                self.flush_uses()
            return Principal(row.kind, row.id, _role(row.role), row.name)
        taken = cast(CursorResult, session.execute(update(CredentialRow).where(
            CredentialRow.id == row.id, CredentialRow.revoked_at.is_(None), CredentialRow.uses_left > 0).values(
            used=CredentialRow.used + 1, uses_left=CredentialRow.uses_left - 1)
            .execution_options(synchronize_session=False))).rowcount
        if not taken:  # spent (or revoked) by another join meanwhile
            row = session.execute(select(*CHECKED).where(CredentialRow.id == row.id)).one()
            return credential_refusal(row, self.core.clock()) or "wrong join token"
        return Principal(row.kind, row.id, _role(row.role), row.name)

    def flush_uses(self) -> None:
        """Write the uses of unlimited join tokens counted since the last time (one statement)."""
        with self._lock:
            uses, self._uses = self._uses, Counter()
        if uses:
            with self.core.store.session() as session:
                session.connection().execute(
                    update(CredentialRow).where(CredentialRow.id == bindparam("credential"))
                    .values(used=CredentialRow.used + bindparam("uses")),
                    [{"credential": credential, "uses": n} for credential, n in uses.items()])


# what a refusal reads of a credential (credential_refusal)
CHECKED = (CredentialRow.id, CredentialRow.kind, CredentialRow.role, CredentialRow.name, CredentialRow.revoked_at,
           CredentialRow.expires_at, CredentialRow.uses_left, CredentialRow.used)


def _view(row: CredentialRow) -> CredentialView:
    return CredentialView(id=row.id, kind=row.kind, role=row.role, name=row.name, created_at=row.created_at,
                          expires_at=row.expires_at, uses_left=row.uses_left, used=row.used, revoked_at=row.revoked_at)
