"""The `ravnest` command as a user runs it, against a real coordinator and real nodes: submit and watch
a job, list it, download the model, load it with `ravnest.load_model`, and the errors scripts see."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ravnest
from ravnest.data import load_dataset
from scripts.local_cluster import LocalCluster

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_submit_watch_download_and_load_a_model_with_the_ravnest_command(tmp_path: Path) -> None:
    def ravnest_cli(*args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "RAVNEST_COORDINATOR": cluster.url, "RAVNEST_KEY": cluster.operator_token}
        return subprocess.run([sys.executable, "-m", "ravnest.client.cli", *args], capture_output=True, text=True,
                              env=env, timeout=300, cwd=tmp_path)

    with LocalCluster(tmp_path, nodes=2) as cluster:
        submitted = ravnest_cli("submit", str(ROOT / "examples/jobs/digits-mlp.json"), "--watch")
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.strip()  # the id alone on stdout, for scripts
        assert len(job_id) == 16 and "completed" in submitted.stderr
        listed = ravnest_cli("status")
        assert listed.returncode == 0 and job_id in listed.stdout and "completed" in listed.stdout
        one = ravnest_cli("status", job_id)
        assert one.returncode == 0 and "cluster 0: blocks" in one.stdout and f"ravnest download {job_id}" in one.stdout
        assert ravnest_cli("download", job_id, "-o", "model.safetensors").returncode == 0
        reported = cluster.job(job_id)["metrics"]["test_accuracy"]

        model = ravnest.load_model(tmp_path / "model.safetensors")
        correct = total = 0
        with torch.no_grad():
            for x, y in load_dataset({"name": "digits"}).test_batches(64):
                correct += int((model(x).argmax(dim=1) == y).sum())
                total += len(y)
        assert correct / total == pytest.approx(reported, abs=1e-9)  # the model the job evaluated

        unknown = ravnest_cli("status", "0123456789abcdef")
        assert unknown.returncode == 1 and "no job" in unknown.stderr
        missing = ravnest_cli("submit", "no-such-file.json")
        assert missing.returncode == 2 and "cannot read" in missing.stderr
        (tmp_path / "bad.json").write_text('{"model": {"name": "mlp"}}')
        refused = ravnest_cli("submit", "bad.json")
        assert refused.returncode == 1 and "dataset" in refused.stderr
