"""A coordinator and N node daemons as real local processes on loopback: the README demo and the
end-to-end tests both run on this."""
from __future__ import annotations

import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx

from scripts.preloaded import Forked

ROOT = Path(__file__).resolve().parent.parent
TERMINAL_STATES = {"completed", "failed", "cancelled"}
_ACCESS_LINE = re.compile(r'INFO: +[\d.:\[\]a-f]+ - "(GET|POST|PUT|DELETE) ')  # uvicorn's access log


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_ANSWERING: list[socket.socket] = []


def answering_address(host: str = "127.0.0.1") -> str:
    """host:port where connections are accepted (by the kernel; nothing is ever read) for as long as
    this process runs: what a node the test plays over REST advertises, so that the coordinator's
    dial-back finds it reachable and jobs are placed on it."""
    listening = socket.create_server((host, 0))
    _ANSWERING.append(listening)
    return f"{host}:{listening.getsockname()[1]}"


def cpu_seconds(pid: int) -> float:
    """User and system CPU a process has used (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    """A process's resident memory now (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS")


class LocalCluster:
    preloaded = False  # fork processes from one that imported torch once (the tests' conftest.py sets it)

    def __init__(self, data_dir: Path, nodes: int = 4, threads_per_node: int = 1, node_args: list[str] = (),
                 tls: bool = False, heartbeat_timeout: float | None = None, relay: bool = True,
                 coordinator_args: list[str] = (), join_timeout: float = 600.0):
        self.data_dir = Path(data_dir)
        self.join_timeout = join_timeout  # the most a start waits for nodes that still make progress
        self.nodes = nodes
        self.node_args = list(node_args)  # extra `ravnest-node join` flags, e.g. ["--max-memory", "1GiB"]
        self.threads_per_node = threads_per_node
        # nodes a test joins over REST beat only when it says so: a long timeout keeps them alive on a slow machine
        # the coordinator's relay on a free port (its default, --port + 1, may be taken), or none
        self.coordinator_args: list[str] = ["--relay-port", "0"] if relay else ["--no-relay"]
        if heartbeat_timeout is not None:
            self.coordinator_args += ["--heartbeat-timeout", str(heartbeat_timeout)]
        self.coordinator_args += coordinator_args  # extra `ravnest-coordinator` flags
        self.coordinator_log = "coordinator.log"  # the current coordinator's log (another after a restart)
        verify: ssl.SSLContext | bool = True
        if tls:  # HTTPS to the coordinator, TLS between nodes, all checked against a CA made here
            from scripts.make_certs import make_certificates
            certs = make_certificates(self.data_dir / "certs", ["127.0.0.1", "localhost"])
            served = ["--tls-cert", str(certs["cert"]), "--tls-key", str(certs["key"])]
            self.coordinator_args += served
            self.node_args += [*served, "--tls-ca", str(certs["ca"])]
            verify = ssl.create_default_context(cafile=certs["ca"])
        self.host = "127.0.0.1"  # where the coordinator listens and the nodes serve
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{free_port()}"
        self.procs: list[subprocess.Popen] = []
        self.http = httpx.Client(base_url=self.url, timeout=30, verify=verify)

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen:
        """`python -m *args`, writing to logs/`log_name`: a fresh interpreter, or, where the cluster is
        `preloaded`, forked from one that imported torch already (scripts/preloaded.py)."""
        logs = self.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = open(logs / log_name, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(self.threads_per_node)}
        if getattr(self, "join_token", None):  # in the environment, not in `ps` for anybody on the machine to read
            env["RAVNEST_JOIN_TOKEN"] = self.join_token
        namespace = self._namespace(log_name)
        if self.preloaded:
            log.close()
            proc: subprocess.Popen = Forked(args[0], args[1:], env, ROOT, logs / log_name,  # type: ignore[assignment]
                                            namespace=namespace)
        else:
            launcher = ["ip", "netns", "exec", namespace] if namespace else []
            proc = subprocess.Popen([*launcher, sys.executable, "-m", *args], cwd=ROOT, stdout=log,
                                    stderr=subprocess.STDOUT, env=env)
        self.procs.append(proc)
        return proc

    def _namespace(self, log_name: str) -> str | None:
        """The network namespace a process runs in: none here; a testbed's are its own."""
        return None

    def _node_args(self, index: int) -> list[str]:
        return []

    def start(self, timeout: float = 600.0) -> None:
        """The coordinator, then the nodes, waited for while they make progress (`wait_joined`)."""
        self._start_coordinator(timeout)
        names = [self._node_name(self._spawn_node()) for _ in range(self.nodes)]
        self.wait_joined(names, timeout)

    def _node_name(self, proc: subprocess.Popen) -> str:
        return f"node-{self.procs.index(proc) - 1}"

    def wait_joined(self, names: list[str], timeout: float = 600.0, stalled_s: float = 60.0) -> set[str]:
        """Wait until the nodes called `names` have joined; their ids. On a busy machine joining takes as
        long as it takes: the wait goes on while some node still joining uses CPU (imports, profiling,
        probing), and fails once none of them has for `stalled_s`, or after `timeout` in all, naming each
        node that did not join and the end of its log."""
        deadline, progressed = time.monotonic() + timeout, time.monotonic()
        procs = {name: self.procs[1 + int(name.rsplit("-", 1)[1])] for name in names}
        spent = {name: -1.0 for name in names}
        while True:
            joined = {n["name"]: n["id"] for n in self.alive_nodes() if n["name"] in procs}
            missing = sorted(set(procs) - set(joined), key=lambda name: int(name.rsplit("-", 1)[1]))
            if not missing:
                return set(joined.values())
            now = time.monotonic()
            for name in missing:
                cpu = cpu_seconds(procs[name].pid)
                if cpu > spent[name]:
                    spent[name], progressed = cpu, now
            exited = [name for name in missing if procs[name].poll() is not None]
            if exited or now - progressed > stalled_s or now > deadline:
                why = (f"{', '.join(exited)} exited" if exited else
                       f"none of them used any CPU for {stalled_s:.0f} s" if now - progressed > stalled_s else
                       f"not within {timeout:.0f} s")
                raise TimeoutError(f"{len(missing)} of {len(names)} nodes did not join ({why}):" + "".join(
                    f"\n{name} ({self._state(procs[name])}); its log ends:\n{self.log_tail(f'{name}.log', 8)}"
                    for name in missing))
            time.sleep(0.25)  # polling a remote HTTP API: there is nothing local to wait on

    @staticmethod
    def _state(proc: subprocess.Popen) -> str:
        code = proc.poll()
        return "still running" if code is None else f"exited with code {code}"

    def _spawn_node(self, extra_args: list[str] = ()) -> subprocess.Popen:
        i = len(self.procs) - 1  # node i is procs[1 + i]
        return self._spawn(["node.cli", "join", "--coordinator", self.url,
                            "--name", f"node-{i}", "--data-dir", str(self.data_dir / "nodes" / f"node-{i}"),
                            "--threads", str(self.threads_per_node), *self._node_args(i),
                            *self.node_args, *extra_args], f"node-{i}.log")

    def add_nodes(self, count: int, extra_args: list[str] = (), timeout: float = 600.0) -> set[str]:
        """Start `count` more nodes at once (e.g. mid-job), wait until they joined; returns their ids."""
        return self.wait_joined([self._node_name(self._spawn_node(extra_args)) for _ in range(count)], timeout)

    def _start_coordinator(self, timeout: float, log_name: str = "coordinator.log") -> None:
        port = self.url.rsplit(":", 1)[1]
        proc = self._spawn(["coordinator.cli", "--host", self.host, "--port", port,
                            "--data-dir", str(self.data_dir), *self.coordinator_args], log_name)
        self.procs.remove(proc)
        self.procs.insert(0, proc)  # procs[0] is the coordinator, procs[1 + i] node i
        self.coordinator_log = log_name
        self.wait_for(lambda: self._healthy(), timeout, "coordinator to answer /healthz")
        # secure by default: the coordinator made its tokens; this client acts as the operator
        self.operator_token = (self.data_dir / "operator_token").read_text().strip()
        self.join_token = (self.data_dir / "join_token").read_text().strip()
        self.http.headers["Authorization"] = f"Bearer {self.operator_token}"

    def kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL: the process gets no chance to say goodbye (a volunteer's machine vanishing)."""
        proc.kill()
        proc.wait()

    def node_process(self, node_id: str) -> subprocess.Popen:
        name = {n["id"]: n["name"] for n in self.http.get("/v1/nodes").json()}[node_id]
        return self.procs[1 + int(name.rsplit("-", 1)[1])]

    def restart_coordinator(self, timeout: float = 60.0) -> None:
        """Kill the coordinator with SIGKILL and start a new one on the same port and database."""
        self.kill(self.procs.pop(0))
        self._start_coordinator(timeout, "coordinator-restarted.log")

    def _healthy(self) -> bool:
        try:
            return self.http.get("/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    def alive_nodes(self) -> list[dict]:
        return [n for n in self.http.get("/v1/nodes").json() if n.get("state") != "gone"]

    def wait_for(self, condition, timeout: float, what: str, interval: float = 0.25, ignore_exits=False):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() not in (None, -signal.SIGKILL) and not ignore_exits:  # killed on purpose
                    raise RuntimeError(f"a process exited early (code {proc.returncode}) while waiting for {what}; "
                                       f"see {self.data_dir / 'logs'}")
            result = condition()
            if result:
                return result
            time.sleep(interval)  # polling a remote HTTP API: there is nothing local to wait on
        exited = [(i, proc.returncode) for i, proc in enumerate(self.procs[1:]) if proc.poll() is not None]
        raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}; the coordinator's log ends:\n"
                           + self.log_tail(self.coordinator_log) + "".join(
                               f"\nnode-{i} exited (code {code}); its log ends:\n" + self.log_tail(f"node-{i}.log")
                               for i, code in exited))

    def log_tail(self, log_name: str, lines: int = 20) -> str:
        """The last lines of a process's log: what a failed wait shows of why (CI keeps no files). HTTP
        access lines are left out: a waiting test's own polls would fill the tail."""
        try:
            text = (self.data_dir / "logs" / log_name).read_text(errors="replace")
            return "\n".join([line for line in text.splitlines() if not _ACCESS_LINE.match(line)][-lines:])
        except OSError as e:
            return f"({e})"

    def submit(self, job: dict) -> str:
        response = self.http.post("/v1/jobs", json=job)
        response.raise_for_status()
        return response.json()["id"]

    def job(self, job_id: str) -> dict:
        response = self.http.get(f"/v1/jobs/{job_id}")
        if response.status_code != 200:  # a body without "state" would fail later with a bare KeyError
            raise RuntimeError(f"GET /v1/jobs/{job_id}: {response.status_code} {response.text[:500]}; "
                               f"the coordinator's log ends:\n{self.log_tail(self.coordinator_log)}")
        return response.json()

    def wait_job(self, job_id: str, timeout: float, on_update=None) -> dict:
        def finished():
            job = self.job(job_id)
            if on_update:
                on_update(job)
            return job if job["state"] in TERMINAL_STATES else None
        return self.wait_for(finished, timeout, f"job {job_id} to finish", interval=1.0)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the nodes first (they leave while the coordinator is still up), then the coordinator."""
        coordinator, nodes = self.procs[:1], self.procs[1:]
        for group in (nodes, coordinator):
            for proc in group:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for proc in group:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.http.close()

    def __enter__(self):
        try:
            self.start(self.join_timeout)
        except BaseException:  # a failed start (or Ctrl-C during it) leaves nothing running
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()
