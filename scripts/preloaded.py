"""`python -m MODULE ARGS` as a real process forked from one that has imported torch already.

A node's start is mostly imports: torch, and torch._dynamo, which the first optimizer pulls in (3.5 of
its 5.5 CPU-seconds here), and the test suite starts hundreds of nodes on 2 cores. Forked from a
process that imported them once (multiprocessing's forkserver), each node still is its own process
with its own environment, working directory, network namespace, log, signals and exit status; it
runs the same `main` a shell would, and pays only for its own work. What a user runs (`make demo`,
`ravnest-node join`) starts fresh interpreters; `LocalCluster.preloaded = True` is for the tests. (A
script that sets it needs the `if __name__ == "__main__":` guard: the forkserver imports the main module.)
"""
from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import warnings
from pathlib import Path

from ravnest.forking import preloaded_context

# imported once, before any fork (ravnest/forking.py); none opens a socket or starts a thread when imported
PRELOADED = ["torch.func", "node.cli", "node.daemon", "node.profiler",
             "coordinator.cli", "coordinator.app", "sklearn.cluster"]


def _run(module: str, args: list[str], env: dict[str, str], cwd: str, log: str, namespace: str | None) -> None:
    """In the forked child: become `python -m module args` writing to `log`, in network `namespace` if
    one is named (as `ip netns exec` would put it there)."""
    if namespace:
        from ravnest.pipeline.local import enter_network_namespace
        enter_network_namespace(namespace)  # (one thread so far: every thread it starts is in there too)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (1, 2):
        os.dup2(fd, stream)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [module, *args]
    # (runpy would say the module was imported before it ran: here that is the point)
    warnings.filterwarnings("ignore", "'.*' found in sys.modules after import of package", RuntimeWarning)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


class Forked:
    """The part of subprocess.Popen's interface the tests use, for a process forked by the forkserver
    (whose exit status the forkserver reports back)."""

    def __init__(self, module: str, args: list[str], env: dict[str, str], cwd: Path, log: Path,
                 namespace: str | None = None):
        self._process = preloaded_context(PRELOADED).Process(
            target=_run, args=(module, list(args), dict(env), str(cwd), str(log), namespace),
            name=module, daemon=True)  # stopped if the test process exits
        self._process.start()
        self.pid = self._process.pid
        self.args = [sys.executable, "-m", module, *args]

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
