"""Properties of the tensor codec, the message assembler and a stage's message handlers, over inputs
hypothesis makes up: whatever a message holds comes back bit for bit; whatever bytes or messages a
peer sends, the receiver answers with a WireError (a status and a reason) or takes it, never another
exception, and never allocates beyond its limits."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ravnest.pipeline import StageRunner
from ravnest.pipeline.local import make_assignments
from ravnest.pipeline.neighbours import MESSAGE_KINDS
from ravnest.spec import JobSpec
from ravnest.v1 import peer_pb2
from ravnest.wire import Message, Router, WireError, WireLimits
from ravnest.wire.tensors import DTYPES, ByteBudget
from ravnest.wire.messages import MessageAssembler, chunk_frame, encode_message

LIMITS = WireLimits(max_tensor_bytes=1 << 16, max_message_bytes=1 << 17, max_chunk_bytes=1 << 12,
                    max_tensors_per_message=4, max_tags=4, max_note_chars=64)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)


@st.composite
def tensors(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    shape = draw(st.lists(st.integers(0, 6), max_size=3))
    count = int(np.prod(shape, dtype=np.int64))
    raw = draw(st.binary(min_size=count * torch.empty((), dtype=DTYPES[dtype]).element_size(),
                         max_size=count * torch.empty((), dtype=DTYPES[dtype]).element_size()))
    if dtype == "bool":  # only 0 and 1 are booleans
        raw = bytes(b & 1 for b in raw)
    return torch.frombuffer(bytearray(raw), dtype=DTYPES[dtype]).reshape(shape) if count else \
        torch.empty(shape, dtype=DTYPES[dtype])


messages = st.builds(
    Message, kind=names, id=st.integers(0, 2**62),
    tensors=st.dictionaries(names, tensors(), max_size=4),
    tags=st.dictionaries(names, st.integers(-2**63, 2**63 - 1), max_size=4),
    note=st.text(max_size=64))


@SETTINGS
@given(message=messages, chunk_bytes=st.integers(1, 1 << 12))
def test_any_message_comes_back_bit_for_bit(message: Message, chunk_bytes: int) -> None:
    budget = ByteBudget(1 << 20)
    (out,) = MessageAssembler(LIMITS, budget=budget).messages(encode_message(message, "", chunk_bytes))
    assert (out.kind, out.id, out.tags, out.note) == (message.kind, message.id, message.tags, message.note)
    assert out.tensors.keys() == message.tensors.keys()
    for name, tensor in message.tensors.items():
        got = out.tensors[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        assert got.reshape(-1).view(torch.uint8).tolist() == tensor.reshape(-1).view(torch.uint8).tolist()
    assert budget.used == 0  # nothing is held once the message is complete


frames = st.one_of(
    st.binary(max_size=64),  # anything at all
    st.binary(max_size=256).map(chunk_frame),  # a data chunk, in or out of place
    st.builds(lambda kind, n, note: peer_pb2.Frame(message=peer_pb2.MessageHeader(
        kind=kind, num_tensors=n, note=note)).SerializeToString(), names, st.integers(-3, 6), st.text(max_size=80)),
    st.builds(lambda name, dtype, shape, nbytes, codec, params: peer_pb2.Frame(tensor=peer_pb2.TensorHeader(
        name=name, dtype=dtype, shape=shape, nbytes=nbytes, codec=codec, decoded_dtype="float32" if codec else "",
        params=params)).SerializeToString(),
        names, st.sampled_from([*DTYPES, "complex64", ""]), st.lists(st.integers(-2, 2**40), max_size=4),
        st.integers(-1, 2**40), st.sampled_from(["", "fp16", "int8", "topk", "zip"]),
        st.lists(st.floats(width=32) | st.sampled_from([64.0, 32.0, 4096.0]), max_size=3)),
)


@SETTINGS
@given(stream=st.lists(frames, max_size=8))
def test_any_bytes_from_a_peer_give_a_wire_error_or_valid_messages(stream: list[bytes]) -> None:
    budget = ByteBudget(LIMITS.max_message_bytes)
    try:
        for message in MessageAssembler(LIMITS, budget=budget).messages(iter(stream)):
            assert sum(t.numel() * t.element_size() for t in message.tensors.values()) <= LIMITS.max_message_bytes
    except WireError as e:
        assert str(e) and e.code is not None
    assert budget.used == 0  # given back whether the stream ended well or not


def stage_router() -> Router:
    """The router of stage 1 of 2 of a small MLP on digits, as a node holds it, before it runs."""
    job = JobSpec.model_validate({"model": {"name": "mlp", "config": {"hidden": 16, "depth": 2}},
                                  "dataset": {"name": "digits"}, "training": {"steps": 5, "batch_size": 4}})
    assignment = make_assignments(job, [(0, 2), (2, 4)], ["127.0.0.1:9", "127.0.0.1:9"], "x")[1]
    router = Router(expected_kinds=MESSAGE_KINDS)
    StageRunner(assignment, router)
    return router


peer_messages = st.builds(
    Message, kind=st.sampled_from([*MESSAGE_KINDS, "ring", "bogus"]), id=st.integers(0, 3),
    tensors=st.dictionaries(st.sampled_from(["x", "y", "grad", "z"]), tensors(), max_size=3),
    tags=st.dictionaries(st.sampled_from(["final", "checkpoint_at"]), st.integers(-5, 5), max_size=2),
    note=st.text(max_size=64))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # a stage per case
@given(message=peer_messages)
def test_a_stage_answers_any_message_with_a_wire_error_or_takes_it(message: Message) -> None:
    """What a neighbour sends reaches the stage's handlers: they refuse it with a reason the stream
    turns into a status (WireError, ValueError), or queue it; nothing else escapes, nothing blocks."""
    router = stage_router()
    try:
        router(message, "ipv4:127.0.0.1:5")
    except (WireError, ValueError):
        pass
