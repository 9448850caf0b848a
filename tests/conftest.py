"""Fixtures shared by several test modules."""
from __future__ import annotations

import itertools

import pytest

from ravnest.wire import close_channels
from scripts.local_cluster import LocalCluster
from tests.postgres import PostgresServer

# nodes and coordinators forked from a process that imported torch once: real processes, each paying
# for its own work only (scripts/preloaded.py); most of the suite's CPU was imports
LocalCluster.preloaded = True


def pytest_collection_modifyitems(config, items):
    """Modules with slow tests first (`--dist loadfile` hands modules out in this order): the long ones
    start at once, and the many short ones fill in at the end, so that neither worker idles long. Soak
    tests (minutes of chaos) run only where asked for by name (`-m soak`: `make soak`)."""
    if "soak" not in (config.getoption("markexpr") or ""):
        soak = [item for item in items if item.get_closest_marker("soak")]
        config.hook.pytest_deselected(items=soak)
        items[:] = [item for item in items if item not in soak]
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # (stable: each module keeps its own order)


@pytest.fixture(autouse=True)
def _fresh_channels():
    """Each test dials with fresh channels: a channel the default pool kept to a server an earlier test
    stopped is in reconnect backoff, and the OS hands that port to the next test's server, whose first
    calls would then fail as UNAVAILABLE ("connection refused") without ever reaching it."""
    yield
    close_channels()


_databases = itertools.count()


@pytest.fixture(scope="session")
def postgres_server():
    """One PostgreSQL server for the session, or a skip saying why there is none."""
    pytest.importorskip("psycopg", reason="PostgreSQL tests need psycopg (pip install -e .[postgres])")
    try:
        server = PostgresServer()
    except (RuntimeError, OSError) as e:
        pytest.skip(f"no PostgreSQL server for this test: {e}")
    yield server
    server.stop()


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """A fresh, empty database on the session's server."""
    return postgres_server.create_database(f"ravnest_test_{next(_databases)}")


@pytest.fixture
def migrated_postgres_url(postgres_server) -> str:
    """A fresh database with the newest schema, as a coordinator would leave an empty one."""
    return postgres_server.create_database(f"ravnest_test_{next(_databases)}", postgres_server.migrated_template())
