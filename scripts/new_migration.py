"""Write the next schema migration from the difference between the models (coordinator/store.py) and
the newest migration: `python scripts/new_migration.py "what changed"`, then read and adjust the file
it names in coordinator/migrations/versions/. tests/test_migrations.py fails until models and
migrations agree."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from coordinator.store import upgrade  # noqa: E402


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    config = Config()
    config.set_main_option("script_location", str(Path(__file__).resolve().parents[1] / "coordinator/migrations"))
    head = ScriptDirectory.from_config(config).get_current_head()
    with tempfile.TemporaryDirectory() as scratch:
        engine = create_engine(f"sqlite:///{scratch}/head.db")
        upgrade(engine)  # a database at the newest migration, to compare the models with
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.revision(config, message=sys.argv[1], autogenerate=True, rev_id=f"{int(head) + 1:04d}")
        engine.dispose()


if __name__ == "__main__":
    main()
