"""fastrl implementations of verl's core algorithm functions, with verl's names and semantics.

Each function below has the name, signature and return value of its namesake in
``verl.trainer.ppo.core_algos`` and returns verl's numbers (same values and gradients up
to float rounding; ``tests/integrations/test_verl.py`` checks every one against the
installed verl on random inputs), computed by fastrl ops:

======================================================  ==============================================
verl function                                           fastrl ops
======================================================  ==============================================
``compute_gae_advantage_return``                        ``gae`` + ``masked_whiten``
``compute_grpo_outcome_advantage``                      ``group_advantages(mode="grpo" | "dr_grpo")``
``compute_rloo_outcome_advantage``                      ``group_advantages(mode="rloo")``
``compute_reinforce_plus_plus_outcome_advantage``       ``discounted_returns`` + ``masked_whiten``
(none: fastrl's turn credit, issue 19)                  ``turn_advantages(mode="gigpo" | "turn_discounted")``
``compute_policy_loss_vanilla`` (PPO, dual-clip)        ``policy_loss``
``compute_policy_loss_gspo``                            ``policy_loss`` (token ratios carrying the
                                                        sequence ratio, verl's GSPO-token gradient)
``kl_penalty`` (k1/kl, abs, k2/mse, k3/low_var_kl, +)   ``kl_penalty``
``compute_value_loss``                                  ``value_loss``
``agg_loss``                                            the aggregation rule of ``policy_loss``
======================================================  ==============================================

Use in verl (>= 0.9, < 0.10; tested with 0.9.1): call :func:`register` in every process that
computes losses or advantages (the driver and the actor/critic workers, e.g. from Ray's
``worker_process_setup_hook``), then select the fastrl versions by name::

    algorithm.adv_estimator=fastrl_grpo                  # or fastrl_rloo, fastrl_reinforce_plus_plus,
                                                         # fastrl_gigpo, fastrl_turn_discounted
    actor_rollout_ref.actor.policy_loss.loss_mode=fastrl_vanilla   # or fastrl_gspo

verl's trainer calls GAE and GRPO through ``core_algos.<name>`` directly; ``register(
replace_builtin=True)`` additionally points ``core_algos.compute_gae_advantage_return``
and ``core_algos.compute_grpo_outcome_advantage`` at the fastrl versions, so
``algorithm.adv_estimator=gae`` / ``grpo`` run on fastrl too. ``kl_penalty``, ``agg_loss``
and ``compute_value_loss`` are imported by name inside verl's workers; use them from this
module in custom code.

Turn credit for multi-turn rollouts (verl's agent loop: one row per trajectory, its
``response_mask`` 1 on the model's tokens and 0 on tool/observation tokens) has no verl
namesake: ``compute_gigpo_advantage`` and ``compute_turn_discounted_advantage`` read each
maximal run of ``response_mask == 1`` as one policy turn, turn k's reward as the sum of
``token_level_rewards`` from turn k's first token to turn k + 1's (its tokens and the
observation after it; verl puts the score on the last response token, so that is the final
turn's reward), the outcome as the row's sum (verl's score), and group by ``index`` (uid);
``algorithm.gamma`` is the discount over turns, ``norm_adv_by_std_in_grpo`` picks F_norm. GiGPO
needs the state each turn acted in: ``non_tensor_batch["anchor_keys"]`` (per row, one hashable
key per turn) when the rollout provides it, else the default, a hash of the observation tokens
before the turn (``responses`` between turn k - 1 and turn k; turn 0: the group's shared prompt).
verl passes the batch to registered estimators only for its GDPO, so :func:`register` also
wraps ``ray_trainer.compute_advantage`` to hand ``data.batch`` and ``data.non_tensor_batch``
to these two (every other estimator goes to verl's function unchanged).

Where the outputs differ from verl, it is only at masked-out positions that no verl loss
or metric reads: fastrl's advantages and returns are 0 at ``response_mask == 0`` tokens,
where verl's GAE leaves the carried-over recursion state (and whitens it). Values at
masked-in positions are verl's, including observation tokens in the middle of a response
(skipped by the recursion, as verl does).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import fastrl.ops as _ops
from fastrl.config import LOSS_AGGS, PolicyLossConfig
from fastrl.ops.aggregation import global_count_for

__all__ = [
    "SUPPORTED_VERL",
    "agg_loss",
    "compute_gae_advantage_return",
    "compute_gigpo_advantage",
    "compute_grpo_outcome_advantage",
    "compute_policy_loss_gspo",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_turn_discounted_advantage",
    "compute_value_loss",
    "kl_penalty",
    "register",
]

SUPPORTED_VERL = ">=0.9,<0.10"
"""verl releases whose semantics these functions reproduce (tested with 0.9.1)."""

_GSPO_LOG_RATIO_CLAMP = 10.0  # verl clamps the GSPO log-ratio at 10 from above
_PPO_LOG_RATIO_CLAMP = 20.0  # verl's vanilla PPO clamps the log-ratio to [-20, 20] (loss and ppo_kl metric)
_LOW_VAR_KL_CLAMP = 10.0  # verl clamps its k3 (low_var_kl) estimate to [-10, 10]
_MASKED_MEAN_EPS = 1e-8  # verl's masked_mean: sum / (count + eps)
_WHITEN_EPS = 1e-8  # verl's masked_whiten: eps inside the square root


# ----------------------------------------------------------------------------- helpers
def _group_ids(index: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``index`` (uids of any hashable type) -> int64 group ids and each sample's group size."""
    ids: dict[Any, int] = {}
    codes = [ids.setdefault(x, len(ids)) for x in np.asarray(index).tolist()]
    gid = torch.tensor(codes, dtype=torch.int64, device=device)
    size = torch.bincount(gid)[gid]
    return gid, size


