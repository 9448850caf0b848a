"""The node daemon: join the coordinator, heartbeat, run the stages it is assigned, report back."""
from __future__ import annotations

import queue
import tempfile
import threading
import traceback
from pathlib import Path

import httpx
import torch

from node.client import CoordinatorClient, CoordinatorError
from node.links import LinkProber
from node.profiler import profile_node
from node.progress import Progress
from ravnest.averaging import make_averager
from ravnest.pipeline.memory import release_free_memory
from ravnest.pipeline.stage import StageRunner
from ravnest.spec import JoinRequest, MetricsReport, StageAssignment
from ravnest.wire import PeerServer, Router


class MetricsReporter:
    """Sends metrics from a thread of its own so the training worker never waits on HTTP.
    If the coordinator is slow, older reports are dropped in favour of newer ones."""

    def __init__(self, client: CoordinatorClient, job_id: str):
        self._client, self._job_id = client, job_id
        self._queue: queue.Queue = queue.Queue(maxsize=64)
        self._thread = threading.Thread(target=self._send_all, name="metrics-reporter", daemon=True)
        self._thread.start()

    def put(self, report: MetricsReport) -> None:
        while True:
            try:
                self._queue.put_nowait(report)
                return
            except queue.Full:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    pass

    def _send_all(self) -> None:
        while (report := self._queue.get()) is not None:
            try:
                self._client.report_metrics(self._job_id, report)
            except (httpx.HTTPError, CoordinatorError):
                pass  # metrics are best effort; the next report carries newer figures

    def close(self, timeout: float = 30.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)


class NodeDaemon:
    def __init__(self, client: CoordinatorClient, *, device: torch.device, host: str = "127.0.0.1",
                 port: int = 0, advertise: str | None = None, name: str = "",
                 progress: Progress | None = None, max_memory: int | None = None):
        self.client = client
        self.max_memory = max_memory
        self.device = device
        self.name = name
        self.progress = progress or Progress()
        self.router = Router(wait_for_route=60.0)  # peers of a job get their assignments at different heartbeats
        self._job_tokens: set[str] = set()
        self._probe_tokens: set[str] = set()  # the coordinator's, once joined: peers may Ping us
        self.server = PeerServer(self.router, host, port, token=lambda: self._job_tokens,
                                 ping_token=lambda: self._probe_tokens)
        self._prober: LinkProber | None = None
        self._note = ""  # the coordinator's last word on why this node is idle
        self.address = f"{advertise or host}:{self.server.port}"
        self._job: tuple[str, threading.Thread, threading.Event] | None = None
        self._finished: set[str] = set()

    def serve(self, stop: threading.Event) -> None:
        """Join, then heartbeat until `stop` is set; runs assigned stages in a worker thread."""
        profile = profile_node(self.client.http, self.device, self.max_memory)
        joined = self.client.join(JoinRequest(name=self.name, address=self.address, profile=profile))
        self.progress.log(f"joined as {joined.node_id} at {self.address} ({profile.device}, "
                          f"{profile.flops / 1e9:.1f} GFLOP/s, offers {profile.memory_bytes / 2**30:.2f} GiB)")
        if joined.probe_token:
            self._probe_tokens = {joined.probe_token}
            self._prober = LinkProber(joined.probe_token)
        try:
            while not stop.is_set():
                self._heartbeat()
                stop.wait(joined.heartbeat_interval_s)
        finally:
            self._stop_job(timeout=30.0)
            try:
                self.client.leave()
                self.progress.log("left the coordinator")
            except (httpx.HTTPError, CoordinatorError) as e:
                self.progress.log(f"could not leave cleanly: {e}")
            if self._prober:
                self._prober.close()
            self.server.stop()

    def _running_job_id(self) -> str | None:
        if self._job and self._job[1].is_alive():
            return self._job[0]
        return None

    def _heartbeat(self) -> None:
        links = self._prober.take() if self._prober else []
        try:
            reply = self.client.heartbeat(self._running_job_id(), links)
        except (httpx.HTTPError, CoordinatorError) as e:
            self.progress.log(f"heartbeat failed, will retry: {e}")
            return
        if reply.probe and self._prober:
            self._prober.ask(reply.probe)
        if reply.note and reply.note != self._note:
            self.progress.log(f"coordinator: {reply.note}")
        self._note = reply.note
        if reply.cancel_job and self._job and reply.cancel_job == self._job[0]:
            self.progress.log(f"job {reply.cancel_job} was cancelled; stopping")
            self._job[2].set()
        assignment = reply.assignment
        if assignment and assignment.job_id not in self._finished and self._running_job_id() is None:
            stop = threading.Event()
            thread = threading.Thread(target=self._run_job, args=(assignment, stop), name="job", daemon=True)
            self._job = (assignment.job_id, thread, stop)
            thread.start()

    def _run_job(self, a: StageAssignment, stop: threading.Event) -> None:
        prefix = f"job {a.job_id[:8]} cluster {a.cluster} stage {a.stage + 1}/{a.num_stages}"
        predicted = f", predicted memory {a.predicted_memory_bytes / 2**20:.0f} MiB" if a.predicted_memory_bytes else ""
        self.progress.log(f"{prefix}: blocks {a.blocks[0]}..{a.blocks[1] - 1}{predicted}")
        reporter = MetricsReporter(self.client, a.job_id)
        self._job_tokens.add(a.token)

        def on_metrics(metrics: dict[str, float]) -> None:
            reporter.put(MetricsReport(node_id=self.client.node_id, cluster=a.cluster, stage=a.stage,
                                       step=int(metrics.get("step", 0)), metrics=metrics))
            self.progress.update(prefix, metrics)

        runner = None
        try:
            runner = StageRunner(a, self.router, device=self.device, on_metrics=on_metrics)
            # The averager works on the runner's live tensors, so it is attached once they exist.
            runner.averager = make_averager(a, self.router, runner.live_tensors(), device=self.device,
                                            optimizer_state=runner.optimizer_tensors)
            final = runner.run(stop)
            self.progress.update(prefix, final, final=True)
            if "memory_peak_bytes" in final:
                peak = final["memory_peak_bytes"] / 2**20
                self.progress.log(f"{prefix}: peak memory {peak:.0f} MiB above idle{predicted}")
            reporter.close()  # final metrics reach the coordinator before the weights do
            with tempfile.TemporaryDirectory(prefix="ravnest-weights-") as folder:
                weights = Path(folder) / "stage.safetensors"
                runner.save_weights(weights)
                self.client.upload_weights(a.job_id, a.cluster, a.stage, weights)
            self.progress.log(f"{prefix}: done, weights uploaded")
        except Exception as e:  # report any failure to the coordinator, which fails the job with the reason
            reporter.close()
            reason = f"node {self.client.node_id} ({prefix}): {type(e).__name__}: {e}"
            self.progress.log(reason + "\n" + traceback.format_exc())
            if not stop.is_set():
                try:
                    self.client.report_failure(a.job_id, reason)
                except (httpx.HTTPError, CoordinatorError):
                    pass
        finally:
            if runner is not None and runner.averager is not None:
                runner.averager.close()  # leave the job's rings: the next job joins its own
            self._finished.add(a.job_id)
            self._job_tokens.discard(a.token)
            self.router.clear()
            runner = None
            release_free_memory()  # an idle volunteer gets its memory back

    def _stop_job(self, timeout: float) -> None:
        if self._job and self._job[1].is_alive():
            self._job[2].set()
            self._job[1].join(timeout)

