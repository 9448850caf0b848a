"""`ravnest model from-hf`: a job's `model` section for fine-tuning a Hugging Face Llama checkpoint
(ravnest/models/hf.py, ravnest/models/weights.py). Runs where the checkpoint is; talks to no coordinator."""
from __future__ import annotations

import json
from pathlib import Path

import typer

from ravnest.client.typer_app import app, err

model = typer.Typer(help="Models: start a job from a Hugging Face checkpoint.", no_args_is_help=True)
app.add_typer(model, name="model")


@model.command("from-hf")
def from_hf(folder: Path = typer.Argument(..., help="a Hugging Face Llama folder: config.json and model.safetensors"),
            source: str = typer.Option("base-model", "--source", help="the name volunteers offer model.safetensors "
                                       "under (`ravnest-node join --model-file NAME=PATH`)")) -> None:
    """Print the `model` section of a job that fine-tunes FOLDER's model: its config in Ravnest's keys and
    the checkpoint's content pinned by sha256 (one sharded over several files: save it as one first)."""
    from ravnest.data import proof
    from ravnest.models import ModelError, build_model
    from ravnest.models.hf import ravnest_config

    weights = folder / "model.safetensors"
    try:
        config = build_model("llama", ravnest_config(json.loads((folder / "config.json").read_text()))).config
        sha256 = proof.fingerprint(weights).split(":", 1)[1]
    except (ModelError, OSError, ValueError) as e:
        err.print(f"ravnest: {e}", highlight=False)
        raise typer.Exit(1) from None
    print(json.dumps({"name": "llama", "config": config, "weights": {"source": source, "sha256": sha256}}, indent=2))
    err.print(f"offer the weights with: ravnest-node join ... --model-file {source}={weights.resolve()}",
              highlight=False)