def _as_float(x: Any) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


_TOKEN_SUM = "token-sum"  # verl's mode without a fastrl loss_agg of its own (token-mean with a count of 1)
_COUNT_ARGUMENT = {"tokens": "(global) batch_num_tokens", "sequences": "global_batch_size"}  # verl's names


def _global_counts(loss_agg_mode: str, dp_size: int, batch_num_tokens, global_batch_size) -> tuple[str, _ops.GlobalCounts]:
    """verl's (dp_size, batch_num_tokens, global_batch_size) -> fastrl's loss_agg and global counts.

    verl divides by the global count and multiplies by ``dp_size`` (DDP/FSDP average the
    gradients over ranks); fastrl divides by the count it is given, so the count is global/dp.
    ``token-sum`` (verl: masked sum * dp_size) is token-mean with a count of 1/dp_size. Which
    count a mode uses is fastrl's aggregation rule (``fastrl.ops.aggregation.global_count_for``);
    with ``dp_size > 1`` that count is required.
    """
    if loss_agg_mode == _TOKEN_SUM:
        return "token-mean", _ops.GlobalCounts(tokens=1.0 / dp_size)
    if loss_agg_mode not in LOSS_AGGS:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")

    def per_rank(count):
        return None if count is None else count / dp_size

    counts = _ops.GlobalCounts(tokens=per_rank(batch_num_tokens), sequences=per_rank(global_batch_size))
    field, count = global_count_for(loss_agg_mode, counts)
    if count is None and dp_size > 1:
        raise ValueError(f"{_COUNT_ARGUMENT[field]} is required when dp_size > 1")
    return loss_agg_mode, counts


