"""Tensor codec and message framing, without a network."""
from __future__ import annotations

import grpc
import pytest
import torch

from ravnest.v1 import peer_pb2
from ravnest.wire import Message, WireError, WireLimits
from ravnest.wire.tensors import DTYPES, decode, encode, require_finite, validate_header
from ravnest.wire.messages import (MessageAssembler, bundled, chunk_frame, encode_message, message_frames,
                                   parse_frame, read_chunk)

LIMITS = WireLimits(max_tensor_bytes=1 << 20, max_message_bytes=2 << 20, max_chunk_bytes=64 << 10)


def roundtrip(msg: Message, codec: str = "", chunk_bytes: int = 64 << 10,
              limits: WireLimits = LIMITS) -> Message:
    """Through serialized frames, as the transport carries them."""
    (out,) = MessageAssembler(limits).messages(encode_message(msg, codec, chunk_bytes))
    return out


def sample(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, dtype=torch.int64).to(dtype)


def header(**fields) -> peer_pb2.TensorHeader:
    base = dict(name="x", dtype="float32", shape=[2, 3], nbytes=24)
    return peer_pb2.TensorHeader(**{**base, **fields})


def frames_of(msg: Message, codec: str = "", chunk_bytes: int = 64 << 10) -> list[bytes]:
    return list(encode_message(msg, codec, chunk_bytes))


# --- round trips ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_every_dtype_roundtrips_bit_exact(dtype: torch.dtype) -> None:
    t = sample(dtype, (7, 9, 11))
    out = roundtrip(Message("m", tensors={"t": t}), chunk_bytes=100).tensors["t"]  # many odd chunks
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out, t)


@pytest.mark.parametrize("shape", [(0,), (3, 0, 2), (), (1,), (1, 1, 1)])
@pytest.mark.parametrize("codec", ["", "fp16", "bf16", "int8"])
def test_empty_and_zero_dim_tensors(shape: tuple[int, ...], codec: str) -> None:
    t = torch.full(shape, 0.5)
    out = roundtrip(Message("m", tensors={"t": t}), codec).tensors["t"]
    assert out.shape == t.shape and out.dtype == torch.float32
    assert torch.allclose(out, t, atol=0.01)


def test_non_contiguous_inputs_arrive_as_their_values() -> None:
    base = torch.arange(4 * 6 * 5, dtype=torch.float32).reshape(4, 6, 5)
    views = {"transposed": base.transpose(0, 2), "strided": base[::2, 1::3], "expanded": torch.ones(3, 1).expand(3, 4)}
    out = roundtrip(Message("m", tensors=views), chunk_bytes=7).tensors
    for name, view in views.items():
        assert torch.equal(out[name], view) and out[name].is_contiguous()


def test_metadata_roundtrips_and_both_frame_forms_agree() -> None:
    msg = Message("forward", id=-42, tensors={"a": torch.ones(2), "b": torch.zeros(3, dtype=torch.int64)},
                  tags={"version": 7, "round": -(2**63)}, note="héllo")
    out = roundtrip(msg)
    assert (out.kind, out.id, out.tags, out.note) == (msg.kind, msg.id, msg.tags, msg.note)
    assert list(out.tensors) == ["a", "b"]
    (via_objects,) = MessageAssembler(LIMITS).messages(message_frames(msg))
    assert via_objects.tags == msg.tags and torch.equal(via_objects.tensors["b"], msg.tensors["b"])


def test_received_tensors_are_writable_and_independent_of_the_frames() -> None:
    frames = frames_of(Message("m", tensors={"t": torch.ones(1000)}), chunk_bytes=1000)
    (out,) = MessageAssembler(LIMITS).messages(frames)
    out.tensors["t"].add_(1)  # would fail or corrupt the frames if it aliased read-only bytes
    assert torch.equal(out.tensors["t"], torch.full((1000,), 2.0))


@pytest.mark.parametrize("codec, dtype, rel", [("fp16", torch.float16, 2**-11), ("bf16", torch.bfloat16, 2**-8)])
def test_half_codecs_error_bound(codec: str, dtype: torch.dtype, rel: float) -> None:
    t = torch.randn(10_000) * 100
    header_, view = encode("t", t, codec)
    assert header_.dtype == str(dtype).split(".")[1] and len(view) == t.numel() * 2
    out = roundtrip(Message("m", tensors={"t": t}), codec).tensors["t"]
    assert out.dtype == torch.float32
    assert torch.all((out - t).abs() <= rel * t.abs() + 1e-30)


@pytest.mark.parametrize("dtype, rounding", [(torch.float32, 2**-24), (torch.float64, 2**-53),
                                             (torch.float16, 2**-11), (torch.bfloat16, 2**-8)])
