"""Faults with real processes on loopback: a node killed mid-job, the coordinator killed and restarted,
a cancelled job resumed from its checkpoint, links that break, nodes serving job after job without
leaking, and sixteen nodes beside busy cores."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ravnest.wire.transport.options import SERVER_THREADS
from scripts.local_cluster import LocalCluster
from tests.forwarder import Forwarder, free_port

pytestmark = pytest.mark.slow
CNN_JOB = Path(__file__).resolve().parent.parent / "examples" / "jobs" / "digits-cnn.json"


def cnn_job(steps: int = 600, checkpoint_every: int = 50, **placement) -> dict:
    spec = json.loads(CNN_JOB.read_text())
    spec["training"].update(steps=steps, eval_every=0)
    spec["placement"].update(placement)
    spec["checkpoints"] = {"every": checkpoint_every}
    return spec


def wait_progress(cluster: LocalCluster, job_id: str, fraction: float, timeout: float = 300) -> dict:
    def far_enough():
        job = cluster.job(job_id)
        assert job["state"] not in ("failed", "cancelled", "completed"), job["reason"]
        return job if job["state"] == "running" and job["progress"]["fraction"] >= fraction else None
    return cluster.wait_for(far_enough, timeout, f"job {job_id} to reach {fraction:.0%}", ignore_exits=True)


def all_idle(cluster: LocalCluster, count: int):
    return lambda: sum(n["state"] == "idle" for n in cluster.alive_nodes()) == count


def test_a_killed_node_is_replaced_by_a_spare_and_the_job_completes(tmp_path):
    """2 clusters x 2 stages + 1 spare: kill -9 a working node at ~30%; the intact cluster trains on
    alone while the lost one hands in what it has, then the intact one hands in its fresher state; the
    job is planned again with the spare, from that state, and completes as well as without the fault."""
    with LocalCluster(tmp_path, nodes=5) as cluster:
        job_id = cluster.submit(cnn_job(max_nodes=4))
        job = wait_progress(cluster, job_id, 0.3)
        victim = job["plan"]["clusters"][1]["stages"][0]["node_id"]  # a pipeline neighbour and a ring member
        cluster.kill(cluster.node_process(victim))
        job = cluster.wait_job(job_id, timeout=600)
        assert job["state"] == "completed", job["reason"]
        [recovery] = job["recoveries"]
        print(f"kill at step {recovery['reached_step']}: training again after {recovery['recovery_s']:.1f} s from "
              f"step {recovery['resume_step']} ({recovery['steps_redone']} steps redone); cluster 0 trained on "
              f"{recovery['steps_trained_on']} steps; test accuracy {job['metrics']['test_accuracy']:.4f}; "
              f"state from {recovery['sources']}")
        assert recovery["recovery_s"] < 30
        assert recovery["kept_training"] == [0] and recovery["steps_trained_on"] > 0
        assert all("-c0-" in source for source in recovery["sources"])  # the intact cluster's state, the freshest
        assert job["generation"] == 1 and recovery["resume_step"] > 0
        placed = {s["node_id"] for c in job["plan"]["clusters"] for s in c["stages"]}
        assert victim not in placed and len(placed) == 4  # the spare took its place
        assert job["metrics"]["test_accuracy"] >= 0.95
        # a lost neighbour is told in a line, not a traceback: it is what volunteers do
        logs = {path.name: path.read_text(errors="replace") for path in (tmp_path / "logs").glob("node-*.log")}
        assert not [name for name, text in logs.items() if "Traceback" in text], logs


def test_the_coordinator_restarts_mid_job_and_loses_nothing(tmp_path):
    """kill -9 the coordinator at ~40% and start it again on the same database: nodes keep training
    peer to peer meanwhile, their reports and uploads retry, and the job completes."""
    with LocalCluster(tmp_path, nodes=4) as cluster:
        job_id = cluster.submit(cnn_job(steps=600, max_nodes=4))
        wait_progress(cluster, job_id, 0.4)
        before = cluster.job(job_id)
        nodes_before = {n["id"] for n in cluster.http.get("/v1/nodes").json()}
        cluster.restart_coordinator()
        after = cluster.job(job_id)
        assert after["history"][:len(before["history"])] == before["history"]
        assert after["checkpoint_step"] >= before["checkpoint_step"] > 0
        assert {n["id"] for n in cluster.http.get("/v1/nodes").json()} == nodes_before
        job = cluster.wait_job(job_id, timeout=600)
        assert job["state"] == "completed", job["reason"]
        assert job["generation"] == 0 and not job["recoveries"]  # nobody was lost
        assert job["metrics"]["test_accuracy"] >= 0.95


def test_a_cancelled_job_resumes_from_its_last_checkpoint(tmp_path):
    with LocalCluster(tmp_path, nodes=2) as cluster:
        job_id = cluster.submit(cnn_job(steps=800, checkpoint_every=100, clusters=1, min_nodes=2))
        cluster.wait_for(lambda: (cluster.job(job_id)["checkpoint_step"] or 0) >= 200, 300, "a checkpoint at 200")
        assert cluster.http.post(f"/v1/jobs/{job_id}/cancel").json()["state"] == "cancelled"
        cluster.wait_for(all_idle(cluster, 2), 60, "both nodes to be idle")
        checkpoint = cluster.job(job_id)["checkpoint_step"]
        resumed = cluster.http.post(f"/v1/jobs/{job_id}/resume").json()
        assert resumed["generation"] == 1
        assert any(h["reason"].startswith(f"resumed from step {checkpoint};") for h in resumed["history"])
        job = cluster.wait_job(job_id, timeout=600)
        assert job["state"] == "completed", job["reason"]
        stage_steps = [s["step"] for s in job["metrics"]["stages"]]
        assert stage_steps == [800, 800]  # counted on from the checkpoint, not from 0
        assert job["metrics"]["test_accuracy"] >= 0.95
        assert cluster.http.post(f"/v1/jobs/{job_id}/resume").status_code == 409  # completed: nothing to resume


# gRPC core's own threads: its EventEngine pool grows under load and keeps what it grew (CI once saw
# one more "event_engine" thread after a job than before it), bounded by gRPC, not by us
GRPC_CORE_THREADS = ("event_engine", "grpc_global_tim", "lifeguard")


def _resources(pid: int) -> tuple[int, int, int]:
    """(threads, files, sockets) of a node process. Threads: those our code starts, other than the
    gRPC server's pool (bounded by construction, and it keeps the threads it once needed: its
    high-water mark may rise by one when a probe overlaps a stream). Files: open descriptors other
    than sockets. Sockets: connections to peers and the coordinator, which gRPC and the REST client
    open and close as they see fit (idle connections, link probes): CI saw one more, for minutes,
    after a job than before it, so they get a margin of one per direction (see the test)."""
    names = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except FileNotFoundError:
            pass  # a thread that ended since the listing
    threads = sum(not name.startswith((SERVER_THREADS[:15], *GRPC_CORE_THREADS))  # comm keeps 15 characters
                  for name in names)
    targets = _open_files(pid)
    sockets = sum(target.startswith("socket:") for target in targets)
    return threads, len(targets) - sockets, sockets


def _open_files(pid: int) -> list[str]:
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:  # closed meanwhile
            pass
    return targets


def test_nodes_serve_job_after_job_cancelled_or_not_and_release_everything(tmp_path):
    """On the same four node processes: one node alone, then a 4-stage pipeline, 4 replicas with no
    averaging and 2 clusters with rings, each cancelled mid-run, then 2 clusters to the end. After a
    cancel every node is idle within 10 s whatever the shape, a stage that is both first and last
    (plain data parallelism, no averaging round to notice the stop) included; after every job, each
    node has no more threads, files and sockets than before.

    "Before" is after a first job of the last shape: each node keeps one channel per peer, so the idle
    level is set once a node has served every kind of stream; it must not grow job after job."""
    ring = dict(clusters=2, stages_per_cluster=2, min_nodes=4)
    shapes = [(dict(clusters=1, stages_per_cluster=1, min_nodes=1, max_nodes=1), "ring", False),
              (dict(clusters=1, stages_per_cluster=4, min_nodes=4), "ring", True),
              (dict(clusters=4, stages_per_cluster=1, min_nodes=4), "none", True),
              (ring, "ring", True),
              (ring, "ring", False)]
    with LocalCluster(tmp_path, nodes=4) as cluster:
        nodes = cluster.procs[1:]

        def run(placement: dict, strategy: str = "ring", cancel: bool = False) -> None:
            # a cancelled job would take minutes were it not cancelled
            spec = cnn_job(steps=20_000 if cancel else 120, checkpoint_every=0 if cancel else 40, **placement)
            spec["averaging"]["strategy"] = strategy
            job_id = cluster.submit(spec)
            if cancel:
                wait_progress(cluster, job_id, 0.005)
                cluster.wait_for(lambda: sum(n["state"] == "busy" for n in cluster.alive_nodes()) == 4, 30,
                                 "all four nodes to be training")
                assert cluster.http.post(f"/v1/jobs/{job_id}/cancel").json()["state"] == "cancelled"
                cancelled = time.monotonic()
                cluster.wait_for(all_idle(cluster, 4), 10, "every node to be idle within 10 s of the cancel")
                print(f"{placement}, {strategy}: every node idle {time.monotonic() - cancelled:.1f} s after the cancel")
                job = cluster.job(job_id)
                assert job["state"] == "cancelled" and job["progress"]["fraction"] < 0.5
                return
            job = cluster.wait_job(job_id, timeout=600)
            assert job["state"] == "completed", job["reason"]
            cluster.wait_for(all_idle(cluster, 4), 60, "every node to be idle again")

        run(ring)
        baseline = [_resources(p.pid) for p in nodes]
        print(f"idle after a first job: threads/files/sockets per node {baseline}")
        for index, (placement, strategy, cancel) in enumerate(shapes):
            run(placement, strategy, cancel)

            def released():  # a job's threads and streams end a moment after its node reports idle
                counts = [_resources(p.pid) for p in nodes]
                # a thread or socket leaked per job would pass its margin (1, 2) by the third job; the
                # thread margin is for an unnamed native one (torch's or gRPC's, no Python frames) that
                # comes and goes on idle nodes: CI saw 5 vs 6 on nodes whose Python threads were the same
                return counts if all(t <= t0 + 1 and f <= f0 and s <= s0 + 2
                                     for (t, f, s), (t0, f0, s0) in zip(counts, baseline)) else None
            try:
                cluster.wait_for(released, 30, "thread, file and socket counts to return to their idle level")
            finally:
                print(f"after job {index + 1} ({placement}, {strategy}{', cancelled' if cancel else ''}): "
                      f"threads/files/sockets per node {[_resources(p.pid) for p in nodes]}")


def test_nodes_that_join_mid_job_get_work_without_restarting_it(tmp_path):
    """A job running as 2 replicas; two nodes join: the planner predicts twice the throughput with 4,
    so the job is re-planned onto all four and continues from the state its stages hand in, on all four.
    (One stage per replica: a pipeline hop between a newcomer and a training node is planned at what the
    newcomer's probes measured of a busy peer, which here, on 2 shared cores, predicted 2 pipelines of 2
    slower than the one running: what is tested is how a job grows, not that estimate; issue 64.)"""
    # four nodes share this machine's cores, which the planner takes for four machines' (and the
    # newcomers profile while two nodes train): it predicted +34% with twice the nodes here, and once in
    # CI less than the default +20%. What is tested is how a job grows, so any predicted gain will do.
    with LocalCluster(tmp_path, nodes=2, coordinator_args=["--grow-gain", "0"]) as cluster:
        # long enough that the newcomers (which start, profile and measure their links while two nodes
        # train on the same cores) join before three quarters of it are done, when a job stops growing:
        # 6000 steps were not, once, on a loaded CI machine (it completed first)
        job_id = cluster.submit(cnn_job(steps=12000, clusters="auto", stages_per_cluster=1, min_nodes=2))
        wait_progress(cluster, job_id, 0.01)
        assert len(cluster.job(job_id)["plan"]["clusters"]) == 2
        newcomers = cluster.add_nodes(2)
        joined = time.monotonic()

        def working():
            job = cluster.job(job_id)
            decisions = [line for line in cluster.log_tail(cluster.coordinator_log, 400).splitlines()
                         if "stays on its nodes" in line][-3:]
            assert job["state"] not in ("failed", "cancelled", "completed"), \
                f"{job['state']} before the newcomers got work: {job['reason']}; recoveries {job['recoveries']}; " \
                f"the coordinator said: {decisions}"
            placed = {s["node_id"] for c in (job["plan"] or {"clusters": []})["clusters"] for s in c["stages"]}
            return job if newcomers <= placed and job["state"] == "running" and job["recoveries"] and \
                job["recoveries"][-1].get("recovery_s") is not None else None
        job = cluster.wait_for(working, 120, "the newcomers to be training", ignore_exits=True)
        print(f"newcomers training {time.monotonic() - joined:.1f} s after joining: {job['recoveries'][-1]}")
        assert time.monotonic() - joined < 30 and job["recoveries"][-1]["kind"] == "grow"
        resumed = job["recoveries"][-1]["resume_step"]
        assert len(job["plan"]["clusters"]) == 4 and resumed > 0

        def trained_on(job: dict) -> bool:  # every stage of the grown plan, the newcomers' included
            return all(s["step"] >= resumed + 300 for s in job["metrics"]["stages"]) and \
                {s["node_id"] for s in job["metrics"]["stages"]} >= newcomers
        cluster.wait_for(lambda: trained_on(cluster.job(job_id)), 120, "300 steps more on all four nodes")
        # (the rest of its 12000 steps would only take minutes: jobs that complete after a re-plan, with
        # their accuracy, are the other tests in this file)
        assert cluster.http.post(f"/v1/jobs/{job_id}/cancel").json()["state"] == "cancelled"


def test_links_that_break_or_go_down_mid_job_cost_no_replan(tmp_path):
    """A 2-stage job whose links fail three ways: one node's outbound stream is cut once (fault injection,
    with 2 ms added to each message); the other node is reached through a forwarder whose connections
    are reset mid-job (each sender dials again and sends its last messages again), and later held for
    5 s (nothing passes, nothing is refused: the streams wait). The job is never re-planned and learns
    as well."""
    port = free_port()
    forwarder = Forwarder(port, ("127.0.0.2", port))
    try:
        with LocalCluster(tmp_path, nodes=0) as cluster:
            cluster.add_nodes(1, ["--inject-fault", "delay=0.002,sever_after=300"])
            cluster.add_nodes(1, ["--host", "127.0.0.2", "--port", str(port), "--advertise", "127.0.0.1"])
            job_id = cluster.submit(cnn_job(steps=600, clusters=1, stages_per_cluster=2, min_nodes=2))
            wait_progress(cluster, job_id, 0.3)
            forwarder.cut()
            held_at = wait_progress(cluster, job_id, 0.6)["progress"]["fraction"]
            forwarder.hold(5.0)
            job = cluster.wait_job(job_id, timeout=600)
            assert job["state"] == "completed", job["reason"]
            assert job["recoveries"] == [], job["recoveries"]
            logs = cluster.log_tail("node-0.log", 2000) + cluster.log_tail("node-1.log", 2000)
            resumed = [line for line in logs.splitlines() if "a new stream took over" in line]
            print("\n".join(resumed) + f"\nheld 5 s at {held_at:.0%}; test accuracy {job['metrics']['test_accuracy']:.4f}")
            assert len(resumed) >= 2, logs
            assert job["metrics"]["test_accuracy"] >= 0.95
    finally:
        forwarder.close()


class CpuLimit:
    """A cgroup holding one process to `share` of one core (cgroup v2's cpu.max, or v1's CFS quota):
    a volunteer's machine that is far slower than its profile said. Root only; removed on exit."""

    def __init__(self, pid: int, share: float):
        self.pid, self.share, self.path = pid, share, None

    def __enter__(self):
        period, quota = 100_000, int(self.share * 100_000)
        limits = {Path("/sys/fs/cgroup"): {"cpu.max": f"{quota} {period}"},  # v2 (cgroup.controllers there)
                  Path("/sys/fs/cgroup/cpu"): {"cpu.cfs_period_us": str(period), "cpu.cfs_quota_us": str(quota)}}
        for root, files in limits.items():
            if not (root / next(iter(files))).exists() and not (root / "cgroup.controllers").exists():
                continue
            path = root / f"ravnest-test-{os.getpid()}"
            try:
                path.mkdir()
                for name, value in files.items():
                    (path / name).write_text(value)
                (path / "cgroup.procs").write_text(str(self.pid))
            except OSError:
                if path.exists():
                    path.rmdir()
                continue
            self.path = path
            return self
        pytest.skip("needs a writable cgroup cpu controller (root): to slow one node down")

    def __exit__(self, *exc):
        if self.path is not None:
            try:
                (self.path.parent / "cgroup.procs").write_text(str(self.pid))
            except OSError:
                pass  # the process ended
            self.path.rmdir()


