"""The `llama` architecture against the implementation we did not write: `transformers`'
LlamaForCausalLM, with the same weights, gives the same logits, both ways through Hugging Face's names."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from ravnest.models import ModelError, build_model, profile_blocks, state_shapes
from ravnest.models.hf import hf_config, hf_key, ravnest_config, ravnest_key

transformers = pytest.importorskip("transformers")

SMALL = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 3,
         "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 32,
         "rope_theta": 5000.0, "rms_norm_eps": 1e-6}


def hf_model(config: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(build_model("llama", config).config)))
    return hf.eval()


def test_hugging_face_weights_give_the_same_logits_in_ravnest():
    hf = hf_model(SMALL)
    spec = build_model("llama", SMALL)
    ours = spec.full_model(seed=1).eval()
    layers = SMALL["num_hidden_layers"]
    ours.load_state_dict({ravnest_key(name, layers): t for name, t in hf.state_dict().items()})
    ids = torch.randint(0, SMALL["vocab_size"], (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs, mine = hf(ids).logits, ours(ids)
    assert mine.shape == theirs.shape == (3, 20, SMALL["vocab_size"])
    assert (mine - theirs).abs().max().item() <= 1e-4


def test_ravnest_weights_load_in_transformers_under_their_names(tmp_path):
    spec = build_model("llama", SMALL)
    ours = spec.full_model(seed=3).eval()
    layers = SMALL["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(hf_config(spec.config)))
    from safetensors.torch import save_file
    save_file({hf_key(k, layers): t.contiguous() for k, t in ours.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max().item() <= 1e-4
    assert ravnest_config(json.loads((tmp_path / "config.json").read_text())) == {
        k: v for k, v in spec.config.items() if k != "head_dim"} | {"head_dim": 8}


def test_blocks_are_the_embedding_each_layer_and_the_head_and_plan_on_the_meta_device():
    spec = build_model("llama", SMALL)
    assert spec.num_blocks == SMALL["num_hidden_layers"] + 2
    costs = profile_blocks(spec, 4)
    assert all(c.flops > 0 for c in costs[1:])  # (a lookup: the embedding counts none)
    shapes = state_shapes(spec)
    assert shapes["1.self_attn.k_proj.weight"][0] == (2 * 8, 64)  # two key/value heads of 8
    assert shapes["4.lm_head.weight"][0] == (97, 64) and "0.embed_tokens.weight" in shapes


@pytest.mark.parametrize("config, words", [
    ({"num_attention_heads": 8, "num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"hidden_size": 60, "num_attention_heads": 8}, "divisible by num_attention_heads"),
    ({"n_layers": 2}, "unknown config key 'n_layers'"),
])
def test_configs_that_cannot_be_built_say_why(config, words):
    with pytest.raises(ModelError, match=words.replace("[", r"\[").replace("]", r"\]")):
        build_model("llama", config)


@pytest.mark.slow
def test_a_llama_trains_as_a_pipeline_of_real_nodes_and_downloads_as_a_hugging_face_folder(tmp_path):
    """The standard library's json and email packages prepared as a token file both nodes offer; one
    cluster of two stages trains on it; then `ravnest download --format hf` (the coordinator's zip of a
    Hugging Face folder, with the tokenizer the job recorded) and transformers loads the folder: its
    logits are the downloaded model's, its tokenizer the token file's."""
    import math
    import os
    import subprocess
    import sys

    import ravnest
    from ravnest.data.tokens import prepare
    from scripts.local_cluster import LocalCluster

    stdlib = Path(json.__file__).parent.parent
    corpus = prepare([stdlib / "json", stdlib / "email"], tmp_path / "corpus.tokens", vocab_size=512, pattern="*.py")
    config = {**SMALL, "vocab_size": corpus.vocab_size, "max_position_embeddings": 64}
    spec = {"model": {"name": "llama", "config": config},
            "dataset": {"name": "tokens", "source": "stdlib", "seq_len": 64, "test_fraction": 0.05},
            "training": {"steps": 150, "batch_size": 16, "eval_every": 75, "grad_clip": 1.0,
                         "optimizer": {"name": "Adam", "kwargs": {"lr": 3e-3}}},
            "averaging": {"strategy": "none"}, "placement": {"clusters": 1, "stages_per_cluster": 2}}
    with LocalCluster(tmp_path, nodes=2, node_args=["--dataset", f"stdlib={tmp_path / 'corpus.tokens'}"]) as cluster:
        job = cluster.wait_job(cluster.submit(spec), timeout=300)
        assert job["state"] == "completed", job["reason"]
        assert [len(c["stages"]) for c in job["plan"]["clusters"]] == [2]
        loss = job["metrics"]["test_loss"]
        uniform = math.log(corpus.vocab_size)
        print(f"\nllama, 2 stages, 150 steps on {corpus.tokens:,} tokens: test loss {loss:.3f} "
              f"(uniform: {uniform:.3f})")
        assert loss < 0.75 * uniform  # it learned the code's tokens, far below guessing
        for stage in job["metrics"]["stages"]:  # the memory planner's llama, against each node's measured peak
            predicted, measured = stage["predicted_memory_bytes"], stage["peak_memory_bytes"]
            print(f"  stage {stage['stage']}: predicted {predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f}")
            assert 0 < measured <= 1.25 * predicted
        env = {**os.environ, "RAVNEST_COORDINATOR": cluster.url, "RAVNEST_KEY": cluster.operator_token}
        for args in (["download", "-o", "model.safetensors"],  # the tokenizer: the one the job recorded
                     ["download", "--format", "hf", "-o", "hf"], ["generate", "--prompt", "def ", "--max-tokens", "30"]):
            done = subprocess.run([sys.executable, "-m", "ravnest.client.cli", args[0], job["id"], *args[1:]],
                                  capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
            assert done.returncode == 0, done.stderr
        print(f"generated: {done.stdout!r}")
        assert done.stdout.startswith("def ") and len(done.stdout) > 20
    ours = ravnest.load_model(tmp_path / "model.safetensors")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, corpus.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (theirs(ids).logits - ours(ids)).abs().max().item() <= 1e-4
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors",
                                                                   "tokenizer.json", "tokenizer_config.json"]
    words = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")  # the job's tokenizer, beside its model
    from ravnest.sampling import FileTokenizer
    assert words("def main():\n")["input_ids"] == FileTokenizer(tmp_path / "corpus.tokens").encode("def main():\n")


def test_bf16_computes_under_autocast_and_keeps_float32_weights_and_outputs():
    """precision bf16: the stage's matmuls run in bfloat16 (its output differs from float32's by
    bfloat16's rounding, not more), what leaves the stage and the gradients are float32."""
    from ravnest.pipeline.stash import StageCompute

    spec = build_model("llama", SMALL)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    outputs = {}
    for precision in ("fp32", "bf16"):
        stage = spec.blocks(0, 3, seed=0)
        compute = StageCompute(stage, mode="stash", input_grad=False, device=torch.device("cpu"),
                               snapshots=False, precision=precision)
        outputs[precision] = compute.forward(0, ids)
        compute.backward_input(0, torch.ones_like(outputs[precision]))
        compute.backward_weights(0)
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in stage.parameters())
    assert outputs["bf16"].dtype == torch.float32
    error = (outputs["bf16"] - outputs["fp32"]).abs().max().item()
    assert 0 < error < 0.1 * outputs["fp32"].abs().max().item()


