"""Home links for any model: a `gpt` from scratch and a Llama fine-tuned from a `transformers` checkpoint,
each as 2 stages on a fast and a slow shaped link, uncompressed and with `codec: "auto"`.

    python -m bench.links --any-model [--steps 150] [--runs 3] [--fast 1000] [--slow 10] [--no-docs]   # as root

The models and data are bench.codec_cost's (neither built to be compressed: no `residual_rank`). Each
stage process lives in its own network namespace whose link tbf shapes both ways
(deploy/testbed/netns.sh), one torch thread each. Per model, alternating for `--runs` rounds:
uncompressed on the fast tier, and `auto` on the slow tier, where auto's pick is the planner's own
(coordinator/codec_choice.py `pick_codecs`, with the model's `lossiest_codec`) from the tier's
bandwidth and this machine's measured FLOP/s. Prints bytes per step on the link (both ways, as the
stages measured), tokens/s and held-out loss, then last:

    links-any slow_over_fast_auto_gpt=<r> slow_over_fast_auto_llama_ft=<r> bytes_ratio_min=<x> loss_gap_max=<g>

r: the slow tier's tokens/s with auto over the fast tier's uncompressed; x: uncompressed bytes per step
over auto's on the slow tier (the smaller of the two models); g: auto's held-out loss over the
uncompressed run's at the same step, minus 1 (the larger).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from bench.allreduce import TESTBED
from bench.codec_cost import gpt_job, llama_job, prepared, run, two_stages
from bench.common import command_line, write_section
from coordinator.codec_choice import lossiest_codec, pick_codecs
from node.profiler import matmul_flops
from ravnest.models import build_model, profile_blocks
from ravnest.models.profile import BlockCost
from ravnest.partition import NodeCapacity
from ravnest.spec import JobSpec

PLACES = [("rvn-m0", "10.77.0.1"), ("rvn-m1", "10.77.0.2")]


def auto_pick(job: JobSpec, mbit: float) -> str:
    """What the planner picks for the one link of this 2-stage pipeline on a `mbit` link."""
    model = build_model(job.model.name, job.model.config)
    costs = profile_blocks(model, job.training.batch_size)
    merged = [BlockCost(params=0, param_bytes=0, flops=sum(c.flops for c in costs[a:b]),
                        activation_bytes=costs[b - 1].activation_bytes) for a, b in two_stages(job)]
    chain = [NodeCapacity(flops=matmul_flops(torch.device("cpu")), memory_bytes=1 << 34,
                          bandwidth_to_next=mbit * 1e6 / 8)] * 2
    picked = pick_codecs(merged, chain, job.training, lossiest=lossiest_codec(model))[0]
    assert picked is not None
    return picked


def main(args: argparse.Namespace, argv: list[str] | None) -> int:
    torch.set_num_threads(1)
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        offered, llama = prepared(Path(scratch))
        jobs = {"gpt": lambda codec: gpt_job(args.steps, codec),
                "llama_ft": lambda codec: llama_job(args.steps, codec, llama)}
        picks = {model: auto_pick(make("auto"), args.slow) for model, make in jobs.items()}
        runs = [(f"{model}, uncompressed, fast", model, args.fast, make(""))
                for model, make in jobs.items()] + \
               [(f"{model}, auto ({picks[model] or 'float32'}), slow", model, args.slow, make(picks[model]))
                for model, make in jobs.items()]
        measured: dict[str, list[dict[str, float]]] = {}
        try:
            for _ in range(args.runs):
                for name, _, mbit, job in runs:
                    subprocess.run(["bash", str(TESTBED), "up", str(mbit), str(mbit)], check=True, timeout=60)
                    measured.setdefault(name, []).append(run(job, offered, PLACES))
                    last = measured[name][-1]
                    print(f"{name:36s} {mbit:6g} Mbit/s  {last['tokens_per_s']:8,.0f} tokens/s  "
                          f"{last['link_bytes'] / 1e6:8.3f} MB/step  held-out loss {last['loss']:.4f}", flush=True)
        finally:
            subprocess.run(["bash", str(TESTBED), "down"], check=False, timeout=60)
    for name, model, mbit, _ in runs:
        rows[name] = {"mbit": mbit, **{k: statistics.median(r[k] for r in measured[name]) for k in measured[name][0]}}
    fast = {model: rows[name] for name, model, mbit, _ in runs if mbit == args.fast}
    slow = {model: rows[name] for name, model, mbit, _ in runs if mbit == args.slow}
    ratio = {model: slow[model]["tokens_per_s"] / fast[model]["tokens_per_s"] for model in jobs}
    fewer = min(fast[m]["link_bytes"] / slow[m]["link_bytes"] for m in jobs)
    summary = (f"links-any slow_over_fast_auto_gpt={ratio['gpt']:.3f} slow_over_fast_auto_llama_ft="
               f"{ratio['llama_ft']:.3f} bytes_ratio_min={fewer:.1f} "
               f"loss_gap_max={max(slow[m]['loss'] / fast[m]['loss'] - 1 for m in jobs):.4f}")
    print(summary)
    if not args.no_docs:
        table = "\n".join(f"| {name} | {r['mbit']:g} | {r['tokens_per_s']:,.0f} | {r['link_bytes'] / 1e6:.3f} | "
                          f"{r['loss']:.4f} |" for name, r in rows.items())
        write_section("Slow links for any model (bench.links --any-model)", f"""
`{command_line("bench.links", argv)}` as root; medians of {args.runs} run(s) of each, alternating. bench.codec_cost's
models (neither has a `residual_rank`): a gpt from scratch on the standard library's source as bytes, and a
random `LlamaForCausalLM` saved by `transformers` and fine-tuned on its token file, each as 2 stage
processes in network namespaces whose links tbf shapes both ways, {args.steps} steps of 8 x 128 tokens, one
torch thread per stage. "auto" is the planner's pick for the slow link, within the model's
`lossiest_codec`. MB per step: what the two stages sent each other, as they measured it.

| run | link Mbit/s | tokens/s | MB per step on the link | held-out loss |
|---|---|---|---|---|
{table}

`{summary}`
""")
    return 0
