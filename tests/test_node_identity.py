"""A volunteer's machine keeps one identity across restarts, by default in its data folder (or `--identity
FILE`): a real node process, stopped or killed and started again, comes back under the same id and row;
the job it held re-plans naming it first, and it takes the next job."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.local_cluster import ROOT, LocalCluster
from tests.test_faults import cnn_job, wait_progress

TEXT_JOB = Path(__file__).resolve().parent.parent / "examples" / "jobs" / "text-gpt.json"

pytestmark = pytest.mark.slow


def test_a_node_started_again_with_no_flags_is_the_same_node(tmp_path, monkeypatch):
    """The user's own data folder keeps the identity ($XDG_DATA_HOME here); a second process on it is
    refused while the first runs; `--ephemeral` is a new node on purpose."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "home"))
    for kept_elsewhere in ("RAVNEST_NODE_DIR", "RAVNEST_NODE_IDENTITY"):
        monkeypatch.delenv(kept_elsewhere, raising=False)
    with LocalCluster(tmp_path / "cluster", nodes=0) as cluster:
        command = ["node.cli", "join", "--coordinator", cluster.url, "--name", "d"]
        identity = tmp_path / "home" / "ravnest" / "node" / "identity"
        # a wrong token is refused before the node measures itself or makes an identity, and before it
        # loads torch (seconds of imports on a busy machine): what it imported is listed by -X importtime
        refused = subprocess.run([sys.executable, "-X", "importtime", "-m", *command], capture_output=True, text=True,
                                 timeout=120, cwd=ROOT, env={**os.environ, "RAVNEST_JOIN_TOKEN": "rvn_not-the-token"})
        assert refused.returncode == 1 and "refuses this node's join token (401: unknown token)" in refused.stderr
        assert "measuring this machine" not in refused.stderr and not identity.exists(), refused.stderr
        imported = {line.rpartition("|")[2].strip() for line in refused.stderr.splitlines() if "import time:" in line}
        assert "httpx" in imported and "torch" not in imported

        ids = lambda: [n["id"] for n in cluster.alive_nodes()]  # noqa: E731
        first = cluster._spawn(command, "d-1.log")  # (its token comes in the environment, as LocalCluster's)
        cluster.wait_for(lambda: len(ids()) == 1, 60, "the node to join")
        [node_id] = ids()
        assert stat.S_IMODE(identity.stat().st_mode) == 0o600
        assert f"made this node's identity in {identity} (mode 600" in (cluster.data_dir / "logs/d-1.log").read_text()

        twin = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True, timeout=120, cwd=ROOT,
                              env={**os.environ, "RAVNEST_JOIN_TOKEN": cluster.join_token})
        assert twin.returncode == 1, twin.stderr
        assert f"another ravnest-node on this machine is running as the node in {identity}" in twin.stderr

        first.send_signal(signal.SIGTERM)
        assert first.wait(30) == 0
        cluster.wait_for(lambda: not ids(), 30, "the node to leave", ignore_exits=True)
        cluster._spawn(command, "d-2.log")
        cluster.wait_for(lambda: ids() == [node_id], 60, "the node to come back", ignore_exits=True)
        assert "this is the node whose identity is in" in (cluster.data_dir / "logs/d-2.log").read_text()

        cluster._spawn([*command, "--ephemeral"], "d-3.log")
        cluster.wait_for(lambda: len(ids()) == 2, 60, "an ephemeral node to join", ignore_exits=True)
        rows = cluster.http.get("/v1/nodes").json()
        assert len(rows) == 2 and node_id in {n["id"] for n in rows}  # one row per node, not per start


def test_a_restarted_node_comes_back_under_its_id_and_its_job_goes_on(tmp_path):
    identity = tmp_path / "volunteer" / "node.key"
    with LocalCluster(tmp_path / "cluster", nodes=1) as cluster:
        [volunteer] = cluster.add_nodes(1, ["--identity", str(identity)])
        assert stat.S_IMODE(identity.stat().st_mode) == 0o600  # a secret: its owner's alone
        job_id = cluster.submit(cnn_job(steps=600, clusters=1, stages_per_cluster=2, min_nodes=2, max_nodes=2))
        job = wait_progress(cluster, job_id, 0.3)
        assert volunteer in {s["node_id"] for s in job["plan"]["clusters"][0]["stages"]}
        cluster.kill(cluster.node_process(volunteer))  # the machine rebooted, say
        assert cluster.add_nodes(1, ["--identity", str(identity)]) == {volunteer}  # back faster than a timeout
        job = cluster.wait_job(job_id, timeout=600)
        assert job["state"] == "completed", job["reason"]
        [recovery] = job["recoveries"]
        print(f"recovery: {recovery['reason']}")
        # its neighbour's report or its own return, whichever came first, names it first
        assert recovery["reason"].startswith(f"node node-1 ({volunteer}) ")
        rows = cluster.http.get("/v1/nodes").json()
        assert len(rows) == 2 and {n["id"] for n in rows} >= {volunteer}  # one row per machine
        # left out of the job it was lost to, it takes the next one under the same id
        job = cluster.wait_job(cluster.submit(cnn_job(steps=100, clusters=1, stages_per_cluster=2, min_nodes=2)),
                               timeout=300)
        assert job["state"] == "completed", job["reason"]
        assert volunteer in {s["node_id"] for s in job["plan"]["clusters"][0]["stages"]}


def test_a_running_node_offers_a_file_without_rejoining(tmp_path):
    """The volunteer adds a line to its offers file and sends SIGHUP: the node keeps its id, proves it
    holds the file, and a job waiting for that file starts on it."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(Path(json.__file__).read_bytes() * 20)  # some real text, ~30 kB
    offers = tmp_path / "offers"
    offers.write_text("# NAME=PATH, one per line\n")
    with LocalCluster(tmp_path / "cluster", nodes=0) as cluster:
        [volunteer] = cluster.add_nodes(1, ["--offers", str(offers)])
        job = json.loads(TEXT_JOB.read_text())
        job["dataset"]["source"] = "stdlib-json"
        job["training"].update(steps=30, eval_every=0)
        job["placement"] = {"clusters": 1, "stages_per_cluster": 1, "min_nodes": 1}
        job_id = cluster.submit(job)
        assert "no node offers dataset 'stdlib-json'" in cluster.job(job_id)["reason"]
        offers.write_text(f"# NAME=PATH, one per line\nstdlib-json={corpus}\n")
        cluster.node_process(volunteer).send_signal(signal.SIGHUP)
        job = cluster.wait_job(job_id, timeout=300)
        assert job["state"] == "completed", job["reason"]
        [row] = cluster.http.get("/v1/nodes").json()
        assert row["id"] == volunteer and "stdlib-json" in row["offers"]
        # what the node's own process took when it joined, besides what it offers for training
        assert 100 << 20 < row["profile"]["idle_bytes"] < 4 << 30
