"""Model registry, built-in architectures, plugins and cost profiles."""
from __future__ import annotations

import importlib.metadata
import textwrap
from collections.abc import Iterator

import pytest
import torch

from ravnest.data import load_dataset
from ravnest.models import (BlockCost, InputSpec, ModelError, ModelSpec, available_models, build_model, input_bytes,
                            profile_blocks, register_model)
from ravnest.models import registry

SMALL_CONFIGS = {
    "mlp": {"input_dim": 12, "hidden": 16, "depth": 2, "num_classes": 3},
    "cnn": {"image_size": 8, "channels": [4, 8]},
    "gpt": {"vocab_size": 32, "seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 4},
}


@pytest.fixture
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by a test do not leak into other tests."""
    monkeypatch.setattr(registry, "_BUILDERS", registry._BUILDERS.copy())


def test_builtins_are_available() -> None:
    assert {"mlp", "cnn", "gpt"} <= set(available_models())


@pytest.mark.parametrize("name", sorted(SMALL_CONFIGS))
def test_blocks_chain_to_the_task_output(name: str) -> None:
    spec = build_model(name, SMALL_CONFIGS[name])
    x = spec.example_input(5)
    for index in range(spec.num_blocks):
        x = spec.block(index, seed=0)(x)
    if spec.task == "classify":
        assert x.shape == (5, spec.config["num_classes"])
        target = torch.zeros(5, dtype=torch.int64)
    else:
        assert x.shape == (5, spec.config["seq_len"], spec.config["vocab_size"])
        target = torch.zeros(5, spec.config["seq_len"], dtype=torch.int64)
    loss = spec.loss(x, target)
    assert loss.ndim == 0 and torch.isfinite(loss)


@pytest.mark.parametrize("name", sorted(SMALL_CONFIGS))
def test_full_model_keys_are_prefixed_by_block_index(name: str) -> None:
    spec = build_model(name, SMALL_CONFIGS[name])
    keys = spec.full_model().state_dict().keys()
    blocks = [spec.block(i) for i in range(spec.num_blocks)]
    for index, block in enumerate(blocks):
        assert {f"{index}.{key}" for key in block.state_dict()} <= keys
    assert len(keys) == sum(len(block.state_dict()) for block in blocks)


@pytest.mark.parametrize("name", sorted(SMALL_CONFIGS))
def test_a_block_built_alone_equals_the_same_block_of_the_whole_model(name: str) -> None:
    spec = build_model(name, SMALL_CONFIGS[name])
    whole = spec.full_model(seed=11).state_dict()
    last = spec.num_blocks - 1
    for start, end in [(last, last + 1), (1, spec.num_blocks), (0, 2)]:
        part = spec.blocks(start, end, seed=11).state_dict()
        assert part and all(int(key.split(".")[0]) in range(start, end) for key in part)
        assert all(torch.equal(tensor, whole[key]) for key, tensor in part.items())


def test_blocks_on_the_meta_device_have_shapes_and_no_storage() -> None:
    spec = build_model("gpt", {"d_model": 4096, "n_layers": 2, "n_heads": 32, "vocab_size": 50_000})
    model = spec.full_model(device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) > 600_000_000  # 2.4 GB in fp32, allocated nowhere
    assert model(spec.example_input(2, device="meta")).shape == (2, 64, 50_000)


def test_a_builder_that_picks_its_own_device_is_refused(isolated_registry: None) -> None:
    @register_model("stubborn")
    def build_stubborn(config: dict) -> ModelSpec:
        def make_block(index: int) -> torch.nn.Module:
            block = torch.nn.Linear(2, 2)
            block.register_buffer("table", torch.zeros(3, device="cpu"))
            return block
        return ModelSpec("stubborn", config, 1, make_block, "classify", InputSpec((2,)))

    spec = build_model("stubborn")
    assert spec.block(0, seed=0).table.shape == (3,)  # on the CPU it is where it should be
    with pytest.raises(ModelError, match="default device"):
        spec.block(0, device="meta")


def test_config_defaults_are_resolved() -> None:
    spec = build_model("gpt", {"n_layers": 2})
    assert spec.config == {"vocab_size": 128, "seq_len": 64, "d_model": 128, "n_layers": 2, "n_heads": 4,
                           "dropout": 0.0}
    assert spec.num_blocks == 2 + 2
    assert build_model("mlp").num_blocks == 4 + 2


def test_example_inputs_have_model_dtypes() -> None:
    gpt = build_model("gpt", SMALL_CONFIGS["gpt"]).example_input(3)
    assert gpt.dtype == torch.int64 and gpt.shape == (3, 16) and 0 <= gpt.min() and gpt.max() < 32
    cnn = build_model("cnn", {"image_size": 28}).example_input(2)
    assert cnn.dtype == torch.float32 and cnn.shape == (2, 1, 28, 28)


def test_cnn_handles_28x28_and_has_batch_norm() -> None:
    spec = build_model("cnn", {"image_size": 28})
    assert spec.full_model()(spec.example_input(2)).shape == (2, 10)
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in spec.full_model().modules())
    plain = build_model("cnn", {"batch_norm": False})
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in plain.full_model().modules())


def test_mlp_flattens_images() -> None:
    spec = build_model("mlp", {"input_dim": 64})
    assert spec.full_model()(torch.rand(4, 1, 8, 8)).shape == (4, 10)


def test_gpt_is_causal() -> None:
    spec = build_model("gpt", SMALL_CONFIGS["gpt"])
    model = spec.full_model().eval()
    ids = spec.example_input(2)
    changed = ids.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 32
    with torch.no_grad():
        assert torch.allclose(model(ids)[:, :10], model(changed)[:, :10], atol=1e-5)
        assert not torch.allclose(model(ids)[:, 10:], model(changed)[:, 10:])


@pytest.mark.parametrize("name", sorted(SMALL_CONFIGS))
def test_seed_gives_identical_weights_and_keeps_global_rng(name: str) -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first = build_model(name, SMALL_CONFIGS[name]).full_model(seed=7).state_dict()
    assert torch.equal(torch.rand(1), expected_next)  # building did not consume the caller's RNG
    second = build_model(name, SMALL_CONFIGS[name]).full_model(seed=7).state_dict()
    other = build_model(name, SMALL_CONFIGS[name]).full_model(seed=8).state_dict()
    assert all(torch.equal(first[key], second[key]) for key in first)
    assert any(not torch.equal(first[key], other[key]) for key in first if first[key].is_floating_point())


def test_dropout_forward_is_deterministic_given_rng_state() -> None:
    spec = build_model("gpt", {**SMALL_CONFIGS["gpt"], "dropout": 0.3})
    model = spec.full_model().train()
    ids = spec.example_input(2)
    torch.manual_seed(5)
    first = model(ids)
    torch.manual_seed(5)
    assert torch.equal(first, model(ids))


def test_unknown_name_lists_known_models() -> None:
    with pytest.raises(ModelError, match="unknown model 'resnet9000'.*cnn.*gpt.*mlp"):
        build_model("resnet9000")


@pytest.mark.parametrize(("name", "config", "reason"), [
    ("mlp", {"width": 3}, "unknown config key 'width'"),
    ("mlp", {"depth": "4"}, "'depth' must be int"),
    ("mlp", {"hidden": 0}, "hidden must be >= 1"),
    ("mlp", {"depth": True}, "'depth' must be int"),
    ("mlp", {"dropout": 1.5}, "dropout"),
    ("cnn", {"channels": []}, "channels"),
    ("cnn", {"channels": [8, "x"]}, "channels"),
    ("cnn", {"batch_norm": 1}, "'batch_norm' must be bool"),
    ("gpt", {"d_model": 30, "n_heads": 4}, "divisible"),
    ("gpt", {"n_layers": -1}, "n_layers must be >= 1"),
    ("gpt", {"n_embd": 64, "block_size": 32}, r"unknown config keys 'block_size' \(did you mean 'seq_len'\?\), "
                                              r"'n_embd' \(did you mean 'd_model'\?\); allowed: 'd_model', "),
])
def test_bad_configs_raise_model_error(name: str, config: dict, reason: str) -> None:
    with pytest.raises(ModelError, match=reason):
        build_model(name, config)
    assert issubclass(ModelError, ValueError)


def test_json_friendly_values_are_accepted() -> None:
    assert build_model("mlp", {"dropout": 0}).config["dropout"] == 0.0
    assert build_model("cnn", {"channels": (4, 8)}).config["channels"] == [4, 8]


def test_gpt_rejects_sequences_longer_than_seq_len() -> None:
    spec = build_model("gpt", SMALL_CONFIGS["gpt"])
    with pytest.raises(ValueError, match="longer than seq_len=16"):
        spec.block(0)(torch.zeros(1, 17, dtype=torch.int64))


def test_register_model_decorator(isolated_registry: None) -> None:
    @register_model("tiny")
    def build_tiny(config: dict) -> ModelSpec:
        return ModelSpec("tiny", config, 1, lambda index: torch.nn.Linear(2, 2), "classify", InputSpec((2,)))

    assert "tiny" in available_models()
    assert build_model("tiny").example_input(3).shape == (3, 2)


def test_entry_point_plugins_load_lazily(isolated_registry: None, monkeypatch: pytest.MonkeyPatch,
                                         tmp_path) -> None:
    (tmp_path / "ravnest_test_plugin.py").write_text(textwrap.dedent("""
        import torch
        from ravnest.models import InputSpec, ModelSpec
        LOADS = []
        def build(config):
            LOADS.append(config)
            return ModelSpec("plugged", config, 1, lambda index: torch.nn.Linear(3, 4), "classify",
                             InputSpec((3,)))
        def broken(config):
            return None
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    points = [importlib.metadata.EntryPoint(name, f"ravnest_test_plugin:{attr}", registry.ENTRY_POINT_GROUP)
              for name, attr in [("plugged", "build"), ("broken", "broken"), ("missing", "nothing_here")]]
    groups = []

    def fake_entry_points(*, group: str) -> list[importlib.metadata.EntryPoint]:
        groups.append(group)
        return points if group == registry.ENTRY_POINT_GROUP else []

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    assert {"plugged", "broken", "mlp"} <= set(available_models())
    spec = build_model("plugged", {"a": 1})
    assert spec.full_model()(spec.example_input(2)).shape == (2, 4)
    assert groups and set(groups) == {"ravnest.models"}
    with pytest.raises(ModelError, match="did not return a ModelSpec"):
        build_model("broken")
    with pytest.raises(ModelError, match="failed to load"):
        build_model("missing")
    with pytest.raises(ModelError, match="unknown model"):
        build_model("not-installed")


# --- profiles -------------------------------------------------------------------------------------

def test_mlp_profile_matches_hand_counts() -> None:
    spec = build_model("mlp", {"input_dim": 12, "hidden": 16, "depth": 1, "num_classes": 3})
    costs = profile_blocks(spec, batch_size=5)
    assert [c.params for c in costs] == [12 * 16 + 16, 16 * 16 + 16, 16 * 3 + 3]
    assert [c.param_bytes for c in costs] == [4 * c.params for c in costs]
    assert [c.flops for c in costs] == [2 * 5 * 12 * 16, 2 * 5 * 16 * 16, 2 * 5 * 16 * 3]  # Linear: 2*n*a*b
    assert [c.activation_bytes for c in costs] == [5 * 16 * 4, 5 * 16 * 4, 5 * 3 * 4]
    assert all(c.forward_seconds is None and c.backward_seconds is None for c in costs)
    assert input_bytes(spec, 5) == 5 * 12 * 4


def test_cnn_profile_counts_bn_buffers() -> None:
    spec = build_model("cnn", {"channels": [4, 8]})
    costs = profile_blocks(spec, batch_size=6)
    # conv 1->4 (no bias under BN) + BN weight/bias, and running mean/var as float buffers
    assert costs[0].params == 4 * 9 + 2 * 4
    assert costs[0].param_bytes == 4 * (costs[0].params + 2 * 4)
    assert costs[0].flops == 2 * 6 * 8 * 8 * 4 * 9  # 3x3 conv on 8x8, 1 -> 4 channels
    assert costs[0].activation_bytes == 6 * 4 * 4 * 4 * 4  # pooled to 4x4
    assert all(c.params > 0 and c.flops > 0 and c.activation_bytes > 0 for c in costs)


def test_gpt_profile_is_plausible_and_measures() -> None:
    cfg = SMALL_CONFIGS["gpt"]
    spec = build_model("gpt", cfg)
    batch, length, width = 2, cfg["seq_len"], cfg["d_model"]
    costs = profile_blocks(spec, batch, measure=True, repeats=2)
    assert len(costs) == cfg["n_layers"] + 2
    dense = 2 * batch * length * 12 * width * width  # qkv (3d^2) + proj (d^2) + MLP (8d^2)
    attention = 4 * batch * length * length * width  # QK^T and AV (counted in full, mask or not)
    assert costs[1].flops == dense + attention
    assert costs[-1].flops == 2 * batch * length * width * cfg["vocab_size"]
    assert costs[0].activation_bytes == batch * length * width * 4
    assert input_bytes(spec, batch) == batch * length * 8
    assert all(c.forward_seconds > 0 and c.backward_seconds > 0 for c in costs)


def test_profile_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        profile_blocks(build_model("mlp"), 0)
    assert isinstance(profile_blocks(build_model("mlp"), 1)[0], BlockCost)


# --- learning -------------------------------------------------------------------------------------

@pytest.fixture
def one_thread() -> Iterator[None]:
    """Small models train faster on one thread, and do not fight other processes for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_cnn_learns_digits_single_process(one_thread: None) -> None:
    """The default cnn reaches >= 95% test accuracy on sklearn digits in 300 Adam steps."""
    spec = build_model("cnn")
    model = spec.full_model()
    data = load_dataset({"name": "digits"})
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    batches = data.batches(32, seed=0)
    for _ in range(300):
        x, y = next(batches)
        optimizer.zero_grad()
        spec.loss(model(x), y).backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in data.test_batches(256))
    assert correct / len(data.test_y) >= 0.95


def test_gpt_learns_text(one_thread: None) -> None:
    data = load_dataset({"name": "text", "source": "textwrap", "seq_len": 32}, {"textwrap": textwrap.__file__})
    spec = build_model("gpt", {"vocab_size": data.vocab_size, "seq_len": 32, "d_model": 64, "n_layers": 2})
    model = spec.full_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    batches = data.batches(16, seed=0)
    losses = []
    for _ in range(100):
        x, y = next(batches)
        optimizer.zero_grad()
        loss = spec.loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < losses[0] - 1.5  # from ~ln(128) = 4.85 nats to well below


def test_the_example_plugin_package_meets_the_block_contract() -> None:
    """examples/model-plugin is installed like any third-party package (scripts/bootstrap.sh): found
    through its entry point, profiled on the meta device, each block built alone as in the whole."""
    assert "resmlp" in available_models()
    spec = build_model("resmlp", {"depth": 3, "width": 32})
    assert registry.ENTRY_POINT_GROUP == "ravnest.models" and spec.num_blocks == 5
    costs = profile_blocks(spec, batch_size=8)
    assert [c.output_shape for c in costs] == [(8, 32)] * 4 + [(8, 10)] and all(c.saved_bytes > 0 for c in costs)
    whole = spec.full_model(seed=4).state_dict()
    alone = spec.blocks(2, 4, seed=4).state_dict()
    assert alone and all(torch.equal(tensor, whole[key]) for key, tensor in alone.items())
