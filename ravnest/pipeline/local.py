"""Run whole pipelines on this machine: one OS process (or thread) per stage over loopback gRPC, one
pipeline or several clusters averaging across rings, and the single-process reference that trains
the same model on the same data for comparison."""
from __future__ import annotations

import ctypes
import hashlib
import os
import secrets
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Sequence

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ravnest.averaging.registry import NO_AVERAGING
from ravnest.averaging import segment_rings
from ravnest.averaging.signatures import public_key
from ravnest.data import load_dataset
from ravnest.forking import preloaded_context
from ravnest.models import BlockCost, build_model, profile_blocks, stage_input
from ravnest.pipeline.stage_metrics import EvalAccumulator, StageClock
from ravnest.pipeline.optim import StageOptimizer
from ravnest.pipeline.stage import StageRunner
from ravnest.spec import JobSpec, Ring, StageAssignment, StagePeer
from ravnest.wire import PeerServer, Router, close_channels

Ranges = Sequence[tuple[int, int]]
ROUTE_WAIT_S = 60.0  # stages start at different moments: a message may arrive before its stage exists


def make_assignments(job: JobSpec, ranges: Ranges, addresses: list[str], token: str,
                     job_id: str = "local", *, cluster: int = 0, num_clusters: int = 1,
                     costs: list[BlockCost] | None = None) -> list[StageAssignment]:
    """Assignments for one cluster whose stage s holds blocks ranges[s] and listens at addresses[s];
    `costs` (the model's profile, for the stages' input shapes) is computed when not given."""
    if any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])) or ranges[0][0] != 0:
        raise ValueError(f"stage ranges must be contiguous from block 0: {list(ranges)}")
    peers = [StagePeer(node_id=f"cluster{cluster}-stage{s}", address=address) for s, address in enumerate(addresses)]
    costs = costs or _profile(job)
    inputs = [stage_input(costs, start) for start, _ in ranges]
    return [StageAssignment(
        job_id=job_id, token=token, cluster=cluster, num_clusters=num_clusters, stage=s, num_stages=len(ranges),
        blocks=(ranges[s][0], ranges[s][1]), input_shape=inputs[s][0], input_dtype=inputs[s][1], model=job.model,
        dataset=job.dataset, training=job.training, averaging=job.averaging, prev=peers[s - 1] if s > 0 else None,
        audit_secret=int.from_bytes(hashlib.sha256(f"audits:{token}".encode()).digest()[:8]) >> 1 if s == 0 else None,
        next=peers[s + 1] if s + 1 < len(ranges) else None) for s in range(len(ranges))]


def _profile(job: JobSpec) -> list[BlockCost]:
    return profile_blocks(build_model(job.model.name, job.model.config), job.training.batch_size,  # fake: cheap
                          precision=job.training.precision)


def make_cluster_assignments(job: JobSpec, cluster_ranges: Sequence[Ranges], addresses: list[list[str]],
                             token: str, job_id: str = "local") -> list[list[StageAssignment]]:
    """Assignments for several clusters (each may cut the model differently): cluster c's stage s
    holds cluster_ranges[c][s], listens at addresses[c][s] and joins the rings of its segments."""
    costs = _profile(job)
    clusters = [make_assignments(job, ranges, addrs, token, job_id, cluster=c, num_clusters=len(cluster_ranges),
                                 costs=costs)
                for c, (ranges, addrs) in enumerate(zip(cluster_ranges, addresses))]
    if job.averaging.strategy == NO_AVERAGING or len(clusters) < 2:
        return clusters
    for segment, (blocks, holders) in enumerate(segment_rings([list(r) for r in cluster_ranges])):
        ring = Ring(segment=segment, blocks=blocks, members=[  # (one token for a whole local run: one key)
            StagePeer(node_id=f"cluster{c}-stage{s}", address=addresses[c][s], signing_key=public_key(token),
                      starts_at=cluster_ranges[c][s][0])
            for c, s in enumerate(holders)])
        for c, s in enumerate(holders):
            clusters[c][s].rings.append(ring)
    return clusters


def _trace_summary(runner: StageRunner) -> dict[str, Any]:
    return {"max_in_flight": runner.trace.max_in_flight,
            "records": [(r.micro_batch, r.forward_version, r.backward_version, r.stage_version)
                        for r in runner.trace.records]}


