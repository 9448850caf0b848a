"""The node's Prometheus metrics, served by `ravnest-node join --metrics-port`.

Besides prometheus_client's process figures (resident memory, CPU seconds, open files) and the
bytes per peer that the wire counts (ravnest.wire.traffic), every stage this node runs exports the
figures it reports to the coordinator, as gauges named `ravnest_stage_<figure>` with the labels
job, cluster and stage: step, samples_per_s, utilization, bubble, staleness, in_flight (micro-batches
between forward and weight gradient: the pipeline's queue depth), memory_peak_bytes, and the
averaging strategy's `avg_*` (rounds, round seconds, stall seconds). A stage's series go away when
its job ends on this node.
"""
from __future__ import annotations

import threading

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.registry import Collector

from ravnest.telemetry import stage_gauges

LABELS = ["job", "cluster", "stage"]


class StageFigures(Collector):
    """The latest figures of each stage this process runs, read at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stages: dict[tuple[str, int, int], dict[str, float]] = {}

    def update(self, job: str, cluster: int, stage: int, figures: dict[str, float]) -> None:
        with self._lock:
            self._stages[(job, cluster, stage)] = {**self._stages.get((job, cluster, stage), {}), **figures}

    def forget(self, job: str, cluster: int, stage: int) -> None:
        with self._lock:
            self._stages.pop((job, cluster, stage), None)

    def collect(self):
        with self._lock:
            stages = sorted(self._stages.items())
        yield from stage_gauges(LABELS, (((job, str(cluster), str(stage)), figures)
                                         for (job, cluster, stage), figures in stages))


STAGES = StageFigures()  # one per process: several daemons in one process (tests) share it by their labels
REGISTRY.register(STAGES)


def serve(host: str, port: int) -> int:
    """Serve /metrics on host:port (0: any free port) from a daemon thread; returns the port."""
    server, _thread = start_http_server(port, addr=host)
    return server.server_address[1]
