"""The `ravnest` command as a user runs it, against a real coordinator and real nodes: submit and watch
a job, list it, download the model, load it with `ravnest.load_model`, and the errors scripts see."""
from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ravnest
from ravnest.data import load_dataset
from scripts.local_cluster import LocalCluster, free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One coordinator and two nodes for the tests below (the last of them revokes a node)."""
    with LocalCluster(tmp_path_factory.mktemp("cli-cluster"), nodes=2) as cluster:
        yield cluster


@pytest.mark.slow
def test_submit_watch_download_and_load_a_model_with_the_ravnest_command(cluster, tmp_path: Path) -> None:
    def ravnest_cli(*args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "RAVNEST_COORDINATOR": cluster.url, "RAVNEST_KEY": cluster.operator_token,
               "COLUMNS": "160"}  # every column (the test below shows 80)
        return subprocess.run([sys.executable, "-m", "ravnest.client.cli", *args], capture_output=True, text=True,
                              env=env, timeout=300, cwd=tmp_path)

    submitted = ravnest_cli("submit", str(ROOT / "examples/jobs/digits-mlp.json"), "--watch")
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()  # the id alone on stdout, for scripts
    assert len(job_id) == 16 and "completed" in submitted.stderr
    listed = ravnest_cli("status")
    assert listed.returncode == 0 and job_id in listed.stdout and "completed" in listed.stdout
    one = ravnest_cli("status", job_id)
    assert one.returncode == 0
    # a row per planned stage: cluster, stage, blocks, node, step, computing (utilization), waiting (bubble),
    # staleness, samples/s; and a line per link between two stages
    row = re.compile(r"^\d+ +\d+ +\[\d+, \d+\) +[0-9a-f]{16} +\d+ +([\d.]+) +([\d.]+) +[\d.]+ +[\d,]+ *$", re.MULTILINE)
    rows = row.findall(one.stdout)
    assert len(rows) == sum(len(c["stages"]) for c in cluster.job(job_id)["plan"]["clusters"]), one.stdout
    assert all(float(u) + float(b) == pytest.approx(1, abs=0.011) for u, b in rows), one.stdout
    links = sum(len(c["stages"]) - 1 for c in cluster.job(job_id)["plan"]["clusters"])
    assert len(re.findall(r"link cluster \d+ stage \d+ -> \d+: float32, [\d.]+ MB/step planned", one.stdout)) == links
    assert f"ravnest download {job_id}" in one.stdout
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
    unknown = ravnest_cli("watch", "0123456789abcdef")  # the refusal alone, no empty progress bar
    assert unknown.returncode == 1 and unknown.stderr.strip() == "ravnest: 404: no job 0123456789abcdef"
    # a coordinator never reached is an error (a watch retries only through a restart of one it has seen)
    nowhere = subprocess.run([sys.executable, "-m", "ravnest.client.cli", "watch", job_id], capture_output=True,
                             text=True, timeout=60, env={**os.environ, "RAVNEST_COORDINATOR": "http://127.0.0.1:1"})
    assert nowhere.returncode == 3 and "127.0.0.1:1" in nowhere.stderr, nowhere.stderr
    missing = ravnest_cli("submit", "no-such-file.json")
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    (tmp_path / "bad.json").write_text('{"model": {"name": "mlp"}}')
    refused = ravnest_cli("submit", "bad.json")
    assert refused.returncode == 1 and "dataset" in refused.stderr


def run_in_terminal(args: list[str], env: dict, timeout: float) -> tuple[int, str]:
    """Run a command with a pseudo-terminal as its stdout and stderr (as in an interactive shell);
    its exit status and everything it wrote."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(args, stdout=follower, stderr=follower, stdin=subprocess.DEVNULL, env=env)
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if ready:
                try:
                    data = os.read(leader, 65536)
                except OSError:  # the command exited and closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=max(1.0, deadline - time.monotonic())), b"".join(chunks).decode(errors="replace")
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()


def fits_80_columns(screen: str) -> str:
    """What a terminal of 80 columns showed, its lines checked: none wider, nothing cut off (rich marks a
    cut with an ellipsis). Returns its words, one space apart."""
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen)
    lines = [line.rstrip() for line in re.split(r"\r\n|\r|\n", shown)]
    assert max(len(line) for line in lines) <= 80 and "…" not in shown, shown
    return " ".join(shown.split())


