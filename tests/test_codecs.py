"""Every codec of ravnest/wire/codecs round-trips within its stated error, through real frames, and a
stateful one loses nothing (what it leaves out is carried to the next tensor of the same name); every
decoder refuses a malformed payload with a WireError, never another exception."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ravnest.spec import JobSpec
from ravnest.v1 import peer_pb2
from ravnest.wire import Message, WireError, WireLimits, codecs
from ravnest.wire.tensors import ByteBudget, encode
from ravnest.wire.codecs.topk import chunk_bytes
from ravnest.wire.messages import MessageAssembler, chunk_frame, encode_message

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LIMITS = WireLimits(max_tensor_bytes=1 << 22, max_message_bytes=1 << 23)


@st.composite
def floats(draw, low: float = -1e4, high: float = 1e4) -> torch.Tensor:
    shape = draw(st.lists(st.integers(0, 70), max_size=3).filter(lambda s: math.prod(s) <= 20000))
    seed = draw(st.integers(0, 2**31))
    scale = draw(st.sampled_from([1e-3, 1.0, 100.0]))
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale
    return t.clamp(low, high)


def through_the_wire(t: torch.Tensor, codec: str, state: dict | None = None) -> torch.Tensor:
    budget = ByteBudget(1 << 24)
    frames = encode_message(Message("m", tensors={"t": t}), codec) if state is None else \
        _stateful_frames(t, codec, state)
    (out,) = MessageAssembler(LIMITS, budget=budget).messages(frames)
    assert budget.used == 0
    return out.tensors["t"]


def _stateful_frames(t: torch.Tensor, codec: str, state: dict):
    from ravnest.wire.messages import chunked_frames, prepare_message
    return chunked_frames(prepare_message(Message("m", tensors={"t": t}), codec, state))


@SETTINGS
@given(t=floats())
def test_element_wise_codecs_keep_their_stated_error(t: torch.Tensor) -> None:
    assert torch.equal(through_the_wire(t, ""), t)
    for codec, relative in (("fp16", 2**-11), ("bf16", 2**-8)):
        out = through_the_wire(t, codec)
        assert out.dtype == t.dtype and out.shape == t.shape
        assert torch.all((out - t).abs() <= relative * t.abs() + 2**-24 * (codec == "fp16") + 1e-38)
    out = through_the_wire(t, "int8")
    step = float(t.abs().max()) / 127 if t.numel() else 0.0
    # half a step, plus float32's rounding of x / scale and of q * scale (hypothesis found a value
    # 1e-7 past half a step)
    assert out.shape == t.shape and torch.all((out - t).abs() <= step / 2 * (1 + 1e-6) + t.abs() * 2**-22 + 1e-30)


@SETTINGS
@given(t=floats(low=-3e38, high=3e38))
def test_blockwise_codecs_keep_their_stated_error(t: torch.Tensor) -> None:
    """q8: each value within half its block's step, max|block| / 127 (the bf16 scale rounds up by at most
    2^-6). q4 and q3 quantize the block turned by an orthonormal rotation, which keeps the error's norm:
    per block of 64, |error| <= 8 x half a step <= 4 |block| / qmax (a worst case; Gaussian blocks
    measure 0.11 and 0.25 of their norm)."""
    blocks = torch.nn.functional.pad(t.reshape(-1).double(), (0, -t.numel() % 64)).view(-1, 64)
    for codec, qmax in (("q8", 127), ("q4", 7), ("q3", 3)):
        out = through_the_wire(t, codec)
        assert out.dtype == t.dtype and out.shape == t.shape
        error = torch.nn.functional.pad((out.double() - t.double()).reshape(-1), (0, -t.numel() % 64)).view(-1, 64)
        if codec == "q8":
            step = blocks.abs().amax(dim=1, keepdim=True) / qmax * (1 + 2**-6)
            assert torch.all(error.abs() <= step / 2 * (1 + 1e-6) + blocks.abs() * 2**-22 + 1e-30), codec
        else:
            norm = blocks.norm(dim=1)
            assert torch.all(error.norm(dim=1) <= 4 * norm / qmax * (1 + 2**-6) * (1 + 1e-5) + 1e-30), codec


def test_blockwise_codecs_send_what_their_docstring_says_and_refuse_non_finite_values() -> None:
    t = torch.randn(8, 128, 256)
    for codec, per_value in (("q8", 1 + 2 / 64), ("q4", 0.5 + 2 / 64), ("q3", 3 / 8 + 2 / 64)):
        header, view = encode("x", t, codec)
        assert len(view) == header.nbytes == t.numel() * per_value
        with pytest.raises(ValueError, match="finite"):
            encode("x", torch.tensor([1.0, float("nan")]), codec)
    # an outlier costs the precision of its own block only
    spiky = t.clone().reshape(-1)
    spiky[0] = 1e4
    out = through_the_wire(spiky, "q8")
    assert (out[64:] - spiky[64:]).norm() / spiky[64:].norm() < 0.01


@SETTINGS
@given(t=floats())
def test_topk_loses_nothing_it_only_delays(t: torch.Tensor) -> None:
    state: dict[str, torch.Tensor] = {}
    sent = through_the_wire(t, "topk", state)
    assert sent.shape == t.shape and sent.dtype == t.dtype
    # what arrived plus what the sender kept back is what it had
    residual = state["t"].view(t.shape) if t.numel() else torch.zeros(t.shape)
    assert torch.allclose(sent + residual, t, rtol=1e-6, atol=1e-6 * float(t.abs().max() if t.numel() else 0))
    flat = sent.reshape(-1)
    for start in range(0, flat.numel(), 4096):  # at most k values per chunk
        assert int(flat[start:start + 4096].ne(0).sum()) <= 64
    # sent again and again, the same tensor arrives in full on average: the residual stays bounded
    total = sent.clone()
    for _ in range(7):
        total += through_the_wire(t, "topk", state)
    assert torch.allclose(total / 8, t, atol=float(state["t"].abs().max()) / 8 + 1e-6) if t.numel() else True


def test_topk_sends_at_least_100_times_fewer_bytes_than_float32() -> None:
    t = torch.randn(1 << 20)
    header, view = encode("t", t, "topk")
    assert len(view) == header.nbytes == 256 * chunk_bytes(64)
    assert t.numel() * 4 / len(view) >= 100
    assert codecs.codec("topk").wire_bytes(t.numel()) == len(view)


@pytest.mark.parametrize("name", codecs.names())
def test_each_codec_says_the_bytes_it_sends(name: str) -> None:
    """Per message; q4g3, whose gradients take fewer, says the mean of a pipeline's two directions."""
    t = torch.randn(3, 1000)
    sent = []
    for tensor_name in ("x", "grad"):  # what the pipeline sends forward, and back
        header, view = encode(tensor_name, t, name)
        assert len(view) == header.nbytes
        sent.append(len(view))
    assert codecs.codec(name).wire_bytes(t.numel()) == sum(sent) // 2


