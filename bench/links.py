"""A llama as a 2-stage pipeline across a fast and a slow shaped link, as sent and compressed: what
crosses the link, how fast the pipeline runs, and what it learns.

    python -m bench.links [--steps 150] [--runs 3] [--fast 1000] [--slow 10] [--no-docs]     # as root
    python -m bench.links --clusters 2                  # the same for 2 clusters x 2 stages, diloco
    python -m bench.links --any-model                   # a gpt and a fine-tuned Llama (bench/links_any.py)

Two stage processes, each in its own network namespace with its link shaped by tbf both ways
(deploy/testbed/netns.sh), one torch thread each, on the standard library's source (bench.lm's
corpus and tokenizer). A llama of hidden 256 and 4 layers, 8 x 128 tokens per step, cut where the
planner cuts for two equal nodes. Runs, in this order:

- uncompressed on the fast tier, and on the slow tier (float32 activations and gradients);
- bf16 on the slow tier;
- compressed on the slow tier: the model with `residual_rank` 12 (ravnest/models/subspace.py: 14
  numbers per token cross the cut instead of 256) and `codec: "auto"`, whose per-link pick is the
  planner's own (coordinator/codec_choice.py `pick_codecs`) from the tier's bandwidth and this machine's
  measured FLOP/s.

Then, for the averaging codec, 2 clusters x 2 stages of the compressed model on loopback with
diloco and `topk`: the bytes a stage sends per round against a float32 ring all-reduce's.

Prints tokens/s, bytes per step on the link (both ways, as measured by the stages) and held-out
loss per run, then last: `links slow_over_fast_uncompressed=<r0> slow_over_fast_auto=<r1>
pipeline_bytes_ratio=<x> averaging_bytes_ratio=<y> loss_gap=<g>`: r = tokens/s on the slow tier over
the uncompressed fast run's; x = uncompressed bytes per step on the link over the compressed run's;
y = a float32 ring's bytes per round over topk's; g = the compressed run's held-out loss over the
uncompressed one's, minus 1.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.allreduce import TESTBED
from bench.common import command_line, write_section
from bench.lm import PACKAGES
from coordinator.codec_choice import pick_codecs
from node.profiler import matmul_flops
from ravnest.data.tokens import prepare
from ravnest.models import build_model, profile_blocks
from ravnest.models.profile import BlockCost
from ravnest.partition import NodeCapacity, partition
from ravnest.pipeline.local import run_local_clusters
from ravnest.spec import JobSpec

CONFIG = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
          "num_key_value_heads": 4, "max_position_embeddings": 128}
RANK = 12  # (12 + 2) x 2 bytes per token in bf16 against 256 x 4 in float32: 36.6x, 31x+ with the targets
PLACES = [("rvn-m0", "10.77.0.1"), ("rvn-m1", "10.77.0.2")]


def make_job(steps: int, vocab: int, rank: int = 0, codec: str = "", clusters: int = 1,
             averaging_codec: str = "topk") -> JobSpec:
    averaging: dict[str, Any] = {"strategy": "diloco", "every": 10, "codec": averaging_codec} if clusters > 1 \
        else {"strategy": "none"}
    return JobSpec.model_validate({
        "model": {"name": "llama", "config": {**CONFIG, "vocab_size": vocab, "residual_rank": rank}},
        "dataset": {"name": "tokens", "source": "stdlib", "seq_len": 128, "test_fraction": 0.05},
        "training": {"steps": steps, "batch_size": 8, "codec": codec, "seed": 0, "eval_every": 0,
                     "optimizer": {"name": "AdamW", "kwargs": {"lr": 7e-4}}},
        "averaging": averaging})


def cut(job: JobSpec) -> list[tuple[int, int]]:
    costs = profile_blocks(build_model("llama", job.model.config), job.training.batch_size)
    return partition(costs, [NodeCapacity(flops=1e10, memory_bytes=1 << 34, bandwidth_to_next=1e9)] * 2).ranges


def auto_codec(job: JobSpec, ranges: list[tuple[int, int]], mbit: float) -> str:
    """What the planner picks for the one link of this 2-stage pipeline on a `mbit` link."""
    costs = profile_blocks(build_model("llama", job.model.config), job.training.batch_size)
    merged = [BlockCost(params=0, param_bytes=0, flops=sum(c.flops for c in costs[a:b]),
                        activation_bytes=costs[b - 1].activation_bytes) for a, b in ranges]
    flops = matmul_flops(torch.device("cpu"))
    chain = [NodeCapacity(flops=flops, memory_bytes=1 << 34, bandwidth_to_next=mbit * 1e6 / 8)] * 2
    picked = pick_codecs(merged, chain, job.training)[0]
    assert picked is not None
    return picked


def shaped(mbit: float) -> None:
    subprocess.run(["bash", str(TESTBED), "up", str(mbit), str(mbit)], check=True, timeout=60)


def run(job: JobSpec, ranges: list[tuple[int, int]], corpus: Path, places: list | None) -> dict[str, float]:
    result = run_local_clusters(job, [ranges], timeout=1800, datasets={"stdlib": str(corpus)}, places=places)[0]
    first, last = result["stages"]
    return {"tokens_per_s": last["steady_samples_per_s"] * job.dataset.seq_len,
            "link_bytes": first["next_bytes_per_step"] + last["prev_bytes_per_step"],
            "loss": result["metrics"]["test_loss"]}


def summary_line(label: str, fast: dict[str, float], slow: dict[str, float], auto: dict[str, float],
                 averaging: float) -> str:
    """The bench's last line: the slow tier's speed over the fast one's, uncompressed and compressed; how
    many times fewer bytes; the compressed run's held-out loss relative to the uncompressed one's."""
    return (f"{label} slow_over_fast_uncompressed={slow['tokens_per_s'] / fast['tokens_per_s']:.3f} "
            f"slow_over_fast_auto={auto['tokens_per_s'] / fast['tokens_per_s']:.3f} "
            f"pipeline_bytes_ratio={fast['link_bytes'] / auto['link_bytes']:.1f} "
            f"averaging_bytes_ratio={averaging:.1f} loss_gap={auto['loss'] / fast['loss'] - 1:.4f}")


def run_clusters(job: JobSpec, ranges: list[tuple[int, int]], corpus: Path, mbit: float) -> dict[str, float]:
    """2 clusters x 2 stages, each stage in its own namespace at `mbit`: tokens/s of both, bytes per step
    on a pipeline link (their mean), bytes a stage sent per averaging round (their mean), cluster 0's loss."""
    subprocess.run(["bash", str(TESTBED), "up", *[str(mbit)] * 4], check=True, timeout=60)
    places = [(f"rvn-m{i}", f"10.77.0.{i + 1}") for i in range(4)]
    clusters = run_local_clusters(job, [ranges, ranges], timeout=3600, datasets={"stdlib": str(corpus)}, places=places)
    return {"tokens_per_s": sum(c["stages"][-1]["steady_samples_per_s"] for c in clusters) * job.dataset.seq_len,
            "link_bytes": statistics.mean(c["stages"][0]["next_bytes_per_step"] + c["stages"][1]["prev_bytes_per_step"]
                                          for c in clusters),
            "round_bytes": statistics.mean(s["avg_round_bytes"] for c in clusters for s in c["stages"]),
            "loss": clusters[0]["metrics"]["test_loss"]}


