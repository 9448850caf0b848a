"""The `ravnest` commands for jobs: submit, status, watch, cancel, resume, download; and `nodes`.

`watch` (and `submit --watch`) polls the job every `--every` seconds until it ends and exits 0 when it
completed, 1 when it failed or was cancelled: a script can chain `ravnest submit job.json --watch &&
ravnest download ...`.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from ravnest.client.api import ApiError
from ravnest.client.admin import node_list
from ravnest.client.typer_app import app, call, err, listed_page, say, show, table, when

ENDED = ("completed", "failed", "cancelled")


@app.command()
def submit(ctx: typer.Context, spec: Path = typer.Argument(..., help="a job file, e.g. examples/jobs/digits-cnn.json"),
           watch_it: bool = typer.Option(False, "--watch", metavar="", help="then follow it to the end")) -> None:
    """Submit a job; prints its id (alone on stdout)."""
    try:
        body = json.loads(spec.read_text())
    except OSError as e:
        err.print(f"ravnest: cannot read {spec}: {e.strerror}", highlight=False)
        raise typer.Exit(2) from None
    except json.JSONDecodeError as e:
        err.print(f"ravnest: {spec} is not JSON: {e}", highlight=False)
        raise typer.Exit(2) from None
    created = call(ctx, "POST", "/v1/jobs", json=body)
    print(created["id"])
    err.print(f"job {created['id']}: {created['state']} {created['reason']}".rstrip(), highlight=False)
    if watch_it:
        _follow(ctx, created["id"], every=2.0)


@app.command()
def status(ctx: typer.Context, job_id: Optional[str] = typer.Argument(None, help="one job (default: list them all)")
           ) -> None:
    """Jobs you may see, or one job's state, progress, figures and plan."""
    if job_id is None:
        job_list(ctx, limit=100, offset=0)
        return
    job = call(ctx, "GET", f"/v1/jobs/{job_id}")
    say(f"{job['id']} {job['name']}: {job['state']} ({job['reason']})")
    figures = _figures(job["metrics"])
    say(f"progress {job['progress']['fraction']:.0%} of {job['progress']['steps_total']} steps"
        + (f"; {figures}" if figures else ""))
    plan = job.get("plan")
    if plan:
        say(f"plan: {plan['reason']}")
        show(_stage_table(plan, job["metrics"].get("stages") or []), spare=("stale", "blocks", "samples/s"))
        for line in _links(plan, job["metrics"].get("stages") or []):
            say(line)
    for recovery in job.get("recoveries") or []:
        kept = recovery.get("kept_training")
        trained_on = f"; clusters {kept} trained on ({recovery.get('steps_trained_on') or 0} steps)" if kept else ""
        back = f"; training again after {recovery['recovery_s']:.1f} s" if recovery.get("recovery_s") else ""
        say(f"recovery ({recovery['kind']}): {recovery['reason']}{trained_on}{back}")
    if job.get("model_url"):
        say(f"model: ravnest download {job['id']} -o model.safetensors")


@app.command("jobs")
def job_list(ctx: typer.Context,
             limit: int = typer.Option(100, min=1, max=1000, help="show at most this many, oldest first"),
             offset: int = typer.Option(0, min=0, help="skip this many first")) -> None:
    """Jobs you may see: state, model, when created, and why they are where they are (as `ravnest status`)."""
    jobs = table("id", "name", "state", "model", "created", "reason")
    listed, cut = listed_page(ctx, "/v1/jobs", "--limit, --offset", limit=limit, offset=offset or None)
    for job in listed:
        jobs.add_row(job["id"], job["name"], job["state"], job["model"], when(job["created_at"]), job["reason"])
    show(jobs, spare=("created", "model", "name"))
    if cut:
        say(cut)


@app.command()
def watch(ctx: typer.Context, job_id: str,
          every: float = typer.Option(2.0, min=0.2, help="seconds between polls")) -> None:
    """Follow a job to its end: a progress bar with loss, accuracy and throughput."""
    _follow(ctx, job_id, every)


