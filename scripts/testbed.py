"""A bandwidth-shaped testbed of real processes (deploy/testbed/netns.sh): the coordinator in
namespace rvn-hub at 10.77.0.254 on the bridge, node i in namespace rvn-m<i> at 10.77.0.<i+1>, each
node's link shaped to its tier (Mbit/s) with tbf both ways. The coordinator profiles the nodes and
measures their links itself, as it would on the internet. Nodes listed in `natted` sit behind a NAT
router of their own (192.168.<i>.2) and accept no inbound connection: peers reach them only through
a relay. Nodes given a `Line` reach the bridge through a delay line (deploy/testbed/linedelay.py):
a round trip, jitter and loss, packet by packet. Needs root, ip and tc (and iptables for NAT); only
rvn-* namespaces are touched, and they are deleted on exit.

    python -m scripts.testbed 400 400 100 100 25 25     # up, print what the coordinator sees, down
    python -m scripts.testbed 100 100:nat 100 100:nat   # nodes 1 and 3 behind NAT
    python -m scripts.testbed 100,rtt=100,jitter=10 100,rtt=50:nat   # 100 ms +- 10 and 50 ms to the hub
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from dataclasses import dataclass
from typing import Collection, Iterator, Mapping

import httpx

from ravnest.pipeline.local import enter_network_namespace
from scripts.local_cluster import ROOT, LocalCluster

NETNS = ROOT / "deploy" / "testbed" / "netns.sh"
HUB, SUBNET = "rvn-hub", "10.77.0"
HUB_ADDRESS = f"{SUBNET}.254"
# The namespaces' names and addresses are fixed, so one testbed runs at a time on a host: a second
# (another pytest worker, a bench beside the tests) waits for this lock instead of tearing down the first.
LOCK = Path(tempfile.gettempdir()) / "ravnest-testbed.lock"
RUN = Path("/run/ravnest-testbed")  # netns.sh's line emulators' pid and settings files


@dataclass(frozen=True)
class Line:
    """What a member's line adds to every round trip through it (a path between two members crosses
    both of theirs), and the share of frames it loses each way."""
    rtt_ms: float
    jitter_ms: float = 0.0
    loss: float = 0.0

    def options(self) -> str:
        return f",rtt={self.rtt_ms:g},jitter={self.jitter_ms:g},loss={self.loss:g}"


def member(tier_mbit: float, line: Line | None = None, nat: bool = False) -> str:
    """netns.sh's word for one member."""
    return f"{tier_mbit:g}{line.options() if line else ''}{':nat' if nat else ''}"


@contextlib.contextmanager
def namespaces(members: list[str]) -> Iterator[None]:
    """netns.sh's testbed of `members` (see `member`) while the block runs, holding the host's testbed lock."""
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, after the namespaces are gone
        try:
            subprocess.run(["bash", str(NETNS), "up", *members], check=True, timeout=60)
            yield
        finally:
            subprocess.run(["bash", str(NETNS), "down"], check=False, timeout=60)


def set_line(index: int, line: Line) -> None:
    """Change member `index`'s running line (it must have come up with one)."""
    subprocess.run(["bash", str(NETNS), "line", str(index), f"{line.rtt_ms:g}", f"{line.jitter_ms:g}",
                    f"{line.loss:g}"], check=True, timeout=10)


def set_rate(index: int, mbit: float) -> None:
    """Change member `index`'s bandwidth, both ways."""
    subprocess.run(["bash", str(NETNS), "rate", str(index), f"{mbit:g}"], check=True, timeout=10)


def line_cpu_seconds(index: int) -> float:
    """CPU seconds member `index`'s line emulator has used so far."""
    pid = (RUN / f"d{index}.pid").read_text().strip()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def unavailable(nat: bool = False) -> str | None:
    """Why no testbed (with NAT routers: `nat`) can run here, or None."""
    if os.geteuid() != 0:
        return "the testbed needs root (network namespaces, tc)"
    missing = [tool for tool in ("ip", "tc", *(("iptables",) if nat else ())) if shutil.which(tool) is None]
    return f"the testbed needs {', '.join(missing)} (Debian: iproute2, iptables)" if missing else None


