"""Fine-tuning over a home link, end to end (issue 44): a Llama saved by `transformers` (no
`residual_rank`: it was not built to be compressed), described by `ravnest model from-hf` and offered by
two real nodes in network namespaces whose links are shaped to 10 Mbit/s, trained through the
coordinator with `codec: "auto"`. The planner compresses the link with a blockwise codec and says why,
the held-out loss is within 2% of the same job on 1000 Mbit/s links, and `ravnest download --format hf`
gives a folder transformers loads.

It takes over a minute (69 s in CI): two testbeds of namespaces, each a coordinator and two nodes, and
two fine-tunes, one of them paced by its 10 Mbit/s link; the 2% bound needs both jobs' 80 steps."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.testbed import HUB, ShapedTestbed, unavailable

pytestmark = [pytest.mark.slow, pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]
transformers = pytest.importorskip("transformers")
LLAMA = {"hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": False}


def ravnest(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """The `ravnest` command; given a coordinator (`env`), run in the hub's namespace where it listens."""
    where = ["ip", "netns", "exec", HUB] if env else []
    done = subprocess.run([*where, sys.executable, "-m", "ravnest.client.cli", *args],
                          capture_output=True, text=True, timeout=120, cwd=cwd, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr
    return done


def test_a_fine_tune_over_10_mbit_links_is_compressed_by_auto_and_learns_as_on_fast_links(tmp_path):
    from ravnest.data.tokens import prepare

    stdlib = Path(json.__file__).parent.parent
    corpus = prepare([stdlib / "json", stdlib / "email"], tmp_path / "corpus.tokens", vocab_size=512, pattern="*.py")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=corpus.vocab_size, **LLAMA)).save_pretrained(
        tmp_path / "base")
    model = json.loads(ravnest("model", "from-hf", "base", "--source", "base", cwd=tmp_path).stdout)
    spec = {"model": model, "dataset": {"name": "tokens", "source": "stdlib", "seq_len": 64, "test_fraction": 0.05},
            "training": {"steps": 80, "batch_size": 8, "codec": "auto", "seed": 0, "eval_every": 0,
                         "optimizer": {"name": "AdamW", "kwargs": {"lr": 1e-3}}},
            "averaging": {"strategy": "none"}, "placement": {"clusters": 1, "stages_per_cluster": 2, "min_nodes": 2}}
    offers = ["--dataset", f"stdlib={tmp_path / 'corpus.tokens'}",
              "--model-file", f"base={tmp_path / 'base' / 'model.safetensors'}"]
    jobs = {}
    for mbit in (1000, 10):
        with ShapedTestbed(tmp_path / f"{mbit}mbit", [mbit, mbit], node_args=offers) as testbed:
            job = testbed.wait_job(testbed.submit(spec), timeout=900)
            assert job["state"] == "completed", job["reason"]
            jobs[mbit] = job
            if mbit == 10:
                env = {"RAVNEST_COORDINATOR": testbed.url, "RAVNEST_KEY": testbed.operator_token}
                ravnest("download", job["id"], "--format", "hf", "-o", "trained", cwd=tmp_path, env=env)
    [slow_link] = [s for s in jobs[10]["plan"]["clusters"][0]["stages"] if s["codec"] is not None]
    print(f"\n10 Mbit/s: {slow_link['codec']}; {jobs[10]['plan']['reason']}")
    assert slow_link["codec"] in ("q8", "q4", "q4g3")  # a blockwise codec: bf16 was the most before
    assert f"link 0->1 sends {slow_link['codec']}: its transfer would take" in jobs[10]["plan"]["reason"]
    losses = {mbit: job["metrics"]["test_loss"] for mbit, job in jobs.items()}
    print(f"held-out loss: {losses}")
    assert losses[10] <= 1.02 * losses[1000]  # no more than 2% worse (this run: 1.9% better, 4.787 against 4.877)

    trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "trained").eval()
    ids = torch.randint(0, corpus.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert bool(torch.isfinite(trained(ids).logits).all())
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    assert not torch.equal(trained.model.embed_tokens.weight, base.model.embed_tokens.weight)  # it trained