def _follow(ctx: typer.Context, job_id: str, every: float) -> None:
    """Poll the job until it ends; once it has been seen, an unreachable coordinator (restarting) is
    waited for; before, it is an error like any other (a mistyped address would wait forever)."""
    job = call(ctx, "GET", f"/v1/jobs/{job_id}")
    columns = [TextColumn("{task.description}"), BarColumn(bar_width=None), TextColumn("{task.percentage:>3.0f}%"),
               TimeElapsedColumn(), TimeRemainingColumn()]
    with _BarAndFigures(*columns, console=err, expand=True, transient=False) as bar:
        task = bar.add_task(job_id, total=1.0, figures="")
        while True:
            bar.update(task, completed=job["progress"]["fraction"], description=f"{job_id} {job['state']}",
                       figures=_figures(job["metrics"]))
            if job["state"] in ENDED:
                break
            while True:  # the next answer, through a coordinator's restart
                time.sleep(every)
                try:
                    job = ctx.obj.call("GET", f"/v1/jobs/{job_id}")
                    break
                except ApiError as e:
                    if e.status:  # refused (the key revoked meanwhile): say so and stop
                        err.print(f"ravnest: {e}", highlight=False)
                        raise typer.Exit(1) from None
                    bar.update(task, figures="the coordinator does not answer; trying again")
    err.print(f"{job_id} {job['state']}: {job['reason']}", highlight=False)  # stdout keeps the id alone
    if job["state"] != "completed":
        raise typer.Exit(1)


class _BarAndFigures(Progress):
    """The bar on its own line (state, bar, percent, elapsed, remaining fit 80 columns) and the job's
    figures on the next, wrapped between words however many there are."""

    def get_renderables(self):
        yield self.make_tasks_table(self.tasks)
        for task in self.tasks:
            if task.fields.get("figures"):
                yield Text(task.fields["figures"])


@app.command()
def cancel(ctx: typer.Context, job_id: str) -> None:
    """Stop a job; its last checkpoint stays (continue it with `ravnest resume`)."""
    job = call(ctx, "POST", f"/v1/jobs/{job_id}/cancel")
    err.print(f"job {job_id}: {job['state']}", highlight=False)


@app.command()
def resume(ctx: typer.Context, job_id: str) -> None:
    """Continue a failed or cancelled job from its last checkpoint, on the nodes there are now."""
    job = call(ctx, "POST", f"/v1/jobs/{job_id}/resume")
    err.print(f"job {job_id}: {job['state']} ({job['reason']})", highlight=False)


@app.command()
def download(ctx: typer.Context, job_id: str,
             output: Optional[Path] = typer.Option(None, "-o", "--output", help="where to write it (default: "
                                                   "model.safetensors, or the folder model-hf for --format hf)"),
             format_: str = typer.Option("ravnest", "--format", help="ravnest: one safetensors file "
                                         "(ravnest.load_model); hf: a Hugging Face folder (llama models) that "
                                         "transformers.AutoModelForCausalLM.from_pretrained loads"),
             tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="with --format hf: a token file "
                                                      "(ravnest data prepare) or a tokenizer.json, written beside "
                                                      "the model for AutoTokenizer; default: the one the job "
                                                      "recorded (jobs on a token file record theirs)")) -> None:
    """The trained model of a completed job; of a cancelled, failed or running one, the model of its last
    checkpoint."""
    if format_ not in ("ravnest", "hf"):
        err.print(f"ravnest: --format is ravnest or hf, not {format_!r}", highlight=False)
        raise typer.Exit(2)
    job = call(ctx, "GET", f"/v1/jobs/{job_id}")
    target = output or Path("model-hf" if format_ == "hf" else "model.safetensors")
    file = target.with_name(target.name + ".zip") if format_ == "hf" else target
    file.parent.mkdir(parents=True, exist_ok=True)
    try:
        size = ctx.obj.download(f"/v1/jobs/{job_id}/model", file, params={"format": format_})
    except ApiError as e:
        err.print(f"ravnest: {e}", highlight=False)
        raise typer.Exit(1 if e.status else 3) from None
    if format_ == "hf":
        try:
            _unpack_hf(file, target, tokenizer)
        except (ValueError, OSError, zipfile.BadZipFile) as e:
            err.print(f"ravnest: {e}", highlight=False)
            raise typer.Exit(1) from None
        finally:
            file.unlink()
    err.print(f"wrote {target} ({size / 2**20:.1f} MiB)", highlight=False)
    if job["state"] != "completed":
        err.print(f"job {job_id} is {job['state']}: this is its last checkpoint, from step {job['checkpoint_step']} "
                  f"of {job['progress']['steps_total']}", highlight=False)


