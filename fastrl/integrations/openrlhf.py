"""Drop-in ``PolicyLoss`` and ``ValueLoss`` for OpenRLHF, computed by fastrl ops.

Same constructor arguments, forward signature, return values and numbers as
``openrlhf.models.loss.PolicyLoss`` / ``ValueLoss`` (OpenRLHF >= 0.11, < 0.12; tested with
0.11.2, see ``tests/integrations/test_openrlhf.py``). To switch, change the import in
``openrlhf/trainer/ray/ppo_actor.py`` / ``ppo_critic.py`` (or your own trainer)::

    from fastrl.integrations.openrlhf import PolicyLoss, ValueLoss   # was: from openrlhf.models.loss import ...

Mapping: ``policy_loss_type="ppo"`` -> ``fastrl.ops.policy_loss`` with the log-ratio clamped
to [-20, 20], clip (clip_eps_low, clip_eps_high), ``dual_clip``; ``"gspo"`` -> sequence-level
ratio (gradient through the mean, as OpenRLHF), per-sample loss. ``token_level_loss`` ->
``token-mean`` / ``seq-mean-token-mean``; ``batch_num_tokens`` / ``global_batch_size`` with
``dp_size`` -> ``global_token_count`` / ``global_seq_count`` = global count / dp_size.
The train/rollout mismatch correction (``is_correction_*``) builds OpenRLHF's per-token
coefficient (ratio, binary-KL or TV gate; token or sequence level; mask or clip) without
gradient and hands it to the loss as its importance weight. ``ValueLoss`` ->
``fastrl.ops.value_loss`` (clip around the old values, 0.5 * max of the squared errors).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

import fastrl.ops as _ops
from fastrl.config import PolicyLossConfig

__all__ = ["PolicyLoss", "SUPPORTED_OPENRLHF", "ValueLoss"]

SUPPORTED_OPENRLHF = ">=0.11,<0.12"
"""OpenRLHF releases whose loss semantics these modules reproduce (tested with 0.11.2)."""

_PPO_LOG_RATIO_CLAMP = 20.0  # OpenRLHF clamps the PPO log-ratio to [-20, 20] before exp
_PROB_CLAMP = 1e-6  # OpenRLHF's gates clamp token probabilities to [1e-6, 1 - 1e-6] before the KL / TV statistic



def _masked_mean(x: torch.Tensor, mask: Optional[torch.Tensor], dim: Optional[int] = None) -> torch.Tensor:
    """OpenRLHF's masked_mean: sum(x * mask) / sum(mask) (no epsilon)."""
    if mask is None:
        return x.mean(dim=dim)
    return (x * mask).sum(dim=dim) / mask.sum(dim=dim)


def _counts(token_level_loss: bool, dp_size: int, batch_num_tokens, global_batch_size) -> tuple[str, _ops.GlobalCounts]:
    """OpenRLHF's ``token_level_loss`` -> fastrl's ``loss_agg``, and its global counts (each
    divided by ``dp_size``: OpenRLHF multiplies the loss by it, DDP averages over ranks); the
    aggregation rule picks the count ``loss_agg`` uses."""
    def per_rank(count):
        return None if count is None else count / dp_size

    agg = "token-mean" if token_level_loss else "seq-mean-token-mean"
    return agg, _ops.GlobalCounts(tokens=per_rank(batch_num_tokens), sequences=per_rank(global_batch_size))


