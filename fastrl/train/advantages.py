"""Advantages of a step's ``Experience``: a group estimator, or PPO's critic and GAE.

``estimate(exp, ...)`` fills ``exp.token_kl`` (with a reference policy), ``exp.advantages``
and, for PPO, ``exp.token_rewards``, ``exp.values`` and ``exp.returns``; it returns the
step's ``kl/...``, ``advantage/...`` and ``groups/...`` metrics. Every formula is a fastrl
op (``kl_penalty``, ``token_rewards``/``sequence_rewards``, ``gae``, ``group_advantages``,
``masked_mean_std``); batch-level statistics go through ``Ranks`` so they are the whole
batch's under torchrun.

KL in the reward (``kl_in_reward``): per token ``-beta * KL_t`` (PPO), or
``outcome - beta * sum_t KL_t`` for group estimators; ``KL_t`` is the chosen estimator
between the behaviour policy (old log-probs, or the sampler's) and the reference.

A new advantage estimator is a mode of ``group_advantages`` (``fastrl/ops/advantages.py``,
its specification in ``fastrl/reference/advantages.py``) that ``TrainConfig.advantage_mode``
and the algorithm presets name; nothing here changes.
"""

from __future__ import annotations

from typing import Callable

import torch

from fastrl.ops import gae, kl_penalty
from fastrl.ops.shaping import sequence_rewards, token_rewards
from fastrl.train.config import TrainConfig
from fastrl.train.experience import Experience

__all__ = ["MONITOR_ADVANTAGE_MODE", "estimate"]

MONITOR_ADVANTAGE_MODE = "dr_grpo"
"""PPO logs group statistics (how many prompts carry signal) from this group estimator."""


def estimate(exp: Experience, *, cfg: TrainConfig, ranks, kl_coef: float,
             critic_values: Callable[[Experience], torch.Tensor] | None = None) -> dict[str, float]:
    """Fill ``exp``'s advantages (see the module docstring). ``critic_values(exp)``: the
    critic's ``[B, T-1]`` values (PPO, ``cfg.uses_critic``)."""
    metrics: dict[str, float] = {}
    if exp.ref_logp is not None:
        behaviour = exp.old_logp if exp.old_logp is not None else exp.sampler_logp
        exp.token_kl = torch.where(exp.loss_mask > 0, kl_penalty(behaviour, exp.ref_logp, estimator=cfg.kl_estimator), 0.0)
        metrics["kl/ref_seq"] = float(ranks.sum(exp.token_kl.sum(1).sum()) / ranks.sum(exp.num_samples))
        metrics["kl/coef"] = kl_coef
    shaping_kl = exp.token_kl if cfg.kl_in_reward else None
    if cfg.uses_critic:
        exp.token_rewards = token_rewards(exp.rewards, exp.loss_mask, token_kl=shaping_kl, kl_coef=kl_coef)
        exp.values = critic_values(exp)
        whiten_here = cfg.whiten_advantages and ranks.whole_batch
        exp.advantages, exp.returns = gae(exp.token_rewards, exp.values, exp.loss_mask, gamma=cfg.gamma, lam=cfg.lam,
                                          whiten=whiten_here)
        if cfg.whiten_advantages and not whiten_here:
            exp.advantages = ranks.whiten(exp.advantages, exp.loss_mask)
        adv_stats = ranks.gather_groups(exp.rewards, exp.group_ids, mode=MONITOR_ADVANTAGE_MODE)[1]  # monitoring only
    else:
        shaped = sequence_rewards(exp.rewards, token_kl=shaping_kl, kl_coef=kl_coef)
        exp.advantages, adv_stats = ranks.gather_groups(shaped, exp.group_ids, mode=cfg.advantage_mode)
    adv = exp.advantages
    per_token = adv if adv.dim() == 2 else adv[:, None].expand_as(exp.loss_mask)
    metrics["advantage/mean"], metrics["advantage/std"] = ranks.masked_mean_std(per_token, exp.loss_mask)
    metrics["groups/frac_all_equal"] = float(adv_stats["frac_all_equal_groups"])
    metrics["groups/effective_ratio"] = float(adv_stats["effective_group_ratio"])
    return metrics
