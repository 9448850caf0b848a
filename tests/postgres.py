"""A throwaway PostgreSQL server for tests: initdb into a temporary directory, listening on
127.0.0.1 only, trust authentication for local connections, stopped (immediate mode) afterwards.
The server binaries come from the machine (Debian's postgresql package); without them the tests
that need PostgreSQL are skipped with the reason."""
from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

BIN_DIRS = [Path("/usr/lib/postgresql") / v / "bin" for v in ("17", "16", "15", "14", "13")]
USER = "ravnest"
PORT_ATTEMPTS = 5


def find_binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    return next((str(d / name) for d in BIN_DIRS if (d / name).exists()), None)


class PostgresServer:
    def __init__(self):
        self._template: str | None = None  # (migrated_template)
        self.initdb, self.pg_ctl = find_binary("initdb"), find_binary("pg_ctl")
        if not self.initdb or not self.pg_ctl:
            raise RuntimeError("PostgreSQL server binaries (initdb, pg_ctl) not found")
        # A directory of its own right under the temp root, so that the server user can reach it.
        self.base = base = Path(tempfile.mkdtemp(prefix="ravnest-pg-"))
        self.data = base / "data"
        # initdb refuses to run as root: run the server as the machine's `postgres` user then
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as:
            try:
                owner = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError("running as root and there is no 'postgres' user to run the server") from None
            os.chown(base, owner.pw_uid, owner.pw_gid)
        self._run([self.initdb, "-D", str(self.data), "-U", USER, "-A", "trust", "--no-sync", "-E", "UTF8"])
        for attempt in range(PORT_ATTEMPTS):
            # a port free a moment ago may be taken before the server binds it (tests beside it open
            # ports all the time; a CI run lost its PostgreSQL tests to "Address already in use")
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port = s.getsockname()[1]
            try:
                self._run([self.pg_ctl, "-D", str(self.data), "-l", str(base / "server.log"), "-w", "-t", "60",
                           "-o", f"-c listen_addresses=127.0.0.1 -p {self.port} -k {base} -c fsync=off", "start"])
                return
            except RuntimeError:
                if attempt == PORT_ATTEMPTS - 1 or "Address already in use" not in self._log():
                    raise

    def _log(self) -> str:
        try:
            return (self.base / "server.log").read_text(errors="replace")
        except OSError:
            return ""

    def _run(self, command: list[str]) -> None:
        result = subprocess.run(self._as + command, capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{Path(command[0]).name} failed: {result.stderr.strip() or result.stdout.strip()}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{USER}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str, template: str | None = None) -> str:
        """An empty database, or a copy of `template` (which nobody may be connected to)."""
        import psycopg
        copy = f' TEMPLATE "{template}"' if template else ""
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user={USER} dbname=postgres", autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"{copy}')
        return self.url(name)

    def migrated_template(self) -> str:
        """A database at the newest migration that tests copy (0.07 s) instead of migrating each (0.3 s)."""
        if self._template is None:
            from sqlalchemy import create_engine

            from coordinator.store import upgrade
            engine = create_engine(self.create_database("ravnest_migrated"))
            try:
                upgrade(engine)
            finally:
                engine.dispose()  # (a template must have no connections)
            self._template = "ravnest_migrated"
        return self._template

    def stop(self) -> None:
        subprocess.run(self._as + [self.pg_ctl, "-D", str(self.data), "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(self.base, ignore_errors=True)