def _result(stage_results: list[dict[str, Any]], states: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    merged: dict[str, torch.Tensor] = {}
    for state in states:
        merged.update(state)
    return {"metrics": stage_results[-1]["metrics"], "stages": [r["metrics"] for r in stage_results],
            "history": [r["history"] for r in stage_results], "traces": [r["trace"] for r in stage_results],
            "state_dict": merged}


# --- one process per stage ---------------------------------------------------------------------------

StageSetup = Callable[[int, int, StageRunner], None]  # (cluster, stage, runner): e.g. slow one replica down


def _stage_process(conn: Connection, token: str, threads: int, device: str, datasets: dict[str, str],
                   place: tuple[str, str] | None = None, setup: StageSetup | None = None,
                   surroundings: tuple[dict[str, str], str] | None = None) -> None:
    """Child: serve gRPC, tell the parent the address, run the assigned stage, send back the results.
    With `place` = (network namespace, address), it first moves into that namespace (the pipe to the
    parent is a socket pair, which crosses namespaces) and serves on that address. `surroundings`: the
    parent's environment and working directory (a child of the fork server has the fork server's)."""
    if surroundings is not None:
        os.environ.clear()
        os.environ.update(surroundings[0])
        os.chdir(surroundings[1])
    if place is not None:
        enter_network_namespace(place[0])
    torch.set_num_threads(threads)
    accelerator = torch.device(device) if torch.device(device).type != "cpu" else None  # as a node's (daemon.py)
    router = Router(wait_for_route=ROUTE_WAIT_S, decode_device=accelerator)
    server = PeerServer(router, place[1] if place else "127.0.0.1", 0, token=token)
    try:
        conn.send(server.address)
        assignment = StageAssignment.model_validate_json(conn.recv())
        history: list[dict[str, float]] = []
        runner = StageRunner(assignment, router, device=device, on_metrics=history.append, datasets=datasets)
        averager = runner.attach_averaging()
        if setup is not None:
            setup(assignment.cluster, assignment.stage, runner)
        try:
            metrics = runner.run()
        finally:
            if averager is not None:
                averager.close()
            close_channels()  # before any stage stops its server (below, once all are done)
        # tensors travel as safetensors bytes, never pickled
        conn.send({"metrics": metrics, "history": history, "trace": _trace_summary(runner),
                   "state": save_tensors(runner.state_dict())})
        conn.recv()  # keep serving until every stage is done: neighbours may still close streams
    except BaseException:
        conn.send({"error": traceback.format_exc()})
    finally:
        server.stop(0)


CLONE_NEWNET = 0x40000000


def enter_network_namespace(name: str) -> None:
    """Move this process (its calling thread, before it starts others) into the named network
    namespace, as `ip netns exec` would (Python 3.11 has no os.setns)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{name}") as namespace:
        if libc.setns(namespace.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"cannot enter network namespace {name!r} (root?)")


def _gather(pipes: list[Connection], processes: list[BaseProcess], deadline: float) -> list[Any]:
    """One reply from every child, in stage order; the first failure (as it happens) raises."""
    replies: dict[int, Any] = {}
    while len(replies) < len(pipes):
        pending = {pipes[s]: s for s in range(len(pipes)) if s not in replies}
        sentinels = {processes[s].sentinel: s for s in pending.values()}
        ready = wait([*pending, *sentinels], timeout=max(deadline - time.monotonic(), 0))
        if not ready:
            raise TimeoutError(f"stages {sorted(pending.values())} did not answer within the time limit")
        for item in ready:
            if item in pending:
                stage = pending[item]
                try:
                    reply = item.recv()
                except EOFError:  # the child died before answering
                    processes[stage].join(5)
                    raise RuntimeError(f"stage {stage} process exited with code {processes[stage].exitcode}") from None
                if isinstance(reply, dict) and "error" in reply:
                    raise RuntimeError(f"stage {stage} failed:\n{reply['error']}")
                replies[stage] = reply
        for item in ready:
            ended = sentinels.get(item) if isinstance(item, int) else None  # (sentinels are file descriptors)
            if ended is not None and ended not in replies:
                raise RuntimeError(f"stage {ended} process exited with code {processes[ended].exitcode}")
    return [replies[s] for s in range(len(pipes))]


def run_local_pipeline(job: JobSpec, ranges: Ranges, *, timeout: float = 600, threads_per_stage: int = 1,
                       device: str | torch.device = "cpu", datasets: dict[str, str] | None = None) -> dict[str, Any]:
    """Train `job` as one cluster with one process per stage on 127.0.0.1; `datasets` are the files the
    stages offer (name -> path, as `ravnest-node join --dataset`).

    Returns {"metrics": last stage's final metrics, "stages": every stage's, "history": on_metrics
    reports per stage, "traces": per-stage version records, "state_dict": the merged full model}.
    """
    return run_local_clusters(job, [ranges], timeout=timeout, threads_per_stage=threads_per_stage,
                              device=device, datasets=datasets)[0]


def run_local_clusters(job: JobSpec, cluster_ranges: Sequence[Ranges], *, timeout: float = 600,
                       threads_per_stage: int = 1, device: str | torch.device = "cpu",
                       datasets: dict[str, str] | None = None,
                       places: Sequence[tuple[str, str]] | None = None,
                       setup: StageSetup | None = None) -> list[dict[str, Any]]:
    """Train `job` as several clusters (cluster c cut as cluster_ranges[c]) averaging over rings,
    one process per stage on 127.0.0.1, or, with `places`, the i-th stage process (clusters in order,
    stages in order) in network namespace places[i][0] on address places[i][1] (a bandwidth-shaped
    testbed: deploy/testbed/netns.sh; needs root); one run_local_pipeline-like result per cluster.
    `setup` (a module-level function: it is pickled to the children) runs on each stage before it trains."""
    flat = [(c, s) for c, ranges in enumerate(cluster_ranges) for s in range(len(ranges))]
    context = preloaded_context(["ravnest.pipeline.local"])
    token = secrets.token_hex(16)
    deadline = time.monotonic() + timeout
    pipes: list[Connection] = []
    processes: list[BaseProcess] = []
    try:
        surroundings = (dict(os.environ), os.getcwd())
        for i, _ in enumerate(flat):
            parent_end, child_end = context.Pipe()
            process = context.Process(target=_stage_process, daemon=True,
                                      args=(child_end, token, threads_per_stage, str(device), dict(datasets or {}),
                                            tuple(places[i]) if places else None, setup, surroundings))
            process.start()
            child_end.close()
            pipes.append(parent_end)
            processes.append(process)
        addresses = _gather(pipes, processes, deadline)
        by_cluster = [[addresses[flat.index((c, s))] for s in range(len(ranges))]
                      for c, ranges in enumerate(cluster_ranges)]
        assignments = make_cluster_assignments(job, cluster_ranges, by_cluster, token)
        for pipe, (c, s) in zip(pipes, flat):
            pipe.send(assignments[c][s].model_dump_json())
        results = _gather(pipes, processes, deadline)
        for pipe in pipes:
            pipe.send("shutdown")
        for child in processes:
            child.join(timeout=max(deadline - time.monotonic(), 5))
    finally:
        for child in processes:
            if child.is_alive():
                child.kill()
                child.join()
    return [_result([results[i] for i, (c, _) in enumerate(flat) if c == cluster],
                    [load_tensors(results[i]["state"]) for i, (c, _) in enumerate(flat) if c == cluster])
            for cluster in range(len(cluster_ranges))]


# --- one thread per stage (tests: runners stay inspectable) --------------------------------------------

def run_threaded_pipeline(job: JobSpec, ranges: Ranges, *, timeout: float = 300,
                          device: str | torch.device = "cpu", averagers: Sequence[Any] | None = None,
                          setup: Callable[[list[StageRunner]], None] | None = None) -> dict[str, Any]:
    """Like run_local_pipeline but every stage is a thread of this process; the result also holds
    "runners". `averagers` (stand-ins, one per stage) are attached as given; `setup(runners)` runs
    before training starts (e.g. to attach observers)."""
    def attach(runners: list[list[StageRunner]], routers: list[list[Router]]) -> None:
        for s, runner in enumerate(runners[0]):
            runner.averager = averagers[s] if averagers else None
        if setup is not None:
            setup(runners[0])
    return _run_threads(job, [ranges], timeout, device, attach)[0]


def run_threaded_clusters(job: JobSpec, cluster_ranges: Sequence[Ranges], *, timeout: float = 300,
                          device: str | torch.device = "cpu",
                          setup: Callable[[list[list[StageRunner]]], None] | None = None) -> list[dict[str, Any]]:
    """Like run_local_clusters but every stage of every cluster is a thread of this process, with the
    averager its assignment asks for; each cluster's result also holds "runners" and "averagers"."""
    def attach(runners: list[list[StageRunner]], routers: list[list[Router]]) -> None:
        for runner in (r for cluster in runners for r in cluster):
            runner.attach_averaging()
        if setup is not None:
            setup(runners)
    results = _run_threads(job, cluster_ranges, timeout, device, attach)
    for result in results:
        result["averagers"] = [runner.averager for runner in result["runners"]]
    return results


def _run_threads(job: JobSpec, cluster_ranges: Sequence[Ranges], timeout: float, device: str | torch.device,
                 attach: Callable[[list[list[StageRunner]], list[list[Router]]], None]) -> list[dict[str, Any]]:
    token = secrets.token_hex(16)
    routers = [[Router(wait_for_route=ROUTE_WAIT_S) for _ in ranges] for ranges in cluster_ranges]
    servers = [PeerServer(router, "127.0.0.1", 0, token=token) for cluster in routers for router in cluster]
    addresses = iter(server.address for server in servers)
    histories: list[list[list[dict[str, float]]]] = [[[] for _ in ranges] for ranges in cluster_ranges]
    runners: list[list[StageRunner]] = []
    try:
        assignments = make_cluster_assignments(
            job, cluster_ranges, [[next(addresses) for _ in ranges] for ranges in cluster_ranges], token)
        runners = [[StageRunner(a, router, device=device, on_metrics=history.append, peer_timeout=timeout)
                    for a, router, history in zip(*cluster)] for cluster in zip(assignments, routers, histories)]
        attach(runners, routers)
        flat = [runner for cluster in runners for runner in cluster]
        outcomes: list[Any] = [None] * len(flat)

        def run(index: int) -> None:
            try:
                outcomes[index] = flat[index].run()
            except BaseException as exc:  # reported below, on the caller's thread
                outcomes[index] = exc

        threads = [threading.Thread(target=run, args=(i,), name=f"cluster{r.assignment.cluster}-stage"
                                    f"{r.assignment.stage}") for i, r in enumerate(flat)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0))
        if any(thread.is_alive() for thread in threads):
            for runner in flat:
                runner.stop("timed out")
            for thread in threads:
                thread.join()
            raise TimeoutError(f"pipeline did not finish within {timeout}s")
        for runner, outcome in zip(flat, outcomes):
            if isinstance(outcome, BaseException):
                a = runner.assignment
                raise RuntimeError(f"cluster {a.cluster} stage {a.stage} failed: {outcome}") from outcome
        results = []
        for cluster, cluster_histories in zip(runners, histories):
            stages = [{"metrics": r.final_metrics, "history": h, "trace": _trace_summary(r)}
                      for r, h in zip(cluster, cluster_histories)]
            results.append({**_result(stages, [r.state_dict() for r in cluster]), "runners": cluster})
        return results
    finally:
        for runner in (r for cluster in runners for r in cluster):
            if runner.averager is not None:
                runner.averager.close()
        for server in servers:
            server.stop(0)