def _unpack_hf(archive: Path, folder: Path, tokenizer: Optional[Path]) -> None:
    """The coordinator's Hugging Face folder (a zip of plain file names) into `folder`; `tokenizer`
    (a token file or tokenizer.json) replaces the one the job recorded, or adds one."""
    from ravnest.data.tokens import tokenizer_json
    from ravnest.models.hf import tokenizer_texts

    with zipfile.ZipFile(archive) as zipped:
        names = zipped.namelist()
        if any(Path(name).name != name or name.startswith(".") for name in names):
            raise ValueError(f"the coordinator's archive holds unexpected paths: {names}")
        folder.mkdir(parents=True, exist_ok=True)
        zipped.extractall(folder)
    if tokenizer is not None:
        length = json.loads((folder / "config.json").read_text())["max_position_embeddings"]
        for name, text in tokenizer_texts(tokenizer_json(tokenizer), length).items():
            (folder / name).write_text(text)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def demo(ctx: typer.Context) -> None:
    """What `make demo` runs: a coordinator and 4 local nodes train digits end to end (options after
    `demo` go to scripts/demo.py, e.g. `ravnest demo --job examples/jobs/digits-mlp.json`)."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "demo.py"
    if not script.is_file():
        err.print("ravnest: the demo runs from a source checkout (scripts/demo.py), which this install lacks",
                  highlight=False)
        raise typer.Exit(2)
    raise typer.Exit(subprocess.call([sys.executable, str(script), *ctx.args], cwd=script.parents[1]))


app.command("nodes", help="Nodes that joined (as `ravnest node list`).")(node_list)


def _stage_table(plan: dict, reports: list[dict]):
    """One row per planned stage with what it last reported: how far it is, the share of time it
    computes (its utilization) and waits for its neighbours (its bubble), and its mean staleness in
    steps; in a robust job, how many spot checks of its input passed (ravnest/pipeline/audits.py)."""
    reported = {(r["cluster"], r["stage"]): r for r in reports}
    audited = any("audits_passed" in (r.get("metrics") or {}) for r in reports)
    stages = table("cluster", "stage", "blocks", "node", "step", "computing", "waiting", "stale", "samples/s",
                   *(["audits passed"] if audited else []))
    for cluster in plan["clusters"]:
        for s in cluster["stages"]:
            r = reported.get((cluster["cluster"], s["stage"]), {})
            figures = [f"{r[key]:.2f}" if r.get(key) is not None else ""
                       for key in ("utilization", "bubble", "staleness")]
            rate, passed = ((r.get("metrics") or {}).get(key) for key in ("samples_per_s", "audits_passed"))
            stages.add_row(str(cluster["cluster"]), str(s["stage"]), f"[{s['blocks'][0]}, {s['blocks'][1]})",
                           s["node_id"], str(r.get("step", "")), *figures, f"{rate:,.0f}" if rate is not None else "",
                           *([f"{passed:.0f}" if passed is not None else ""] if audited else []))
    return stages


def _links(plan: dict, reports: list[dict]) -> list[str]:
    """A line per link between two stages: its codec, megabytes per step both ways (planned, and as the
    stages measured), and the share of time the stage before it had activations waiting to cross it."""
    reported = {(r["cluster"], r["stage"]): r.get("metrics") or {} for r in reports}
    lines = []
    for cluster in plan["clusters"]:
        for s in cluster["stages"]:
            if s.get("codec") is None:
                continue
            here, after = (reported.get((cluster["cluster"], s["stage"] + i), {}) for i in (0, 1))
            forward, back = here.get("next_bytes_per_step"), after.get("prev_bytes_per_step")
            measured = f", {(forward + back) / 1e6:.2f} measured" if forward is not None and back is not None else ""
            planned = s.get("predicted_link_bytes_per_step")
            busy = f", busy {here['next_link_busy']:.0%}" if here.get("next_link_busy") is not None else ""
            lines.append(f"link cluster {cluster['cluster']} stage {s['stage']} -> {s['stage'] + 1}: "
                         f"{s['codec'] or 'float32'}" + (f", {planned / 1e6:.2f} MB/step planned" if planned else "")
                         + measured + busy)
    return lines


def _figures(metrics: dict) -> str:
    parts = []
    if metrics.get("loss") is not None:
        parts.append(f"loss {metrics['loss']:.3g}")  # a tiny loss is not 0.000
    if metrics.get("test_accuracy") is not None:
        parts.append(f"accuracy {metrics['test_accuracy']:.4f}")
    if metrics.get("test_loss") is not None and metrics.get("tokens_per_s") is not None:  # a language model
        parts.append(f"held-out perplexity {math.exp(min(metrics['test_loss'], 700)):.2f}")
    if metrics.get("tokens_per_s") is not None:
        parts.append(f"{metrics['tokens_per_s']:,.0f} tokens/s")
    elif metrics.get("samples_per_s") is not None:
        parts.append(f"{metrics['samples_per_s']:,.0f} samples/s")
    if metrics.get("mfu") is not None:
        parts.append(f"MFU {metrics['mfu']:.1%}")
    return ", ".join(parts)
