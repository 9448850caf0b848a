"""What each pipeline codec costs in learning, for models that were not built to be compressed: a `gpt`
trained from scratch and a Llama fine-tuned from a `transformers` checkpoint.

    python -m bench.codec_cost [--steps 200] [--runs 1] [--codecs ,bf16,q8,q4] [--no-docs]

Each model runs as 2 stages on loopback (one process per stage, one torch thread each), cut where the
planner cuts for two equal nodes, with every codec in turn on the link between them (activations
forward, gradients back). The gpt reads the standard library's source as bytes; the Llama is a small
random LlamaForCausalLM saved with `save_pretrained` and imported as `ravnest model from-hf` does, then
trained on the standard library's token file. Prints per codec the bytes per step on the link (both
ways, as the stages measured) and the held-out loss, then last:

    codec-cost loss_gap_<model>_<codec>=<g> ...

g: held-out loss over the uncompressed run's at the same step, minus 1. The same figures go to
docs/links.md ("What each codec costs in learning"); coordinator/codec_choice.py's LOSS_BOUND is
the bound they are held to.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.common import command_line, write_section
from bench.lm import PACKAGES
from ravnest.data.tokens import prepare
from ravnest.models import build_model, profile_blocks
from ravnest.models.hf import ravnest_config
from ravnest.partition import NodeCapacity, partition
from ravnest.pipeline.local import run_local_clusters
from ravnest.spec import JobSpec

LINKS_MD = Path(__file__).resolve().parent.parent / "docs" / "links.md"
GPT = {"vocab_size": 256, "seq_len": 128, "d_model": 256, "n_layers": 4, "n_heads": 4}
LLAMA = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4, "max_position_embeddings": 128}


def gpt_job(steps: int, codec: str) -> JobSpec:
    return JobSpec.model_validate({
        "model": {"name": "gpt", "config": GPT},
        "dataset": {"name": "text", "source": "stdlib-text", "seq_len": GPT["seq_len"], "test_fraction": 0.05},
        "training": {"steps": steps, "batch_size": 8, "codec": codec, "seed": 0, "eval_every": 0,
                     "optimizer": {"name": "AdamW", "kwargs": {"lr": 1e-3}}},
        "averaging": {"strategy": "none"}})


def llama_checkpoint(folder: Path, vocab: int) -> dict[str, Any]:
    """A small random LlamaForCausalLM saved as transformers saves one; the job's `model` section for it,
    as `ravnest model from-hf` prints it."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, tie_word_embeddings=False, **LLAMA))
    hf.save_pretrained(folder)
    config = build_model("llama", ravnest_config(json.loads((folder / "config.json").read_text()))).config
    return {"name": "llama", "config": config, "weights": {"source": "base-model"}}


def llama_job(steps: int, codec: str, model: dict[str, Any]) -> JobSpec:
    return JobSpec.model_validate({
        "model": model,
        "dataset": {"name": "tokens", "source": "stdlib", "seq_len": 128, "test_fraction": 0.05},
        "training": {"steps": steps, "batch_size": 8, "codec": codec, "seed": 0, "eval_every": 0,
                     "optimizer": {"name": "AdamW", "kwargs": {"lr": 3e-4}}},
        "averaging": {"strategy": "none"}})


def two_stages(job: JobSpec) -> list[tuple[int, int]]:
    """Where the planner cuts this model for two equal nodes."""
    costs = profile_blocks(build_model(job.model.name, job.model.config), job.training.batch_size)
    return partition(costs, [NodeCapacity(flops=1e10, memory_bytes=1 << 34, bandwidth_to_next=1e9)] * 2).ranges


def run(job: JobSpec, offered: dict[str, str], places: list | None = None) -> dict[str, float]:
    """One 2-stage run: tokens/s, bytes per step on the link (both ways), held-out loss."""
    result = run_local_clusters(job, [two_stages(job)], timeout=1800, datasets=offered, places=places)[0]
    first, last = result["stages"]
    return {"tokens_per_s": last["steady_samples_per_s"] * job.dataset.seq_len,
            "link_bytes": first["next_bytes_per_step"] + last["prev_bytes_per_step"],
            "loss": result["metrics"]["test_loss"]}


def prepared(scratch: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """The files both models read (offered by name, as volunteers offer them) and the Llama's model section."""
    stdlib = Path(json.__file__).parent.parent
    text = scratch / "stdlib.txt"
    text.write_bytes(b"".join(p.read_bytes() for package in PACKAGES for p in sorted((stdlib / package).rglob("*.py"))))
    tokens = scratch / "stdlib.tokens"
    vocab = prepare([stdlib / p for p in PACKAGES], tokens, vocab_size=1024, pattern="*.py").vocab_size
    model = llama_checkpoint(scratch / "base", vocab)
    return {"stdlib-text": str(text), "stdlib": str(tokens),
            "base-model": str(scratch / "base" / "model.safetensors")}, model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--runs", type=int, default=1, help="repeat each and quote medians")
    parser.add_argument("--codecs", default=",bf16,q8,q4", help="comma-separated; the empty name is float32")
    parser.add_argument("--no-docs", action="store_true", help="do not write docs/links.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    codecs = args.codecs.split(",")
    rows: dict[tuple[str, str], dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        offered, llama = prepared(Path(scratch))
        jobs = {"gpt": lambda codec: gpt_job(args.steps, codec),
                "llama_ft": lambda codec: llama_job(args.steps, codec, llama)}
        for model, make in jobs.items():
            for codec in codecs:
                runs = [run(make(codec), offered) for _ in range(args.runs)]
                rows[model, codec] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                r = rows[model, codec]
                print(f"{model:9s} {codec or 'fp32':5s} {r['link_bytes'] / 1e3:9.1f} kB/step  "
                      f"{r['tokens_per_s']:8,.0f} tokens/s  held-out loss {r['loss']:.4f}", flush=True)
    gaps = {(model, codec): rows[model, codec]["loss"] / rows[model, codecs[0]]["loss"] - 1 for model, codec in rows}
    summary = "codec-cost " + " ".join(f"loss_gap_{model}_{codec or 'fp32'}={gap:.4f}"
                                       for (model, codec), gap in gaps.items())
    print(summary)
    if not args.no_docs:
        table = "\n".join(f"| {model} | {codec or 'fp32'} | {r['link_bytes'] / 1e3:,.1f} | "
                          f"{rows[model, codecs[0]]['link_bytes'] / r['link_bytes']:.1f}x | {r['loss']:.4f} | "
                          f"{gaps[model, codec]:+.2%} |" for (model, codec), r in rows.items())
        write_section("What each codec costs in learning", f"""
`{command_line("bench.codec_cost", argv)}`: medians of {args.runs} run(s). Two stages on loopback, {args.steps}
steps of 8 x 128 tokens, the codec on the link between them both ways. gpt: d_model {GPT['d_model']},
{GPT['n_layers']} layers, bytes of the standard library's source, from scratch. llama_ft: a random
`LlamaForCausalLM` (hidden {LLAMA['hidden_size']}, {LLAMA['num_hidden_layers']} layers) saved by `transformers` and
imported as `ravnest model from-hf` does, fine-tuned on the standard library's token file. kB per step:
what the stages sent each other (activations and targets forward, gradients back), as they measured it.

| model | codec | kB per step | fewer bytes | held-out loss | against fp32 |
|---|---|---|---|---|---|
{table}

`{summary}`
""", LINKS_MD)
    return 0


if __name__ == "__main__":
    sys.exit(main())