def test_a_job_names_only_codecs_that_fit_its_use() -> None:
    with pytest.raises(ValueError, match="not a codec for the pipeline.*'bf16'"):
        JobSpec.model_validate({"model": {"name": "mlp"}, "dataset": {"name": "digits"},
                                "training": {"codec": "topk"}})
    with pytest.raises(ValueError, match="suits changes, not weights.*diloco"):
        JobSpec.model_validate({"model": {"name": "mlp"}, "dataset": {"name": "digits"},
                                "averaging": {"strategy": "ring", "codec": "topk"}})
    JobSpec.model_validate({"model": {"name": "mlp"}, "dataset": {"name": "digits"},
                            "averaging": {"strategy": "diloco", "codec": "topk"}})
    with pytest.raises(ValueError, match=r"did you mean 'topk'"):
        JobSpec.model_validate({"model": {"name": "mlp"}, "dataset": {"name": "digits"},
                                "averaging": {"codec": "topl"}})


# hostile payloads behind headers that pass validation: a WireError, or a tensor of the declared shape
topk_frames = st.builds(
    lambda numel, payload: [peer_pb2.Frame(message=peer_pb2.MessageHeader(kind="m", num_tensors=1)).SerializeToString(),
                            peer_pb2.Frame(tensor=peer_pb2.TensorHeader(
                                name="t", dtype="uint8", shape=[numel], nbytes=chunk_bytes(32) * math.ceil(numel / 64),
                                codec="topk", decoded_dtype="float32", params=[64, 32])).SerializeToString(),
                            *[chunk_frame(payload[:chunk_bytes(32) * math.ceil(numel / 64)])]],
    st.integers(1, 300), st.binary(min_size=chunk_bytes(32) * 5, max_size=chunk_bytes(32) * 5))


@SETTINGS
@given(frames=topk_frames)
def test_any_topk_payload_gives_a_wire_error_or_the_declared_tensor(frames: list[bytes]) -> None:
    try:
        (out,) = MessageAssembler(LIMITS).messages(iter(frames))
    except WireError as e:
        assert str(e) and e.code is not None
        return
    t = out.tensors["t"]
    assert t.dtype == torch.float32 and t.numel() == peer_pb2.Frame.FromString(frames[1]).tensor.shape[0]
    assert bool(torch.isfinite(t).all())  # its magnitudes were checked finite


