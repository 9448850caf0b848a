"""AccumAdam and AccumAdamW: Adam whose moments advance with the gradient averaged over A steps.

In decentralized training ("From promise to practice", arXiv 2410.11998) each replica's gradients
are noisy, and Adam's second moment, estimated from them one step at a time, is noisier still.
Here the parameters move every step, but the moments advance once every A steps (default 4), with
the mean gradient of those A steps:

    every step t:          s += g_t                              (s: the window's gradient sum)
    when t is a multiple of A:  g = s / A;  s = 0;  k += 1
                           m = b1 m + (1 - b1) g
                           v = b2 v + (1 - b2) g^2
    every step t, once k >= 1:
                           x -= lr * (m / (1 - b1^k)) / (sqrt(v / (1 - b2^k)) + eps)

so before the first window is complete the parameters do not move (no moments yet). AccumAdamW
also decays the weights every step, decoupled from the gradient: x -= lr * weight_decay * x;
AccumAdam adds weight_decay * x to the gradient instead, as Adam does. With A = 1 both are Adam and
AdamW exactly.
"""
from __future__ import annotations

from typing import Iterable

import torch


class AccumAdam(torch.optim.Optimizer):
    """See the module docstring. `accumulation` is A, the steps per moment update."""

    decoupled = False

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 accumulation: int = 4):
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError("lr, eps and weight_decay must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if int(accumulation) != accumulation or accumulation < 1:
            raise ValueError(f"accumulation must be a whole number >= 1, got {accumulation}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      accumulation=int(accumulation)))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            decay, window = group["weight_decay"], group["accumulation"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros(())
                    state["moment_steps"] = torch.zeros(())
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                    state["grad_sum"] = torch.zeros_like(param)
                if decay and self.decoupled:
                    param.mul_(1 - lr * decay)
                elif decay:
                    grad = grad.add(param, alpha=decay)
                state["step"] += 1
                state["grad_sum"].add_(grad)
                if int(state["step"]) % window == 0:
                    mean = state["grad_sum"].div_(window)
                    state["exp_avg"].lerp_(mean, 1 - beta1)
                    state["exp_avg_sq"].mul_(beta2).addcmul_(mean, mean, value=1 - beta2)
                    state["grad_sum"].zero_()
                    state["moment_steps"] += 1
                k = int(state["moment_steps"])
                if k == 0:
                    continue
                denominator = (state["exp_avg_sq"] / (1 - beta2 ** k)).sqrt_().add_(eps)
                param.addcdiv_(state["exp_avg"], denominator, value=-lr / (1 - beta1 ** k))
        return loss


class AccumAdamW(AccumAdam):
    """AccumAdam with decoupled weight decay (as AdamW), 0.01 by default."""

    decoupled = True

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 accumulation: int = 4):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, accumulation=accumulation)


OPTIMIZERS = {"AccumAdam": AccumAdam, "AccumAdamW": AccumAdamW}