def test_int8_codec_error_is_at_most_half_a_step(dtype: torch.dtype, rounding: float) -> None:
    t = (torch.randn(10_000) * 3).to(dtype)
    h, view = encode("t", t, "int8")
    assert h.dtype == "int8" and len(view) == t.numel() and h.decoded_dtype == str(dtype).split(".")[1]
    out = roundtrip(Message("m", tensors={"t": t}), "int8").tensors["t"]
    assert out.dtype == dtype
    step = t.double().abs().max() / 127
    # half a quantization step, plus the final rounding to the decoded dtype
    assert torch.all((out.double() - t.double()).abs() <= step / 2 * 1.001 + t.double().abs() * rounding)


def test_int8_of_zeros_and_integers_are_exact() -> None:
    zeros, ints = torch.zeros(5), torch.arange(5)
    out = roundtrip(Message("m", tensors={"z": zeros, "i": ints}), "int8").tensors
    assert torch.equal(out["z"], zeros)
    assert torch.equal(out["i"], ints) and out["i"].dtype == torch.int64  # integers travel raw


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_int8_refuses_non_finite_values(bad: float) -> None:
    with pytest.raises(ValueError, match="finite"):
        encode("t", torch.tensor([1.0, bad]), "int8")


BIG = "the dtype's largest finite value"


