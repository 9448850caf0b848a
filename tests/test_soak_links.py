"""Soak (`make soak` only): a link that flaps every minute for ten minutes. Each minute the forwarder in
front of one node of a 1 x 2 pipeline either resets its connections or holds them for 5 s; the job is
never re-planned, nobody is blamed for what the link did, and it learns as well as on a clean link."""
from __future__ import annotations

import time

import pytest

from scripts.local_cluster import LocalCluster
from tests.forwarder import Forwarder, free_port
from tests.test_faults import cnn_job, wait_progress

pytestmark = [pytest.mark.slow, pytest.mark.soak]
FLAPS, EVERY_S = 10, 60.0


@pytest.mark.timeout(3600)
def test_a_link_that_flaps_every_minute_for_ten_minutes_blames_nobody(tmp_path):
    port = free_port()
    forwarder = Forwarder(port, ("127.0.0.2", port))
    try:
        with LocalCluster(tmp_path, nodes=0) as cluster:
            cluster.add_nodes(1)
            cluster.add_nodes(1, ["--host", "127.0.0.2", "--port", str(port), "--advertise", "127.0.0.1"])
            shape = {"clusters": 1, "stages_per_cluster": 2, "min_nodes": 2}
            started = time.monotonic()  # a short job on the same nodes sizes the long one: ~15 minutes here
            assert cluster.wait_job(cluster.submit(cnn_job(steps=600, **shape)), timeout=600)["state"] == "completed"
            steps = int(600 / (time.monotonic() - started) * 1.5 * FLAPS * EVERY_S)
            job_id = cluster.submit(cnn_job(steps=steps, **shape))
            wait_progress(cluster, job_id, 0.0)
            for flap in range(FLAPS):
                deadline = time.monotonic() + EVERY_S
                cluster.wait_for(lambda: time.monotonic() >= deadline or None, EVERY_S + 5, "the next minute",
                                 interval=1.0)
                job = cluster.job(job_id)
                assert job["state"] == "running" and job["recoveries"] == [], (flap, job["state"], job["reason"])
                forwarder.cut() if flap % 2 == 0 else forwarder.hold(5.0)
            job = cluster.wait_job(job_id, timeout=1800)
            assert job["state"] == "completed", job["reason"]
            assert job["recoveries"] == [], job["recoveries"]
            logs = cluster.log_tail("node-0.log", 5000) + cluster.log_tail("node-1.log", 5000)
            resumed = [line for line in logs.splitlines() if "a new stream took over" in line]
            print(f"\n{FLAPS} flaps over {FLAPS * EVERY_S / 60:.0f} minutes, {steps} steps, {len(resumed)} resumes, "
                  f"test accuracy {job['metrics']['test_accuracy']:.4f}")
            assert len(resumed) >= FLAPS // 2, logs
            assert job["metrics"]["test_accuracy"] >= 0.95
    finally:
        forwarder.close()