def _norm_length(agg: str, loss_scale_factor: float | None, response_mask: torch.Tensor) -> float | None:
    """fastrl's (required) ``norm_length`` for verl's ``seq-mean-token-sum-norm``: verl's
    ``loss_scale_factor``, or -- as verl does without one -- the padded response length of
    this micro-batch (verl's own semantics, which fastrl no longer applies implicitly)."""
    if not agg.endswith("-norm"):
        return None
    return float(response_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's ``masked_mean``: sum over mask / (count + 1e-8)."""
    valid = torch.where(mask.bool(), x, torch.zeros_like(x))
    return (valid * mask).sum() / (mask.sum() + _MASKED_MEAN_EPS)


def _get(config: Any, name: str, default: Any = None) -> Any:
    if config is None:
        return default
    if hasattr(config, "get"):
        return config.get(name, default)
    return getattr(config, name, default)


# ----------------------------------------------------------------------------- advantages
def _outcome_advantage(mode: str, token_level_rewards, response_mask, index, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's outcome estimators: each row's score (its reward sum) against its ``index`` group's by
    ``group_advantages(mode=...)``, broadcast over the response mask; a single-member group keeps
    its raw score (under ``grpo`` divided by ``1 + epsilon``: verl's mean 0, std 1)."""
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        gid, size = _group_ids(index, scores.device)
        adv, _ = _ops.group_advantages(scores, gid, mode=mode, eps=epsilon)
        single = scores / (1.0 + epsilon) if mode == "grpo" else scores
        adv = torch.where(size == 1, single.to(adv.dtype), adv).to(scores.dtype)
        adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: torch.Tensor | float,
    lam: torch.Tensor | float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's GAE: (whitened advantages, returns), both [bs, response_length].

    Masked-out tokens (padding, or observation tokens inside a response) are skipped by the
    recursion; returns = advantages + values before whitening; advantages are whitened over
    the masked-in tokens (unbiased variance, eps 1e-8 inside the square root).
    """
    with torch.no_grad():
        adv, returns = _ops.gae(
            token_level_rewards, values, response_mask, gamma=_as_float(gamma), lam=_as_float(lam)
        )
        adv = _ops.masked_whiten(adv, response_mask, shift_mean=True, eps=_WHITEN_EPS)
    return adv, returns


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's GRPO outcome advantage: (score - mean_g) / (std_g + epsilon) (unbiased std), or
    score - mean_g with ``norm_adv_by_std_in_grpo=False`` (Dr. GRPO); broadcast over the
    response mask. A single-member group keeps its raw score (verl: mean 0, std 1).
    """
    return _outcome_advantage("grpo" if norm_adv_by_std_in_grpo else "dr_grpo", token_level_rewards, response_mask, index,
                              epsilon)


def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's RLOO: score - mean of the other members of its group; a single-member group
    keeps its raw score. Broadcast over the response mask."""
    return _outcome_advantage("rloo", token_level_rewards, response_mask, index, epsilon)


def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config: Any = None, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's REINFORCE++: discounted returns with ``config.gamma`` (masked-out tokens skipped,
    0 there), whitened over the masked-in tokens. Returns (advantages, returns)."""
    assert config is not None
    with torch.no_grad():
        returns = _ops.discounted_returns(token_level_rewards, response_mask, gamma=_as_float(config.gamma))
        adv = _ops.masked_whiten(returns, response_mask, shift_mean=True, eps=_WHITEN_EPS)
    return adv.to(token_level_rewards.dtype), returns.to(token_level_rewards.dtype)


_MIX = (-7046029254386353131, -4658895280553007687, 7640891576956012809)  # odd int64 multipliers (wrapping)
"""Constants of the observation-token hash (golden-ratio / splitmix64 multipliers as signed int64)."""
_NO_TURN = 0  # anchor key of turn 0 (the group's shared prompt): any constant; groups are per uid


def _turns(response_mask: torch.Tensor, token_level_rewards: torch.Tensor):
    """The policy turns of verl rows: turn index of each token (-1 before the first turn),
    ``num_turns [bs]``, K, and the turn rewards ``[bs, K]`` (float64)."""
    on = response_mask != 0
    starts = on & ~torch.nn.functional.pad(on[:, :-1], (1, 0), value=False)
    seg = torch.cumsum(starts.to(torch.int64), 1) - 1  # the latest turn starting at or before each token
    num_turns = starts.sum(1)
    K = max(int(num_turns.max()) if num_turns.numel() else 0, 1)
    rewards = torch.zeros(seg.shape[0], K, dtype=torch.float64, device=seg.device)
    rewards.scatter_add_(1, seg.clamp(min=0), token_level_rewards.to(torch.float64))
    return seg, on, num_turns, K, rewards


def _observation_keys(responses: torch.Tensor, on: torch.Tensor, seg: torch.Tensor, K: int) -> torch.Tensor:
    """``[bs, K]`` int64: turn k's anchor key = a hash of the observation tokens between turn
    k - 1 and turn k (their ids and offsets, mixed and summed with wrapping int64 arithmetic);
    turn 0: ``_NO_TURN``. Padding after the last turn is never an anchor."""
    T = responses.shape[1]
    pos = torch.arange(T, device=responses.device).expand_as(responses)
    last_policy = torch.cummax(torch.where(on, pos, -1), dim=1).values
    x = (responses.to(torch.int64) + 1) * _MIX[0] + (pos - last_policy) * _MIX[1]
    x = (x ^ (x >> 31)) * _MIX[2]
    gap = torch.where(~on & (seg >= 0), x, 0)
    after = torch.zeros(responses.shape[0], K, dtype=torch.int64, device=responses.device)
    after.scatter_add_(1, seg.clamp(min=0), gap)
    return torch.cat([torch.full_like(after[:, :1], _NO_TURN), after[:, :-1]], dim=1)


def _given_keys(anchor_keys: Any, K: int) -> torch.Tensor:
    """``non_tensor_batch["anchor_keys"]`` (per row, one hashable key per turn) -> ``[bs, K]`` int64."""
    from fastrl.train.advantages import state_key_hash

    rows = list(anchor_keys)
    out = torch.zeros(len(rows), K, dtype=torch.int64)
    for b, keys in enumerate(rows):  # Python objects: hashed on the host, once per turn
        keys = list(keys)[:K]
        out[b, : len(keys)] = torch.tensor([state_key_hash(k) for k in keys], dtype=torch.int64)
    return out


def _turn_estimator(mode: str, token_level_rewards, response_mask, index, epsilon, config, *, step_coef=1.0,
                    turn_coef=1.0, outcome_coef=0.0, final_turn_coef=None, batch=None, non_tensor_batch=None):
    with torch.no_grad():
        seg, on, num_turns, K, rewards = _turns(response_mask, token_level_rewards)
        gid, _ = _group_ids(index, token_level_rewards.device)
        keys = None
        if mode == "gigpo":
            given = None if non_tensor_batch is None else non_tensor_batch.get("anchor_keys")
            if given is not None:
                keys = _given_keys(given, K).to(seg.device)
            elif batch is not None and "responses" in batch.keys():
                keys = _observation_keys(batch["responses"], on, seg, K)
            else:
                raise ValueError("fastrl_gigpo needs the state each turn acted in: non_tensor_batch['anchor_keys'] or "
                                 "batch['responses'] (call fastrl.integrations.verl.register() so verl's trainer passes them)")
        norm = "std" if _get(config, "norm_adv_by_std_in_grpo", True) else "none"
        adv, _ = _ops.turn_advantages(
            torch.where(on, seg, -1), response_mask, rewards, num_turns, token_level_rewards.sum(-1).to(torch.float64),
            gid, mode=mode, state_keys=keys, gamma=_as_float(_get(config, "gamma", 1.0)), step_coef=step_coef,
            turn_coef=turn_coef, outcome_coef=outcome_coef, final_turn_coef=final_turn_coef, norm=norm, eps=epsilon,
        )
        adv = adv.to(token_level_rewards.dtype)
    return adv, adv


def compute_gigpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    *,
    step_coef: float = 1.0,
    batch: Any = None,
    non_tensor_batch: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GiGPO (arXiv:2505.10978) on verl's multi-turn rows (see the module docstring): the
    episode advantage of the row's score plus ``step_coef`` (omega) times the step advantage of
    each turn's discounted return within its (uid, anchor state) group. Returns (advantages,
    advantages) ``[bs, response_length]``, 0 off the response mask."""
    return _turn_estimator("gigpo", token_level_rewards, response_mask, index, epsilon, config, step_coef=step_coef,
                           batch=batch, non_tensor_batch=non_tensor_batch)


def compute_turn_discounted_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    config: Any = None,
    *,
    turn_coef: float = 1.0,
    outcome_coef: float = 0.0,
    final_turn_coef: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn-discounted advantages on verl's multi-turn rows: each turn's discounted return
    normalised within its (uid, turn index) group, times ``turn_coef`` (``final_turn_coef`` on
    a row's final turn; None: ``turn_coef``), plus ``outcome_coef`` times the episode advantage
    (MT-GRPO: ``algorithm.gamma=0``, ``outcome_coef=1``, ``turn_coef=lambda``,
    ``final_turn_coef=0``). Returns (advantages, advantages), 0 off the response mask."""
    return _turn_estimator("turn_discounted", token_level_rewards, response_mask, index, epsilon, config,
                           turn_coef=turn_coef, outcome_coef=outcome_coef, final_turn_coef=final_turn_coef)


# ----------------------------------------------------------------------------- losses
def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
    loss_scale_factor: int | None = None,
) -> torch.Tensor:
    """verl's ``agg_loss`` with fastrl's aggregation rule (``PolicyLossConfig.loss_agg``).

    Plain tensor sums (there is nothing to fuse); the denominators are those fastrl's loss
    ops use, mapped from verl's global batch information.
    """
    agg, counts = _global_counts(loss_agg_mode, dp_size, batch_num_tokens, global_batch_size)
    return _ops.aggregate_loss(loss_mat, loss_mask, loss_agg=agg, norm_length=_norm_length(agg, loss_scale_factor, loss_mask),
                               global_counts=counts)


def _policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, weights, cfg):
    info = dict(_get(config, "global_batch_info", None) or {})
    agg, counts = _global_counts(
        loss_agg_mode, info.get("dp_size", 1), info.get("batch_num_tokens"), info.get("global_batch_size")
    )
    cfg = cfg.replace(loss_agg=agg, norm_length=_norm_length(agg, info.get("loss_scale_factor"), response_mask))
    return _ops.policy_loss(
        log_prob, old_log_prob, advantages, response_mask, is_weight=None if weights is None else weights.detach(),
        config=cfg,
        global_counts=counts,
    )


