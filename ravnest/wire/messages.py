"""Messages: a kind, an id, integer tags and named tensors, cut into frames and put back together.

Frames travel as serialized `ravnest.v1.Frame`s. Data chunks, which are nearly all of the bytes,
are written and read without the protobuf object: a chunk frame is an 8-byte prefix and the raw
bytes, so the sender copies each byte once into the frame and the receiver copies it once from the
frame into the tensor it is assembling, or not at all when the handler accepts read-only tensors
that share the frame's memory (`zero_copy`) and the tensor came in one chunk.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Union

import grpc
import torch
from google.protobuf.message import DecodeError

from ravnest.v1 import peer_pb2
from ravnest.wire.tensors import (ByteBudget, CodecState, WireError, WireLimits, allocate, decoded_nbytes, encode,
                                restore, validate_header, wrap)

DEFAULT_CHUNK_BYTES = 4 << 20
BUNDLE_BYTES = 64 << 10  # frames smaller than this travel together (`bundled`): a message costs per gRPC message
_CHUNK_TAG = 0x1A  # Frame.chunk: field number 3, wire type 2 (length-delimited)
_END = "end of stream"  # what MessageAssembler._next reports when the frames run out

# What a receiver reads: Frame objects, or serialized frames straight off the wire.
FrameLike = Union[peer_pb2.Frame, bytes, bytearray, memoryview]


@dataclass
class Message:
    kind: str
    id: int = 0
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    tags: dict[str, int] = field(default_factory=dict)
    note: str = ""


# A chunk frame's prefix: an empty chunk field, then the real one with a 5-byte (padded) varint length.
# Protobuf keeps the last of repeated oneof fields, so any parser reads exactly the data; the 8 bytes
# put the data 8-byte aligned in the receiver's 16-byte-aligned buffer, so it can be viewed in place.
_EMPTY_CHUNK = bytes((_CHUNK_TAG, 0))
_MAX_PADDED_LENGTH = 1 << 35


def _chunk_prefix(n: int) -> bytes:
    if not 0 <= n < _MAX_PADDED_LENGTH:
        raise ValueError(f"chunk of {n} bytes is too large for one frame")
    return _EMPTY_CHUNK + bytes((_CHUNK_TAG, (n & 0x7F) | 0x80, (n >> 7 & 0x7F) | 0x80,
                                 (n >> 14 & 0x7F) | 0x80, (n >> 21 & 0x7F) | 0x80, n >> 28))


def chunk_frame(data: bytes | memoryview) -> bytes:
    """A serialized Frame holding `data` as its chunk, built with a single copy of the data."""
    return b"".join((_chunk_prefix(len(data)), data))


def read_chunk(data: bytes | bytearray | memoryview) -> memoryview | None:
    """The chunk of a serialized Frame that holds nothing but a chunk, without copying; else None.

    Anything else (headers, extra or unknown fields, odd encodings) returns None and goes through
    the protobuf parser, so this shortcut accepts exactly what the parser would read as a chunk:
    one chunk field, optionally after one empty chunk field (which the last one supersedes).
    """
    start = 2 if len(data) > 2 and data[0] == _CHUNK_TAG and data[1] == 0 else 0
    if len(data) <= start or data[start] != _CHUNK_TAG:
        return None
    length = shift = 0
    for pos in range(start + 1, min(len(data), start + 11)):
        byte = data[pos]
        length |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return memoryview(data)[pos + 1:] if pos + 1 + length == len(data) else None
    return None


def parse_frame(data: bytes | bytearray | memoryview) -> peer_pb2.Frame | memoryview:
    """A serialized frame: a memoryview for a data chunk, a Frame for anything else."""
    chunk = read_chunk(data)
    if chunk is not None:
        return chunk
    try:
        return peer_pb2.Frame.FromString(data)
    except DecodeError:
        raise WireError(f"malformed frame of {len(data)} bytes") from None


def prepare_message(msg: Message, codec: str = "", state: CodecState | None = None,
                    ) -> list[tuple[bytes, memoryview | None]]:
    """Encode a message up to its chunks: [(serialized header frame, bytes of its tensor or None)];
    `state` is the link's for a codec that keeps some (error feedback).

    Bad input (unknown codec, unsupported dtype, out-of-range tag) raises ValueError/TypeError here.
    A raw-codec view aliases the caller's tensor: chunk it before the tensor changes.
    """
    parts: list[tuple[bytes, memoryview | None]] = [(peer_pb2.Frame(message=peer_pb2.MessageHeader(
        kind=msg.kind, id=msg.id, tags=msg.tags, num_tensors=len(msg.tensors), note=msg.note,
    )).SerializeToString(), None)]
    for name, tensor in msg.tensors.items():
        header, view = encode(name, tensor, codec, state)
        parts.append((peer_pb2.Frame(tensor=header).SerializeToString(), view))
    return parts


def chunked_frames(parts: list[tuple[bytes, memoryview | None]],
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """The serialized frames of a prepared message, data cut into chunks as they are consumed."""
    for header, view in parts:
        yield header
        if view is not None:
            for start in range(0, len(view), chunk_bytes):
                yield chunk_frame(view[start:start + chunk_bytes])


def bundled(frames: Iterable[bytes], limit: int = BUNDLE_BYTES) -> Iterator[bytes]:
    """`frames` with each run of small ones joined into one Bundle frame of at most about `limit` bytes
    (a frame alone where it is the only one of its run: a large chunk stays as it is)."""
    def joined(run: list[bytes]) -> bytes:
        return run[0] if len(run) == 1 else peer_pb2.Frame(bundle=peer_pb2.Bundle(frames=run)).SerializeToString()
    run: list[bytes] = []
    size = 0
    for frame in frames:
        if run and size + len(frame) > limit:
            yield joined(run)
            run, size = [], 0
        run.append(frame)
        size += len(frame)
    if run:
        yield joined(run)


def unbundled(frames: Iterable[FrameLike]) -> Iterator[peer_pb2.Frame | memoryview]:
    """The frames a stream carried, parsed (a Frame, or a chunk's data), each bundle's in its place."""
    for item in frames:
        frame = item if isinstance(item, peer_pb2.Frame) else parse_frame(item)
        if isinstance(frame, memoryview) or frame.WhichOneof("body") != "bundle":
            yield frame
            continue
        for inner in frame.bundle.frames:
            parsed = parse_frame(inner)
            if isinstance(parsed, peer_pb2.Frame) and parsed.WhichOneof("body") == "bundle":
                raise WireError("a bundle of frames holds another bundle")
            yield parsed


def encode_message(msg: Message, codec: str = "", chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """The serialized frames of one message: its header, then per tensor a header and its chunks."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return chunked_frames(prepare_message(msg, codec), chunk_bytes)


def message_frames(msg: Message, codec: str = "", chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                   ) -> Iterator[peer_pb2.Frame]:
    """The frames of one message as Frame objects (for tools and tests; the transport sends bytes)."""
    for data in encode_message(msg, codec, chunk_bytes):
        yield peer_pb2.Frame.FromString(data)


class MessageAssembler:
    """Turns a stream of frames back into Messages, validating everything before allocating."""

    def __init__(self, limits: WireLimits = WireLimits(), zero_copy: Callable[[str], bool] | None = None,
                 budget: ByteBudget | None = None, decode_device: torch.device | None = None):
        """`zero_copy(kind)` says whether messages of that kind may carry read-only tensors sharing the
        received frames' memory (see `Router.route`). `budget`, shared by a server's streams, bounds
        what all messages being received hold at once (a message's bytes are taken from it when its
        headers are read, given back once it is complete or its stream ends). `decode_device`: where
        codecs that decode on a device do (tensors.restore)."""
        self.limits = limits
        self.zero_copy = zero_copy
        self.budget = budget
        self.decode_device = decode_device

    def messages(self, frames: Iterable[FrameLike]) -> Iterator[Message]:
        frames = unbundled(frames)
        while True:
            body, value = self._next(frames)
            if body == _END:
                return
            if body != "message":
                raise WireError(f"stream out of order: expected a message header, got {body}")
            yield self._read_message(value, frames)

    @staticmethod
    def _next(frames: Iterator[peer_pb2.Frame | memoryview]) -> tuple[str, Any]:
        """(body kind, value) of the next frame of `unbundled`: "message", "tensor", "chunk", "empty frame"
        or _END."""
        item = next(frames, None)
        if item is None:
            return _END, None
        if isinstance(item, memoryview):
            return "chunk", item
        body = item.WhichOneof("body")
        if body is None:
            return "empty frame", None
        value = getattr(item, body)
        return body, memoryview(value) if body == "chunk" else value

    def _read_message(self, mh: peer_pb2.MessageHeader, frames: Iterator[peer_pb2.Frame | memoryview]) -> Message:
        limits = self.limits
        if len(mh.kind) > limits.max_name_chars:
            raise WireError(f"message kind of {len(mh.kind)} chars exceeds the limit of {limits.max_name_chars}")
        where = f"message {mh.kind!r} #{mh.id}"
        if not 0 <= mh.num_tensors <= limits.max_tensors_per_message:
            raise WireError(f"{where}: {mh.num_tensors} tensors, limit {limits.max_tensors_per_message}",
                            grpc.StatusCode.RESOURCE_EXHAUSTED)
        if len(mh.note) > limits.max_note_chars:
            raise WireError(f"{where}: note of {len(mh.note)} chars exceeds the limit of "
                            f"{limits.max_note_chars}", grpc.StatusCode.RESOURCE_EXHAUSTED)
        if len(mh.tags) > limits.max_tags:
            raise WireError(f"{where}: {len(mh.tags)} tags exceed the limit of {limits.max_tags}",
                            grpc.StatusCode.RESOURCE_EXHAUSTED)
        if any(len(key) > limits.max_name_chars for key in mh.tags):
            raise WireError(f"{where}: tag name longer than {limits.max_name_chars} chars")
        msg = Message(kind=mh.kind, id=mh.id, tags=dict(mh.tags), note=mh.note)
        in_place = self.zero_copy is not None and self.zero_copy(mh.kind)
        total = taken = 0  # bytes of this message so far; of those, taken from the shared budget
        try:
            for _ in range(mh.num_tensors):
                body, th = self._next(frames)
                if body == _END:
                    raise WireError(f"{where}: stream ended after {len(msg.tensors)} of {mh.num_tensors} tensors")
                if body != "tensor":
                    raise WireError(f"{where}: expected a tensor header, got {body}")
                validate_header(th, limits)
                if th.name in msg.tensors:
                    raise WireError(f"{where}: tensor {th.name!r} appears twice")
                size = decoded_nbytes(th)
                total += size
                if total > limits.max_message_bytes:
                    raise WireError(f"{where}: {total} bytes exceed the limit of {limits.max_message_bytes}",
                                    grpc.StatusCode.RESOURCE_EXHAUSTED)
                if self.budget is not None:
                    if not self.budget.take(size):
                        raise WireError(f"{where}: this node is receiving {self.budget.used} bytes already; "
                                        f"{size} more exceed its limit of {self.budget.capacity}",
                                        grpc.StatusCode.RESOURCE_EXHAUSTED)
                    taken += size
                msg.tensors[th.name] = restore(th, self._read_tensor(th, frames, in_place), self.decode_device)
        finally:  # complete (the handler owns it now) or abandoned: either way no longer being received
            if self.budget is not None:
                self.budget.give(taken)
        return msg

    def _read_tensor(self, th: peer_pb2.TensorHeader, frames: Iterator[peer_pb2.Frame | memoryview],
                     in_place: bool = False) -> torch.Tensor:
        """Copy the chunks straight into a tensor allocated from the validated header; with `in_place`,
        a tensor that arrives in one aligned chunk is instead a read-only view of that chunk."""
        tensor = dest = None
        filled = 0
        while filled < th.nbytes:
            body, chunk = self._next(frames)
            if body == _END:
                raise WireError(f"tensor {th.name!r}: stream ended after {filled} of {th.nbytes} bytes")
            if body != "chunk":
                raise WireError(f"tensor {th.name!r}: expected data after {filled} of {th.nbytes} bytes, "
                                f"got {body}")
            n = len(chunk)
            if n == 0:
                raise WireError(f"tensor {th.name!r}: empty chunk after {filled} of {th.nbytes} bytes")
            if n > self.limits.max_chunk_bytes:
                raise WireError(f"tensor {th.name!r}: chunk of {n} bytes exceeds the limit of "
                                f"{self.limits.max_chunk_bytes}", grpc.StatusCode.RESOURCE_EXHAUSTED)
            if filled + n > th.nbytes:
                raise WireError(f"tensor {th.name!r}: {filled + n} bytes, more than the declared {th.nbytes}")
            if dest is None:
                if in_place and n == th.nbytes:
                    view = wrap(th, chunk)
                    if view is not None:
                        return view
                tensor = allocate(th)
                dest = tensor.view(-1).view(torch.uint8)  # nbytes > 0 here, so never a 0-element view
            dest[filled:filled + n].copy_(torch.frombuffer(chunk, dtype=torch.uint8))
            filled += n
        return allocate(th) if tensor is None else tensor
