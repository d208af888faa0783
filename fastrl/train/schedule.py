"""Learning-rate schedule and the adaptive KL controller."""

from __future__ import annotations

import math

import torch


def warmup_cosine(optimizer: torch.optim.Optimizer, *, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up from 0 over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr``
    at ``total_steps`` (optimizer steps)."""

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class AdaptiveKLController:
    """Proportional control of the KL weight beta toward a target (Ziegler et al. 2019,
    arXiv:1909.08593, eq. 2):

        e     = clip(KL / target - 1, -0.2, 0.2)
        beta <- beta * (1 + e * n / horizon)

    ``KL`` is the batch mean of each sequence's summed per-token KL estimate, ``n`` the
    number of sequences in the batch. ``target=None`` keeps beta fixed.
    """

    def __init__(self, init_coef: float, *, target: float | None, horizon: int):
        self.value = float(init_coef)
        self.target = target
        self.horizon = max(1, int(horizon))

    def update(self, observed_kl: float, n_samples: int) -> float:
        if self.target is not None and math.isfinite(observed_kl):
            error = min(max(observed_kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_samples / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