@pytest.mark.parametrize("values, refused", [
    ([1.0, float("nan"), 2.0], True),
    ([float("inf"), float("-inf")], True),  # the sum is NaN
    ([BIG, BIG, -1.0], False),              # finite values whose sum overflows: checked one by one
    ([BIG, float("inf")], True),
    ([], False),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_require_finite_refuses_exactly_the_tensors_holding_nan_or_inf(values: list, refused: bool,
                                                                       dtype: torch.dtype) -> None:
    tensor = torch.tensor([torch.finfo(dtype).max if v is BIG else v for v in values], dtype=dtype)
    if refused:
        with pytest.raises(WireError, match="NaN or infinite values; refused"):
            require_finite(tensor, "t")
    else:
        require_finite(tensor, "t")
    require_finite(torch.tensor([2**62, 2**62]), "integers are not checked")


def test_encode_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="codec"):
        encode("t", torch.ones(2), "zip")
    with pytest.raises(ValueError, match="cannot go on the wire"):
        encode("t", torch.ones(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="chunk_bytes"):
        frames_of(Message("m", tensors={"t": torch.ones(2)}), chunk_bytes=0)
    with pytest.raises(ValueError):
        frames_of(Message("m", tags={"too_big": 2**64}))


# --- header validation ---------------------------------------------------------------------------

def topk(**fields) -> dict:
    """A valid top-k header's fields (one chunk of 4096 kept 64) but for `fields`."""
    return {**dict(dtype="uint8", nbytes=144, codec="topk", decoded_dtype="float32", params=[4096, 64]), **fields}


@pytest.mark.parametrize("fields, code, words", [
    (dict(dtype="complex64"), "INVALID_ARGUMENT", "unknown dtype"),
    (dict(dtype="object"), "INVALID_ARGUMENT", "unknown dtype"),
    (dict(codec="zip"), "INVALID_ARGUMENT", "unknown codec"),
    (dict(codec="fp16"), "INVALID_ARGUMENT", "needs wire dtype float16"),
    (dict(dtype="int8", nbytes=6, codec="int8", decoded_dtype="int32"), "INVALID_ARGUMENT", "float dtype"),
    (dict(dtype="int8", nbytes=6, codec="int8", decoded_dtype="float32", params=[float("nan")]),
     "INVALID_ARGUMENT", "not finite"),
    (dict(dtype="int8", nbytes=6, codec="int8", decoded_dtype="float32"), "INVALID_ARGUMENT", "takes 1 parameters"),
    (dict(params=[1.0]), "INVALID_ARGUMENT", "takes 0 parameters"),
    # top-k: its payload's size follows from the shape and its two parameters, checked before allocating
    (topk(params=[4096, 48]), "INVALID_ARGUMENT", "multiple of 32"),
    (topk(params=[4096, float("nan")]), "INVALID_ARGUMENT", "multiple of 32"),
    (topk(params=[1e9, 64]), "INVALID_ARGUMENT", "whole number"),
    (topk(nbytes=145), "INVALID_ARGUMENT", "as topk needs 144"),
    (topk(dtype="float32"), "INVALID_ARGUMENT", "needs wire dtype uint8"),
    # 4 GiB once decoded, 36 MiB on the wire
    (topk(shape=[1 << 30], nbytes=(1 << 18) * 144), "RESOURCE_EXHAUSTED", "exceeds the limit"),
    (dict(decoded_dtype="float16"), "INVALID_ARGUMENT", "without a codec"),
    (dict(decoded_dtype="pickle"), "INVALID_ARGUMENT", "unknown decoded dtype"),
    (dict(shape=[2, -3]), "INVALID_ARGUMENT", "negative dimension"),
    (dict(shape=[-2, -3]), "INVALID_ARGUMENT", "negative dimension"),
    (dict(shape=[1] * 9, nbytes=4), "INVALID_ARGUMENT", "dims exceed"),
    (dict(nbytes=25), "INVALID_ARGUMENT", "declares 25 bytes"),
    (dict(nbytes=-24), "INVALID_ARGUMENT", "declares -24 bytes"),
    (dict(dtype="float64"), "INVALID_ARGUMENT", "needs 48"),  # dtype/shape/nbytes disagree
    (dict(shape=[1024, 1024], nbytes=4 << 20), "RESOURCE_EXHAUSTED", "exceeds the limit"),
    (dict(shape=[0, 2**62, 2**62], nbytes=0), "RESOURCE_EXHAUSTED", "exceeds the limit"),
    (dict(shape=[2**32, 2**32], nbytes=0), "RESOURCE_EXHAUSTED", "exceeds the limit"),  # product overflows int64
    # int8 on the wire, float64 in memory: what we allocate counts.
    (dict(dtype="int8", shape=[256, 1024], nbytes=256 << 10, codec="int8", decoded_dtype="float64", params=[1.0]),
     "RESOURCE_EXHAUSTED", "exceeds the limit"),
    (dict(name="n" * 1000), "INVALID_ARGUMENT", "name longer"),
])
def test_bad_headers_are_refused_with_a_reason(fields: dict, code: str, words: str) -> None:
    h = header(**fields)
    with pytest.raises(WireError, match=words) as info:
        validate_header(h, LIMITS)
    assert info.value.code == getattr(grpc.StatusCode, code)
    if len(h.name) < 100:
        assert repr(h.name) in str(info.value)  # the message names the tensor


def test_half_codec_without_decoded_dtype_decodes_to_its_wire_dtype() -> None:
    h = header(dtype="float16", nbytes=12, codec="fp16")
    validate_header(h, LIMITS)
    out = decode(h, torch.ones(2, 3, dtype=torch.float16).numpy().tobytes())
    assert out.dtype == torch.float16 and torch.equal(out, torch.ones(2, 3, dtype=torch.float16))


def test_decode_checks_the_buffer_length() -> None:
    with pytest.raises(WireError, match="got 23 bytes"):
        decode(header(), bytes(23))


# --- chunk frames --------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16383, 16384, 70_000])
def test_fast_chunk_frames_are_protobuf_frames(size: int) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    wire = chunk_frame(memoryview(data))
    assert peer_pb2.Frame.FromString(wire) == peer_pb2.Frame(chunk=data)
    assert len(wire) == 8 + size  # the data starts 8-byte aligned within the frame
    assert bytes(read_chunk(wire)) == data
    assert read_chunk(peer_pb2.Frame(chunk=data).SerializeToString()) is not None  # canonical frames too


def test_only_plain_chunk_frames_take_the_fast_path() -> None:
    wire = chunk_frame(b"abc")
    trailing = wire + peer_pb2.Frame(chunk=b"xy").SerializeToString()  # protobuf: last one wins
    assert read_chunk(trailing) is None and parse_frame(trailing).chunk == b"xy"
    assert read_chunk(wire[:-1]) is None  # truncated
    assert read_chunk(peer_pb2.Frame(message=peer_pb2.MessageHeader(kind="k")).SerializeToString()) is None
    non_minimal = bytes((0x1A, 0x83, 0x00)) + b"abc"  # length 3 as a two-byte varint
    assert bytes(read_chunk(non_minimal)) == b"abc" == peer_pb2.Frame.FromString(non_minimal).chunk
    with pytest.raises(WireError, match="malformed frame"):
        parse_frame(b"\x1a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01")
    two_padding = b"\x1a\x00" + wire  # only one leading empty chunk takes the fast path
    assert read_chunk(two_padding) is None and parse_frame(two_padding).chunk == b"abc"
    assert bytes(read_chunk(b"\x1a\x00")) == b""  # an empty chunk alone is still an empty chunk


# --- hostile streams -----------------------------------------------------------------------------

def frame(**body) -> peer_pb2.Frame:
    return peer_pb2.Frame(**body)


def message_header(**fields) -> peer_pb2.Frame:
    return frame(message=peer_pb2.MessageHeader(**{"kind": "forward", "num_tensors": 1, **fields}))


GOOD_TENSOR = frame(tensor=header())


@pytest.mark.parametrize("frames, code, words", [
    ([GOOD_TENSOR], "INVALID_ARGUMENT", "expected a message header, got tensor"),
    ([frame()], "INVALID_ARGUMENT", "got empty frame"),
    ([b"\x0a\xff"], "INVALID_ARGUMENT", "malformed frame"),
    ([message_header(num_tensors=2**31 - 1)], "RESOURCE_EXHAUSTED", "2147483647 tensors"),
    ([message_header(num_tensors=-1)], "RESOURCE_EXHAUSTED", "-1 tensors"),
    ([message_header()], "INVALID_ARGUMENT", "stream ended after 0 of 1 tensors"),
    ([message_header(), frame(chunk=b"x")], "INVALID_ARGUMENT", "expected a tensor header, got chunk"),
    ([message_header(), GOOD_TENSOR, frame(chunk=bytes(10))], "INVALID_ARGUMENT", "stream ended after 10 of 24"),
    ([message_header(), GOOD_TENSOR, frame(chunk=bytes(30))], "INVALID_ARGUMENT", "more than the declared 24"),
    ([message_header(), GOOD_TENSOR, frame(chunk=b"")], "INVALID_ARGUMENT", "empty chunk"),
    ([message_header(), GOOD_TENSOR, frame()], "INVALID_ARGUMENT", "got empty frame"),
    ([message_header(), GOOD_TENSOR, GOOD_TENSOR], "INVALID_ARGUMENT", "expected data after 0 of 24 bytes, got tensor"),
    ([message_header(num_tensors=2), GOOD_TENSOR, frame(chunk=bytes(24)), GOOD_TENSOR],
     "INVALID_ARGUMENT", "appears twice"),
    ([message_header(note="n" * 5000)], "RESOURCE_EXHAUSTED", "note of 5000 chars"),
    ([message_header(tags={f"t{i}": i for i in range(100)})], "RESOURCE_EXHAUSTED", "100 tags"),
    ([message_header(tags={"k" * 300: 1})], "INVALID_ARGUMENT", "tag name longer"),
    ([message_header(kind="k" * 300)], "INVALID_ARGUMENT", "kind of 300 chars"),
])
def test_malformed_streams_are_refused_with_a_reason(frames: list, code: str, words: str) -> None:
    with pytest.raises(WireError, match=words) as info:
        list(MessageAssembler(LIMITS).messages(frames))
    assert info.value.code == getattr(grpc.StatusCode, code)


def test_oversize_chunk_and_message_are_resource_exhausted() -> None:
    big = frame(tensor=header(shape=[32 << 10], nbytes=128 << 10))
    with pytest.raises(WireError, match="chunk of 131072 bytes exceeds") as info:
        list(MessageAssembler(LIMITS).messages([message_header(), big, frame(chunk=bytes(128 << 10))]))
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    tensors = {f"t{i}": torch.zeros(200 << 10) for i in range(3)}  # 800 KiB each, 2 MiB limit per message
    with pytest.raises(WireError, match="exceed the limit of 2097152") as info:
        roundtrip(Message("m", tensors=tensors))
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_several_messages_in_one_stream() -> None:
    msgs = [Message("m", i, {"t": torch.full((i,), float(i))}) for i in range(5)]
    frames = [f for m in msgs for f in frames_of(m, chunk_bytes=8)]
    out = list(MessageAssembler(LIMITS).messages(frames))
    assert [m.id for m in out] == list(range(5))
    assert all(torch.equal(o.tensors["t"], m.tensors["t"]) for o, m in zip(out, msgs))


def test_small_frames_cross_in_one_bundle_and_large_chunks_alone() -> None:
    ring = Message("ring", 3, {"t": torch.arange(100.0)}, {"round": 1})
    frames = frames_of(ring)  # its header, its tensor's header, the data
    assert len(frames) == 3 and len(list(bundled(frames))) == 1
    (out,) = MessageAssembler(LIMITS).messages(bundled(frames))
    assert torch.equal(out.tensors["t"], ring.tensors["t"]) and out.tags == ring.tags
    both = Message("m", tensors={"small": torch.ones(2), "big": torch.arange(20_000.0)})
    frames = frames_of(both)  # ..., big's header, then its 80 kB in chunks of 64 KiB and the rest
    sent = list(bundled(frames))
    assert len(sent) == 3 and sent[1] is frames[-2] and sent[2] is frames[-1]  # a large chunk is left as it is
    (out,) = MessageAssembler(LIMITS).messages(sent)
    assert all(torch.equal(out.tensors[name], t) for name, t in both.tensors.items())


def test_a_bundle_inside_a_bundle_is_refused() -> None:
    inner = frame(bundle=peer_pb2.Bundle(frames=[message_header().SerializeToString()])).SerializeToString()
    with pytest.raises(WireError, match="a bundle of frames holds another bundle"):
        list(MessageAssembler(LIMITS).messages([frame(bundle=peer_pb2.Bundle(frames=[inner]))]))
    with pytest.raises(WireError, match="malformed frame"):
        list(MessageAssembler(LIMITS).messages([frame(bundle=peer_pb2.Bundle(frames=[b"\x1a\xff"]))]))