def test_grad_clip_bounds_each_stages_step():
    from ravnest.pipeline.optim import StageOptimizer
    from ravnest.spec import TrainingSettings

    weights = torch.nn.Parameter(torch.zeros(4))
    optimizer = StageOptimizer([weights], TrainingSettings(grad_clip=0.5, optimizer={"name": "SGD",
                                                                                      "kwargs": {"lr": 1.0}}))
    weights.grad = torch.full((4,), 100.0)
    optimizer.step()
    assert torch.linalg.vector_norm(weights.detach()).item() == pytest.approx(0.5)
    before = weights.detach().clone()  # DeAR applies the update in parts: each part is clipped
    optimizer.apply_update({weights: torch.full((4,), -100.0)}, last=True)
    assert torch.linalg.vector_norm(weights.detach() - before).item() == pytest.approx(0.5)


def test_sampling_is_greedy_at_temperature_zero_and_reproducible_with_a_seed():
    from ravnest.sampling import ByteTokenizer, generate

    model = build_model("llama", {**SMALL, "vocab_size": 256}).full_model(seed=0).eval()
    prompt = ByteTokenizer().encode("import os")
    greedy = generate(model, prompt, max_new_tokens=12, temperature=0, context=32)
    with torch.no_grad():
        assert greedy[len(prompt)] == int(model(torch.tensor([prompt]))[0, -1].argmax())
    assert generate(model, prompt, max_new_tokens=12, top_k=1, context=32) == greedy  # top-1 is greedy
    sampled = [generate(model, prompt, max_new_tokens=12, temperature=1.0, top_k=None, seed=s) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2] and sampled[0][:len(prompt)] == prompt
    long = generate(model, prompt, max_new_tokens=40, temperature=0, context=32)  # past the model's 32 positions
    assert len(long) == len(prompt) + 40


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_16_bit_llama_learns_as_a_two_stage_pipeline(precision):
    """bf16 and fp16 (with its loss scaling) and activation checkpointing through the pipeline's
    machinery (a process per stage, the real schedule and stash, each block recomputed under autocast
    in its backward): the held-out loss falls far below guessing, the weights stay float32. This CPU has
    neither's arithmetic, where a stage computes in float32 and says so (bf16 emulated was 8x slower,
    and once tripped the coordinator's slow-stage rule): RAVNEST_PRECISION_ANYWAY forces it."""
    import argparse
    import math
    import os

    from ravnest.pipeline import run_local_pipeline
    from ravnest.spec import JobSpec

    job = JobSpec.model_validate({
        "model": {"name": "llama", "config": {**SMALL, "vocab_size": 128, "max_position_embeddings": 32}},
        "dataset": {"name": "text", "source": "argparse", "seq_len": 32, "test_fraction": 0.05},
        "training": {"steps": 70, "batch_size": 8, "precision": precision, "grad_clip": 1.0,
                     "activation_checkpointing": True,
                     "optimizer": {"name": "Adam", "kwargs": {"lr": 3e-3}}}})
    os.environ["RAVNEST_PRECISION_ANYWAY"] = "1"  # (the stage processes inherit it)
    try:
        result = run_local_pipeline(job, [(0, 2), (2, 5)], timeout=300, datasets={"argparse": argparse.__file__})
    finally:
        del os.environ["RAVNEST_PRECISION_ANYWAY"]
    loss = result["metrics"]["test_loss"]
    print(f"\n{precision} llama, 2 stages, 120 steps: test loss {loss:.3f} (uniform {math.log(128):.3f})")
    assert loss < 0.7 * math.log(128)
    assert all(t.dtype == torch.float32 for t in result["state_dict"].values())


