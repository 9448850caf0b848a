"""AccumAdam / AccumAdamW against a hand-computed sequence, and against Adam / AdamW with A = 1."""
from __future__ import annotations

import pytest
import torch

from ravnest.pipeline import build_optimizer
from ravnest.pipeline.accum_adam import AccumAdam, AccumAdamW
from ravnest.spec import OptimizerRef


def run(optimizer_class, grads: list[float], **kwargs) -> list[float]:
    x = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    optimizer = optimizer_class([x], **kwargs)
    trajectory = []
    for g in grads:
        x.grad = torch.tensor([g], dtype=torch.float64)
        optimizer.step()
        trajectory.append(x.item())
    return trajectory


def test_moments_advance_every_a_steps_with_the_mean_gradient_and_parameters_move_every_step() -> None:
    # A = 2, b1 = b2 = 0.5, eps = 0, lr = 0.1, gradients 1, 3, 0, 2:
    # t=1: window sum 1, no moments yet: x stays 1
    # t=2: mean 2 -> m = 1, v = 2, k = 1; m^ = 2, v^ = 4: x -= 0.1 * 2 / 2 -> 0.9
    # t=3: window sum 0, same moments: x -> 0.8
    # t=4: mean 1 -> m = 1, v = 1.5, k = 2; m^ = 4/3, v^ = 2: x -= 0.1 * (4/3) / sqrt(2)
    got = run(AccumAdam, [1, 3, 0, 2], lr=0.1, betas=(0.5, 0.5), eps=0.0, accumulation=2)
    assert got == pytest.approx([1.0, 0.9, 0.8, 0.8 - 0.1 * (4 / 3) / 2 ** 0.5], abs=1e-12)


def test_accum_adamw_decays_every_step_decoupled_from_the_gradient() -> None:
    got = run(AccumAdamW, [1, 3], lr=0.1, betas=(0.5, 0.5), eps=0.0, accumulation=2, weight_decay=0.5)
    # t=1: x = 1 * (1 - 0.05) = 0.95, no moments; t=2: x = 0.95 * 0.95 - 0.1 * 2 / 2
    assert got == pytest.approx([0.95, 0.95 * 0.95 - 0.1], abs=1e-12)


@pytest.mark.parametrize("ours,theirs", [(AccumAdam, torch.optim.Adam), (AccumAdamW, torch.optim.AdamW)])
def test_with_a_window_of_one_it_is_adam(ours, theirs) -> None:
    torch.manual_seed(0)
    grads = torch.randn(20).tolist()
    assert run(ours, grads, lr=0.01, weight_decay=0.1, accumulation=1) == \
        pytest.approx(run(theirs, grads, lr=0.01, weight_decay=0.1), rel=1e-9)


def test_chosen_by_name_in_a_job_and_bad_settings_refused() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert isinstance(build_optimizer(params, OptimizerRef(name="AccumAdamW", kwargs={"accumulation": 8})),
                      AccumAdamW)
    with pytest.raises(ValueError, match="accumulation must be a whole number >= 1"):
        build_optimizer(params, OptimizerRef(name="AccumAdam", kwargs={"accumulation": 0}))
