"""Reference policy-gradient surrogates: the per-token term ``pg`` of the policy loss.

Selected by ``PolicyLossConfig.surrogate`` (each surrogate's record, its options, kernel id
and metric name: ``fastrl.config.SURROGATE_SPECS``; its formula here is the function of its
name); ``fastrl.reference.policy_loss`` calls the entry, then applies importance weights, KL,
entropy and the aggregation around it. Every entry takes the same arguments (all ``[B, T]``, zero at masked-out positions):

    lr     the token log-ratio ``logp - old_logp`` (after ``log_ratio_clamp``)
    rlr    the log-ratio the surrogate's ratio uses: ``lr`` (``ratio_level="token"``) or the
           row's masked mean of ``lr``, broadcast (``"sequence"``, gradient through the mean)
    logp   the policy log-probs (differentiable)
    A      the advantages
    m      the mask (bool)
    log_is the rollout log-weight ``old_logp - rollout_logp`` per token, or None

and returns ``(pg, metrics)``: the per-token loss, differentiable wrt ``logp`` by autograd,
and per-token metric values whose masked token mean the op reports. With r = exp(rlr):

    ppo_clip  pg = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)),
              then min(pg, -A dual_clip) where A < 0 if dual_clip is set
              metrics: clip_frac_low (r < 1 - clip_low, A < 0), clip_frac_high
              (r > 1 + clip_high, A > 0), dual_clip_frac (A < 0 and the dual clip active)
    cispo     pg = -sg(min(r, cispo_max)) A logp                   (gradient -min(r, cmax) A)
              metrics: cispo_clip_frac (r > cispo_max and A > 0)
    sapo      pg = -(4 / tau) sigmoid(tau (r - 1)) A,  tau = sapo_tau_pos if A > 0 else sapo_tau_neg
              (gradient through r: -4 A s (1 - s) r per unit log-ratio, s the sigmoid)
    vespo     pg = -sg(phi) A logp, with per row
                  log w = clamp(sum_t m clamp(lr, -20, 20) + sum_t m log_is, log 1e-8, 20)
              and per token (k, lam) = (vespo_k_pos, vespo_lambda_pos) if A >= 0 else the
              negative pair, lam at least 1e-4:
                  phi = exp(lam + k log w - lam w)     (phi(1) = 1; a non-finite phi is 0)
              The rollout log-weight enters w instead of multiplying pg (TRL 1.16 folds its
              vLLM ratio the same way); metrics: vespo_phi_mean (phi).

Gradient conventions: the gradient through a ratio that overflowed to inf is exactly 0
wherever the surrogate is flat there (clipped, dual-clipped, saturated gate), never
0 * inf = NaN; cispo and vespo differentiate only ``logp`` (their ratio weight is detached).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fastrl.config import SURROGATE_SPECS, PolicyLossConfig

LOG_1E8 = math.log(1e-8)
"""VESPO's lower bound on the log sequence weight (TRL 1.16's)."""
VESPO_LOG_RATIO_CLAMP = 20.0
"""VESPO clamps each token log-ratio, and the row's log weight from above, at this value."""

SurrogateFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _through_live(rlr: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """exp(rlr) with gradient only where ``live`` (elsewhere the surrogate is flat: 0, not 0 * inf)."""
    return torch.exp(torch.where(live, rlr, rlr.detach()))


def ppo_clip(*, lr, rlr, logp, A, m, log_is, cfg: PolicyLossConfig):
    lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
    with torch.no_grad():
        r = torch.exp(rlr)
        take1 = -A * r >= -A * torch.clamp(r, lo, hi)
        pg_val = torch.where(take1, -A * r, -A * torch.clamp(r, lo, hi))
        dual_on = (A < 0) & (pg_val > -A * cfg.dual_clip) if cfg.dual_clip is not None else None
        live = take1 if dual_on is None else take1 & ~dual_on
    ratio = _through_live(rlr, live)
    # the clipped term never carries gradient: it wins only strictly outside [lo, hi]
    pg = torch.where(take1, -A * ratio, -A * torch.clamp(ratio.detach(), lo, hi))
    metrics = {"clip_frac_low": (r < lo) & (A < 0), "clip_frac_high": (r > hi) & (A > 0)}
    if dual_on is not None:
        pg = torch.where(dual_on, -A * cfg.dual_clip, pg)
        metrics["dual_clip_frac"] = dual_on
    return pg, metrics


def cispo(*, lr, rlr, logp, A, m, log_is, cfg: PolicyLossConfig):
    r = torch.exp(rlr.detach())
    pg = -torch.clamp(r, max=cfg.cispo_max) * A * logp
    return pg, {"cispo_clip_frac": (r > cfg.cispo_max) & (A > 0)}


def sapo(*, lr, rlr, logp, A, m, log_is, cfg: PolicyLossConfig):
    tau = torch.where(A > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg).to(rlr.dtype)
    with torch.no_grad():
        s = torch.sigmoid(tau * (torch.exp(rlr) - 1))
        live = s * (1 - s) != 0  # the gate's slope; 0 where it saturated (also at an inf ratio)
    ratio = _through_live(rlr, live)
    return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * A, {}


@torch.no_grad()
def vespo_phi(lr: torch.Tensor, A: torch.Tensor, m: torch.Tensor, log_is: torch.Tensor | None,
              cfg: PolicyLossConfig) -> torch.Tensor:
    """VESPO's detached weight ``phi`` per token (of the module docstring)."""
    mf = m.to(lr.dtype)
    c = VESPO_LOG_RATIO_CLAMP
    log_w = (lr.clamp(-c, c) * mf).sum(-1, keepdim=True)
    if log_is is not None:
        log_w = log_w + (log_is * mf).sum(-1, keepdim=True)
    log_w = log_w.clamp(LOG_1E8, c)
    nonneg = A >= 0
    k = torch.where(nonneg, cfg.vespo_k_pos, cfg.vespo_k_neg).to(lr.dtype)
    lam = torch.where(nonneg, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg).to(lr.dtype).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.where(torch.isfinite(phi), phi, 0.0)


def vespo(*, lr, rlr, logp, A, m, log_is, cfg: PolicyLossConfig):
    phi = vespo_phi(lr, A, m, log_is, cfg)
    return -phi * A * logp, {"vespo_phi_mean": phi}


SURROGATES: dict[str, SurrogateFn] = {name: globals()[name] for name in SURROGATE_SPECS}
"""Every surrogate by its ``PolicyLossConfig.surrogate`` name: the function of that name above
(a record without its formula fails here, at import)."""

FOLDS_ROLLOUT_WEIGHT = frozenset(spec.name for spec in SURROGATE_SPECS.values() if spec.folds_rollout_weight)
"""Surrogates that take the rollout log-weight into their own formula instead of being
multiplied by ``exp(old_logp - rollout_logp)``."""
