"""The optimisers: AdamW (torch's fused kernel where it applies) and its warm-up + cosine
schedule, for the policy and, with PPO, the critic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from fastrl.train.config import TrainConfig
from fastrl.train.schedule import warmup_cosine

if TYPE_CHECKING:
    from fastrl.train.critic import ValueModel

__all__ = ["FUSED_ADAMW_DEVICES", "Optimizers", "build_optimizers", "fused_adamw"]


@dataclass
class Optimizers:
    """AdamW and its warm-up + cosine schedule for the policy, and for the critic when there is one."""

    optimizer: torch.optim.Optimizer
    scheduler: Any
    critic_optimizer: torch.optim.Optimizer | None = None
    critic_scheduler: Any = None


FUSED_ADAMW_DEVICES = ("cpu", "cuda")
"""Devices of torch's fused AdamW kernel."""


def fused_adamw(params: Sequence[torch.Tensor]) -> bool:
    """Whether ``params`` take torch's fused AdamW: plain (not FSDP-sharded) floating-point
    tensors on a ``FUSED_ADAMW_DEVICES`` device. The fused kernel updates each parameter and
    both moments in one in-place pass; the default CPU path (one tensor at a time) forms
    ``sqrt(exp_avg_sq)`` and its quotient as two temporaries of the parameter's size (311 MB
    at the LM head and embedding of a V = 151,936, H = 256 model, at the step's memory peak)
    and CUDA's default (foreach) forms them for every parameter at once."""
    from torch.distributed.tensor import DTensor

    return bool(params) and all(
        p.device.type in FUSED_ADAMW_DEVICES and p.is_floating_point() and not isinstance(p, DTensor) for p in params
    )


def build_optimizers(cfg: TrainConfig, policy: torch.nn.Module, critic: ValueModel | None) -> Optimizers:
    total_updates = cfg.steps * cfg.ppo_epochs * cfg.mini_batches

    def adamw(params, lr: float) -> torch.optim.Optimizer:
        params = list(params)
        return torch.optim.AdamW(params, lr=lr, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay,
                                 fused=fused_adamw(params) or None)

    def schedule(opt: torch.optim.Optimizer) -> Any:
        return warmup_cosine(opt, total_steps=total_updates, warmup_steps=cfg.warmup_steps, min_lr_ratio=cfg.min_lr_ratio)

    optimizer = adamw(policy.parameters(), cfg.lr)
    out = Optimizers(optimizer, schedule(optimizer))
    if critic is not None:
        out.critic_optimizer = adamw(critic.parameters(), cfg.critic_lr)
        out.critic_scheduler = schedule(out.critic_optimizer)
    return out