@pytest.mark.slow
def test_config_file_tokens_watch_in_a_terminal_versions_and_the_coordinators_log(cluster, tmp_path: Path) -> None:
    config = tmp_path / "client.toml"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAVNEST_")}
    env.update(RAVNEST_CONFIG=str(config), COLUMNS="160")  # piped: every column (a terminal of 80 below)

    def ravnest_cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ravnest.client.cli", *args], capture_output=True, text=True,
                              env=env, timeout=120, cwd=tmp_path)

    for module in ("ravnest.client.cli", "node.cli", "coordinator.cli"):
        shown = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, env=env)
        assert shown.returncode == 0 and shown.stdout.strip().endswith(ravnest.__version__), module

    config.write_text(f'coordinator = "{cluster.url}"\n')  # no key anywhere: the refusal says where one comes from
    refused = ravnest_cli("status")
    assert refused.returncode == 1 and "set RAVNEST_KEY or pass --key" in refused.stderr, refused.stderr
    refused = ravnest_cli("--key", "not-a-key", "status")  # a mistyped key: told so, not only "unknown token"
    assert refused.returncode == 1 and "this coordinator knows no such API key" in refused.stderr, refused.stderr
    config.write_text(f'coordinator = "{cluster.url}"\nkey = "{cluster.operator_token}"\n')
    assert ravnest_cli("whoami").stdout.startswith(f"operator key operator token (data directory) at {cluster.url}")
    created = ravnest_cli("token", "create", "--name", "lab machines", "--uses", "3")
    assert created.returncode == 0, created.stderr
    token_id = re.search(r"created join token (\w+)", created.stderr)[1]
    assert len(created.stdout.strip()) >= 32  # the token alone on stdout, once
    listed = ravnest_cli("token", "list")
    assert "lab machines" in listed.stdout and token_id in listed.stdout
    assert ravnest_cli("token", "revoke", token_id).returncode == 0
    assert re.search(rf"{token_id}.*lab machines.*\d\d-\d\d \d\d:\d\d\s*$", ravnest_cli("token", "list").stdout,
                     re.MULTILINE)  # its revoked column is filled
    assert "node-0" in ravnest_cli("nodes").stdout
    # node-0 again under its name, a new row (restarted without its identity): its lines say which row
    again = cluster.http.post("/v1/nodes", headers={"Authorization": f"Bearer {cluster.join_token}"}, json={
        "name": "node-0", "address": f"127.0.0.1:{free_port()}", "profile": {
            "flops": 1e10, "memory_bytes": 2**30, "bandwidth_bytes_per_s": 1e8, "latency_s": 0.001,
            "datasets": ["books"], "fingerprints": {"books": "64:" + "ab" * 32}}}).json()
    assert f"node-0 ({again['node_id']}) offers books" in ravnest_cli("nodes").stdout.replace("\n", " ")
    cluster.http.delete(f"/v1/nodes/{again['node_id']}", headers={"Authorization": f"Bearer {again['node_token']}"})

    job_id = ravnest_cli("submit", str(ROOT / "examples/jobs/digits-mlp.json")).stdout.strip()
    narrow = {**env, "COLUMNS": "80"}
    code, screen = run_in_terminal([sys.executable, "-m", "ravnest.client.cli", "watch", job_id, "--every", "0.5"],
                                   narrow, timeout=300)
    assert code == 0, screen
    assert "\x1b[" in screen and "━" in screen  # drawn live: escape codes and a bar, not log lines
    assert "100%" in screen and f"{job_id} completed" in screen and "samples/s" in screen
    fits_80_columns(screen)
    job = cluster.job(job_id)
    for command in (["status"], ["jobs"], ["status", job_id]):
        code, screen = run_in_terminal([sys.executable, "-m", "ravnest.client.cli", *command], narrow, timeout=60)
        assert code == 0, screen
        text = fits_80_columns(screen)
        assert job_id in text and "completed" in text and " ".join(job["reason"].split()) in text, command
    assert "progress 100% of" in text
    code, screen = run_in_terminal([sys.executable, "-m", "ravnest.client.cli", "nodes"], narrow, timeout=60)
    text = fits_80_columns(screen)
    assert code == 0 and all(f"{n['id']} {n['name']}" in text for n in cluster.alive_nodes()), text

    spec = json.loads((ROOT / "examples/jobs/digits-mlp.json").read_text())
    spec["training"]["steps"] = 100_000
    spec["checkpoints"] = {"every": 20}
    (tmp_path / "long.json").write_text(json.dumps(spec))
    long_id = ravnest_cli("submit", "long.json").stdout.strip()
    early = ravnest_cli("resume", long_id)  # it is not stopped: refused, the reason on one line for scripts
    assert early.returncode == 1 and early.stderr.count("\n") == 1 and "only failed or cancelled" in early.stderr
    cluster.wait_for(lambda: cluster.job(long_id)["checkpoint_step"], 120, "a checkpoint to resume from")
    cancelled = ravnest_cli("cancel", long_id)
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stderr
    resumed = ravnest_cli("resume", long_id)
    assert resumed.returncode == 0 and re.search(r"pending|placing|running", resumed.stderr), resumed.stderr

    reader = ravnest_cli("key", "create", "--role", "reader", "--name", "grafana")
    key_id, reader_key = re.search(r"created API key (\w+)", reader.stderr)[1], reader.stdout.strip()
    assert "grafana" in ravnest_cli("key", "list").stdout
    as_reader = subprocess.run([sys.executable, "-m", "ravnest.client.cli", "--key", reader_key, "cancel", long_id],
                               capture_output=True, text=True, env=env, timeout=60)
    assert as_reader.returncode == 1 and "submitter or operator key" in as_reader.stderr  # the flag beats the file
    assert ravnest_cli("key", "revoke", key_id).returncode == 0
    revoked = subprocess.run([sys.executable, "-m", "ravnest.client.cli", "--key", reader_key, "status"],
                             capture_output=True, text=True, env=env, timeout=60)
    assert revoked.returncode == 1 and "401" in revoked.stderr
    assert ravnest_cli("cancel", long_id).returncode == 0

    node_id = next(n["id"] for n in cluster.alive_nodes() if n["name"] == "node-1")
    assert ravnest_cli("node", "revoke", node_id).returncode == 0
    cluster.wait_for(lambda: all(n["id"] != node_id for n in cluster.alive_nodes()), 30, "the revoked node to go",
                     ignore_exits=True)  # (told 401, the node stops: code 1)

    config.write_text("coordinator = [")
    broken = ravnest_cli("status")
    assert broken.returncode == 2 and "client.toml" in broken.stderr

    log = (cluster.data_dir / "logs" / "coordinator.log").read_text()
    assert "authentication is on" in log and "database sqlite:" in log
    assert re.search(r"node \w+ \(node-0\) joined from 127\.0\.0\.1:\d+", log)
    assert re.search(rf"job {job_id} \(digits-mlp\) submitted by key operator", log)
    for change in ("pending -> placing", "placing -> running", "running -> completed"):
        assert f"job {job_id} (digits-mlp): {change}" in log
    assert '"POST /v1/jobs HTTP' in log and "/heartbeat" not in log  # heartbeats' access lines only at debug


