"""What lets several coordinator processes share one PostgreSQL: the change lock and the leader lease.

The change lock. Every change the coordinator makes is one transaction taken under `Core.lock`, and
its correctness rests on that: a join, a placement and a re-plan each read, decide and write as if
alone. Within one process a threading.RLock gives that. Across processes on PostgreSQL, ChangeLock
adds a session-level advisory lock (pg_advisory_lock) taken on a connection of its own before the
transaction starts and let go after it commits, so the transactions of all processes take turns as
the threads of one did: the same argument, with the database as the referee. What does not change
anything (a quiet heartbeat, a listing, a download) takes no lock, in any process.

Why one lock and not row locks: the decisions read many rows (a placement reads every idle node and
every pending job), so row locks would have to cover nearly everything any decision reads, and
serializable transactions would fail and retry under exactly the load that matters. The locked work
is the rare part (a probe round, a join, a report): bench.coordinator measures what it holds.

Keyed locks. A join changes no other node's row and no job's, so it need not wait for every other
change: what it must not race is another join (or a move) to the same address or under the same
identity. On PostgreSQL, `hold_keys` takes a transaction-level advisory lock per key (pg_advisory_xact_lock
on the key's hash, let go at commit or rollback). A path that also needs the change lock takes that
first, then its keys, so the order is always the same and no two transactions wait on each other in a
circle. On SQLite (one process, whose joins take the change lock) `hold_keys` does nothing.

The leader lease. Background work that must happen once (the liveness tick: silent nodes, stalled
stages, recoveries that waited long enough, placing, pruning) runs in the process holding another
advisory lock, taken with pg_try_advisory_lock and kept as long as its connection lives. A process
that dies loses it with its connection: at once when it exits or is killed (its socket closes), and
within KEEPALIVE_S when its machine or its network goes (the server's TCP keepalives, set for that
connection). Any other process's next tick takes it.

On SQLite (one process per file: store.py) both are what they were: an RLock, and always the leader.
"""
from __future__ import annotations

import logging
import threading
from contextlib import AbstractContextManager, nullcontext

from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

log = logging.getLogger(__name__)

CHANGE_KEY, LEADER_KEY = 0x7261766E_6C6F636B, 0x7261766E_6C656164  # advisory lock ids ("ravnlock", "ravnlead")
KEYED = 0x7261766B  # the first half of a keyed lock's two-part id ("ravk"): a space apart from the two above
WAIT_S = 60  # a change waits this long at most for the other processes' (then it fails, and says why)
KEEPALIVE_S = (5, 2, 3)  # idle, interval, count: a dead peer's connection ends within about 11 s


def is_postgres(url: str) -> bool:
    return url.startswith("postgresql")


class _OwnConnection:
    """One connection of its own to PostgreSQL, outside the pool, in autocommit, with short TCP
    keepalives on both ends; opened again after it breaks."""

    def __init__(self, url: str) -> None:
        idle, interval, count = KEEPALIVE_S
        self._engine: Engine = create_engine(url, poolclass=NullPool, isolation_level="AUTOCOMMIT", connect_args={
            "keepalives": 1, "keepalives_idle": idle, "keepalives_interval": interval, "keepalives_count": count})
        self._connection: Connection | None = None

    def scalar(self, sql: str, **params) -> object:
        if self._connection is None:
            self._connection = self._engine.connect()
            idle, interval, count = KEEPALIVE_S
            for name, value in (("tcp_keepalives_idle", idle), ("tcp_keepalives_interval", interval),
                                ("tcp_keepalives_count", count), ("lock_timeout", f"{WAIT_S}s")):
                self._connection.execute(text(f"SET {name} = '{value}'"))
        try:
            return self._connection.execute(text(sql), params).scalar()
        except DBAPIError:
            self.drop()
            raise

    def drop(self) -> None:
        """Close it (what it held, PostgreSQL lets go)."""
        if self._connection is not None:
            try:
                self._connection.close()
            except DBAPIError:
                pass
            self._connection = None

    def close(self) -> None:
        self.drop()
        self._engine.dispose()


class ChangeLock:
    """Core.lock: reentrant within a thread; on PostgreSQL, also held against the other processes."""

    def __init__(self, url: str) -> None:
        self._local = threading.RLock()
        self._depth = 0  # how deep the holding thread is (the advisory lock is taken once)
        self._db = _OwnConnection(url) if is_postgres(url) else None

    def __enter__(self) -> ChangeLock:
        self._local.acquire()
        if self._depth == 0 and self._db is not None:
            try:
                self._take()
            except BaseException:
                self._local.release()
                raise
        self._depth += 1
        return self

    def __exit__(self, *_: object) -> None:
        self._depth -= 1
        try:
            if self._depth == 0 and self._db is not None:
                try:
                    self._db.scalar("SELECT pg_advisory_unlock(:key)", key=CHANGE_KEY)
                except DBAPIError:
                    pass  # the connection broke, and the lock went with it
        finally:
            self._local.release()

    @property
    def shared(self) -> bool:
        """Held against other processes (PostgreSQL), where keyed locks let joins skip it."""
        return self._db is not None

    def own_rows(self) -> AbstractContextManager:
        """For a write to rows nothing else decides on at once (when nodes were last seen, what dialling a
        node found): this lock on SQLite, where a writer that finds the file locked sleeps up to 100 ms a
        try, so writers do best taking turns; nothing on PostgreSQL, whose row locks are enough."""
        return nullcontext() if self.shared else self

    def hold_keys(self, session: Session, *keys: str | None) -> None:
        """Advisory locks on `keys` (None: skipped) for the rest of `session`'s transaction, on PostgreSQL
        (see the module's docstring); in sorted order, so two holders of the same keys never deadlock."""
        if self._db is None:
            return
        held = sorted({key for key in keys if key})
        if held:  # one round trip; one statement, so the same order for every caller
            session.execute(text("SELECT " + ", ".join(f"pg_advisory_xact_lock(:space, hashtext(:key{i}))"
                                                       for i in range(len(held)))),
                            {"space": KEYED, **{f"key{i}": key for i, key in enumerate(held)}})

    def _take(self) -> None:
        assert self._db is not None
        try:
            self._db.scalar("SELECT pg_advisory_lock(:key)", key=CHANGE_KEY)
        except DBAPIError:  # a broken connection (the database restarted): once more, on a new one
            self._db.scalar("SELECT pg_advisory_lock(:key)", key=CHANGE_KEY)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()


class Lease:
    """Whether this process is the one that runs the background work (see the module's docstring)."""

    def __init__(self, url: str) -> None:
        self._db = _OwnConnection(url) if is_postgres(url) else None
        self._held = self._db is None

    def held(self) -> bool:
        """Held now: taken if free, and still connected if held before (a broken connection lost it)."""
        if self._db is None:
            return True
        try:
            was = self._held
            self._held = bool(self._db.scalar("SELECT true") if was
                              else self._db.scalar("SELECT pg_try_advisory_lock(:key)", key=LEADER_KEY))
            if self._held and not was:
                log.info("this coordinator process now runs the background work (liveness, placing, re-planning)")
        except DBAPIError as e:
            if self._held:
                log.warning("this coordinator process lost the lead (its database connection broke: %s)", e)
            self._held = False
        return self._held

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
