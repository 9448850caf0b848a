"""What may cross the wire: the tensor dtypes we accept by name, and the error a malformed frame raises."""
from __future__ import annotations

import grpc
import torch

from ravnest.errors import RavnestError
from ravnest.failures import NotFinite

# Every dtype we are willing to put on the wire, by its wire name. Nothing else is accepted.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ITEMSIZES = {name: torch.empty((), dtype=dt).element_size() for name, dt in DTYPES.items()}


class WireError(RavnestError):
    """A malformed or oversized message. Carries the gRPC status the receiver answers with."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(message)
        self.code = code


class NotFiniteValues(WireError, NotFinite):
    """A peer's tensor holds NaN or infinite values: refused before it spreads into the weights."""
