"""Alembic's entry point for the coordinator's store: run from coordinator/store.py (`upgrade`) with
the connection in `config.attributes["connection"]`; there is no alembic.ini. A schema change is a
model change in coordinator/store.py plus a new file in versions/ (scripts/new_migration.py writes it)."""
from __future__ import annotations

from alembic import context

from coordinator.store import Base

connection = context.config.attributes["connection"]
# SQLite cannot alter most of a table in place: batch mode copies the table instead
context.configure(connection=connection, target_metadata=Base.metadata,
                  render_as_batch=connection.dialect.name == "sqlite")
with context.begin_transaction():
    context.run_migrations()