def test_16_bit_precisions_are_used_only_where_the_hardware_has_them(monkeypatch):
    from ravnest.pipeline.precision import usable_precision

    cpu, flags = torch.device("cpu"), open("/proc/cpuinfo").read()
    for precision, wanted in (("bf16", (" avx512_bf16", " amx_bf16")), ("fp16", (" avx512_fp16", " amx_fp16"))):
        assert usable_precision(precision, cpu) == (precision if any(f in flags for f in wanted) else "fp32")
    assert usable_precision("fp32", cpu) == "fp32"
    monkeypatch.setenv("RAVNEST_PRECISION_ANYWAY", "1")
    assert usable_precision("bf16", cpu) == "bf16" and usable_precision("fp16", cpu) == "fp16"


def test_a_stage_starts_from_its_own_slice_of_a_hugging_face_checkpoint(tmp_path):
    """Fine-tuning: a stage of blocks 1..2 copies exactly its tensors out of a checkpoint
    `transformers` saved (under Llama's names) or a `ravnest download` (under Ravnest's); a checkpoint
    that does not fit the job's model says where."""
    from safetensors.torch import save_file

    from ravnest.models.weights import load_starting_weights

    hf = hf_model(SMALL)
    hf.save_pretrained(tmp_path / "hf")
    spec, layers = build_model("llama", SMALL), SMALL["num_hidden_layers"]
    theirs = hf.state_dict()
    stage = spec.blocks(1, 3, seed=5)
    load_starting_weights(stage, spec, tmp_path / "hf" / "model.safetensors", "model file 'tiny'")
    assert all(torch.equal(t, theirs[hf_key(k, layers)]) for k, t in stage.state_dict().items())

    ours = spec.full_model(seed=7)
    save_file({k: t.contiguous() for k, t in ours.state_dict().items()}, str(tmp_path / "download.safetensors"),
              metadata={"model": json.dumps({"name": "llama", "config": SMALL})})
    last = spec.blocks(3, 5, seed=5)
    load_starting_weights(last, spec, tmp_path / "download.safetensors", "model file 'mine'")
    assert all(torch.equal(t, ours.state_dict()[k]) for k, t in last.state_dict().items())

    wider = build_model("llama", {**SMALL, "intermediate_size": 160})
    with pytest.raises(ModelError, match=r"'model.layers.0.mlp.gate_proj.weight' is \[176, 64\], this job's model "
                                         r"has \[160, 64\] there: its config does not match"):
        load_starting_weights(wider.blocks(1, 2), wider, tmp_path / "hf" / "model.safetensors", "model file 'tiny'")
    deeper = build_model("llama", {**SMALL, "num_hidden_layers": 4})
    with pytest.raises(ModelError, match="model file 'tiny' has no tensor 'model.layers.3."):
        load_starting_weights(deeper.blocks(4, 5), deeper, tmp_path / "hf" / "model.safetensors", "model file 'tiny'")
    gpt = build_model("gpt", {"n_layers": 1})
    for file, words in (("hf/model.safetensors", "is neither a `ravnest download` nor a Hugging Face Llama"),
                        ("download.safetensors", "holds a 'llama' model; this job trains a 'gpt'"),
                        ("hf/config.json", "is not a readable safetensors file")):
        with pytest.raises(ModelError, match=re.escape(f"model file 'x' {words}")):
            load_starting_weights(gpt.blocks(0, 1), gpt, tmp_path / file, "model file 'x'")


