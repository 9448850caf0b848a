"""The coordinator's SQL store: nodes, the links they measured, jobs and the stages of each placed job.

Only portable SQLAlchemy types (String, Integer, Float, Boolean, Text, JSON), so the same models run
on SQLite (the default, a file in the data directory) and on PostgreSQL given its URL. JSON columns
are always replaced, never mutated in place, so SQLAlchemy notices the change. The schema changes only
through a migration (coordinator/migrations/versions/), which every start applies.
"""
from __future__ import annotations

import fcntl
import importlib.resources
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from alembic import command
from alembic.config import Config
from pydantic import BaseModel
from sqlalchemy import (JSON, Boolean, Float, ForeignKey, Integer, String, Text, create_engine, event, func,
                        inspect, select)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqlalchemy.types import TypeDecorator

from ravnest.errors import RavnestError

from .changes import Changes
from .schemas import Recovery

ID = String(32)
FIRST_REVISION = "0001"  # the schema as it was before migrations (create_all), with these tables:
FIRST_TABLES = ("credentials", "jobs", "links", "nodes", "checkpoints", "stages")


class ModelList(TypeDecorator):
    """A list of pydantic models kept as a JSON array: typed in Python, plain JSON in the database (so
    records written before a field existed still read, with its default)."""
    impl = JSON
    cache_ok = True

    def __init__(self, model: type[BaseModel]) -> None:
        super().__init__()
        self.model = model

    def process_bind_param(self, value: list[BaseModel] | None, dialect: Any) -> list[dict] | None:
        return None if value is None else [item.model_dump(mode="json", exclude_defaults=True) for item in value]

    def process_result_value(self, value: list[dict] | None, dialect: Any) -> list[BaseModel] | None:
        return None if value is None else [self.model.model_validate(item) for item in value]


class Base(DeclarativeBase):
    pass


COORDINATOR_RELAY = "coordinator"  # `relayed_by` of a node on the coordinator's own relay


class NodeRow(Base):
    __tablename__ = "nodes"
    id: Mapped[str] = mapped_column(ID, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    address: Mapped[str] = mapped_column(String(256), index=True)
    profile: Mapped[dict[str, Any]] = mapped_column(JSON)
    token_hash: Mapped[str] = mapped_column(String(64), index=True)
    # the hash of the secret in the node's identity file (`ravnest-node join --identity`): a node that
    # restarts with it gets this row back, its id and history (None: a new row at every join)
    identity_hash: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    token_expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)  # pushed on by every heartbeat
    credential_ended: Mapped[str | None] = mapped_column(String(16), nullable=True)  # None | "left" | "revoked"
    state: Mapped[str] = mapped_column(String(16), index=True)  # idle | busy | gone
    joined_at: Mapped[float] = mapped_column(Float)
    last_seen: Mapped[float] = mapped_column(Float, index=True)
    # the heartbeat interval it was last told (None: the configured one); it is silent after
    # heartbeat_timeout_factor of them (service/presence.py)
    beat_interval_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    job_id: Mapped[str | None] = mapped_column(ID, nullable=True, index=True)
    # its failure reports are claims (failure_policy.py): when the re-plans they caused happened, and
    # until when it is not placed because they were too many
    replans_caused: Mapped[list[float] | None] = mapped_column(JSON, nullable=True)
    quarantined_until: Mapped[float | None] = mapped_column(Float, nullable=True)
    # refusals are accusations (failure_rules/accusations.py): who accused it and when, whom it accused and
    # when, as [[node id, at], ...] within the quarantine window
    accusers: Mapped[list[list[Any]] | None] = mapped_column(JSON, nullable=True)
    accused: Mapped[list[list[Any]] | None] = mapped_column(JSON, nullable=True)
    quarantine_reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    # its profile is a claim: the FLOP/s its stages measured where they were far below it (failure_policy.py)
    measured_flops: Mapped[float | None] = mapped_column(Float, nullable=True)
    # so is its bandwidth: what its peers measured of its links where that was far below it (calibration.py)
    measured_bandwidth: Mapped[float | None] = mapped_column(Float, nullable=True)
    # its stages' compute seconds as measured over as predicted, recent jobs weighing most (calibration.py)
    slowdown: Mapped[float | None] = mapped_column(Float, nullable=True)
    # what one message between its stages and their neighbours cost, as its jobs' pace measured (calibration.py)
    message_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    # both on each model it trained ({"gpt": {"slowdown": 4.1, "message_s": 0.0004}}): models differ
    by_model: Mapped[dict[str, dict[str, float]] | None] = mapped_column(JSON, nullable=True)
    # whether peers can dial its address (None: not found out yet), and how that was found (reachability.py)
    reachable: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    reachability: Mapped[str | None] = mapped_column(Text, nullable=True)
    # the port it relays on for nodes that cannot be dialled (`ravnest-node join --relay`), and the relay
    # it was offered itself, if it cannot be (a node's id, or COORDINATOR_RELAY: the built-in relay)
    relay_port: Mapped[int | None] = mapped_column(Integer, nullable=True)
    relayed_by: Mapped[str | None] = mapped_column(String(32), nullable=True)
    # the port of its relay for its own peers: those nobody can dial listen there for what it sends them
    peer_relay_port: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # the host it joined at: what its TLS certificate names, once a relay's address has replaced it
    tls_name: Mapped[str | None] = mapped_column(String(255), nullable=True)
    # the job it trains on alone, as its last heartbeat said (a recovery waits for that: recovery.py)
    training_alone: Mapped[str | None] = mapped_column(ID, nullable=True)


