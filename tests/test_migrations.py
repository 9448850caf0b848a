"""Schema migrations (Alembic, coordinator/migrations): an existing database is upgraded in place at
start and keeps its rows, on SQLite and on a real PostgreSQL; the migrations and the models agree."""
from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from coordinator.store import FIRST_REVISION, Base, CurvePointRow, JobRow, NodeRow, Store, upgrade


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path: Path) -> str:
    return request.getfixturevalue("postgres_url") if request.param == "postgresql" else f"sqlite:///{tmp_path}/c.db"


def fill_first_revision(url: str, *, forget_migrations: bool = False) -> None:
    """A database at the first revision with a node, a job and a credential in it; without its
    alembic_version table when `forget_migrations` (as Ravnest made them before it had migrations)."""
    engine = create_engine(url)
    upgrade(engine, FIRST_REVISION)
    with engine.begin() as db:
        assert "curve_points" not in inspect(db).get_table_names()
        db.execute(text("INSERT INTO nodes (id, name, address, profile, token_hash, state, joined_at, last_seen) "
                        "VALUES ('n1', 'old node', '10.0.0.1:5000', '{}', 'h', 'idle', 1.0, 2.0)"))
        db.execute(text("INSERT INTO jobs (id, name, spec, state, reason, created_at, updated_at, history, "
                        "generation, faults) VALUES ('j1', 'old job', '{}', 'completed', 'done', 1.0, 2.0, '[]', 0, "
                        "'[]')"))
        db.execute(text("INSERT INTO credentials (id, kind, name, token_hash, created_at, used) "
                        "VALUES ('k1', 'key', 'alice', 'hash-of-alice', 1.0, 0)"))
        if forget_migrations:
            db.execute(text("DROP TABLE alembic_version"))
    engine.dispose()


@pytest.mark.parametrize("forget_migrations", [False, True], ids=["first-revision", "before-migrations"])
def test_an_older_database_is_upgraded_at_start_and_keeps_its_rows(url: str, forget_migrations: bool) -> None:
    fill_first_revision(url, forget_migrations=forget_migrations)
    store = Store(url)  # what the coordinator does at start
    try:
        with store.session() as session:
            assert session.get(NodeRow, "n1").name == "old node"
            assert session.get(JobRow, "j1").name == "old job" and session.get(JobRow, "j1").state == "completed"
            session.add(CurvePointRow(job_id="j1", cluster=0, step=1, at=3.0, loss=0.5))  # the new table works
        with store.session() as session:
            assert session.scalar(text("SELECT name FROM credentials WHERE id = 'k1'")) == "alice"
            assert session.scalar(text("SELECT count(*) FROM curve_points")) == 1
            head = session.scalar(text("SELECT version_num FROM alembic_version"))
        assert head == sorted(p.name for p in (Path(__file__).parents[1] / "coordinator/migrations/versions")
                              .glob("*.py"))[-1].split("_")[0]
    finally:
        store.close()
    Store(url).close()  # starting again on an up-to-date database changes nothing


def test_the_migrations_build_exactly_the_models_schema(url: str) -> None:
    """A model changed without a migration fails here, not on a user's database."""
    engine = create_engine(url)
    upgrade(engine)
    with engine.connect() as db:
        assert compare_metadata(MigrationContext.configure(db), Base.metadata) == []
    engine.dispose()
