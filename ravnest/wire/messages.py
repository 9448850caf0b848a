"""Messages: a kind, an id, integer tags and named tensors, cut into frames and put back together.

Frames travel as serialized `ravnest.v1.Frame`s. Data chunks, which are nearly all of the bytes,
are written and read without the protobuf object: a chunk frame is one tag byte, a varint length
and the raw bytes, so the sender copies each byte once into the frame and the receiver copies it
once from the frame into the tensor it is assembling.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Union

import grpc
import torch
from google.protobuf.message import DecodeError

from ravnest.v1 import peer_pb2
from ravnest.wire.codec import (WireError, WireLimits, allocate, byte_view, decoded_nbytes, encode,
                                restore, validate_header)

DEFAULT_CHUNK_BYTES = 4 << 20
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


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def chunk_frame(data: bytes | memoryview) -> bytes:
    """A serialized Frame holding `data` as its chunk, built with a single copy of the data."""
    return b"".join((bytes((_CHUNK_TAG,)), _varint(len(data)), data))


def read_chunk(data: bytes) -> memoryview | None:
    """The chunk of a serialized Frame that holds nothing but a chunk, without copying; else None.

    Anything else (headers, extra or unknown fields, odd encodings) returns None and goes through
    the protobuf parser, so this shortcut accepts exactly what the parser would read as a chunk.
    """
    if not data or data[0] != _CHUNK_TAG:
        return None
    length = shift = 0
    for pos in range(1, min(len(data), 11)):
        byte = data[pos]
        length |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return memoryview(data)[pos + 1:] if pos + 1 + length == len(data) else None
    return None


def parse_frame(data: bytes) -> peer_pb2.Frame | memoryview:
    """A serialized frame: a memoryview for a data chunk, a Frame for anything else."""
    chunk = read_chunk(data)
    if chunk is not None:
        return chunk
    try:
        return peer_pb2.Frame.FromString(data)
    except DecodeError:
        raise WireError(f"malformed frame of {len(data)} bytes") from None


def prepare_message(msg: Message, codec: str = "") -> list[tuple[bytes, memoryview | None]]:
    """Encode a message up to its chunks: [(serialized header frame, bytes of its tensor or None)].

    Bad input (unknown codec, unsupported dtype, out-of-range tag) raises ValueError/TypeError here.
    A raw-codec view aliases the caller's tensor: chunk it before the tensor changes.
    """
    parts: list[tuple[bytes, memoryview | None]] = [(peer_pb2.Frame(message=peer_pb2.MessageHeader(
        kind=msg.kind, id=msg.id, tags=msg.tags, num_tensors=len(msg.tensors), note=msg.note,
    )).SerializeToString(), None)]
    for name, tensor in msg.tensors.items():
        header, view = encode(name, tensor, codec)
        parts.append((peer_pb2.Frame(tensor=header).SerializeToString(), view))
    return parts


def chunked_frames(parts: list[tuple[bytes, memoryview | None]],
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """The serialized frames of a prepared message, data cut into chunks as they are consumed."""
    for header, view in parts:
        yield header
        for start in range(0, len(view or b""), chunk_bytes):
            yield chunk_frame(view[start:start + chunk_bytes])


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

    def __init__(self, limits: WireLimits = WireLimits()):
        self.limits = limits

    def messages(self, frames: Iterable[FrameLike]) -> Iterator[Message]:
        frames = iter(frames)
        while True:
            body, value = self._next(frames)
            if body == _END:
                return
            if body != "message":
                raise WireError(f"stream out of order: expected a message header, got {body}")
            yield self._read_message(value, frames)

    @staticmethod
    def _next(frames: Iterator[FrameLike]) -> tuple[str, object]:
        """(body kind, value) of the next frame: "message", "tensor", "chunk", "empty frame" or _END."""
        item = next(frames, None)
        if item is None:
            return _END, None
        if not isinstance(item, peer_pb2.Frame):
            item = parse_frame(item)
            if isinstance(item, memoryview):
                return "chunk", item
        body = item.WhichOneof("body")
        if body is None:
            return "empty frame", None
        value = getattr(item, body)
        return body, memoryview(value) if body == "chunk" else value

    def _read_message(self, mh: peer_pb2.MessageHeader, frames: Iterator[FrameLike]) -> Message:
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
        total = 0
        for _ in range(mh.num_tensors):
            body, th = self._next(frames)
            if body == _END:
                raise WireError(f"{where}: stream ended after {len(msg.tensors)} of {mh.num_tensors} tensors")
            if body != "tensor":
                raise WireError(f"{where}: expected a tensor header, got {body}")
            validate_header(th, limits)
            if th.name in msg.tensors:
                raise WireError(f"{where}: tensor {th.name!r} appears twice")
            total += decoded_nbytes(th)
            if total > limits.max_message_bytes:
                raise WireError(f"{where}: {total} bytes exceed the limit of {limits.max_message_bytes}",
                                grpc.StatusCode.RESOURCE_EXHAUSTED)
            msg.tensors[th.name] = restore(th, self._read_tensor(th, frames))
        return msg

    def _read_tensor(self, th: peer_pb2.TensorHeader, frames: Iterator[FrameLike]) -> torch.Tensor:
        """Copy the chunks straight into a tensor allocated from the validated header."""
        tensor = allocate(th)
        dest = byte_view(tensor)
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
            dest[filled:filled + n] = chunk
            filled += n
        return tensor
