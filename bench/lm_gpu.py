"""A llama in bf16 on one GPU: one Ravnest node (the whole model as one stage, in a real stage process)
against a plain `transformers` training loop on the same GPU, the same model, data and optimizer.

    python -m bench.lm_gpu [--steps 60] [--layers 12]

Both run autocast bf16 with fp32 master weights and AdamW state (Ravnest's `training.precision: bf16`),
SDPA attention, one sequence of 1,024 tokens x 16 per step. Tokens/s are steady state (steps 20%-90%),
MFU is model FLOPs (6N + attention, as `ravnest/pipeline/throughput.py` counts them) over the GPU's
dense 16-bit peak. Prints a table, then last `lm_gpu tokens_per_s_ratio=<node / transformers>
mfu_node=<m> mfu_transformers=<m>`; writes docs/benchmarks.md's section unless --no-docs.
Needs CUDA (it exits with a message elsewhere).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import command_line, write_section
from bench.lm import transformers_model
from ravnest.data import load_dataset
from ravnest.data.tokens import prepare
from ravnest.models import build_model
from ravnest.pipeline import run_local_pipeline
from ravnest.pipeline.optim import StageOptimizer
from ravnest.pipeline.throughput import peak_flops, training_flops_per_sample
from ravnest.spec import JobSpec

# about 0.7B parameters: a small Llama-2-shaped model that fills an H100 well at 16 x 1,024 tokens
CONFIG = {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 8,
          "max_position_embeddings": 1024}
PACKAGES = ("json", "email", "http", "logging", "xml", "urllib", "asyncio", "unittest", "idlelib", "tkinter")


def make_job(steps: int, layers: int, vocab_size: int, seq_len: int, batch: int, hidden: int) -> JobSpec:
    width = {"hidden_size": hidden, "intermediate_size": CONFIG["intermediate_size"] * hidden // CONFIG["hidden_size"]}
    return JobSpec.model_validate({
        "model": {"name": "llama", "config": {**CONFIG, **width, "num_hidden_layers": layers,
                                              "vocab_size": vocab_size, "max_position_embeddings": seq_len}},
        "dataset": {"name": "tokens", "source": "stdlib", "seq_len": seq_len, "test_fraction": 0.02},
        "training": {"steps": steps, "batch_size": batch, "optimizer": {"name": "AdamW", "kwargs": {"lr": 3e-4}},
                     "eval_every": 0, "seed": 0, "precision": "bf16"},
        "averaging": {"strategy": "none"}})


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def transformers_loop(job: JobSpec, corpus: Path, device: torch.device) -> dict[str, float]:
    """Steady tokens/s, held-out loss and peak GPU memory of LlamaForCausalLM under bf16 autocast."""
    model, spec = transformers_model(job)
    model.to(device).train()
    data = load_dataset(job.dataset, {"stdlib": corpus})
    optimizer = StageOptimizer(model.parameters(), job.training)
    batches = data.shard(0, 1).batches(job.training.batch_size, seed=job.training.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first, last = job.training.steps // 5, job.training.steps * 9 // 10
    for step in range(job.training.steps):
        if step == first:
            synchronize(device)
            start = time.perf_counter()
        x, y = (t.to(device, non_blocking=True) for t in next(batches))
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(x).logits
        spec.loss(logits.float(), y).backward()
        optimizer.micro_batch_done()
        if step + 1 == last:
            synchronize(device)
            elapsed = time.perf_counter() - start
    tokens_per_s = (last - first) * job.training.batch_size * job.dataset.seq_len / elapsed
    model.eval()
    total = count = 0.0
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        for x, y in data.test_batches(job.training.batch_size):
            x, y = x.to(device), y.to(device)
            total += float(spec.loss(model(x).logits.float(), y)) * y.numel()
            count += y.numel()
    return {"tokens_per_s": tokens_per_s, "test_loss": total / count,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")}


def ravnest_node(job: JobSpec, corpus: Path, device: torch.device) -> dict[str, float]:
    """The same, trained by one Ravnest stage process holding every block."""
    blocks = build_model("llama", job.model.config).num_blocks
    result = run_local_pipeline(job, [(0, blocks)], device=device, datasets={"stdlib": str(corpus)}, timeout=540)
    metrics = result["metrics"]
    return {"tokens_per_s": metrics["steady_samples_per_s"] * job.dataset.seq_len, "test_loss": metrics["test_loss"],
            "peak_gib": metrics.get("memory_peak_bytes", float("nan")) / 2**30}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--runs", type=int, default=3, help="runs of each, alternating; medians are quoted")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=CONFIG["hidden_size"])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script, with no MFU")
    parser.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench.lm_gpu needs a CUDA GPU; none is visible here")
        return 2
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    stdlib = Path(json.__file__).parent.parent
    with tempfile.TemporaryDirectory() as scratch:
        corpus = Path(scratch) / "stdlib.tokens"
        header = prepare([stdlib / p for p in PACKAGES if (stdlib / p).exists()], corpus, vocab_size=args.vocab,
                         pattern="*.py")
        job = make_job(args.steps, args.layers, header.vocab_size, args.seq_len, args.batch, args.hidden)
        spec = build_model("llama", job.model.config)
        parameters = sum(p.numel() for p in spec.full_model(device="meta").parameters())
        print(f"{gpu}; corpus {header.tokens:,} tokens, vocabulary {header.vocab_size}; "
              f"llama {args.layers} layers, {parameters / 1e9:.2f}B parameters", flush=True)
        flops_per_token = training_flops_per_sample(spec, 0, spec.num_blocks, args.seq_len) / args.seq_len
        peak = peak_flops(device, "bf16")
        measured: dict[str, list[dict[str, float]]] = {"transformers loop": [], "one Ravnest node": []}
        for _ in range(args.runs):  # alternating, so that a drift of the GPU's clock hits both alike
            for name, train in (("transformers loop", transformers_loop), ("one Ravnest node", ravnest_node)):
                measured[name].append(train(job, corpus, device))
                print(f"{name:18s} {measured[name][-1]['tokens_per_s']:10,.0f} tokens/s", flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    runs = {name: {key: statistics.median(r[key] for r in results) for key in results[0]}
            for name, results in measured.items()}
    for run in runs.values():
        run["mfu"] = run["tokens_per_s"] * flops_per_token / peak if peak else float("nan")
    table = "\n".join(f"| {name} | {r['tokens_per_s']:,.0f} | {r['mfu']:.3f} | {r['test_loss']:.4f} | "
                      f"{r['peak_gib']:.1f} |" for name, r in runs.items())
    ratio = runs["one Ravnest node"]["tokens_per_s"] / runs["transformers loop"]["tokens_per_s"]
    summary = (f"lm_gpu tokens_per_s_ratio={ratio:.3f} mfu_node={runs['one Ravnest node']['mfu']:.3f} "
               f"mfu_transformers={runs['transformers loop']['mfu']:.3f}")
    print("| run | tokens/s | MFU | held-out loss | peak GiB |\n|---|---|---|---|---|\n" + table)
    print(summary)
    if not args.no_docs:
        config = job.model.config
        write_section("A llama in bf16 on one GPU (bench.lm_gpu)", f"""
`{command_line("bench.lm_gpu", argv)}` on one {gpu} (peak {(peak or float("nan")) / 1e12:.0f} TFLOP/s
dense bf16 from its datasheet), lent for one session. A llama of {args.layers} layers, hidden
{config['hidden_size']}, {config['num_attention_heads']} heads sharing {config['num_key_value_heads']}
key/value heads, MLP {config['intermediate_size']}, vocabulary {header.vocab_size} (byte-level BPE
trained on {header.tokens:,} tokens of the standard library's source): {parameters / 1e9:.2f}B
parameters. {args.steps} steps of {args.batch} x {args.seq_len} tokens, AdamW, autocast bf16 with fp32
master weights in both. Tokens/s are steady state (steps 20%-90%); MFU counts
{flops_per_token / 1e9:.2f} GFLOP per token. "One Ravnest node" is a real stage process holding the
whole model, fed from the memory-mapped token file; peak GiB is what each allocated on the GPU.
Medians of {args.runs} runs of each, alternating.

| run | tokens/s | MFU | held-out loss | peak GiB |
|---|---|---|---|---|
{table}

`{summary}`
""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
