"""What every part of the contract shares: strict models, hard bounds, and the patterns of names."""
from __future__ import annotations

import typing
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # `true` is not 1 step, "30" is not 30


# a block range: JSON has no tuples, and parsed JSON (lists) must validate as well as JSON text
BlockRange = Annotated[tuple[int, int], Field(strict=False)]


MAX_STEPS = 100_000_000  # hard bounds on what any spec may say; the coordinator's own limits are tighter
MAX_CONFIG_BYTES = 16 << 10
MAX_NESTING = 4


def plain_json(value: Any, where: str) -> Any:
    """A small, shallow JSON value (configs and kwargs): no 300-level nesting, no megabytes of it."""
    def depth(v: Any) -> int:
        if isinstance(v, dict):
            return 1 + max(map(depth, v.values()), default=0)
        if isinstance(v, list):
            return 1 + max(map(depth, v), default=0)
        return 0
    if depth(value) > MAX_NESTING:
        raise ValueError(f"{where} nests deeper than {MAX_NESTING} levels")
    if len(repr(value)) > MAX_CONFIG_BYTES:
        raise ValueError(f"{where} is longer than {MAX_CONFIG_BYTES} characters")
    return value


DATASET_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
FINGERPRINT = r"^[0-9]{1,15}:[0-9a-f]{64}$"  # "<size>:<sha256>" of an offered file (ravnest/data/proof.py)
SHA256 = r"^[0-9a-f]{64}$"
HEX_NONCE = r"^[0-9a-f]{32}$"



def field_names(model: type[BaseModel], path: list[str | int]) -> list[str]:
    """The field names of the model found at `path` inside `model` (e.g. ["training"] in a JobSpec:
    steps, batch_size, ...), or [] where the path leads to no model: for "did you mean" on a typo."""
    for part in path:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        inner = field and next((t for t in (field.annotation, *typing.get_args(field.annotation))
                                if isinstance(t, type) and issubclass(t, BaseModel)), None)
        if not inner:
            return []
        model = inner
    return list(model.model_fields)