def two_by_two(args: argparse.Namespace, argv: list[str] | None, vocab: int, corpus: Path,
               ranges: list[tuple[int, int]]) -> None:
    """The same comparison for 2 clusters x 2 stages under diloco, raw against topk."""
    picked = auto_codec(make_job(args.steps, vocab, rank=RANK, codec="auto"), ranges, args.slow)
    plain = make_job(args.steps, vocab, clusters=2, averaging_codec="")
    runs = [("uncompressed, fast", args.fast, plain), ("uncompressed, slow", args.slow, plain),
            (f"subspace + auto ({picked}) + topk, slow", args.slow,
             make_job(args.steps, vocab, rank=RANK, codec=picked, clusters=2, averaging_codec="topk"))]
    rows = {}
    try:
        for name, mbit, job in runs:
            rows[name] = {"mbit": mbit, **run_clusters(job, ranges, corpus, mbit)}
            r = rows[name]
            print(f"2x2 {name:36s} {mbit:6g} Mbit/s  {r['tokens_per_s']:8,.0f} tokens/s  {r['link_bytes'] / 1e6:8.3f} "
                  f"MB/step  {r['round_bytes'] / 1e6:8.3f} MB/round  held-out loss {r['loss']:.4f}", flush=True)
    finally:
        subprocess.run(["bash", str(TESTBED), "down"], check=False, timeout=60)
    fast, slow, auto = (rows[name] for name, _, _ in runs)
    summary = summary_line("links-2x2", fast, slow, auto, fast["round_bytes"] / auto["round_bytes"])
    print(summary)
    if not args.no_docs:
        table = "\n".join(f"| {name} | {r['mbit']:g} | {r['tokens_per_s']:,.0f} | {r['link_bytes'] / 1e6:.3f} | "
                          f"{r['round_bytes'] / 1e6:.3f} | {r['loss']:.4f} |" for name, r in rows.items())
        write_section("Slow links: 2 clusters x 2 stages (bench.links --clusters 2)", f"""
`{command_line("bench.links", argv)}` as root, one run of each. bench.links' llama as 2 clusters x 2 stages,
the 4 stage processes each in a network namespace shaped to the tier, diloco every 10 steps (raw
against topk), {args.steps} steps. Tokens/s are both clusters'; MB per step is a pipeline link's (both ways,
mean of the two); MB per round is what a stage sent per averaging round (mean of the four); the loss is
cluster 0's held-out loss.

| run | link Mbit/s | tokens/s | MB per step on a pipeline link | MB per averaging round | held-out loss |
|---|---|---|---|---|---|
{table}

`{summary}`
""")


