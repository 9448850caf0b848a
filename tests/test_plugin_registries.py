"""A new strategy and a new codec are each one file: installed as a package is (a module and its
dist-info with entry points, in a folder on the path), each is found by its registry, and `auto`
chooses each where it is cheapest, and not where a registered one is as good."""
from __future__ import annotations

import importlib
import textwrap

import pytest
import torch

from coordinator.codec_choice import AUTO_LINK_SHARE, averaging_codec, pick_codecs
from coordinator.planning import coded_bytes
from ravnest.averaging import registry, runtime
from ravnest.averaging.registry import Group
from ravnest.models.profile import BlockCost
from ravnest.partition import NodeCapacity, compute_seconds
from ravnest.spec import AveragingSettings, TrainingSettings
from ravnest.wire import codecs

TOY = textwrap.dedent('''
    """A toy strategy that costs nothing (its rounds are free, as if they hid perfectly), and a toy
    codec of 4 bits a value: sign and 3 bits of magnitude, one float32 scale per tensor."""
    import math

    import torch

    from ravnest.averaging.registry import StrategyInfo
    from ravnest.wire.codecs import Codec


    def free(c):
        return c.step_s


    STRATEGY = StrategyInfo("toy", lambda context: None, cost=free, auto_rank=3)


    class Nibbles(Codec):
        name, uses, wire_dtype, params = "nibbles", frozenset({"pipeline", "averaging"}), "uint8", 1
        auto = {"pipeline": 2, "averaging": 5}

        def payload_numel(self, numel, params):
            return math.ceil(numel / 2)

        def encode(self, t, state=None, key=""):
            flat = t.reshape(-1).float()
            scale = float(flat.abs().max()) / 7 if flat.numel() and float(flat.abs().max()) > 0 else 1.0
            q = (torch.round(flat / scale).clamp(-7, 7) + 8).to(torch.uint8)
            if q.numel() % 2:
                q = torch.cat([q, q.new_full((1,), 8)])
            return q[0::2] * 16 + q[1::2], [scale]

        def decode(self, payload, shape, dtype, params):
            q = torch.stack([payload // 16, payload % 16], dim=1).reshape(-1).float() - 8
            return (q[:math.prod(shape)] * params[0]).to(dtype).view(tuple(shape))
''')


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """The toy package installed in a folder of its own: its module and a dist-info naming its entry points."""
    (tmp_path / "ravnest_toy.py").write_text(TOY)
    info = tmp_path / "ravnest_toy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ravnest-toy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[ravnest.averaging]\ntoy = ravnest_toy:STRATEGY\n\n"
                                           "[ravnest.codecs]\nnibbles = ravnest_toy:Nibbles\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.setattr(registry, "_REGISTRY", registry._REGISTRY.copy())  # what they load is undone after
    fresh = codecs._REGISTRY.copy()
    fresh._imported = False  # look for plug-ins again
    monkeypatch.setattr(codecs, "_REGISTRY", fresh)


def test_the_toy_codec_is_found_and_round_trips(installed) -> None:
    assert "nibbles" in codecs.names("pipeline") and "nibbles" in codecs.names("averaging")
    from ravnest.wire.tensors import decode, encode
    x = torch.linspace(-1, 1, 101)
    header, payload = encode("x", x, "nibbles")
    assert len(payload) == 51  # 4 bits a value
    torch.testing.assert_close(decode(header, payload), x, atol=1 / 14 + 1e-6, rtol=0)


def test_auto_chooses_the_toy_strategy_only_where_it_is_cheapest(installed) -> None:
    assert ("toy", "") in runtime.candidates("Adam")
    slow = [Group(members=4, param_bytes=100e6, bandwidth=1e6, latency=0.05)]  # rounds of minutes
    assert runtime.pick(runtime.predictions(1.0, slow, every=10, optimizer="Adam")) == ("toy", "")
    fast = [Group(members=4, param_bytes=1e3, bandwidth=1e10, latency=1e-5)]  # rounds cost nothing: dear
    assert runtime.pick(runtime.predictions(1.0, fast, every=10, optimizer="Adam")) == ("dear", "")


def link(bandwidth: float) -> list[NodeCapacity]:
    return [NodeCapacity(flops=1e10, memory_bytes=1 << 30, bandwidth_to_next=bandwidth)] * 2


def test_auto_chooses_the_toy_codec_on_a_pipeline_link_only_where_bf16_does_not_fit(installed) -> None:
    """Stages sending 1 MiB of activations a micro-batch (and as many gradient bytes back), for a model
    that may take q8's loss (the toy's rank): a link that moves both in half their compute at float32
    keeps float32; one that does so at 2 bytes a value gets bf16; one that does so only at 4 bits gets
    the toy codec, as does any slower one (none lossier is allowed)."""
    stages = [BlockCost(params=1, param_bytes=4, flops=1e8, activation_bytes=1 << 20)] * 2
    budget = AUTO_LINK_SHARE * compute_seconds(1e8, link(1.0)[0])  # seconds the link may take
    training = TrainingSettings(codec="auto")
    at = lambda value_bytes: 2 * (1 << 18) * value_bytes / budget * 1.01  # noqa: E731  (bytes/s that just fits)
    assert pick_codecs(stages, link(at(4)), training, lossiest="q8") == ["", None]
    assert pick_codecs(stages, link(at(2)), training, lossiest="q8") == ["bf16", None]
    assert pick_codecs(stages, link(at(0.5)), training, lossiest="q8") == ["nibbles", None]
    assert pick_codecs(stages, link(at(0.1)), training, lossiest="q8") == ["nibbles", None]  # the fewest bytes


def test_auto_chooses_the_toy_codec_for_averaging_only_where_it_pays(installed) -> None:
    averaging, training = AveragingSettings(strategy="ring", codec="auto", every=1), TrainingSettings()

    def groups(bandwidth: float):
        return lambda codec: [Group(members=4, param_bytes=coded_bytes(40e6, codec, 4), bandwidth=bandwidth,
                                    latency=1e-3)]
    assert averaging_codec(averaging, training, 1.0, groups(1e6)) == "nibbles"  # bytes set the pace
    assert averaging_codec(averaging, training, 1.0, groups(1e12)) == ""  # rounds keep up anyway
