"""The single-process answer a 2-stage pipeline with K = 2 must reproduce: the same arithmetic, done
step by step in one process, so that what the pipeline learns can be told apart from how it runs.

Micro-batch m runs stage 1 on weight version m and stage 0 on
- "sync": version m (synchronous training: the single process),
- "stale": version m - 1 (the pipeline with `staleness: none`),
- "predict": 2 w_{m-1} - w_{m-2}, version m - 1 extrapolated one update on (`staleness: predict`;
  version 0 while there is no earlier one),
- "predict2": 3 w_{m-1} - 3 w_{m-2} + w_{m-3}, the same with the change of the update extrapolated too
  (`staleness: predict2`; first order while there are only two earlier versions),
and both stages apply its gradient as update m -> m + 1.
"""
from __future__ import annotations

from collections import deque

import torch
from torch.func import functional_call

from ravnest.data import load_dataset
from ravnest.models import build_model
from ravnest.pipeline.optim import StageOptimizer
from ravnest.spec import JobSpec

FORWARD_WEIGHTS = ("sync", "stale", "predict", "predict2")


def two_stage_reference(job: JobSpec, cut: int, forward_weights: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """(the weights after `job.training.steps` updates, the loss of every micro-batch) of blocks [0, cut)
    and [cut, end) trained as above (one micro-batch per update)."""
    if forward_weights not in FORWARD_WEIGHTS:
        raise ValueError(f"forward_weights must be one of {FORWARD_WEIGHTS}, got {forward_weights!r}")
    training = job.training
    spec = build_model(job.model.name, job.model.config)
    stages = [spec.blocks(0, cut, seed=training.seed), spec.blocks(cut, seed=training.seed)]
    optimizers = [StageOptimizer(stage.parameters(), training) for stage in stages]
    batches = load_dataset(job.dataset).shard(0, 1).batches(training.batch_size, seed=training.seed)
    versions: deque[dict[str, torch.Tensor]] = deque(maxlen=4)  # stage 0's weights, newest last
    losses = []
    for m in range(training.steps):
        versions.append({k: p.detach().clone() for k, p in stages[0].named_parameters()})
        if forward_weights == "sync" or m == 0:
            weights = versions[-1]
        elif forward_weights == "stale" or m == 1:
            weights = versions[-2]
        elif forward_weights == "predict" or m == 2:
            weights = {k: 2 * versions[-2][k] - versions[-3][k] for k in versions[-1]}
        else:
            weights = {k: 3 * versions[-2][k] - 3 * versions[-3][k] + versions[-4][k] for k in versions[-1]}
        weights = {k: w.clone().requires_grad_(True) for k, w in weights.items()}
        x, y = next(batches)
        loss = spec.loss(stages[1](functional_call(stages[0], weights, (x,))), y)
        loss.backward()
        losses.append(float(loss.detach()))
        for k, p in stages[0].named_parameters():
            p.grad = weights[k].grad
        for optimizer in optimizers:
            optimizer.micro_batch_done()
    return {k: v.detach() for stage in stages for k, v in stage.state_dict().items()}, losses