def test_a_node_far_slower_than_planned_is_replanned_around_and_the_job_completes(tmp_path):
    """The busier stage of a 2-stage pipeline is held to 2% of a core mid-job: its compute per micro-batch
    stays far above the plan's and its peer's, so the job is re-planned onto the spare, says why, and
    completes as well as without the fault. (Growing onto the spare is kept out of it: a slowed node's
    calibration made that predict faster, once, before the slow rule's window ran out.)"""
    with LocalCluster(tmp_path, nodes=3, coordinator_args=["--grow-gain", "1000"]) as cluster:
        # (800 steps: slowed at step 40, the victim makes a few steps a second, so the job is far from done when
        # the slow rule's window runs out; hundreds remain after the re-plan)
        job_id = cluster.submit(cnn_job(steps=800, checkpoint_every=100, clusters=1, stages_per_cluster=2,
                                        min_nodes=2, max_nodes=2))
        job = wait_progress(cluster, job_id, 0.05)
        # the stage that computes most (the CNN's last holds only its linear head, whose fixed costs per
        # micro-batch a small share of a core still keeps up with): 2% of a core slows it beyond slow_factor
        # even where the host's other work slows its peer down too (5% did not, once, on a host 4x overloaded)
        victim = max(job["plan"]["clusters"][0]["stages"], key=lambda s: s["predicted_compute_seconds"])["node_id"]
        with CpuLimit(cluster.node_process(victim).pid, share=0.02):
            job = cluster.wait_for(lambda: (j := cluster.job(job_id))["recoveries"] and j, 180,
                                   "the job to re-plan around the slow node", ignore_exits=True)
        [recovery] = job["recoveries"]
        print(f"re-planned: {recovery['reason']}")
        assert recovery["reason"].startswith("node ") and f"({victim}) is too slow" in recovery["reason"]
        assert recovery["failure"]["kind"] == "slow" and recovery["left_out"] == [victim]
        job = cluster.wait_job(job_id, timeout=600)
        assert job["state"] == "completed", job["reason"]
        placed = {s["node_id"] for c in job["plan"]["clusters"] for s in c["stages"]}
        assert victim not in placed and len(placed) == 2
        assert job["metrics"]["test_accuracy"] >= 0.95


