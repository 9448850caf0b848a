"""The single-process answer the ring must reproduce: a plain element-wise mean."""
from __future__ import annotations

from typing import Mapping

import torch


def reference_mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Element-wise fp32 mean of equally shaped tensors."""
    return torch.stack([t.detach().float() for t in tensors]).mean(dim=0)


def reference_average(states: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Mean of every floating-point entry over replicas' state dicts (keys of the first one);
    integer entries are taken from the first replica, as averaging leaves them alone."""
    return {key: reference_mean([s[key] for s in states]) if t.is_floating_point() else t.clone()
            for key, t in states[0].items()}