class JobRow(Base):
    __tablename__ = "jobs"
    id: Mapped[str] = mapped_column(ID, primary_key=True)
    name: Mapped[str] = mapped_column(String(256), default="")
    owner: Mapped[str | None] = mapped_column(ID, nullable=True, index=True)  # the submitting key's id
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[float] = mapped_column(Float, index=True)
    updated_at: Mapped[float] = mapped_column(Float)
    history: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)  # [{state, at, reason}]
    plan: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    final_metrics: Mapped[dict[str, float] | None] = mapped_column(JSON, nullable=True)
    generation: Mapped[int] = mapped_column(Integer, default=0)  # re-plans so far (after a loss, or a resume)
    # where the next generation's stages get their state: {"step", "sources": [{"file", "blocks", "step"}]}
    resume: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    faults: Mapped[list[Recovery]] = mapped_column(ModelList(Recovery), default=list)  # one per re-plan


class StageRow(Base):
    """One stage of one cluster of a placed job: who runs it, what it reported, whether it finished."""
    __tablename__ = "stages"
    job_id: Mapped[str] = mapped_column(ID, ForeignKey("jobs.id"), primary_key=True)
    cluster: Mapped[int] = mapped_column(Integer, primary_key=True)
    stage: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_id: Mapped[str] = mapped_column(ID, index=True)
    delivered: Mapped[bool] = mapped_column(Boolean, default=False)  # the node was handed its assignment
    step: Mapped[int] = mapped_column(Integer, default=0)
    metrics: Mapped[dict[str, float]] = mapped_column(JSON, default=dict)
    weights_uploaded: Mapped[bool] = mapped_column(Boolean, default=False)
    updated_at: Mapped[float] = mapped_column(Float, default=0.0)


class CheckpointRow(Base):
    """A stage's state (parameters, optimizer state) at one step, kept in the job's directory: periodic
    checkpoints of cluster 0, and snapshots every stage hands in when its job is re-planned."""
    __tablename__ = "checkpoints"
    job_id: Mapped[str] = mapped_column(ID, ForeignKey("jobs.id"), primary_key=True)
    file: Mapped[str] = mapped_column(String(256), primary_key=True)  # relative to the job's directory
    kind: Mapped[str] = mapped_column(String(16))  # periodic | snapshot
    generation: Mapped[int] = mapped_column(Integer)
    block_start: Mapped[int] = mapped_column(Integer)
    block_end: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer, index=True)
    created_at: Mapped[float] = mapped_column(Float)


class OfferRow(Base):
    """A file a node offers under a name, by its fingerprint, and whether it proved it holds it
    (ravnest/data/proof.py): first (nobody offered this content before: it answers the bank),
    challenged (its answer is awaited: `expected` is a banked holder's), proven, or refused."""
    __tablename__ = "offers"
    node_id: Mapped[str] = mapped_column(ID, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(96), index=True)
    state: Mapped[str] = mapped_column(String(16))
    challenge: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)  # {nonce, ranges, expected}
    offered_at: Mapped[float] = mapped_column(Float)
    reason: Mapped[str] = mapped_column(Text, default="")


