"""A llama whose residual stream lives in a fixed subspace (`residual_rank`, ravnest/models/subspace.py):
what crosses a cut is k + 2 numbers per token, the cut is exact, and the model exports as a plain Llama."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from coordinator import files
from ravnest.models import ModelError, build_model
from ravnest.models.hf import hf_config, hf_key, write_hf_folder
from ravnest.models.subspace import Subspace
from ravnest.models.weights import load_starting_weights
from ravnest.wire.codecs import codec

CONFIG = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32, "residual_rank": 6}


def trained_like(spec) -> torch.nn.Module:
    """A model whose o_proj and down_proj are not already in the subspace (as after training)."""
    model = spec.full_model(seed=3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_what_crosses_a_cut_is_k_plus_two_numbers_per_token_and_bf16_keeps_the_ids():
    spec = build_model("llama", CONFIG)
    ids = torch.tensor([[0, 1, 255, 256, 299, 7]])
    packed = spec.block(0, seed=0)(ids)
    assert packed.shape == (1, 6, CONFIG["residual_rank"] + 2)
    bf16 = codec("bf16")
    payload, params = bf16.encode(packed)
    decoded = bf16.decode(payload, packed.shape, torch.float32, params)
    assert torch.equal(Subspace.of(spec.config).unpack(decoded).ids, ids)  # ids up to 65535 survive bf16
    # bytes per token against the full residual stream in fp32: 32x at hidden 256, k 14
    wide = build_model("llama", {**CONFIG, "hidden_size": 256, "residual_rank": 14})
    plain = build_model("llama", {**CONFIG, "hidden_size": 256, "residual_rank": 0})
    ours = bf16.wire_bytes(wide.block(0)(ids).numel())
    full = codec("").wire_bytes(plain.block(0)(ids).numel())
    assert full / ours == 32


@pytest.mark.parametrize("cut", [1, 2, 3, 4])
def test_a_cut_is_exact_the_gradient_that_goes_back_is_the_whole_models(cut):
    """Wherever the planner cuts (a re-plan may move a cut), both sides agree with the whole model."""
    spec = build_model("llama", CONFIG)
    whole = trained_like(spec)
    copy = build_model("llama", CONFIG).full_model()
    copy.load_state_dict(whole.state_dict())
    first, second = copy[:cut], copy[cut:]
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    spec.loss(whole(ids), ids).backward()
    sent = first(ids)
    received = sent.detach().requires_grad_(True)
    spec.loss(second(received), ids).backward()
    sent.backward(received.grad)
    split = {**dict(first.named_parameters()), **dict(second.named_parameters())}
    for name, p in whole.named_parameters():
        assert torch.allclose(p.grad, split[name].grad, rtol=1e-4, atol=1e-6), name
    assert received.grad[..., -2:].abs().max() == 0  # the ids carry no gradient


def test_a_trained_subspace_model_exports_as_a_plain_llama_with_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    spec = build_model("llama", CONFIG)
    model = trained_like(spec).eval()
    state = model.state_dict()
    file = tmp_path / "model.safetensors"
    save_file(state, str(file), metadata={"model": json.dumps({"name": "llama", "config": CONFIG})})
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)
    # ravnest download --format hf
    write_hf_folder(file, tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert "residual_rank" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    with torch.no_grad():
        assert (theirs(ids).logits - ours).abs().max() < 1e-4
    # the coordinator's ?format=hf: the folded tensors, one per file, win the merge by offset
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    folded = files.folded(file, Subspace.of(spec.config), scratch)
    assert len(folded) == 1 + 2 * CONFIG["num_hidden_layers"]  # the embedding, each o_proj and down_proj
    merged = tmp_path / "merged.safetensors"
    files.merge([*folded, file], merged, {"format": "pt"}, rename=lambda key: hf_key(key, 3))
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(spec.config)))
    from safetensors.torch import load_file
    hf.load_state_dict(load_file(str(merged)))
    with torch.no_grad():
        assert (hf.eval()(ids).logits - ours).abs().max() < 1e-4


@pytest.mark.parametrize("change, words", [
    ({"residual_rank": 64}, "below hidden_size"),
    ({"residual_rank": -1}, "from 0"),
    ({"vocab_size": 70_000}, "vocab_size <= 65536"),
    ({"tie_word_embeddings": True}, "cannot be combined"),
])
def test_subspace_configs_that_cannot_work_say_why(change, words):
    with pytest.raises(ModelError, match=words):
        build_model("llama", {**CONFIG, **change})


def test_a_subspace_model_does_not_start_from_a_hugging_face_checkpoint(tmp_path):
    plain = build_model("llama", {**CONFIG, "residual_rank": 0})
    layers = CONFIG["num_hidden_layers"]
    file = tmp_path / "hf.safetensors"
    save_file({hf_key(k, layers): t for k, t in plain.full_model(seed=0).state_dict().items()}, str(file))
    spec = build_model("llama", CONFIG)
    with pytest.raises(ModelError, match="cannot start from it"):
        load_starting_weights(spec.blocks(0, 2), spec, file, "the checkpoint")


def test_the_frame_is_the_same_on_every_machine_whatever_torchs_rng():
    spec = build_model("llama", CONFIG)
    sub = Subspace.of(spec.config)
    fixed, basis = sub.frame(torch.device("cpu"))
    torch.manual_seed(12345)
    from ravnest.models.subspace import _frame
    _frame.cache_clear()
    again = Subspace.of(spec.config).frame(torch.device("cpu"))
    assert torch.equal(fixed, again[0]) and torch.equal(basis, again[1])
    assert torch.allclose(basis.T @ basis, torch.eye(CONFIG["residual_rank"]), atol=1e-6)


@pytest.mark.slow
def test_a_subspace_llama_trains_as_a_pipeline_sending_a_fraction_of_the_bytes():
    """Real stage processes over gRPC: the subspace model in bf16 on the wire learns like the full
    model with fp32 activations, and its first stage sends a small fraction of the bytes per step."""
    import argparse

    from ravnest.pipeline import run_local_pipeline
    from ravnest.spec import JobSpec

    def job(rank: int, codec: str) -> JobSpec:
        return JobSpec.model_validate({
            "model": {"name": "llama", "config": {"vocab_size": 128, "hidden_size": 128, "intermediate_size": 256,
                                                  "num_hidden_layers": 2, "num_attention_heads": 4,
                                                  "num_key_value_heads": 2, "max_position_embeddings": 32,
                                                  "residual_rank": rank}},
            "dataset": {"name": "text", "source": "argparse", "seq_len": 32, "test_fraction": 0.05},
            "training": {"steps": 100, "batch_size": 8, "codec": codec,
                         "optimizer": {"name": "Adam", "kwargs": {"lr": 3e-3}}}})

    runs = {name: run_local_pipeline(job(rank, codec), [(0, 2), (2, 4)], timeout=300,
                                     datasets={"argparse": argparse.__file__})
            for name, rank, codec in (("full", 0, ""), ("subspace", 6, "bf16"))}
    full, sub = (runs[name]["metrics"]["test_loss"] for name in ("full", "subspace"))
    sent = {name: run["stages"][0]["next_bytes_per_step"] for name, run in runs.items()}
    back = {name: run["stages"][1]["prev_bytes_per_step"] for name, run in runs.items()}
    print(f"\ntest loss full {full:.3f} subspace {sub:.3f}; bytes per step forward {sent}, back {back}")
    assert sub < full * 1.05
    assert sent["full"] / sent["subspace"] > 25  # 32x for the activations; the targets travel too
    assert back["full"] / back["subspace"] > 30