class NamespacedClient:
    """An httpx client whose sockets live in a network namespace: every call runs on one thread that
    entered it (a namespace is per thread), so the test process itself stays where it is."""

    def __init__(self, namespace: str, base_url: str, timeout: float = 30.0):
        self._thread = ThreadPoolExecutor(1, initializer=enter_network_namespace, initargs=(namespace,))
        self._client: httpx.Client = self._thread.submit(httpx.Client, base_url=base_url, timeout=timeout).result()
        self.headers = self._client.headers

    def request(self, method: str, url: str, **kwargs) -> httpx.Response:
        return self._thread.submit(self._client.request, method, url, **kwargs).result()

    def get(self, url: str, **kwargs) -> httpx.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs) -> httpx.Response:
        return self.request("POST", url, **kwargs)

    def close(self) -> None:
        if not self._client.is_closed:  # a failed start and the context manager's exit both close it
            self._thread.submit(self._client.close).result()
        self._thread.shutdown()


class ShapedTestbed(LocalCluster):
    def __init__(self, data_dir: Path, tiers_mbit: list[float], threads_per_node: int = 1,
                 node_args: list[str] = (), natted: Collection[int] = (), args_of: dict[int, list[str]] | None = None,
                 relay: bool = True, lines: Mapping[int, Line] | None = None):
        """`args_of`: more `ravnest-node join` flags for some nodes, by index; `lines`: their delay lines."""
        super().__init__(data_dir, nodes=len(tiers_mbit), threads_per_node=threads_per_node, node_args=node_args,
                         relay=relay)
        self.tiers, self.natted, self.args_of = list(tiers_mbit), set(natted), args_of or {}
        self.lines = dict(lines or {})
        self.host, self.url = HUB_ADDRESS, f"http://{HUB_ADDRESS}:8470"
        self.http.close()
        self.http = None
        self._namespaces: contextlib.ExitStack | None = None

    def _namespace(self, log_name: str) -> str:
        return HUB if log_name.startswith("coordinator") else f"rvn-m{log_name.split('-')[1].split('.')[0]}"

    def _node_args(self, index: int) -> list[str]:
        return ["--host", f"192.168.{index}.2" if index in self.natted else f"{SUBNET}.{index + 1}",
                *self.args_of.get(index, [])]

    def start(self, timeout: float = 120.0) -> None:
        members = [member(tier, self.lines.get(i), i in self.natted) for i, tier in enumerate(self.tiers)]
        self._namespaces = contextlib.ExitStack()
        try:
            self._namespaces.enter_context(namespaces(members))
            self.http = NamespacedClient(HUB, self.url)
            self._start_coordinator(timeout)
            # one at a time: hosts that would each have their own CPU do not slow each other's profiling down here
            for _ in range(self.nodes):
                self.wait_joined([self._node_name(self._spawn_node())], timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 20.0) -> None:
        try:
            if self.http is not None:
                super().stop(timeout)
            else:
                for proc in self.procs:
                    proc.kill()
        finally:
            if self._namespaces is not None:
                self._namespaces.close()
                self._namespaces = None

    def tier_of(self, node: dict) -> float:
        """The tier (Mbit/s) of a node from the coordinator's list, by its name (node-<i>)."""
        return self.tiers[int(node["name"].rsplit("-", 1)[1])]


def main() -> int:
    members = sys.argv[1:] or ["400", "400", "100", "100", "25", "25"]
    natted = [i for i, m in enumerate(members) if m.endswith(":nat")]
    words = [m.removesuffix(":nat").split(",") for m in members]
    tiers = [float(w[0]) for w in words]
    lines = {i: Line(**{k.replace("rtt", "rtt_ms").replace("jitter", "jitter_ms"): float(v)
                        for k, v in (o.split("=", 1) for o in w[1:])}) for i, w in enumerate(words) if w[1:]}
    reason = unavailable(nat=bool(natted))
    if reason:
        print(reason, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch, \
            ShapedTestbed(Path(scratch), tiers, natted=natted, lines=lines) as testbed:
        for node in sorted(testbed.alive_nodes(), key=lambda n: n["name"]):
            print(f"{node['name']} {node['address']} tier {testbed.tier_of(node):g} Mbit/s: measured "
                  f"{node['profile']['bandwidth_bytes_per_s'] * 8 / 1e6:.0f} Mbit/s to the coordinator, "
                  f"{node['profile']['flops'] / 1e9:.0f} GFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