@pytest.mark.slow
def test_fine_tuning_a_hugging_face_llama_starts_from_the_loss_transformers_computes(tmp_path):
    """A random LlamaForCausalLM saved by `transformers`, described by `ravnest model from-hf`, offered by
    both nodes with --model-file, trained
    as 1 cluster x 2 stages at learning rate 0: the held-out loss the pipeline reports is what
    `transformers` computes on the same tokens, and the downloaded weights are the checkpoint's, bit for bit."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    from ravnest.data.datasets import load_dataset
    from ravnest.data.tokens import prepare
    from scripts.local_cluster import LocalCluster

    stdlib = Path(json.__file__).parent.parent
    corpus = prepare([stdlib / "json"], tmp_path / "corpus.tokens", vocab_size=300, pattern="*.py")
    config = {**SMALL, "vocab_size": corpus.vocab_size, "max_position_embeddings": 32}
    hf = hf_model(config)
    hf.save_pretrained(tmp_path / "hf")
    section = subprocess.run([sys.executable, "-m", "ravnest.client.cli", "model", "from-hf", "hf", "--source",
                              "tiny-llama"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert section.returncode == 0, section.stderr
    model = json.loads(section.stdout)  # the job's model section, as a user makes it
    assert model["config"]["hidden_size"] == config["hidden_size"] and len(model["weights"]["sha256"]) == 64
    dataset = {"name": "tokens", "source": "stdlib", "seq_len": 32}
    spec = {"model": model, "dataset": dataset,
            "training": {"steps": 4, "batch_size": 8, "optimizer": {"name": "SGD", "kwargs": {"lr": 0.0}}},
            "averaging": {"strategy": "none"}, "placement": {"clusters": 1, "stages_per_cluster": 2}}
    offers = ["--dataset", f"stdlib={tmp_path / 'corpus.tokens'}",
              "--model-file", f"tiny-llama={tmp_path / 'hf' / 'model.safetensors'}"]
    with LocalCluster(tmp_path, nodes=2, node_args=offers) as cluster:
        job = cluster.wait_job(cluster.submit(spec), timeout=300)
        assert job["state"] == "completed", job["reason"]
        assert [len(c["stages"]) for c in job["plan"]["clusters"]] == [2]
        env = {**os.environ, "RAVNEST_COORDINATOR": cluster.url, "RAVNEST_KEY": cluster.operator_token}
        done = subprocess.run([sys.executable, "-m", "ravnest.client.cli", "download", job["id"], "-o", "out.st"],
                              capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    held_out = load_dataset(dataset, {"stdlib": tmp_path / "corpus.tokens"}).test_batches(64)
    with torch.no_grad():
        losses = [(torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten(), reduction="sum"),
                   y.numel()) for x, y in held_out]
    expected = sum(float(s) for s, _ in losses) / sum(n for _, n in losses)
    print(f"\nheld-out loss: transformers {expected:.6f}, ravnest {job['metrics']['test_loss']:.6f}")
    assert job["metrics"]["test_loss"] == pytest.approx(expected, rel=1e-5)
    trained, layers = load_file(str(tmp_path / "out.st")), config["num_hidden_layers"]
    assert {hf_key(k, layers) for k in trained} == set(hf.state_dict())
    assert all(torch.equal(t, hf.state_dict()[hf_key(k, layers)]) for k, t in trained.items())


KEPT_PER_MICRO_BATCH = """
import sys, torch
from ravnest.models import build_model, profile_blocks
from ravnest.partition import Load, kept_bytes
from ravnest.pipeline.stash import StageCompute
torch.set_num_threads(1)
checkpointing = sys.argv[1] == "1"
spec = build_model("llama", {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
                             "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 256})
def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))
compute = StageCompute(spec.blocks(1, 3, seed=0), mode="stash", input_grad=True, device=torch.device("cpu"),
                       snapshots=False, checkpoint_blocks=checkpointing)
