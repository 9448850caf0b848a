"""`ravnest generate`: continue a prompt with the language model a job trained, here, on the CPU."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ravnest.client.typer_app import app, err


@app.command()
def generate(ctx: typer.Context, job_id: str,
             prompt: str = typer.Option(..., "--prompt", help="the text to continue"),
             tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="a token file (ravnest data "
                                                      "prepare) or a tokenizer.json; default: the one the job "
                                                      "recorded (jobs on a token file), else bytes (text jobs)"),
             max_tokens: int = typer.Option(100, "--max-tokens", min=1, max=100_000),
             temperature: float = typer.Option(0.8, "--temperature", min=0.0, help="0: always the likeliest"),
             top_k: int = typer.Option(50, "--top-k", min=1), seed: Optional[int] = typer.Option(None, "--seed")
             ) -> None:
    """Continue PROMPT with the language model a completed job trained (downloaded, run here on the CPU)."""
    import tempfile

    from safetensors import safe_open

    import ravnest
    from ravnest.client.api import ApiError
    from ravnest.sampling import ByteTokenizer, FileTokenizer, generate as sample

    with tempfile.TemporaryDirectory() as scratch:
        file = Path(scratch) / "model.safetensors"
        try:
            ctx.obj.download(f"/v1/jobs/{job_id}/model", file)
        except ApiError as e:
            err.print(f"ravnest: {e}", highlight=False)
            raise typer.Exit(1 if e.status else 3) from None
        model = ravnest.load_model(file)
        with safe_open(str(file), "pt") as handle:
            recorded = (handle.metadata() or {}).get("tokenizer")
    spec = getattr(model, "ravnest_spec", None)
    if spec is not None and spec.task != "lm":
        err.print(f"ravnest: job {job_id} trained a {spec.name!r} classifier, not a language model", highlight=False)
        raise typer.Exit(1)
    words = FileTokenizer(tokenizer) if tokenizer else FileTokenizer(text=recorded) if recorded else ByteTokenizer()
    ids = sample(model, words.encode(prompt), max_new_tokens=max_tokens, temperature=temperature, top_k=top_k,
                 context=spec.input.shape[0] if spec is not None else None, seed=seed)
    print(words.decode(ids))