def averaging_ratio(steps: int, vocab: int, corpus: Path, ranges: list[tuple[int, int]]) -> float:
    """A float32 ring all-reduce's bytes per stage and round over what topk sent, for 2 x 2 on loopback."""
    job = make_job(steps, vocab, rank=RANK, codec="bf16", clusters=2)
    clusters = run_local_clusters(job, [ranges, ranges], timeout=1800, datasets={"stdlib": str(corpus)})
    costs = profile_blocks(build_model("llama", job.model.config), job.training.batch_size)
    ratios: list[float] = []
    for s, (a, b) in enumerate(ranges):
        values = sum(c.param_bytes for c in costs[a:b]) // 4
        ring_bytes = 2 * (2 - 1) / 2 * 4 * values  # what each of 2 members sends per float32 all-reduce
        ratios.extend(ring_bytes / c["stages"][s]["avg_round_bytes"] for c in clusters)
    return min(ratios)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--fast", type=float, default=1000, help="the fast tier, Mbit/s")
    parser.add_argument("--slow", type=float, default=10, help="the slow tier, Mbit/s")
    parser.add_argument("--runs", type=int, default=1, help="repeat the shaped runs, alternating, and quote medians")
    parser.add_argument("--clusters", type=int, choices=(1, 2), default=1,
                        help="2: the same as 2 clusters x 2 stages under diloco, raw against topk")
    parser.add_argument("--any-model", action="store_true",
                        help="a gpt and a fine-tuned Llama (no residual_rank), plain and auto: bench/links_any.py")
    parser.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.links shapes links in network namespaces: run it as root", file=sys.stderr)
        return 2
    if args.any_model:
        from bench import links_any
        return links_any.main(args, argv)
    torch.set_num_threads(1)
    stdlib = Path(json.__file__).parent.parent
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        corpus = Path(scratch) / "stdlib.tokens"
        vocab = prepare([stdlib / p for p in PACKAGES], corpus, vocab_size=1024, pattern="*.py").vocab_size
        plain = make_job(args.steps, vocab)
        ranges = cut(plain)
        if args.clusters == 2:
            two_by_two(args, argv, vocab, corpus, ranges)
            return 0
        compressed = make_job(args.steps, vocab, rank=RANK, codec="auto")
        picked = auto_codec(compressed, ranges, args.slow)
        runs = [("uncompressed, fast", args.fast, plain), ("uncompressed, slow", args.slow, plain),
                ("bf16, slow", args.slow, make_job(args.steps, vocab, codec="bf16")),
                (f"subspace + auto ({picked or 'fp32'}), slow", args.slow,
                 make_job(args.steps, vocab, rank=RANK, codec=picked))]
        measured: dict[str, list[dict[str, float]]] = {}
        try:
            for _ in range(args.runs):
                for name, mbit, job in runs:
                    shaped(mbit)
                    measured.setdefault(name, []).append(run(job, ranges, corpus, PLACES))
                    last = measured[name][-1]
                    print(f"{name:36s} {mbit:6g} Mbit/s  {last['tokens_per_s']:8,.0f} tokens/s  "
                          f"{last['link_bytes'] / 1e6:8.3f} MB/step  held-out loss {last['loss']:.4f}", flush=True)
            rows = {name: {"mbit": mbit, **{figure: statistics.median(r[figure] for r in measured[name])
                                            for figure in measured[name][0]}} for name, mbit, _ in runs}
        finally:
            subprocess.run(["bash", str(TESTBED), "down"], check=False, timeout=60)
        averaging = averaging_ratio(args.steps, vocab, corpus, ranges)
    fast, slow, auto = rows["uncompressed, fast"], rows["uncompressed, slow"], rows[runs[-1][0]]
    summary = summary_line("links", fast, slow, auto, averaging)
    print(summary)
    if not args.no_docs:
        table = "\n".join(f"| {name} | {r['mbit']:g} | {r['tokens_per_s']:,.0f} | {r['link_bytes'] / 1e6:.3f} | "
                          f"{r['loss']:.4f} |" for name, r in rows.items())
        write_section("Slow links: a compressed pipeline (bench.links)", f"""
`{command_line("bench.links", argv)}` as root; medians of {args.runs} run(s) of each, alternating. A llama
(hidden {CONFIG['hidden_size']}, {CONFIG['num_hidden_layers']} layers, vocabulary {vocab}) as 2 stage processes in
network namespaces whose links tbf shapes both ways, {args.steps} steps of 8 x 128 tokens of the standard
library's source, one torch thread per stage. The slow tier is where the uncompressed pipeline runs at 0.25
of its fast-tier speed or less: a home link's ratio of bytes to compute for a GPU, scaled to this CPU. Bytes
per step are what the two stages sent each other (activations and
targets forward, gradients back, and the final evaluation's activations), as measured by the stages.
"subspace" is the model with `residual_rank` {RANK} (ravnest/models/subspace.py); "auto" is the
planner's per-link pick for that model on the slow tier. The averaging ratio is 2 clusters x 2 stages
of the subspace model with diloco and topk on loopback: a float32 ring's bytes per round over topk's.

| run | link Mbit/s | tokens/s | MB per step on the link | held-out loss |
|---|---|---|---|---|
{table}

`{summary}`
""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