class PolicyLoss(nn.Module):
    """PPO / GSPO policy loss with OpenRLHF's arguments; see the module docstring."""

    def __init__(
        self,
        clip_eps_low: float = 0.2,
        clip_eps_high: float = 0.2,
        dual_clip: float = None,
        token_level_loss: bool = True,
        policy_loss_type: str = "ppo",
        is_correction_level: str = "off",
        is_correction_mode: str = "mask",
        is_correction_gating: str = "ratio",
        is_correction_threshold: list = (0.5, 5.0),
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.clip_eps_low = clip_eps_low
        self.clip_eps_high = clip_eps_high
        self.token_level_loss = token_level_loss
        self.dual_clip = dual_clip
        self.policy_loss_type = policy_loss_type
        self.is_correction_level = is_correction_level
        self.is_correction_mode = is_correction_mode
        self.is_correction_gating = is_correction_gating
        self.is_correction_threshold = is_correction_threshold
        self.backend = backend
        if policy_loss_type == "gspo":
            self.token_level_loss = False
        if policy_loss_type not in ("ppo", "gspo"):
            raise ValueError(f"Invalid policy loss type: {policy_loss_type}")
        if dual_clip is not None:
            assert dual_clip > 1.0, f"dual_clip must be > 1.0, got {dual_clip}"
        if is_correction_level not in {"off", "token", "seq"}:
            raise ValueError(f"is_correction_level must be off/token/seq, got {is_correction_level}")
        if is_correction_mode not in {"mask", "clip"}:
            raise ValueError(f"is_correction_mode must be mask/clip, got {is_correction_mode}")
        if is_correction_gating not in {"ratio", "binary_kl", "tv"}:
            raise ValueError(f"is_correction_gating must be ratio/binary_kl/tv, got {is_correction_gating}")
        if is_correction_mode == "clip" and (is_correction_level == "seq" or is_correction_gating != "ratio"):
            raise ValueError(
                "is_correction_mode=clip requires is_correction_level=token and is_correction_gating=ratio"
            )
        if is_correction_gating != "ratio" and is_correction_level != "off" and is_correction_threshold[0] > 0:
            raise ValueError(f"is_correction_gating={is_correction_gating} takes an upper bound only (a single delta)")

    def _is_coefficient(self, old_log_probs, rollout_log_probs, action_mask):
        """OpenRLHF's train/rollout correction coefficient (no gradient) and its two metrics."""
        low, high = self.is_correction_threshold
        seq_level = self.is_correction_level == "seq"
        is_log_ratio = (old_log_probs - rollout_log_probs).detach()
        token_is = is_log_ratio.exp()
        if self.is_correction_gating == "ratio":
            stat = _masked_mean(is_log_ratio, action_mask, dim=-1).unsqueeze(-1) if seq_level else is_log_ratio
            stat = stat.exp()
        else:
            p = rollout_log_probs.detach().exp().clamp(_PROB_CLAMP, 1 - _PROB_CLAMP)
            q = old_log_probs.detach().exp().clamp(_PROB_CLAMP, 1 - _PROB_CLAMP)
            if self.is_correction_gating == "binary_kl":
                stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
            else:
                stat = (p - q).abs()
            if seq_level:
                stat = _masked_mean(stat, action_mask, dim=-1).unsqueeze(-1)
        if self.is_correction_mode == "clip":
            coef = stat.clamp(min=low, max=high)
            filtered = (stat < low) | (stat > high)
        else:
            keep = (stat >= low) & (stat <= high)
            coef = torch.where(keep, token_is, 0.0)
            filtered = ~keep
        if seq_level:
            is_filter_ratio = filtered.float().mean()
        else:
            is_filter_ratio = _masked_mean(filtered.float(), action_mask, dim=None)
        vllm_kl = _masked_mean(rollout_log_probs - old_log_probs, action_mask, dim=None)
        return coef, vllm_kl, is_filter_ratio

    def forward(
        self,
        log_probs: torch.Tensor,
        old_log_probs: torch.Tensor,
        advantages: torch.Tensor,
        action_mask: Optional[torch.Tensor] = None,
        rollout_log_probs: Optional[torch.Tensor] = None,
        dp_size: int = 1,
        batch_num_tokens: Optional[float] = None,
        global_batch_size: Optional[float] = None,
    ):
        """Returns ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio)`` like OpenRLHF."""
        mask = torch.ones_like(log_probs) if action_mask is None else action_mask
        agg, counts = _counts(self.token_level_loss, dp_size, batch_num_tokens, global_batch_size)
        cfg = PolicyLossConfig(
            clip_low=self.clip_eps_low,
            clip_high=self.clip_eps_high,
            dual_clip=self.dual_clip,
            loss_agg=agg,
            ratio_level="token" if self.policy_loss_type == "ppo" else "sequence",
            log_ratio_clamp=_PPO_LOG_RATIO_CLAMP if self.policy_loss_type == "ppo" else None,
        )
        old = old_log_probs
        if self.policy_loss_type == "gspo" and self.is_correction_level != "off":
            old = rollout_log_probs  # OpenRLHF's GSPO measures the ratio against the rollout policy
        is_weight = None
        vllm_kl = is_filter_ratio = None
        if self.is_correction_level != "off" and self.policy_loss_type == "ppo":
            coef, vllm_kl, is_filter_ratio = self._is_coefficient(old_log_probs, rollout_log_probs, action_mask)
            is_weight = coef.detach().to(torch.float32).expand_as(log_probs)
        loss, metrics = _ops.policy_loss(
            log_probs, old.detach(), advantages, mask, is_weight=is_weight, config=cfg,
            global_counts=counts, backend=self.backend,
        )
        clip_ratio = metrics["clip_frac_low"] + metrics["clip_frac_high"]
        ppo_kl = _masked_mean(-(log_probs - old_log_probs).detach(), action_mask, dim=None)
        return loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio


class ValueLoss(nn.Module):
    """PPO value loss with OpenRLHF's arguments: 0.5 * agg(max((v_clip - R)^2, (v - R)^2))."""

    def __init__(self, clip_eps: float = None, token_level_loss: bool = True, backend: str = "auto") -> None:
        super().__init__()
        self.clip_eps = clip_eps
        self.token_level_loss = token_level_loss
        self.backend = backend

    def forward(
        self,
        values: torch.Tensor,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        action_mask: Optional[torch.Tensor] = None,
        dp_size: int = 1,
        batch_num_tokens: Optional[float] = None,
        global_batch_size: Optional[float] = None,
    ) -> torch.Tensor:
        mask = torch.ones_like(values) if action_mask is None else action_mask
        agg, counts = _counts(self.token_level_loss, dp_size, batch_num_tokens, global_batch_size)
        loss, _ = _ops.value_loss(
            values, old_values, returns, mask, clip=self.clip_eps, loss_agg=agg,
            global_counts=counts, backend=self.backend,
        )
        return loss