# --- the single-process reference ----------------------------------------------------------------------

def run_single_process(job: JobSpec, *, device: str | torch.device = "cpu",
                       datasets: dict[str, str] | None = None) -> dict[str, Any]:
    """Train the same model (same seed, data stream, optimizer, schedule, steps) in one process with
    plain synchronous SGD; returns {"metrics": ..., "state_dict": ...} like the pipeline runners."""
    training, device = job.training, torch.device(device)
    spec = build_model(job.model.name, job.model.config)
    model = spec.full_model(seed=training.seed, device=device)
    dataset = load_dataset(job.dataset, datasets)
    batches = dataset.shard(0, 1).batches(training.batch_size, seed=training.seed)
    optimizer = StageOptimizer(model.parameters(), training)
    clock = StageClock(training.batch_size * training.accumulation)
    for _ in range(training.steps * training.accumulation):
        with clock.busy():
            x, y = (t.to(device) for t in next(batches))
            loss = spec.loss(model(x), y)
            (loss / training.accumulation).backward()
            stepped = optimizer.micro_batch_done()
        clock.add_loss(float(loss.detach()))
        if stepped:
            clock.step_done()
    metrics = {**clock.snapshot(), **clock.steady_state()}
    model.eval()
    evaluation = EvalAccumulator()
    with torch.no_grad():
        for x, y in dataset.test_batches(training.batch_size):
            x, y = x.to(device), y.to(device)
            output = model(x)
            evaluation.add(output, y, spec.loss(output, y))
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return {"metrics": {**metrics, **evaluation.result()}, "state_dict": state}
