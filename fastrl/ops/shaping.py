"""Reward shaping: a step's outcome rewards placed on the token grid, with the KL-in-reward
penalty (``kl_in_reward``). Specification: ``fastrl/reference/shaping.py``.

The outcome of a sequence is earned at its last completion token (PPO's per-token rewards);
with a KL term each token also pays ``kl_coef * KL_t``; a group estimator sees the sequence
sum instead. ``token_kl`` is the per-token KL estimate between the behaviour and reference
policies (``kl_penalty``), 0 outside the mask.
"""

from __future__ import annotations

import torch

__all__ = ["sequence_rewards", "token_rewards"]


def token_rewards(
    outcome: torch.Tensor, mask: torch.Tensor, *, token_kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """``[B, T]`` fp32: ``outcome[b]`` at the last masked-in token of row ``b``, minus
    ``kl_coef * token_kl`` everywhere when ``token_kl`` is given."""
    if outcome.dim() != 1 or mask.dim() != 2 or outcome.shape[0] != mask.shape[0]:
        raise ValueError(f"outcome must be [B] and mask [B, T], got {tuple(outcome.shape)} and {tuple(mask.shape)}")
    if token_kl is not None and token_kl.shape != mask.shape:
        raise ValueError(f"token_kl must have the mask's shape {tuple(mask.shape)}, got {tuple(token_kl.shape)}")
    B, T = mask.shape
    rewards = torch.zeros(B, T, device=mask.device)
    last = (mask.cumsum(1) == mask.sum(1, keepdim=True)) & (mask > 0)
    rewards[last] = outcome[last.any(1)]
    if token_kl is not None:
        rewards = rewards - kl_coef * token_kl
    return rewards


def sequence_rewards(outcome: torch.Tensor, *, token_kl: torch.Tensor | None = None, kl_coef: float = 0.0) -> torch.Tensor:
    """``[B]``: ``outcome - kl_coef * token_kl.sum(1)`` (``outcome`` itself without ``token_kl``)."""
    if token_kl is None:
        return outcome
    if token_kl.dim() != 2 or token_kl.shape[0] != outcome.shape[0]:
        raise ValueError(f"token_kl must be [B, T] with B = {outcome.shape[0]}, got {tuple(token_kl.shape)}")
    return outcome - kl_coef * token_kl.sum(1)