class ChallengeRow(Base):
    """A challenge a proven holder answered, kept to check one later claimant of the same content."""
    __tablename__ = "challenges"
    nonce: Mapped[str] = mapped_column(String(32), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(96), index=True)
    ranges: Mapped[list[list[int]]] = mapped_column(JSON)
    answer: Mapped[str] = mapped_column(String(64))


class CredentialRow(Base):
    """A credential the operator handed out, stored as its hash: a join token (volunteers join with
    it, maybe a limited number of times) or an API key with a role (operator, submitter, reader)."""
    __tablename__ = "credentials"
    id: Mapped[str] = mapped_column(ID, primary_key=True)
    kind: Mapped[str] = mapped_column(String(8), index=True)  # join | key
    role: Mapped[str | None] = mapped_column(String(16), nullable=True)  # keys only
    name: Mapped[str] = mapped_column(String(128), default="")
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    uses_left: Mapped[int | None] = mapped_column(Integer, nullable=True)  # join tokens; None: unlimited
    used: Mapped[int] = mapped_column(Integer, default=0)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class CurvePointRow(Base):
    """A point of a job's training curve: what a last stage reported at a step (its training loss,
    and its test accuracy and loss when it had just evaluated)."""
    __tablename__ = "curve_points"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ID, ForeignKey("jobs.id"), index=True)
    cluster: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    at: Mapped[float] = mapped_column(Float)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    test_accuracy: Mapped[float | None] = mapped_column(Float, nullable=True)
    samples_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    test_loss: Mapped[float | None] = mapped_column(Float, nullable=True)


class LoginLinkRow(Base):
    """An unused one-time dashboard link (login_links.py): the key it stands for, sealed with the code."""
    __tablename__ = "login_links"
    code_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    sealed_key: Mapped[str] = mapped_column(Text)
    expires_at: Mapped[float] = mapped_column(Float, index=True)


class LinkRow(Base):
    """A link one node measured to another (directional: latency and upload bandwidth from `node_id`)."""
    __tablename__ = "links"
    node_id: Mapped[str] = mapped_column(ID, primary_key=True)
    peer_id: Mapped[str] = mapped_column(ID, primary_key=True, index=True)
    bandwidth: Mapped[float] = mapped_column(Float)  # bytes/s
    latency: Mapped[float] = mapped_column(Float)  # round trip, seconds
    measured_at: Mapped[float] = mapped_column(Float)
    spread: Mapped[float] = mapped_column(Float, default=1.0, server_default="1.0")  # its repeats' largest / smallest
    rounds: Mapped[int] = mapped_column(Integer, default=1, server_default="1")  # probe rounds that measured it


POOL_SIZE = 24  # THREADS (app.py) and a few for the background loops


class Store:
    def __init__(self, url: str) -> None:
        connect_args = {"check_same_thread": False} if url.startswith("sqlite") else {}
        # as many connections kept as threads ask for them (the server's thread pool and the background
        # loops): an overflow connection is opened and closed for each use
        self.engine = create_engine(url, connect_args=connect_args, pool_size=POOL_SIZE, max_overflow=POOL_SIZE)
        if url.startswith("sqlite"):
            event.listen(self.engine, "connect", _sqlite_pragmas)
        upgrade(self.engine)
        _check_columns(self.engine)
        self._held = None
        if self.engine.url.get_backend_name() == "sqlite" and self.engine.url.database not in (None, "", ":memory:"):
            self._held = _hold_alone(self.engine.url.database)
            os.chmod(self.engine.url.database, 0o600)  # node records and job specs: the owner's only
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._readers = sessionmaker(self.engine.execution_options(isolation_level="AUTOCOMMIT"))
        self.db_seconds = 0.0  # time spent waiting on statements (ravnest_db_seconds_total of /metrics)
        event.listen(self.engine, "before_cursor_execute", self._started)
        event.listen(self.engine, "after_cursor_execute", self._finished)
        self.changes = Changes()  # what live views wait on: bumped by transactions that wrote
        event.listen(self._sessions, "after_flush", lambda session, _: session.info.__setitem__("wrote", True))

    @contextmanager
    def session(self, quiet: bool = False) -> Iterator[Session]:
        """A transaction: committed when the block ends normally, rolled back on any exception. A
        quiet one wakes no live view (what it writes, when nodes were last seen, shows nothing new)."""
        with self._sessions.begin() as session:
            yield session
        if session.info.get("wrote") and not quiet:
            self.changes.bump()

    @contextmanager
    def reading(self) -> Iterator[Session]:
        """For what only reads, where each statement may see the database as it is when it runs (as
        every statement of a `session` does on PostgreSQL, read committed): no transaction around them,
        so no BEGIN and COMMIT, which were two of a quiet heartbeat's three round trips. Nothing written
        here is kept."""
        with self._readers() as session:
            yield session

    @staticmethod
    def _started(connection, *_: Any) -> None:
        connection.info["statement_started"] = time.perf_counter()

    def _finished(self, connection, *_: Any) -> None:
        self.db_seconds += time.perf_counter() - connection.info.pop("statement_started", time.perf_counter())

    def count(self, model: type[Base]) -> int:
        with self._sessions() as session:
            return session.scalar(select(func.count()).select_from(model)) or 0

    def close(self) -> None:
        self.engine.dispose()
        if self._held is not None:
            self._held.close()  # (which releases its lock)


