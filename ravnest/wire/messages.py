"""Messages: a kind, an id, integer tags and named tensors, cut into frames and put back together."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

import grpc
import torch

from ravnest.v1 import peer_pb2
from ravnest.wire.codec import WireError, WireLimits, decode, encode, validate_header

DEFAULT_CHUNK_BYTES = 2 << 20


@dataclass
class Message:
    kind: str
    id: int = 0
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    tags: dict[str, int] = field(default_factory=dict)
    note: str = ""


def message_frames(msg: Message, codec: str = "", chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                   ) -> Iterator[peer_pb2.Frame]:
    """The frames of one message: its header, then per tensor a header and its byte chunks.

    Tensors are encoded one at a time, so a message never holds two encoded copies at once.
    """
    yield peer_pb2.Frame(message=peer_pb2.MessageHeader(
        kind=msg.kind, id=msg.id, tags=msg.tags, num_tensors=len(msg.tensors), note=msg.note))
    for name, tensor in msg.tensors.items():
        header, view = encode(name, tensor, codec)
        yield peer_pb2.Frame(tensor=header)
        for start in range(0, len(view), chunk_bytes):
            yield peer_pb2.Frame(chunk=bytes(view[start:start + chunk_bytes]))


class MessageAssembler:
    """Turns a stream of frames back into Messages, validating everything before allocating."""

    def __init__(self, limits: WireLimits = WireLimits()):
        self.limits = limits

    def messages(self, frames: Iterable[peer_pb2.Frame]) -> Iterator[Message]:
        frames = iter(frames)
        for frame in frames:
            if frame.WhichOneof("body") != "message":
                raise WireError("stream out of order: expected a message header")
            yield self._read_message(frame.message, frames)

    def _read_message(self, mh: peer_pb2.MessageHeader, frames: Iterator[peer_pb2.Frame]) -> Message:
        if not 0 <= mh.num_tensors <= self.limits.max_tensors_per_message:
            raise WireError(f"message {mh.kind!r}: {mh.num_tensors} tensors, limit "
                            f"{self.limits.max_tensors_per_message}", grpc.StatusCode.RESOURCE_EXHAUSTED)
        msg = Message(kind=mh.kind, id=mh.id, tags=dict(mh.tags), note=mh.note)
        total = 0
        for _ in range(mh.num_tensors):
            frame = next(frames, None)
            if frame is None:
                raise WireError(f"message {mh.kind!r}: stream ended before all tensors arrived")
            if frame.WhichOneof("body") != "tensor":
                raise WireError(f"message {mh.kind!r}: expected a tensor header")
            th = frame.tensor
            validate_header(th, self.limits)
            total += th.nbytes
            if total > self.limits.max_message_bytes:
                raise WireError(f"message {mh.kind!r}: {total} bytes exceed the limit of "
                                f"{self.limits.max_message_bytes}", grpc.StatusCode.RESOURCE_EXHAUSTED)
            if th.name in msg.tensors:
                raise WireError(f"message {mh.kind!r}: tensor {th.name!r} appears twice")
            msg.tensors[th.name] = decode(th, self._read_bytes(th, frames))
        return msg

    def _read_bytes(self, th: peer_pb2.TensorHeader, frames: Iterator[peer_pb2.Frame]) -> bytearray:
        buffer = bytearray(th.nbytes)
        filled = 0
        while filled < th.nbytes:
            frame = next(frames, None)
            if frame is None:
                raise WireError(f"tensor {th.name!r}: stream ended after {filled} of {th.nbytes} bytes")
            if frame.WhichOneof("body") != "chunk":
                raise WireError(f"tensor {th.name!r}: expected data after {filled} of {th.nbytes} bytes")
            n = len(frame.chunk)
            if n > self.limits.max_chunk_bytes:
                raise WireError(f"tensor {th.name!r}: chunk of {n} bytes exceeds the limit of "
                                f"{self.limits.max_chunk_bytes}", grpc.StatusCode.RESOURCE_EXHAUSTED)
            if filled + n > th.nbytes:
                raise WireError(f"tensor {th.name!r}: more bytes than the declared {th.nbytes}")
            buffer[filled:filled + n] = frame.chunk
            filled += n
        return buffer