blockwise_frames = st.builds(
    lambda codec, numel, payload: [
        peer_pb2.Frame(message=peer_pb2.MessageHeader(kind="m", num_tensors=1)).SerializeToString(),
        peer_pb2.Frame(tensor=peer_pb2.TensorHeader(
            name="t", dtype="uint8", shape=[numel], nbytes=codecs.codec(codec).payload_numel(numel, ()),
            codec=codec, decoded_dtype="float32")).SerializeToString(),
        chunk_frame(payload[:codecs.codec(codec).payload_numel(numel, ())])],
    st.sampled_from(["q8", "q4", "q3"]), st.integers(1, 300), st.binary(min_size=400, max_size=400))


@SETTINGS
@given(frames=blockwise_frames)
def test_any_blockwise_payload_decodes_to_the_declared_tensor(frames: list[bytes]) -> None:
    """Every byte string of the declared size is some tensor of the declared shape (scales that are not
    finite give values that are not, which the stage then refuses naming its sender)."""
    (out,) = MessageAssembler(LIMITS).messages(iter(frames))
    header = peer_pb2.Frame.FromString(frames[1]).tensor
    assert out.tensors["t"].dtype == torch.float32 and list(out.tensors["t"].shape) == list(header.shape)


@pytest.mark.parametrize("codec", ["q8", "q4", "q3"])
def test_a_blockwise_frame_that_lies_about_its_size_is_refused_before_allocation(codec: str) -> None:
    numel = 10**6
    budget = ByteBudget(1 << 24)
    header = peer_pb2.TensorHeader(name="t", dtype="uint8", shape=[numel], codec=codec, decoded_dtype="float32",
                                   nbytes=codecs.codec(codec).payload_numel(numel, ()) - 1)
    frames = [peer_pb2.Frame(message=peer_pb2.MessageHeader(kind="m", num_tensors=1)).SerializeToString(),
              peer_pb2.Frame(tensor=header).SerializeToString()]
    with pytest.raises(WireError, match="declares .* bytes but float32\\[1000000\\] as " + codec):
        list(MessageAssembler(LIMITS, budget=budget).messages(iter(frames)))
    assert budget.used == 0


def test_blockwise_frames_decode_on_the_receivers_device_and_others_on_its_cpu() -> None:
    """A stage on an accelerator gets a blockwise tensor decoded there: only the packed bytes cross to it
    (shown with PyTorch's meta device, where a tensor has no data: the decode's math ran on it)."""
    t = torch.randn(4, 64)
    frames = [*encode_message(Message("m", tensors={"q": t}), "q4"), *encode_message(Message("m", tensors={"b": t}),
                                                                                      "bf16")]
    first, second = MessageAssembler(LIMITS, decode_device=torch.device("meta")).messages(iter(frames))
    assert first.tensors["q"].device.type == "meta" and first.tensors["q"].shape == t.shape
    assert second.tensors["b"].device.type == "cpu"  # an element-wise cast: as cheap on the CPU


def test_q4g3_sends_activations_as_q4_and_gradients_as_q3_and_its_frames_say_which() -> None:
    t = torch.randn(8, 128, 256)
    for name, like, per_value in (("x", "q4", 0.5 + 2 / 64), ("grad", "q3", 3 / 8 + 2 / 64)):
        header, view = encode(name, t, "q4g3")
        assert list(header.params) == [codecs.codec(like).bits] and header.nbytes == t.numel() * per_value
        budget = ByteBudget(1 << 24)
        frames = encode_message(Message("m", tensors={name: t}), "q4g3")
        (out,) = MessageAssembler(WireLimits(max_tensor_bytes=1 << 24, max_message_bytes=1 << 25),
                                  budget=budget).messages(frames)
        expected = codecs.codec(like).decode(torch.frombuffer(bytearray(view), dtype=torch.uint8),
                                             t.shape, torch.float32, [])
        assert torch.equal(out.tensors[name], expected), name
    # a planner prices a link at the mean of its two directions: 8.5x fewer bytes than float32
    assert codecs.codec("q4g3").wire_bytes(64 * 1000) == (34 + 26) // 2 * 1000


@pytest.mark.parametrize("bits, nbytes, refused", [
    (8, 64 + 2, "q4g3 frames are of 4 or 3 bits, not 8"),
    (3, 32 + 2, "declares 34 bytes but float32\\[64\\] as q4g3 needs 26"),  # q4's size under q3's bits
])
def test_a_q4g3_frame_that_lies_about_its_bits_or_size_is_refused_before_allocation(bits, nbytes, refused) -> None:
    budget = ByteBudget(1 << 24)
    header = peer_pb2.TensorHeader(name="t", dtype="uint8", shape=[64], codec="q4g3", decoded_dtype="float32",
                                   nbytes=nbytes, params=[bits])
    frames = [peer_pb2.Frame(message=peer_pb2.MessageHeader(kind="m", num_tensors=1)).SerializeToString(),
              peer_pb2.Frame(tensor=header).SerializeToString()]
    with pytest.raises(WireError, match=refused):
        list(MessageAssembler(LIMITS, budget=budget).messages(iter(frames)))
    assert budget.used == 0