inputs = [torch.randn(8, 256, 256) for _ in range(5)]
compute.forward(0, inputs[0]); compute.backward_input(0, torch.ones(8, 256, 256)); compute.backward_weights(0)
before = rss()
for i in range(1, 5):
    compute.forward(i, inputs[i])
print((rss() - before) / 4, sum(kept_bytes(profile_blocks(spec, 8), Load(checkpoint_blocks=checkpointing))[1:3]))
"""


def test_activation_checkpointing_keeps_block_inputs_as_planned_and_gives_the_same_gradients():
    """Each block keeps only its input from forward to backward and is recomputed in its backward: the
    gradients are exactly those of the plain backward (split or not), and what a micro-batch in flight
    holds is what the planner counts per micro-batch in flight (measured in a process whose
    large tensors come straight from mmap, so its resident memory follows them)."""
    import os
    import subprocess
    import sys

    from ravnest.pipeline.stash import StageCompute

    spec = build_model("llama", SMALL)
    inputs, grad = [torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(i)) for i in range(3)], \
        torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(9))
    reference = spec.blocks(1, 3, seed=0)
    for x in inputs:
        reference(x).backward(grad)
    for split in (True, False):
        stage = spec.blocks(1, 3, seed=0)
        compute = StageCompute(stage, mode="stash", input_grad=True, device=torch.device("cpu"), snapshots=False,
                               split=split, checkpoint_blocks=True)
        for i, x in enumerate(inputs):
            compute.forward(i, x)
        for i in range(len(inputs)):
            compute.backward_input(i, grad)
            compute.backward_weights(i)
        assert all(torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)
                   for p, q in zip(stage.parameters(), reference.parameters()))
    held = {}
    for checkpointing in ("0", "1"):
        done = subprocess.run([sys.executable, "-c", KEPT_PER_MICRO_BATCH, checkpointing], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
        assert done.returncode == 0, done.stderr
        held[checkpointing] = [float(v) for v in done.stdout.split()]
    (plain, plain_predicted), (kept, predicted) = held["0"], held["1"]
    print(f"\nper micro-batch in flight: {plain / 2**20:.1f} MiB (predicted {plain_predicted / 2**20:.1f}), "
          f"with activation checkpointing {kept / 2**20:.1f} MiB (predicted {predicted / 2**20:.1f})")
    assert 0.8 * predicted <= kept <= 1.25 * predicted and 0.8 * plain_predicted <= plain <= 1.25 * plain_predicted
    assert kept < plain / 10


def test_fp16_scales_each_stages_gradients_so_small_ones_survive_and_drops_a_micro_batch_that_overflows():
    """Gradients of 1e-9 underflow in float16 (its smallest is 6e-8): unscaled, a stage learns almost
    nothing from them; with its loss scale, its weight and input gradients match float32's. A micro-batch
    whose gradients overflow is dropped from the update, sends zeros upstream and halves the scale."""
    from ravnest.pipeline.precision import INITIAL_SCALE
    from ravnest.pipeline.stash import StageCompute

    spec = build_model("llama", SMALL)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0))
    tiny = 1e-9 * torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))

    def backward(precision: str, grad: torch.Tensor, scaled: bool = True):
        stage = spec.blocks(1, 3, seed=0)
        compute = StageCompute(stage, mode="stash", input_grad=True, device=torch.device("cpu"), snapshots=False,
                               precision=precision)
        if not scaled:
            compute.loss_scale = None
        compute.forward(0, x)
        input_grad = compute.backward_input(0, grad)
        compute.backward_weights(0)
        return torch.cat([p.grad.flatten() for p in stage.parameters() if p.grad is not None]) \
            if any(p.grad is not None for p in stage.parameters()) else None, input_grad, compute

    def error(ours, reference):
        return float((ours - reference).norm() / reference.norm())

    exact, exact_input, _ = backward("fp32", tiny)
    scaled, scaled_input, _ = backward("fp16", tiny)
    unscaled, unscaled_input, _ = backward("fp16", tiny, scaled=False)
    print(f"\nfp16 gradient error against float32: scaled {error(scaled, exact):.4f}, "
          f"unscaled {error(unscaled, exact):.4f}")
    assert error(scaled, exact) < 0.02 and error(scaled_input, exact_input) < 0.02
    assert error(unscaled, exact) > 0.5  # most of it flushed to zero

    dropped, zeros, compute = backward("fp16", torch.full((2, 16, 64), 1e36))
    assert dropped is None and torch.equal(zeros, torch.zeros_like(zeros))
    assert compute.loss_scale.scale == INITIAL_SCALE / 2 and compute.loss_scale.overflows == 1


def test_model_flops_are_the_textbook_count_and_mfu_is_them_over_the_peak():
    """A stage's model FLOPs per sample are what the scaling-law papers count: per token, 6 x the
    layers' parameters plus attention's 12 x T x d per layer (forward and backward), at the job's
    sequence length; tokens/s and MFU follow from samples/s. The job's MFU is every stage's model
    FLOPs over every stage's peak."""
    from coordinator.jobs import _mfu
    from ravnest.pipeline.throughput import figures, training_flops_per_sample

    spec, tokens, d = build_model("llama", SMALL), 16, SMALL["hidden_size"]
    layers = SMALL["num_hidden_layers"]
    layer_params = sum(c.params for c in profile_blocks(spec, 1)[1:layers + 1])
    textbook = tokens * (6 * layer_params + 12 * tokens * d * layers)
    assert training_flops_per_sample(spec, 1, layers + 1, tokens) == pytest.approx(textbook, rel=0.01)
    assert figures(10.0, 1e9, tokens, 1e12) == {"model_flops_per_s": 1e10, "tokens_per_s": 160.0, "mfu": 0.01}
    assert figures(10.0, 1e9, None, None) == {"model_flops_per_s": 1e10}  # a classifier, a CPU
    stages = [{"model_flops_per_s": 1e10, "mfu": 0.01}, {"model_flops_per_s": 3e10, "mfu": 0.1}]
    assert _mfu(stages) == pytest.approx(4e10 / (1e12 + 3e11)) and _mfu(stages + [{"model_flops_per_s": 1}]) is None


