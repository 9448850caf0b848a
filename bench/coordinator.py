"""How many volunteers a coordinator holds: simulated idle volunteers against real coordinator processes.

Each volunteer is a light asyncio client that joins (POST /v1/nodes) and then heartbeats at the
interval the coordinator gives it (the join's, then each reply's), answering the link probes it is
asked for with a made-up measurement and listening at the address it advertised, so the
coordinator's dial-back reaches it. The volunteers ramp up in levels; at each level the heartbeats of
one window are timed, with the coordinators' CPU (from /proc) and the time their processes spent in
the database (`ravnest_db_seconds_total` of /metrics). A level is held while its heartbeats' p99 stays
under the bound (250 ms) and every due heartbeat was answered. A heartbeat is timed on its connection,
from its request's first byte written to its reply's last byte read: a real node has a connection of
its own, so the time a simulated one waits for one of the CONNECTIONS it shares is the bench's, not
the coordinator's (it is still bounded: a level whose due beats are not all answered is not held).

Three set-ups, each in a fresh data directory: one process on SQLite (the default), one process on
PostgreSQL, two processes on one PostgreSQL (the volunteers split between their URLs). PostgreSQL is
the throwaway server the tests start (tests/postgres.py). Then a join storm: N volunteers joining at
once, as after an outage, against the two processes on PostgreSQL.

    python -m bench.coordinator [--levels 500,1000,2000,5000,10000] [--storm 10000] [--no-docs]

The last line printed is `coordinator held_1proc_sqlite=<n> held_1proc_pg=<n> held_2proc_pg=<n>
p99_ms_at_10000=<t> join_storm_s=<s>` (held: the largest level held; p99 at 10,000: two processes).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import json
from collections import Counter
from urllib.parse import urlsplit

import httpx

from bench.common import command_line, write_section

P99_BOUND_MS = 250.0
WINDOW_S = 20.0  # heartbeats timed per level (after every volunteer of the level joined and beat once)
CONNECTIONS = 16  # keep-alive connections per coordinator URL, shared by the volunteers
PROFILE = {"flops": 2e12, "memory_bytes": 8 << 30, "bandwidth_bytes_per_s": 1.2e8, "latency_s": 0.002,
           "device": "cpu", "cores": 4}
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Timings:
    beats: list[float] = field(default_factory=list)  # seconds, in the current window
    joins: list[float] = field(default_factory=list)
    failed: int = 0
    due: int = 0  # heartbeats the volunteers were due to send in the window
    why: Counter = field(default_factory=Counter)  # why heartbeats failed

    def reset(self) -> None:
        self.beats, self.failed, self.due, self.why = [], 0, 0, Counter()


class Coordinators:
    """N coordinator processes on one database, in a data directory of their own."""

    def __init__(self, processes: int, db_url: str | None, workdir: Path) -> None:
        self.token, self.operator = secrets.token_hex(16), secrets.token_hex(16)
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        env = {**os.environ, "RAVNEST_JOIN_TOKEN": self.token, "RAVNEST_OPERATOR_TOKEN": self.operator}
        for i in range(processes):
            port = free_port()
            args = [sys.executable, "-m", "coordinator.cli", "--port", str(port), "--data-dir", str(workdir),
                    "--no-relay", "--log-level", "warning"]
            if db_url:
                args += ["--db", db_url]
            log = open(workdir / f"coordinator{i}.log", "w")
            self.procs.append(subprocess.Popen(args, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
            self.urls.append(f"http://127.0.0.1:{port}")
            wait_healthy(self.urls[-1], self.procs[-1])

    def cpu_s(self) -> float:
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for proc in self.procs:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        return total

    def db_s(self) -> float:
        total = 0.0
        for url in self.urls:
            text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {self.operator}"}, timeout=30).text
            total += sum(float(line.split()[-1]) for line in text.splitlines()
                         if line.startswith("ravnest_db_seconds_total"))
        return total

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the coordinator at {url} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the coordinator at {url} did not answer within {timeout:.0f} s")


class Refused(Exception):
    """A reply other than 2xx."""


@dataclass
class Reply:
    status_code: int
    body: bytes
    seconds: float = 0.0  # from the request's first byte written to the reply's last read

    def json(self):
        return json.loads(self.body)

    def raise_for_status(self) -> None:
        if not 200 <= self.status_code < 300:
            raise Refused(f"{self.status_code}: {self.body[:200]!r}")


class LightClient:
    """HTTP/1.1 over a few keep-alive connections, just enough to POST JSON: with httpx the simulated
    volunteers took 0.8 of a core at 100 heartbeats/s, taken from the coordinators they measured."""

    def __init__(self, base_url: str, connections: int = CONNECTIONS, timeout: float = 30.0) -> None:
        url = urlsplit(base_url)
        self.host, self.port, self.timeout = url.hostname, url.port, timeout
        self.idle: asyncio.Queue = asyncio.Queue()
        for _ in range(connections):
            self.idle.put_nowait(None)  # a slot; connected on first use

    async def post(self, path: str, json: dict, headers: dict[str, str]) -> Reply:
        body = _dumps(json)
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        request = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(body)}\r\n{head}\r\n").encode() + body
        connection = await self.idle.get()
        try:
            for fresh in (connection is None, True):
                if fresh:
                    connection = await asyncio.open_connection(self.host, self.port)
                reader, writer = connection
                sent = time.perf_counter()
                writer.write(request)
                try:
                    reply = await asyncio.wait_for(_read_reply(reader), self.timeout)
                    break
                except asyncio.IncompleteReadError as e:
                    if fresh or e.partial:
                        raise
                    writer.close()  # the server closed it while idle (its keep-alive timeout): as
                    # clients do, the request goes again on a new connection
            reply.seconds = time.perf_counter() - sent
        except BaseException:
            if connection is not None:
                connection[1].close()
            self.idle.put_nowait(None)
            raise
        self.idle.put_nowait(connection)
        return reply

    async def aclose(self) -> None:
        while not self.idle.empty():
            connection = self.idle.get_nowait()
            if connection is not None:
                connection[1].close()


def _dumps(value: dict) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


async def _read_reply(reader: asyncio.StreamReader) -> Reply:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = next((int(line.split(":", 1)[1]) for line in lines[1:] if line.lower().startswith("content-length:")), 0)
    return Reply(status, await reader.readexactly(length))


class Volunteer:
    """One simulated node: joins, listens where it said, beats at the interval it is told."""

    def __init__(self, index: int, client: LightClient, token: str, timings: Timings,
                 joins: LightClient | None = None) -> None:
        self.index, self.client, self.token, self.timings = index, client, token, timings
        self.joins = joins or client  # the connections it joins over
        self.node_id = self.node_token = ""
        self.interval = 2.0
        self.links: list[dict] = []
        self.server: asyncio.Server | None = None
        self.joined = asyncio.Event()
        self.beating = asyncio.Event()  # set after its first heartbeat

    async def join(self) -> None:
        self.server = await asyncio.start_server(_hang_up, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        body = {"name": f"v{self.index}", "address": f"127.0.0.1:{port}", "profile": PROFILE}
        started = time.perf_counter()
        while True:
            reply = await self.joins.post("/v1/nodes", json=body, headers={"Authorization": f"Bearer {self.token}"})
            if reply.status_code != 429 and reply.status_code < 500:
                break
            await asyncio.sleep(random.uniform(0.5, 2.0))  # refused for load: back off, as a node does
        reply.raise_for_status()
        self.timings.joins.append(time.perf_counter() - started)
        joined = reply.json()
        self.node_id, self.node_token = joined["node_id"], joined["node_token"]
        self.interval = joined["heartbeat_interval_s"]

    async def join_and_beat(self) -> None:
        """As a node does: its first beat follows its join."""
        await self.join()
        await self.beat()

    async def live(self, joining: asyncio.Semaphore) -> None:
        """Join (while `joining` lets it), then beat at the interval told, from the first beat on."""
        async with joining:
            await self.join()
        self.joined.set()
        while True:
            due = time.perf_counter() + self.interval
            await self.beat()
            await asyncio.sleep(max(0.0, due - time.perf_counter()))

    async def beat(self) -> None:
        body = {"links": self.links} if self.links else {}
        self.links = []
        self.timings.due += 1
        try:
            reply = await self.client.post(f"/v1/nodes/{self.node_id}/heartbeat", json=body,
                                           headers={"Authorization": f"Bearer {self.node_token}"})
            reply.raise_for_status()
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, Refused) as e:
            self.timings.failed += 1
            self.timings.why[f"{type(e).__name__}: {e}"[:120]] += 1
            return
        self.timings.beats.append(reply.seconds)  # (what a node with a connection of its own would wait)
        answer = reply.json()
        self.interval = answer.get("heartbeat_interval_s") or self.interval
        self.links = [{"peer_id": p["node_id"], "bandwidth_bytes_per_s": 1e8, "latency_s": 0.001}
                      for p in answer.get("probe", [])]
        self.beating.set()


async def _hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.close()


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def ramp(coordinators: Coordinators, levels: list[int], window_s: float) -> list[dict]:
    """Volunteers added level by level; one window of heartbeats timed at each, until one is not held."""
    timings = Timings()
    # joins and beats on connections of their own: a real node's beat never queues behind another's join
    clients = [LightClient(url) for url in coordinators.urls]
    joins = [LightClient(url) for url in coordinators.urls]
    volunteers: list[Volunteer] = []
    tasks: list[asyncio.Task] = []
    rows = []
    try:
        for level in levels:
            new = [Volunteer(i, clients[i % len(clients)], coordinators.token, timings, joins[i % len(joins)])
                   for i in range(len(volunteers), level)]
            started = time.perf_counter()
            joining = asyncio.Semaphore(200)  # joins at a steady rate, not a storm
            tasks += [asyncio.create_task(v.live(joining)) for v in new]
            await asyncio.wait_for(asyncio.gather(*(v.joined.wait() for v in new)), timeout=600)
            joined_s = time.perf_counter() - started
            volunteers += new
            await asyncio.wait_for(asyncio.gather(*(v.beating.wait() for v in new)), timeout=600)
            timings.reset()
            cpu, db, client = coordinators.cpu_s(), coordinators.db_s(), _own_cpu_s()
            await asyncio.sleep(window_s)
            beats, failed, due = list(timings.beats), timings.failed, timings.due
            cpu, db, client = coordinators.cpu_s() - cpu, coordinators.db_s() - db, _own_cpu_s() - client
            row = {"volunteers": level, "join_s": joined_s,
                   "interval_s": statistics.median(v.interval for v in volunteers),
                   "beats_per_s": len(beats) / window_s, "due_per_s": due / window_s, "failed": failed,
                   "p50_ms": 1e3 * percentile(beats, 0.5), "p99_ms": 1e3 * percentile(beats, 0.99),
                   "cpu": cpu / window_s, "db": db / window_s, "client_cpu": client / window_s}
            row["held"] = row["p99_ms"] < P99_BOUND_MS and failed == 0 and len(beats) >= 0.9 * due
            rows.append(row)
            print(f"  {level:>6} volunteers: joined in {joined_s:5.1f} s, beat every {row['interval_s']:4.1f} s, "
                  f"{row['beats_per_s']:6.1f} beats/s, p50 {row['p50_ms']:6.1f} ms, p99 {row['p99_ms']:6.1f} ms, "
                  f"{failed} failed, coordinator CPU {row['cpu']:.2f} cores, database {row['db']:.2f} s/s, "
                  f"volunteers' CPU {row['client_cpu']:.2f} cores"
                  f"{'' if row['held'] else '  (not held)'}", flush=True)
            for why, n in timings.why.most_common(3):
                print(f"    {n} failed: {why}", flush=True)
            if not row["held"]:
                break
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for v in volunteers:
            if v.server:
                v.server.close()
        for client in clients + joins:
            await client.aclose()
    return rows


async def storm(coordinators: Coordinators, n: int) -> float:
    """Seconds until n volunteers that all join at once have each joined and then beaten once."""
    timings = Timings()
    clients = [LightClient(url, timeout=120) for url in coordinators.urls]
    volunteers = [Volunteer(i, clients[i % len(clients)], coordinators.token, timings) for i in range(n)]
    started = time.perf_counter()
    try:
        await asyncio.gather(*(v.join_and_beat() for v in volunteers))
        return time.perf_counter() - started
    finally:
        for v in volunteers:
            if v.server:
                v.server.close()
        for client in clients:
            await client.aclose()


def held(rows: list[dict]) -> int:
    return max((row["volunteers"] for row in rows if row["held"]), default=0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.coordinator", description=__doc__.split("\n")[0])
    parser.add_argument("--levels", default="500,1000,2000,5000,10000",
                        help="volunteers at each level of the ramp (default: 500,1000,2000,5000,10000)")
    parser.add_argument("--storm", type=int, default=10_000, help="volunteers joining at once (0: no storm)")
    parser.add_argument("--window", type=float, default=WINDOW_S, help="seconds of heartbeats timed per level")
    parser.add_argument("--setups", default="1proc_sqlite,1proc_pg,2proc_pg",
                        help="which set-ups to run (default: all three)")
    parser.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    args = parser.parse_args(argv)
    levels = [int(n) for n in args.levels.split(",")]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a listening socket per volunteer

    sys.path.insert(0, str(ROOT))
    from tests.postgres import PostgresServer

    server = PostgresServer()
    results: dict[str, list[dict]] = {}
    storm_s = float("nan")
    try:
        for setup in args.setups.split(","):
            processes, backend = int(setup[0]), setup.split("_")[1]
            with tempfile.TemporaryDirectory(prefix="ravnest-bench-coord-") as workdir:
                db = server.create_database(f"bench_{setup}") if backend == "pg" else None
                print(f"{setup}: {processes} coordinator process(es) on {'PostgreSQL' if db else 'SQLite'}", flush=True)
                coordinators = Coordinators(processes, db, Path(workdir))
                try:
                    results[setup] = asyncio.run(ramp(coordinators, levels, args.window))
                finally:
                    coordinators.stop()
        if args.storm:
            with tempfile.TemporaryDirectory(prefix="ravnest-bench-storm-") as workdir:
                coordinators = Coordinators(2, server.create_database("bench_storm"), Path(workdir))
                try:
                    storm_s = asyncio.run(storm(coordinators, args.storm))
                finally:
                    coordinators.stop()
            print(f"join storm: {args.storm} volunteers joined at once and beat once in {storm_s:.1f} s", flush=True)
    finally:
        server.stop()

    at_10000 = next((row["p99_ms"] for row in results.get("2proc_pg", []) if row["volunteers"] == 10_000),
                    float("nan"))
    summary = (f"coordinator held_1proc_sqlite={held(results.get('1proc_sqlite', []))} "
               f"held_1proc_pg={held(results.get('1proc_pg', []))} held_2proc_pg={held(results.get('2proc_pg', []))} "
               f"p99_ms_at_10000={at_10000:.0f} join_storm_s={storm_s:.1f}")
    if not args.no_docs:
        table = ["| set-up | volunteers | joins took | beat every | heartbeats/s done / due | p50 | p99 | "
                 "coordinator CPU (cores) | database (s/s) | held |", "|---" * 10 + "|"]
        for setup, rows in results.items():
            table += [f"| {setup} | {r['volunteers']:,} | {r['join_s']:.1f} s | {r['interval_s']:.1f} s | "
                      f"{r['beats_per_s']:.0f} / {r['due_per_s']:.0f} | {r['p50_ms']:.0f} ms | {r['p99_ms']:.0f} ms | "
                      f"{r['cpu']:.2f} | {r['db']:.2f} | {'yes' if r['held'] else 'no'} |" for r in rows]
        write_section("Coordinator: volunteers held", (
            f"`{command_line('bench.coordinator', argv)}`\n\n"
            f"Simulated idle volunteers (asyncio clients on this machine, sharing its 2 cores with the coordinators "
            f"and PostgreSQL) join, listen for the dial-back, answer link probes and beat at the interval they are "
            f"given. A level is held while the heartbeats' p99 stays under {P99_BOUND_MS:.0f} ms and every due "
            f"heartbeat is answered.\n\n" + "\n".join(table) +
            f"\n\nJoin storm ({args.storm:,} volunteers at once, 2 processes on PostgreSQL): {storm_s:.1f} s.\n\n"
            f"`{summary}`"))
    print(summary)


if __name__ == "__main__":
    main()
