"""Policy-gradient surrogates of ``policy_loss``'s PyTorch backend, one entry per
``PolicyLossConfig.surrogate`` (formulas: ``fastrl.reference.surrogates``; each surrogate's
record, and the tables below derived from it: ``fastrl.config.SURROGATE_SPECS``).

Contract: an entry gets fp32 ``[B, T]`` tensors that are 0 at masked-out positions (``A``,
``lp``, ``lr``; ``ratio`` is 1 there) and returns ``SurrogateTerms``: the per-token loss
``pg``, its derivative ``d_ratio`` wrt the ratio (the caller chains it through the token
ratio or the row's mean log-ratio) or its derivative ``d_logp`` wrt ``logp`` directly (the
ratio detached), and one per-token metric. The Triton kernel fuses the same entries
(``csrc_triton.policy_loss``, constexpr ``SURROGATE`` = ``SURROGATE_IDS[name]``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from fastrl.config import SURROGATE_SPECS, PolicyLossConfig


class SurrogateTerms(NamedTuple):
    pg: torch.Tensor
    """Per-token loss [B, T]."""
    d_ratio: torch.Tensor | None
    """d pg / d ratio (surrogates differentiated through the ratio), else None."""
    d_logp: torch.Tensor | None
    """d pg / d logp with the ratio detached (cispo, vespo), else None."""
    metric: torch.Tensor | None
    """The surrogate's own per-token metric (its masked token mean is reported), or None."""


def _step(x: torch.Tensor) -> torch.Tensor:
    """1.0 where x > 0 else 0.0 (float ops: faster than bool selects on CPU)."""
    return torch.sign(x).clamp_(min=0.0)


def surrogate_params(cfg: PolicyLossConfig) -> tuple[float, float, float, float]:
    """The four scalars a surrogate reads (the kernel's ``p0..p3``; unused ones are 0): its
    record's ``params`` (``fastrl.config.SURROGATE_SPECS``): ppo_clip (1 - clip_low,
    1 + clip_high, dual_clip), cispo (cispo_max,), sapo (tau_pos, tau_neg), vespo (k_pos,
    lambda_pos, k_neg, lambda_neg)."""
    p = SURROGATE_SPECS[cfg.surrogate].params(cfg)
    return tuple(float(x) for x in p) + (0.0,) * (4 - len(p))  # type: ignore[return-value]


def _ppo_clip(ratio, A, lp, lr, mf, log_is, p, has_dual: bool, write_grad: bool) -> SurrogateTerms:
    negA = -A
    lo, hi, dual_clip = p[0], p[1], p[2]
    pg1 = negA * ratio
    pg2 = negA * ratio.clamp(lo, hi)
    pg = torch.maximum(pg1, pg2)
    dpg = negA * (1.0 - _step(pg2 - pg1)) if write_grad else None
    dual_ind = None
    if has_dual:
        # -min(A, 0) c is -A c for A < 0 and 0 otherwise, where pg <= 0 already
        pg3 = A.clamp(max=0.0) * (-dual_clip)
        dual_ind = _step(pg - pg3)
        pg = torch.minimum(pg, pg3)
        if write_grad:
            dpg.mul_(1.0 - dual_ind)
    return SurrogateTerms(pg, dpg, None, dual_ind)


def _cispo(ratio, A, lp, lr, mf, log_is, p, has_dual: bool, write_grad: bool) -> SurrogateTerms:
    cispo_max = p[0]
    coef = -ratio.clamp(max=cispo_max) * A
    clipped = _step(ratio - cispo_max) * _step(A)
    return SurrogateTerms(coef * lp, None, coef if write_grad else None, clipped)


def _sapo(ratio, A, lp, lr, mf, log_is, p, has_dual: bool, write_grad: bool) -> SurrogateTerms:
    tau_pos, tau_neg = p[0], p[1]
    tau = tau_neg + (tau_pos - tau_neg) * _step(A)
    s = torch.sigmoid(tau * (ratio - 1.0))
    pg = -4.0 * s * A / tau
    # d pg / d ratio = -4 A s (1 - s); 0 where the gate saturated (then the caller keeps 0 * inf out)
    d_ratio = -4.0 * A * s * (1.0 - s) if write_grad else None
    return SurrogateTerms(pg, d_ratio, None, None)


_LOG_1E8 = math.log(1e-8)
_VESPO_CLAMP = 20.0


def vespo_phi(lr, A, mf, log_is, p) -> torch.Tensor:
    """VESPO's per-token weight phi (``fastrl.reference.surrogates.vespo_phi``), fp32."""
    log_w = lr.clamp(-_VESPO_CLAMP, _VESPO_CLAMP).mul(mf).sum(1, keepdim=True)
    if log_is is not None:
        log_w = log_w + log_is.sum(1, keepdim=True)
    log_w = log_w.clamp(_LOG_1E8, _VESPO_CLAMP)
    k_pos, lam_pos, k_neg, lam_neg = p
    nonneg = 1.0 - _step(-A)
    k = k_neg + (k_pos - k_neg) * nonneg
    lam = (lam_neg + (lam_pos - lam_neg) * nonneg).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.where(torch.isfinite(phi), phi, 0.0)


def _vespo(ratio, A, lp, lr, mf, log_is, p, has_dual: bool, write_grad: bool) -> SurrogateTerms:
    phi = vespo_phi(lr, A, mf, log_is, p)
    coef = -phi * A
    return SurrogateTerms(coef * lp, None, coef if write_grad else None, phi * mf)


SurrogateFn = Callable[..., SurrogateTerms]

SURROGATES: dict[str, SurrogateFn] = {name: globals()[f"_{name}"] for name in SURROGATE_SPECS}
"""The torch backend's entry per surrogate name: the function ``_<name>`` above, in the records'
order (a record without its entry fails here, at import)."""

THROUGH_RATIO = frozenset(spec.name for spec in SURROGATE_SPECS.values() if spec.through_ratio)
"""Surrogates whose gradient flows through the ratio (in sequence mode: through the row mean)."""

FOLDS_ROLLOUT_WEIGHT = frozenset(spec.name for spec in SURROGATE_SPECS.values() if spec.folds_rollout_weight)
"""Surrogates that take ``old_logp - rollout_logp`` into their formula instead of a multiplied weight."""

METRIC_NAME = {spec.name: spec.metric for spec in SURROGATE_SPECS.values() if spec.metric is not None}
"""The name under which each surrogate's own per-token metric (token mean) is reported."""