MLP_JOB = Path(__file__).resolve().parent.parent / "examples" / "jobs" / "digits-mlp.json"


def test_sixteen_nodes_beside_two_busy_cores_lose_nobody(tmp_path):
    """16 nodes as 8 clusters x 2 stages on this 2-core machine while two processes burn both cores: the
    nodes' beats come late and irregularly (the accrual detector, coordinator/beat_history.py, gives each
    the room its history shows), yet no node is declared dead, none that was not killed is left out for
    silence, and the job completes."""
    burn = "import time\nend = time.monotonic() + 600\nwhile time.monotonic() < end:\n    pass\n"
    burners: list[subprocess.Popen] = []
    try:
        with LocalCluster(tmp_path, nodes=16) as cluster:  # (joined first: the job is what runs beside them)
            burners = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(2)]  # 10 minutes at most
            spec = json.loads(MLP_JOB.read_text())
            spec["training"].update(steps=400, eval_every=0)
            spec["placement"] = {"clusters": 8, "stages_per_cluster": 2}
            job = cluster.wait_job(cluster.submit(spec), timeout=600)
            assert job["state"] == "completed", job["reason"]
            silent = [r["reason"] for r in job["recoveries"] if (r["failure"] or {}).get("kind") == "silent"]
            assert not silent, silent
            assert not [n["name"] for n in cluster.http.get("/v1/nodes").json() if n["state"] == "gone"]
            assert job["metrics"]["test_accuracy"] >= 0.9
            print(f"re-plans: {[r['reason'][:120] for r in job['recoveries']]}")
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
