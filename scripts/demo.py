"""The README demo: a coordinator on SQLite and 4 local nodes train a CNN on scikit-learn's digits.

Run with `make demo` (or `.venv/bin/python scripts/demo.py [--job FILE] [--nodes N]`).
"""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import textwrap
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from scripts.local_cluster import LocalCluster  # noqa: E402
from ravnest.data import load_dataset  # noqa: E402
from ravnest.models import build_model  # noqa: E402
from ravnest.spec import JobSpec  # noqa: E402


def evaluate_model_file(path: Path, spec: JobSpec, offered: dict[str, str]) -> float:
    """Load the downloaded model into the single-process architecture and measure test accuracy."""
    model = build_model(spec.model.name, spec.model.config).full_model()
    model.load_state_dict(load_file(path))
    model.eval()
    data = load_dataset(spec.dataset, offered)
    with torch.no_grad():
        predictions = model(data.test_x).argmax(dim=-1)
    return (predictions == data.test_y).float().mean().item()


def fit(line: str, indent: str = "    ") -> str:
    """A line for people, wrapped at 80 columns; its continuation lines indented."""
    return textwrap.fill(line, 80, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def describe_plan(job: dict) -> str:
    lines = [f"  why: {job['plan']['reason']}"]
    for cluster in job["plan"]["clusters"]:
        stages = " -> ".join(f"node {s['node_id'][:8]} (blocks [{s['blocks'][0]}, {s['blocks'][1]}), "
                             f"~{s['predicted_memory_bytes'] / 2**20:.0f} MiB)" for s in cluster["stages"])
        lines.append(f"  cluster {cluster['cluster']}: {stages}")
    for ring in job["plan"]["rings"]:
        where = ", ".join(f"cluster {c} stage {s}" for c, s in enumerate(ring["stages"]))
        lines.append(f"  blocks [{ring['blocks'][0]}, {ring['blocks'][1]}) are averaged across clusters by "
                     f"{where}")
    return "\n".join(map(fit, lines))


def describe_memory(job: dict) -> str:
    """Predicted against measured memory per stage (peak above the node's idle level)."""
    lines = ["memory per stage (predicted by the planner / measured peak above idle):"]
    for stage in job["metrics"]["stages"]:
        predicted, peak = stage.get("predicted_memory_bytes"), stage.get("peak_memory_bytes")
        if predicted and peak is not None:
            lines.append(f"  cluster {stage['cluster']} stage {stage['stage']}: {predicted / 2**20:7.1f} MiB / "
                         f"{peak / 2**20:7.1f} MiB")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", default="examples/jobs/digits-cnn.json")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--data-dir", default="ravnest-data/demo")
    parser.add_argument("--timeout", type=float, default=900, help="seconds the job may take (default 900)")
    parser.add_argument("--join-timeout", type=float, default=600,
                        help="seconds the nodes may take to join while they still make progress (default 600)")
    parser.add_argument("--dataset", action="append", default=[], metavar="NAME=PATH",
                        help="a file every node offers to the job (e.g. gpl3=/usr/share/common-licenses/GPL-3 "
                             "for examples/jobs/text-gpt.json)")
    args = parser.parse_args()
    spec_json = json.loads(Path(args.job).read_text())
    spec = JobSpec.model_validate(spec_json)
    data_dir = Path(args.data_dir).resolve()
    shutil.rmtree(data_dir, ignore_errors=True)  # a fresh demo every time: database, jobs, logs

    print(f"starting a coordinator and {args.nodes} nodes (logs in {data_dir / 'logs'})", flush=True)
    start = time.monotonic()
    offered = dict(item.split("=", 1) for item in args.dataset)
    node_args = [arg for item in args.dataset for arg in ("--dataset", item)]
    # SIGTERM (a closed terminal, `kill`) leaves through the same door as an error or Ctrl-C: the cluster stops
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"stopped by SIGTERM after {time.monotonic() - start:.0f}s"))
    try:
        with LocalCluster(data_dir, nodes=args.nodes, node_args=node_args, join_timeout=args.join_timeout) as cluster:
            job = train(cluster, args.job, spec_json, args.timeout, start)
            if job["state"] == "completed":
                model_path = data_dir / f"{job['id']}.safetensors"
                response = cluster.http.get(f"/v1/jobs/{job['id']}/model")
                response.raise_for_status()
                model_path.write_bytes(response.content)
    except (TimeoutError, RuntimeError) as e:  # the cluster could not start: say why, not where in the code
        print(f"the demo's cluster did not start: {e}", flush=True)
        return 1
    finally:
        print(f"stopped the coordinator and the {args.nodes} nodes this demo started", flush=True)
    if job["state"] != "completed":
        print(fit(f"job {job['state']}: {job.get('reason')}"), flush=True)
        return 1

    accuracy = (job.get("metrics") or {}).get("test_accuracy")
    reloaded = evaluate_model_file(model_path, spec, offered)
    print(f"\nfinished in {time.monotonic() - start:.0f}s")
    print(describe_memory(job))
    print(f"final test accuracy (reported by the pipeline): {accuracy:.4f}" if accuracy is not None else
          "final test accuracy: not reported")
    print(f"test accuracy of the downloaded model, reloaded in one process: {reloaded:.4f}")
    print(f"model: {model_path}")
    return 0


def train(cluster: LocalCluster, job_file: str, spec_json: dict, timeout: float, start: float) -> dict:
    """Submit the job, print its plan and its progress until it ends; the job as it ended."""
    job_id = cluster.submit(spec_json)
    print(f"submitted {job_file} as job {job_id}", flush=True)
    shown = {"plan": False}

    def show(job: dict) -> None:
        if job.get("plan") and not shown["plan"]:
            print("plan:\n" + describe_plan(job), flush=True)
            print(fit("progress (util: the share of time the stages compute; the rest they wait for their "
                      "neighbours; acc: accuracy on the held-out test set):"), flush=True)
            shown["plan"] = True
        m, p = job.get("metrics") or {}, job.get("progress") or {}
        parts = [f"[{time.monotonic() - start:4.0f}s] {job['state']:<9}"]  # (within 80 columns)
        if p.get("clusters"):
            done = min(c["steps_done"] for c in p["clusters"])
            parts.append(f"step {done}/{p['steps_total']}")
        for key, fmt in (("loss", "loss {:.4f}"), ("samples_per_s", "{:.0f} samples/s"),
                         ("utilization", "util {:.2f}"), ("test_accuracy", "acc {:.4f}")):
            if m.get(key) is not None:
                parts.append(fmt.format(m[key]))
        print(" ".join(parts), flush=True)

    return cluster.wait_job(job_id, timeout, on_update=show)


if __name__ == "__main__":
    sys.exit(main())