def _sqlite_pragmas(connection: Any, _: Any) -> None:
    """Write-ahead logging: readers never wait for the writer, and a commit appends to the log instead
    of syncing the database file (synchronous=NORMAL: a power cut may lose the last commits, never
    corrupt the file); a writer that finds the file locked waits up to 30 s instead of failing."""
    cursor = connection.cursor()
    for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "busy_timeout=30000"):
        cursor.execute(f"PRAGMA {pragma}")
    cursor.close()


def upgrade(engine, revision: str = "head") -> None:
    """Bring the database to `revision` with Alembic's migrations (coordinator/migrations/versions): a
    new database is created, an older one upgraded in place. One made before Ravnest had migrations
    (tables but no alembic_version) is completed as Ravnest then did (create_all of the first
    revision's tables) and stamped with the first revision; columns it lacks are _check_columns' to find."""
    config = Config()
    config.set_main_option("script_location", str(importlib.resources.files("coordinator") / "migrations"))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        tables = set(inspect(connection).get_table_names())
        if tables and "alembic_version" not in tables:
            Base.metadata.create_all(connection, tables=[Base.metadata.tables[name] for name in FIRST_TABLES])
            command.stamp(config, FIRST_REVISION)
        command.upgrade(config, revision)


class StoreInUse(RavnestError, RuntimeError):
    """Another coordinator process has the SQLite file open."""


def _hold_alone(database: str):
    """One coordinator process per SQLite file: its soft state and its lock are per process, and SQLite
    serialises writers across processes anyway. Held (an flock on DATABASE.lock) until the store closes;
    the kernel drops it when the process dies, so a crash never leaves it behind."""
    held = open(f"{database}.lock", "a")
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held.close()
        raise StoreInUse(f"another coordinator process is using {database}: one SQLite file serves one coordinator "
                         f"process; stop the other, or run several coordinators on PostgreSQL (--db "
                         f"postgresql+psycopg://...)") from None
    return held


class SchemaError(RavnestError, RuntimeError):
    """The database was created by an older Ravnest and lacks columns this one needs."""


def _check_columns(engine) -> None:
    """A database older than the first migration may lack columns: say so plainly instead of failing
    on the first query that needs one."""
    inspector = inspect(engine)
    missing = [f"{table.name}.{column.name}" for table in Base.metadata.sorted_tables
               for column in table.columns
               if column.name not in {c["name"] for c in inspector.get_columns(table.name)}]
    if missing:
        raise SchemaError(f"the database at {engine.url!r} was created by an older Ravnest and lacks "
                          f"{', '.join(missing)}; it predates the migrations this version upgrades with: keep it "
                          f"aside and start with a new --data-dir (or --db)")


def stages_of(session: Session, job_id: str) -> list[StageRow]:
    return list(session.scalars(select(StageRow).where(StageRow.job_id == job_id)
                                .order_by(StageRow.cluster, StageRow.stage)))


def members_of(session: Session, job_id: str) -> dict[str, NodeRow]:
    """The nodes holding a stage of the job, by id."""
    return {node.id: node for node in session.scalars(select(NodeRow).where(NodeRow.id.in_(
        select(StageRow.node_id).where(StageRow.job_id == job_id))))}


def stage_of_node(session: Session, job_id: str, node_id: str) -> StageRow | None:
    return session.scalars(select(StageRow).where(StageRow.job_id == job_id, StageRow.node_id == node_id)).first()
