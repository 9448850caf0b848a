"""Link probes the coordinator asks for: latency and bandwidth to a peer over its gRPC Ping, measured
on a thread of their own so heartbeats never wait on a slow or unreachable peer."""
from __future__ import annotations

import logging
import queue
import threading

import grpc

from ravnest.relay.dial import dial
from ravnest.spec import LATENCY, SPREAD, LinkReport, PeerProbe, plausible_bandwidth
from ravnest.timeouts import LINK_PROBE_S
from ravnest.wire import ProbeStopped, measure_link, name_peer

log = logging.getLogger(__name__)
PROBE_BYTES = 1 << 20  # the first probe (about a second at 10 Mbit/s); 4x larger ones follow on fast links
MAX_QUEUED = 16
STAND_ASIDE_S = 2.0  # longest a node starting a stage waits for its probe under way to end (0.1 s when cancelled)


def reachability_line(address: str, reachable: bool, how: str, relayed: bool = False) -> str:
    """What the node logs when the coordinator tells it whether peers can dial it (`relayed`: it
    offered a relay, which this node uses)."""
    if reachable:
        return f"reachable at {address}: {how}"
    if relayed:
        return f"peers cannot dial this node at {address}: {how}. It will be reached through a relay"
    return (f"peers cannot dial this node at {address}: {how}. Listen on an address they reach (--host 0.0.0.0 "
            f"--advertise <public address>) and let the port in, or let it use a relay (docs/volunteer.md)")


class LinkProber:
    """Measures the links it is asked to, one at a time; `take()` hands over what was measured."""

    def __init__(self, token: str, probe_bytes: int = PROBE_BYTES):
        self._token, self._probe_bytes = token, probe_bytes
        self._todo: queue.Queue[PeerProbe | None] = queue.Queue(MAX_QUEUED)
        self._queued: set[str] = set()
        self._done: list[LinkReport] = []
        self._unreached: list[str] = []  # peers it could not dial since the last `take`
        self._lock = threading.Lock()
        self._measured = threading.Condition(self._lock)
        self._stop = threading.Event()  # set: the probe under way is cancelled (`stand_aside`)
        self._thread = threading.Thread(target=self._run, name="link-prober", daemon=True)
        self._thread.start()

    def ask(self, probes: list[PeerProbe]) -> None:
        """Queue probes not already queued; more than the queue holds are dropped (asked again later)."""
        for probe in probes:
            with self._lock:
                if probe.node_id in self._queued:
                    continue
                self._queued.add(probe.node_id)
            try:
                self._todo.put_nowait(probe)
            except queue.Full:
                with self._lock:
                    self._queued.discard(probe.node_id)

    def stand_aside(self, wait_s: float = STAND_ASIDE_S) -> None:
        """This node starts training: forget the probes not started yet and cancel the one under way,
        waiting up to `wait_s` for it to end. A probe's megabytes (up to 16 MiB a ping, on both ends) would
        take the job's link and be counted in its stage's peak memory; the coordinator asks again once the
        node is idle."""
        with self._measured:
            self._stop.set()
            while True:
                try:
                    probe = self._todo.get_nowait()
                except queue.Empty:
                    break
                if probe is None:  # closing: leave the end marker for the thread
                    self._todo.put_nowait(None)
                    break
                self._queued.discard(probe.node_id)
            self._measured.wait_for(lambda: not self._queued, timeout=wait_s)
            self._stop.clear()

    def take(self, wait: float = 0.0) -> tuple[list[LinkReport], list[str]]:
        """The links measured since the last call, and the peers it could not dial; waits up to `wait`
        seconds for a first one."""
        with self._measured:
            self._measured.wait_for(lambda: self._done or self._unreached, timeout=wait)
            done, self._done, unreached, self._unreached = self._done, [], self._unreached, []
        return done, unreached

    def _run(self) -> None:
        while (probe := self._todo.get()) is not None:
            try:
                if probe.tls_name:
                    name_peer(probe.address, probe.tls_name)
                link = measure_link(probe.address, token=self._token, probe_bytes=self._probe_bytes,
                                    timeout=LINK_PROBE_S, stop=self._stop)  # the process's shared channels
                report = LinkReport(peer_id=probe.node_id, bandwidth_bytes_per_s=plausible_bandwidth(link.bandwidth),
                                    latency_s=min(link.latency, LATENCY["le"]), spread=min(link.spread, SPREAD["le"]))
            except ProbeStopped:
                report, unreached = None, False
            except (grpc.RpcError, ValueError) as e:  # unreachable, refused, or a malformed address
                log.info("link probe to %s (%s) failed: %s", probe.node_id, probe.address, e)
                report = None
                # no connection at all, as opposed to a peer that answered and refused the probe, or one
                # behind a slow link (a relay's) that took longer than the probe may: it can be dialled
                unreached = not isinstance(e, grpc.RpcError) or e.code() == grpc.StatusCode.UNAVAILABLE or \
                    e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not dial(probe.address)[0]
            with self._measured:
                self._queued.discard(probe.node_id)
                if report is not None:
                    self._done.append(report)
                elif unreached:
                    self._unreached.append(probe.node_id)
                self._measured.notify_all()

    def settle(self, timeout: float) -> bool:
        """With probes under way, wait up to `timeout` seconds for them to finish and say True: the
        next heartbeat should go now, with what they measured (their targets are probed by nobody
        else until it is reported). False at once when none are under way."""
        with self._measured:
            if not self._queued:
                return False
            self._measured.wait_for(lambda: not self._queued, timeout=timeout)
            return True

    def close(self, timeout: float = 5.0) -> None:
        try:
            self._todo.put_nowait(None)
        except queue.Full:
            pass  # daemon thread: it ends with the process
        self._thread.join(timeout)