@pytest.mark.slow
def test_ravnest_demo_runs_the_newcomers_job_end_to_end(tmp_path: Path) -> None:
    """`ravnest demo` (what `make demo` runs): a coordinator and 4 nodes train the digits CNN; the
    downloaded model, reloaded in one process, scores what the pipeline reported."""
    demo = subprocess.run([sys.executable, "-m", "ravnest.client.cli", "demo", "--data-dir", str(tmp_path / "demo")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    reported = float(re.search(r"final test accuracy \(reported by the pipeline\): ([\d.]+)", demo.stdout)[1])
    reloaded = float(re.search(r"reloaded in one process: ([\d.]+)", demo.stdout)[1])
    assert reported == reloaded >= 0.95
    assert "are averaged across clusters by cluster 0 stage" in demo.stdout  # the plan, in words


def test_flags_read_as_flags_in_the_help() -> None:
    """typer shows a type after every option; a flag takes no value, so none is shown for it."""
    for args in (["--help"], ["submit", "--help"]):
        shown = subprocess.run([sys.executable, "-m", "ravnest.client.cli", *args], capture_output=True, text=True,
                               timeout=60, env={**os.environ, "COLUMNS": "100"})
        assert shown.returncode == 0, shown.stderr
        flags = [line for line in shown.stdout.splitlines() if "--version" in line or "--watch" in line]
        assert flags and not any("<bool>" in line for line in flags), flags
