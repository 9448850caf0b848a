"""The node daemon: join the coordinator, heartbeat, run the stages it is assigned, report back."""
from __future__ import annotations

import logging
import math
import os
import queue
import shutil
import tempfile
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Generic, TypeVar

import httpx
import torch

from node.client import CoordinatorClient
from node.links import LinkProber, reachability_line
from node.exporter import STAGES
from node.offered_files import Offers
from node.profiler import IdleProfiler, profile_node
from node.progress import Progress
from node.relaying import Relaying
from ravnest.averaging import collectives
from ravnest.client.api import ApiError
from ravnest.failures import also_named, classify
from ravnest.pipeline import audits, neighbours
from ravnest.pipeline.inbox import PipelineError, TrainedAlone
from ravnest.pipeline.memory import release_free_memory, trim_heap
from ravnest.pipeline.stage import StageRunner
from ravnest.spec import DataProof, JoinRequest, MetricsReport, StageAssignment
from ravnest.wire import PeerGate, PeerServer, Router, name_peer

log = logging.getLogger(__name__)
T = TypeVar("T")
SCRATCH_PREFIX = "ravnest-job-"  # + pid: a job's scratch folder in the temporary directory


def remove_orphaned_scratch() -> None:
    """Scratch folders of node processes that were killed (they could not clean up) go at start-up."""
    for folder in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*"):
        pid = folder.name[len(SCRATCH_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def reportable(metrics: dict[str, float]) -> dict[str, float]:
    """The figures JSON can carry: a NaN or an infinity (a loss gone non-finite, say) is left out of
    the report, and said in the node's log, rather than failing the report (and the stage with it)."""
    dropped = sorted(name for name, value in metrics.items() if not math.isfinite(value))
    if dropped:
        log.warning("not reported, not finite: %s", ", ".join(f"{name}={metrics[name]}" for name in dropped))
    return {name: value for name, value in metrics.items() if name not in dropped}


class BackgroundSender(Generic[T]):
    """Sends items (metrics, checkpoints) from a thread of its own so the training worker never waits
    on HTTP. If the coordinator is slow, the oldest waiting items are dropped (`discard` is called on
    them) in favour of newer ones: the next report carries newer figures anyway."""

    def __init__(self, send: Callable[[T], None], *, capacity: int, name: str,
                 discard: Callable[[T], None] = lambda item: None):
        self._send, self._discard = send, discard
        self._queue: queue.Queue = queue.Queue(maxsize=capacity)
        self._thread = threading.Thread(target=self._send_all, name=name, daemon=True)
        self._thread.start()

    def put(self, item: T) -> None:
        while True:
            try:
                self._queue.put_nowait(item)
                return
            except queue.Full:
                try:
                    self._discard(self._queue.get_nowait())
                except queue.Empty:
                    pass

    def _send_all(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._send(item)
            except (httpx.HTTPError, ApiError, OSError):
                pass  # best effort
            except Exception:  # noqa: BLE001  (what one item held never ends the sending of the next)
                log.exception("could not send %s; sending on", type(item).__name__)
            finally:
                self._discard(item)

    def close(self, timeout: float = 30.0) -> None:
        """Send what is queued, then stop (within `timeout`)."""
        self._queue.put(None)
        self._thread.join(timeout)


@dataclass
class _Job:
    """The job this node works on, and why it was told to stop, if it was."""
    assignment: StageAssignment
    thread: threading.Thread = field(init=False)  # runs _run_job(this job)
    stop: threading.Event = field(default_factory=threading.Event)
    stopped_for: str = ""  # "" | "cancel" | "recover" | "leave"
    done: threading.Event = field(default_factory=threading.Event)  # its thread has nothing left to do
    runner: StageRunner | None = None  # once built

    def stop_for(self, why: str) -> None:
        self.stopped_for = self.stopped_for or why
        self.stop.set()
        if self.runner is not None:
            self.runner.stop(f"the node was told to stop ({self.stopped_for})")  # at once, not at the next poll

    @property
    def key(self) -> tuple[str, int]:
        return self.assignment.job_id, self.assignment.generation


@dataclass
class _JobRun:
    """What one run of a job holds on this node, from start to clean-up."""
    job: _Job
    prefix: str  # how the node's log names the stage, as the API counts
    scratch: Path  # checkpoints on their way out
    reporter: BackgroundSender[MetricsReport]
    uploader: BackgroundSender[tuple[int, Path]]
    runner: StageRunner | None = None  # once built


class NodeDaemon:
    def __init__(self, client: CoordinatorClient, *, device: torch.device, host: str = "127.0.0.1",
                 port: int = 0, advertise: str | None = None, name: str = "",
                 progress: Progress | None = None, max_memory: int | None = None,
                 datasets: dict[str, Path] | None = None, tls: tuple[bytes, bytes] | None = None,
                 identity: str = "", reload_offers: Callable[[], dict[str, Path]] | None = None,
                 reprofile_every: float = 600.0, use_relay: bool = True, relay_port: int | None = None,
                 relay_ports: range | None = None, peer_relay_port: int | None = 0):
        self.client = client
        self.identity = identity  # the secret of its identity file: joining again keeps its id
        self.progress = progress or Progress()
        self.offers = Offers(datasets or {}, self.progress, reload_offers)  # reload: its offers file, on SIGHUP
        self.max_memory = max_memory
        self.device = device
        self.name = name
        # peers of a job get their assignments at different heartbeats: their first messages may wait 60 s
        self.router = Router(60.0, (*neighbours.MESSAGE_KINDS, collectives.KIND, audits.KIND), decode_device=device)
        self.gate = PeerGate()  # the job's planned peers may call; the coordinator's probe token may Ping
        self.server = PeerServer(self.router, host, port, gate=self.gate, tls=tls)  # tls: (certificate, key) PEM
        self._prober: LinkProber | None = None
        self._note = ""  # the coordinator's last word on why this node is idle
        self._interval = 2.0  # seconds between heartbeats: what the coordinator said last
        self.address = f"{advertise or host}:{self.server.port}"
        self._job: _Job | None = None
        self._finished: set[tuple[str, int]] = set()  # (job id, generation): a re-planned job comes back
        # the next heartbeat goes out early when a job ends: the coordinator releases the node and may
        # have its next assignment (a re-planned job waits for its nodes to hand in and be released)
        self._beat_now = threading.Event()
        self._proofs: list[DataProof] = []  # answers to the last heartbeat's challenges, sent with the next
        self.idle_profiler = IdleProfiler(device, reprofile_every, self.progress)
        self._reachable: bool | None = None  # what the coordinator last said: can peers dial this node?
        self.relaying = Relaying(client, self.progress, use_relay=use_relay, relay_port=relay_port,
                                 relay_ports=relay_ports, peer_relay_port=peer_relay_port, host=host,
                                 wake=self._beat_now.set)

    def serve(self, stop: threading.Event) -> None:
        """Join, then heartbeat until `stop` is set; runs assigned stages in a worker thread."""
        remove_orphaned_scratch()
        fingerprints = self.offers.fingerprints()
        self.progress.log(f"measuring this machine ({self.device}: compute, memory, the link to the coordinator) "
                          "before joining")
        profile = profile_node(self.client.http, self.device, self.max_memory, fingerprints, self.offers.vocabularies())
        joined = self.client.join(JoinRequest(name=self.name, address=self.address, profile=profile,
                                              identity=self.identity, relay_port=self.relaying.relay_port,
                                              peer_relay_port=self.relaying.peer_relay_port))
        self.progress.log(f"joined as {joined.node_id} at {self.address} ({profile.device}, "
                          f"{profile.flops / 1e9:.1f} GFLOP/s, offers {profile.memory_bytes / 2**30:.2f} GiB)")
        self.relaying.joined(joined.node_id, joined.relay_secret)
        self._interval = joined.heartbeat_interval_s  # what each reply says from now on
        if joined.probe_token:
            self.gate.set_probe_tokens([joined.probe_token])
            self._prober = LinkProber(joined.probe_token)
        def beat_at_stop() -> None:  # the last heartbeat goes out at once
            stop.wait()
            self._beat_now.set()
        threading.Thread(target=beat_at_stop, name="stop-watch", daemon=True).start()
        self.offers.keep_offering(self.client, stop)
        try:
            while not stop.is_set():
                self._heartbeat()
                if self._running_job_id() is None:
                    trim_heap()  # what peers' probes made the wire buffer (kept for speed) goes back
                if self._prober and self._prober.settle(self._interval):
                    continue  # report the links measured now rather than an interval later
                self._beat_now.wait(self._interval)
                self._beat_now.clear()
        finally:
            self._stop_job(timeout=30.0)
            try:
                self.client.leave()
                self.progress.log("left the coordinator")
            except (httpx.HTTPError, ApiError) as e:
                self.progress.log(f"could not leave cleanly: {e}")
            if self._prober:
                self._prober.close()
            self.server.stop()
            self.relaying.close()

    def _running_job_id(self) -> str | None:
        if self._job and self._job.thread.is_alive() and not self._job.done.is_set():
            return self._job.assignment.job_id
        return None

    def _heartbeat(self) -> None:
        links, unreached = self._prober.take() if self._prober else ([], [])
        job_id = self._running_job_id()
        runner = self._job.runner if self._job is not None and job_id else None
        try:
            reply = self.client.heartbeat(job_id, links, bool(runner and runner.alone), self._proofs,
                                          self.idle_profiler.measured(busy=job_id is not None), unreached,
                                          self.relaying.moved(self.address))
        except ApiError as e:
            if e.status == 401:  # revoked, expired or forgotten: retrying cannot help; stop and say why
                raise
            self.progress.log(f"heartbeat failed, will retry: {e}")
            return
        except httpx.HTTPError as e:
            self.progress.log(f"heartbeat failed, will retry: {e}")
            return
        self._proofs = [answer for c in reply.challenges if (answer := self.offers.prove(c)) is not None]
        if self._proofs:
            self._beat_now.set()  # proven sooner, placed sooner
        if reply.probe and self._prober:
            self._prober.ask(reply.probe)
        if reply.note and reply.note != self._note:
            self.progress.log(f"coordinator: {reply.note}")
        self._note = reply.note
        self._interval = reply.heartbeat_interval_s or self._interval  # it grows with the number of nodes
        relayed = self.relaying.offered(reply.relay, self.server.address) is not None
        if reply.reachable is not None and reply.reachable != self._reachable:
            self.progress.log(reachability_line(self.relaying.advertised(self.address), reply.reachable,
                                                reply.reachability, relayed=relayed))
        self._reachable = reply.reachable
        job = self._job if self._running_job_id() else None
        if job and reply.train_alone == job.assignment.job_id and not job.stop.is_set():
            runner = job.runner
            if runner is None or not runner.alone and not runner.train_alone("the job is being re-planned"):
                reply.recover_job = reply.train_alone  # it cannot train without its averaging: hand in now
        for told, why, words in ((reply.cancel_job, "cancel", "was cancelled"),
                                 (reply.recover_job, "recover", "is being re-planned; handing in this stage's state")):
            if job and told == job.assignment.job_id and not job.stop.is_set():
                self.progress.log(f"job {told} {words}; stopping")
                job.stop_for(why)
        assignment = reply.assignment
        if assignment and (assignment.job_id, assignment.generation) not in self._finished and job is None:
            job = self._job = _Job(assignment)
            job.thread = threading.Thread(target=self._run_job, args=(job,), name="job", daemon=True)
            job.thread.start()

    def _run_job(self, job: _Job) -> None:
        a = job.assignment
        if self._prober:
            self._prober.stand_aside()
        run = _JobRun(job, prefix=f"job {a.job_id[:8]} cluster {a.cluster} stage {a.stage} (of {a.num_stages})",
                      scratch=Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")),
                      reporter=BackgroundSender[MetricsReport](
                          lambda report: self.client.report_metrics(a.job_id, report), capacity=64,
                          name="metrics-reporter"),
                      uploader=BackgroundSender[tuple[int, Path]](
                          lambda item: self.client.upload_checkpoint(a.job_id, a.cluster, a.stage, a.generation,
                                                                     item[0], "periodic", item[1]),
                          capacity=1, name="checkpoint-uploader", discard=lambda item: item[1].unlink(missing_ok=True)))
        predicted = f", predicted memory {a.predicted_memory_bytes / 2**20:.0f} MiB" if a.predicted_memory_bytes else ""
        resumed = f", continuing from step {a.resume_step}" if a.resume_step else ""
        self.progress.log(f"{run.prefix}: blocks [{a.blocks[0]}, {a.blocks[1]}){predicted}{resumed}")
        self.gate.admit(f"{a.job_id}/{a.generation}", a.peer_credentials, a.planned_peers())
        for address, tls_name in a.tls_names().items():
            name_peer(address, tls_name)
        try:
            self.relaying.job_started(a, self.server.address)
            self._train(run)
        except Exception as e:  # report any failure to the coordinator, which re-plans or fails the job
            self._failed(run, e)
        finally:
            self._clean_up(run)

    def _train(self, run: _JobRun) -> None:
        job, a = run.job, run.job.assignment
        state = None
        if a.resume_step:
            state = run.scratch / "resume.safetensors"
            self.client.download_state(a.job_id, a.cluster, a.stage, state)

        def on_metrics(metrics: dict[str, float]) -> None:
            run.reporter.put(MetricsReport(node_id=self.client.me, cluster=a.cluster, stage=a.stage,
                                           step=int(metrics.get("step", 0)), metrics=reportable(metrics)))
            STAGES.update(a.job_id, a.cluster, a.stage, metrics)
            self.progress.update(run.prefix, metrics)

        def on_checkpoint(step: int) -> None:  # on the worker thread, between two steps
            path = run.scratch / f"step-{step}.safetensors"
            runner.save_state(path)
            run.uploader.put((step, path))

        def on_alone(reason: str) -> None:  # on the worker thread (which logged it): tell the coordinator
            if not job.stopped_for:  # a re-plan starts, or its record learns this cluster trains on
                threading.Thread(target=report_failure, args=(self.client, a, f"training alone: {reason}", True, True,
                                                              runner.alone_cause, runner.optimizer.steps),
                                 name="failure-report", daemon=True).start()

        runner = run.runner = job.runner = StageRunner(
            a, self.router, device=self.device, on_metrics=on_metrics, initial_state=state,
            on_checkpoint=on_checkpoint, on_alone=on_alone, datasets=self.offers.files)
        if state is not None:
            state.unlink()
        runner.attach_averaging()  # it works on the runner's live tensors, which exist now
        final = runner.run(job.stop)
        self.progress.update(run.prefix, final, final=True)
        if "memory_peak_bytes" in final:
            predicted = f", predicted memory {a.predicted_memory_bytes / 2**20:.0f} MiB" if a.predicted_memory_bytes \
                else ""
            self.progress.log(f"{run.prefix}: peak memory {final['memory_peak_bytes'] / 2**20:.0f} MiB above idle"
                              f"{predicted}")
        run.reporter.close()
        # the final metrics reach the coordinator before the weights do (the job's result is taken then)
        self.client.report_final_metrics(a.job_id, MetricsReport(
            node_id=self.client.me, cluster=a.cluster, stage=a.stage, step=int(final.get("step", 0)),
            metrics=reportable(final)))
        weights = run.scratch / "stage.safetensors"
        runner.save_weights(weights)
        self.client.upload_weights(a.job_id, a.cluster, a.stage, weights)
        self.progress.log(f"{run.prefix}: done, weights uploaded")

    def _failed(self, run: _JobRun, e: Exception) -> None:
        job, a, runner = run.job, run.job.assignment, run.runner
        run.reporter.close()
        reason = f"{type(e).__name__}: {e}"  # the coordinator says which node, job and stage
        if isinstance(e, TrainedAlone):  # as if told to stop: the job is being re-planned already
            self.progress.log(f"{run.prefix}: {e}")
            job.stopped_for = "recover"
        if not job.stopped_for:
            # a pipeline's own failures (a lost neighbour, a silent peer) are told in a line; the
            # rest (a model or a bug raising) with where they came from
            expected = isinstance(e, PipelineError) and e.__cause__ is None
            self.progress.log(f"node {self.client.node_id} ({run.prefix}): {reason}"
                              + ("" if expected else f"\n{traceback.format_exc()}"))
        if runner is not None and job.stopped_for != "cancel":
            hand_in_state(self.client, self.progress, runner, a, run.scratch / "snapshot.safetensors", run.prefix)
        if not job.stopped_for:
            # a stage that trained and then failed (a lost peer) can be re-planned; one that never started cannot
            report_failure(self.client, a, reason, runner is not None, False, e,
                           runner.optimizer.steps if runner is not None else None)

    def _clean_up(self, run: _JobRun) -> None:
        """Every per-job resource goes back, however the job ended: a node serves job after job."""
        job, a = run.job, run.job.assignment
        run.uploader.close()
        if run.runner is not None and run.runner.averager is not None:
            run.runner.averager.close()  # leave the job's rings: the next job joins its own
        self._finished.add(job.key)
        STAGES.forget(a.job_id, a.cluster, a.stage)
        self.gate.dismiss(f"{a.job_id}/{a.generation}")
        self.router.clear()
        self.relaying.job_ended()
        run.runner = job.runner = None
        shutil.rmtree(run.scratch, ignore_errors=True)
        release_free_memory()  # an idle volunteer gets its memory back
        job.done.set()
        self._beat_now.set()

    def _stop_job(self, timeout: float) -> None:
        if self._job and self._job.thread.is_alive():
            self._job.stop_for("leave")  # hands in its state, then leaves
            self._job.thread.join(timeout)


def report_failure(client: CoordinatorClient, a: StageAssignment, reason: str, recoverable: bool,
                   still_training: bool, cause: BaseException | None, step: int | None) -> None:
    """Tell the coordinator the stage failed (or trains on alone), with what `cause` says as data: one
    report for the peer it names, and one more for each further peer (a robust round that convicted
    several at once: failures.also_named)."""
    peers = a.peer_addresses()
    failure = classify(cause, peers, step) if cause is not None else None
    for told in [failure, *(also_named(cause, peers, failure) if cause and failure else [])]:
        try:
            client.report_failure(a.job_id, reason, recoverable, still_training, told)
        except (httpx.HTTPError, ApiError):
            pass


def hand_in_state(client: CoordinatorClient, progress: Progress, runner: StageRunner, a: StageAssignment, path: Path,
                  prefix: str) -> None:
    """The job is re-planned: upload this stage's state so its blocks continue from here."""
    if runner.optimizer.steps <= a.resume_step:
        return  # nothing newer than what the coordinator already holds
    try:
        step = runner.save_state(path)
        client.upload_checkpoint(a.job_id, a.cluster, a.stage, a.generation, step, "snapshot", path)
        progress.log(f"{prefix}: handed in its state at step {step}")
    except (httpx.HTTPError, ApiError, OSError) as e:
        progress.log(f"{prefix}: could not hand in its state: {e}")
