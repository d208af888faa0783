"""Rollout corrections: how the sampler's log-probs enter the loss (``TrainConfig.rollout_correction``).

The sampler's log-probs (``Experience.sampler_logp``) differ from the trainer's because of
numerics (a vLLM engine, bf16 kernels) or because the sampler runs an older policy
(``async_steps``). Each mode is one entry of ``ROLLOUT_CORRECTIONS``: whether the trainer
recomputes its own log-probs of the rollout before the update, and which of the three
log-prob tensors the loss (``fastrl.ops.policy_loss``) takes in which role:

- ``none``: the sampler's log-probs are not used; the ratio is against the trainer's policy
  at the start of the update (recomputed, or the current log-probs detached when the update
  is exactly on-policy).
- ``is``: truncated importance sampling (Yao et al. 2025): the ratio against the recomputed
  trainer log-probs, the weight ``min(exp(old - sampler), is_cap)``.
- ``bypass``: the sampler's log-probs are the old log-probs (no trainer pass); on a stale
  sampler this is the "naive PPO" baseline of AReaL (clipping against the behaviour policy).
- ``decoupled``: decoupled PPO (AReaL, Fu et al. 2025, arXiv 2505.24298): the sampler is the
  behaviour policy, the proximal policy is the trainer's at the start of the update
  (recomputed only when the update is not on-policy: otherwise the current log-probs,
  detached), ratio and clip against the proximal, the behaviour weight
  ``min(exp(proximal - sampler), is_cap)`` (``policy_loss(..., proximal_logp=)``).

On a synchronous run ``decoupled`` computes the same loss as ``is`` (the trainer's policy at
rollout time is the proximal one) and saves the no-grad pass when the update is on-policy.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Callable, Literal

import torch

__all__ = ["ROLLOUT_CORRECTIONS", "RolloutCorrection", "RolloutCorrectionMode", "rollout_correction"]

RolloutCorrectionMode = Literal["none", "is", "bypass", "decoupled"]
"""``TrainConfig.rollout_correction``'s choices: the names of ``ROLLOUT_CORRECTIONS``."""

LossInputs = Callable[..., dict[str, torch.Tensor]]


@dataclass(frozen=True)
class RolloutCorrection:
    """A registry entry."""

    recompute: bool
    """The trainer always computes its log-probs of the rollout before the update (else only
    when the update is not on-policy or the KL is in the reward)."""
    sampler_is_old: bool
    """The sampler's log-probs stand in for the trainer's old log-probs (no trainer pass)."""
    weights: bool
    """The loss weights tokens by a sampler importance weight (``is_cap``, ``is_level`` apply)."""
    stale_ok: bool
    """Meaningful on rollouts of an older policy (``async_steps >= 1``): the loss sees the
    sampler's log-probs (``none`` ignores them, so it would not know the data is stale)."""
    loss_inputs: LossInputs
    """``(sampler=, trainer=, current=) -> policy_loss keyword arguments`` for one micro-batch:
    ``sampler`` the sampler's log-probs, ``trainer`` the trainer's old log-probs or None (not
    computed: the update is on-policy), ``current`` the log-probs being trained, detached."""


def _trainer_or_current(trainer: torch.Tensor | None, current: torch.Tensor) -> torch.Tensor:
    return trainer if trainer is not None else current


ROLLOUT_CORRECTIONS: dict[str, RolloutCorrection] = {
    "none": RolloutCorrection(
        recompute=False, sampler_is_old=False, weights=False, stale_ok=False,
        loss_inputs=lambda *, sampler, trainer, current: {"old_logp": _trainer_or_current(trainer, current)}),
    "is": RolloutCorrection(
        recompute=True, sampler_is_old=False, weights=True, stale_ok=True,
        loss_inputs=lambda *, sampler, trainer, current: {"old_logp": trainer, "rollout_logp": sampler}),
    "bypass": RolloutCorrection(
        recompute=False, sampler_is_old=True, weights=False, stale_ok=True,
        loss_inputs=lambda *, sampler, trainer, current: {"old_logp": sampler}),
    "decoupled": RolloutCorrection(
        recompute=False, sampler_is_old=False, weights=True, stale_ok=True,
        loss_inputs=lambda *, sampler, trainer, current: {
            "old_logp": sampler, "proximal_logp": _trainer_or_current(trainer, current)}),
}
"""Every rollout correction by its ``TrainConfig.rollout_correction`` name."""

assert set(typing.get_args(RolloutCorrectionMode)) == set(ROLLOUT_CORRECTIONS)


def rollout_correction(name: str) -> RolloutCorrection:
    return ROLLOUT_CORRECTIONS[name]