def test_tied_embeddings_are_one_tensor_on_one_stage_as_in_transformers(tmp_path):
    """tie_word_embeddings: the head's weight is the embedding's. A stage holding both ties them
    (transformers' tied checkpoint, saved without the head, loads and gives its logits); a range holding
    one of them is refused, and the coordinator plans one-stage pipelines for it (test_planning)."""
    from ravnest.models.weights import load_starting_weights

    tied = {**SMALL, "tie_word_embeddings": True}
    hf = hf_model(tied)
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    hf.save_pretrained(tmp_path)
    spec = build_model("llama", tied)
    assert spec.stages_at_most == 1 and build_model("llama", SMALL).stages_at_most is None
    ours = spec.full_model(seed=1).eval()
    load_starting_weights(ours, spec, tmp_path / "model.safetensors", "model file 'tied'")
    assert ours[4].lm_head.weight is ours[0].embed_tokens.weight
    ids = torch.randint(0, SMALL["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max().item() <= 1e-4
    with pytest.raises(ModelError, match=r"are one tensor \(tied\), so blocks 0 and 4 must be on one stage"):
        spec.blocks(0, 3)

    from ravnest.pipeline.stash import StageCompute  # the head's use of the tensor reaches its gradient,
    y = torch.randint(0, SMALL["vocab_size"], (2, 20), generator=torch.Generator().manual_seed(4))
    reference = spec.full_model(seed=0)  # block by block under activation checkpointing too
    spec.loss(reference(ids), y).backward()
    for checkpointing in (False, True):
        model = spec.full_model(seed=0)
        compute = StageCompute(model, mode="stash", input_grad=False, device=torch.device("cpu"),
                               checkpoint_blocks=checkpointing)
        compute.forward(0, ids, loss_fn=lambda out: spec.loss(out, y))
        compute.backward_input(0, None)
        compute.backward_weights(0)
        assert all(torch.allclose(p.grad, q.grad, atol=1e-6) for p, q in zip(model.parameters(),
                                                                              reference.parameters()))