def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's PPO clipped loss: log-ratio clamped to [-20, 20], clip (clip_ratio_low,
    clip_ratio_high), dual-clip ``clip_ratio_c`` (default 3) for negative advantages, optional
    rollout IS weights on the policy term, ``agg_loss`` with ``config.global_batch_info``.

    Returns ``(pg_loss, {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"})``
    with float metrics, like verl.
    """
    assert config is not None
    clip_ratio = _get(config, "clip_ratio")
    low = _get(config, "clip_ratio_low") if _get(config, "clip_ratio_low") is not None else clip_ratio
    high = _get(config, "clip_ratio_high") if _get(config, "clip_ratio_high") is not None else clip_ratio
    clip_c = _get(config, "clip_ratio_c", 3.0)
    assert clip_c > 1.0, f"The lower bound of the clip_ratio_c for dual-clip PPO should be greater than 1.0, got {clip_c}"
    cfg = PolicyLossConfig(clip_low=low, clip_high=high, dual_clip=clip_c, log_ratio_clamp=_PPO_LOG_RATIO_CLAMP)
    loss, m = _policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                           rollout_is_weights, cfg)
    with torch.no_grad():
        neg_kl = torch.clamp(log_prob.detach().float() - old_log_prob.float(), min=-_PPO_LOG_RATIO_CLAMP, max=_PPO_LOG_RATIO_CLAMP)
        ppo_kl = _masked_mean(-neg_kl, response_mask)
    metrics = {
        "actor/pg_clipfrac": (m["clip_frac_low"] + m["clip_frac_high"]).item(),
        "actor/ppo_kl": ppo_kl.item(),
        "actor/pg_clipfrac_lower": m["dual_clip_frac"].item(),
    }
    return loss, metrics


def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's GSPO (GSPO-token form): every token's ratio has the value of its sequence's
    ratio s = exp(mean_t(logp - old_logp)) and the gradient s * grad(logp_t)
    (``log s_t = sg[log s] + logp_t - sg[logp_t]``, clamped at 10 from above); clip
    (clip_ratio_low, clip_ratio_high), no dual clip.

    fastrl's token-level ratio gets exactly that when its ``old_logp`` is
    ``sg[logp_t] - sg[log s]``. verl clamps log s_t only from above; fastrl's
    ``log_ratio_clamp`` is symmetric, so rows with log s < -10 (s < 4.5e-5) differ by at most
    |A| * 4.5e-5 per token.
    """
    assert config is not None
    low = _get(config, "clip_ratio_low") if _get(config, "clip_ratio_low") is not None else _get(config, "clip_ratio")
    high = _get(config, "clip_ratio_high") if _get(config, "clip_ratio_high") is not None else _get(config, "clip_ratio")
    with torch.no_grad():
        m = response_mask.to(torch.float32)
        neg_kl = log_prob.detach().float() - old_log_prob.float()
        seq = (neg_kl * m).sum(-1) / m.sum(-1).clamp(min=1)
        old_token = log_prob.detach().float() - seq.unsqueeze(-1)
    cfg = PolicyLossConfig(clip_low=low, clip_high=high, log_ratio_clamp=_GSPO_LOG_RATIO_CLAMP)
    loss, met = _policy_loss(
        old_token, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights, cfg
    )
    with torch.no_grad():
        ppo_kl = _masked_mean(-neg_kl, response_mask)
    metrics = {
        "actor/pg_clipfrac": (met["clip_frac_low"] + met["clip_frac_high"]).item(),
        "actor/ppo_kl": ppo_kl.item(),
        "actor/pg_clipfrac_lower": 0.0,
    }
    return loss, metrics


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """verl's KL estimators: ``kl``/``k1`` logp - ref, ``abs`` |logp - ref|, ``mse``/``k2``
    (logp - ref)^2 / 2, ``low_var_kl``/``k3`` exp(ref - logp) - (ref - logp) - 1 clamped to
    [-10, 10]. A ``+`` suffix (``k1+``, ``k3+``, ...) keeps the value and takes the gradient of
    k2 (straight-through)."""
    base = kl_penalty[:-1] if kl_penalty.endswith("+") else kl_penalty
    forward = _kl_forward(logprob, ref_logprob, base)
    if not kl_penalty.endswith("+") or kl_penalty in ("mse", "k2"):
        return forward
    backward = _ops.kl_penalty(logprob, ref_logprob, estimator="k2")
    return backward - backward.detach() + forward.detach()


def _kl_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, name: str) -> torch.Tensor:
    if name in ("kl", "k1"):
        return _ops.kl_penalty(logprob, ref_logprob, estimator="k1")
    if name == "abs":
        return _ops.kl_penalty(logprob, ref_logprob, estimator="k1").abs()
    if name in ("mse", "k2"):
        return _ops.kl_penalty(logprob, ref_logprob, estimator="k2")
    if name in ("low_var_kl", "k3"):
        # verl also clamps ref - logp to [-20, 20] before exp; outside that range k3 exceeds 10 and is
        # clamped to 10 (zero gradient) either way, so clamping the estimate is enough.
        return _ops.kl_penalty(logprob, ref_logprob, estimator="k3", clamp=_LOW_VAR_KL_CLAMP)
    raise NotImplementedError


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
    loss_scale_factor: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's clipped value loss: 0.5 * agg(max((v - R)^2, (clip(v, v_old +- c) - R)^2)).
    Returns ``(vf_loss, vf_clipfrac)``."""
    agg, counts = _global_counts(loss_agg_mode, dp_size, batch_num_tokens, global_batch_size)
    loss, metrics = _ops.value_loss(
        vpreds, values, returns, response_mask, clip=cliprange_value, loss_agg=agg,
        norm_length=_norm_length(agg, loss_scale_factor, response_mask),
        global_counts=counts,
    )
    return loss, metrics["vf_clip_frac"]


# ----------------------------------------------------------------------------- registration
def _fastrl_grpo(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True,
                 config=None, **kwargs):
    norm = _get(config, "norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo)
    return compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon, norm, config)


ADV_ESTIMATORS = {
    "fastrl_grpo": _fastrl_grpo,
    "fastrl_rloo": compute_rloo_outcome_advantage,
    "fastrl_reinforce_plus_plus": compute_reinforce_plus_plus_outcome_advantage,
    "fastrl_gigpo": compute_gigpo_advantage,
    "fastrl_turn_discounted": compute_turn_discounted_advantage,
}
"""Advantage estimators :func:`register` adds to verl's registry (``algorithm.adv_estimator``).
(GAE needs the critic values, which verl passes only to its built-in ``gae`` branch.)"""

POLICY_LOSSES = {
    "fastrl_vanilla": compute_policy_loss_vanilla,
    "fastrl_gspo": compute_policy_loss_gspo,
}
"""Policy losses :func:`register` adds (``actor_rollout_ref.actor.policy_loss.loss_mode``)."""

TURN_ESTIMATORS = ("fastrl_gigpo", "fastrl_turn_discounted")
"""The estimators verl's ``compute_advantage`` must hand the batch to (``register`` wraps it)."""


def _wrap_compute_advantage(original):
    """verl's ``ray_trainer.compute_advantage`` with the turn estimators given ``data.batch``
    and ``data.non_tensor_batch`` (as verl does for its GDPO); everything else unchanged."""
    if getattr(original, "_fastrl_turns", False):
        return original

    def compute_advantage(data, adv_estimator, *args, **kwargs):
        if str(adv_estimator) not in TURN_ESTIMATORS:
            return original(data, adv_estimator, *args, **kwargs)
        config = kwargs.get("config", args[5] if len(args) > 5 else None)
        if "response_mask" not in data.batch.keys():
            from verl.trainer.ppo.ray_trainer import compute_response_mask

            data.batch["response_mask"] = compute_response_mask(data)
        adv, returns = ADV_ESTIMATORS[str(adv_estimator)](
            token_level_rewards=data.batch["token_level_rewards"], response_mask=data.batch["response_mask"],
            index=data.non_tensor_batch["uid"], config=config, batch=data.batch,
            non_tensor_batch=data.non_tensor_batch,
        )
        data.batch["advantages"] = adv
        data.batch["returns"] = returns
        return data

    compute_advantage._fastrl_turns = True  # type: ignore[attr-defined]
    compute_advantage.__wrapped__ = original  # type: ignore[attr-defined]
    return compute_advantage


def register(*, replace_builtin: bool = False) -> None:
    """Add fastrl's estimators and losses to verl's registries under ``fastrl_*`` names.

    Idempotent. With ``replace_builtin=True`` also points ``core_algos.compute_gae_advantage_return``
    and ``core_algos.compute_grpo_outcome_advantage`` (which verl's trainer calls by module
    attribute for ``adv_estimator=gae`` / ``grpo``) at the fastrl versions. Wraps
    ``ray_trainer.compute_advantage`` (where it imports) so the turn estimators
    (``TURN_ESTIMATORS``) get the batch.
    """
    from verl.trainer.ppo import core_algos

    for name, fn in ADV_ESTIMATORS.items():
        if core_algos.ADV_ESTIMATOR_REGISTRY.get(name) is not fn:
            core_algos.ADV_ESTIMATOR_REGISTRY.pop(name, None)
            core_algos.register_adv_est(name)(fn)
    for name, fn in POLICY_LOSSES.items():
        core_algos.register_policy_loss(name)(fn)
    try:  # the driver's trainer module (needs verl's trainer extras, e.g. torchdata; absent in workers is fine)
        from verl.trainer.ppo import ray_trainer
    except ImportError:
        ray_trainer = None
    if ray_trainer is not None:
        ray_trainer.compute_advantage = _wrap_compute_advantage(ray_trainer.compute_advantage)
    if replace_builtin:
        core_algos.compute_gae_advantage_return = compute_gae_advantage_return
        core_algos.compute_grpo_outcome_advantage = compute_grpo_outcome_advantage
