"""Reference per-token KL penalty to a reference policy (the oracle of ``fastrl.ops.kl``).

With ``d = ref_logp - logp`` (log pi_ref - log pi at the sampled token, sampled from pi),
the three estimators of KL(pi || pi_ref) from Schulman, "Approximating KL divergence"
(2020, http://joschu.net/blog/kl-approx.html) are

    k1 = -d                    (unbiased, can be negative)
    k2 = d^2 / 2               (biased, non-negative, low variance)
    k3 = exp(d) - d - 1        (unbiased, non-negative, low variance; GRPO's choice)

and, when ``clamp`` is set, the estimate is clamped to [-clamp, clamp] (zero gradient
outside the interval, the boundary included in the interval).
"""

from __future__ import annotations

import torch

from fastrl.config import KL_ESTIMATORS  # the one list of estimator names


def kl_penalty_reference(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    *,
    estimator: str = "k3",
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-element KL estimate (see the module docstring), differentiable wrt both inputs.

    Computed in float64 when an input is float64, else in float32 (k3's final difference
    always in float64).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    dtype = torch.promote_types(torch.promote_types(logp.dtype, ref_logp.dtype), torch.float32)
    d = ref_logp.to(dtype) - logp.to(dtype)
    if estimator == "k1":
        kl = -d
    elif estimator == "k2":
        kl = 0.5 * d * d
    else:
        # exp(d) - d - 1 = expm1(d) - d, a difference of nearly equal numbers for small d:
        # evaluated in float64 so fp32 results keep their relative precision (and stay >= 0)
        d64 = d.to(torch.float64)
        kl = (torch.expm1(d64) - d64).to(dtype)
    if clamp is not None:
        kl = torch.clamp(kl, -clamp, clamp)
    return kl
