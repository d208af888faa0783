"""One aggregation rule for every loss (``PolicyLossConfig.loss_agg``): how per-token losses
become one number, and which global count replaces which local denominator.

With ``m`` the mask, ``n_b`` the masked-in tokens of row b, ``N = sum_b n_b`` and ``S`` the
number of rows with ``n_b > 0``:

    loss = inv_d * sum_b f_b * sum_t m[b,t] x[b,t]

    loss_agg                   f_b               D (inv_d = 1 / D)
    token-mean                 1                 N, or global_token_count
    seq-mean-token-mean        1 / max(n_b, 1)   S, or global_seq_count
    seq-mean-token-sum         1                 S, or global_seq_count
    seq-mean-token-sum-norm    1                 (S, or global_seq_count) * norm_length

A count of 0 is taken as 1 (``fastrl._checks.effective_count``), so a batch without any
masked-in token has loss 0. ``policy_loss`` (PyTorch backend), ``value_loss`` and the
adapters use these functions; the Triton finalize kernel implements the same table, and
``fastrl.reference.policy_loss`` restates it independently (it is the oracle).
"""

from __future__ import annotations

import torch

from fastrl._checks import (
    check_choice,
    check_float,
    check_global_count,
    check_mask,
    check_same_device,
    check_scalar,
    effective_count,
    select_global_count,
)
from fastrl.config import LOSS_AGGS, NORM_LENGTH_REQUIRED


def aggregation_weights(
    n_b: torch.Tensor,
    *,
    loss_agg: str,
    norm_length: float | None,
    global_count: torch.Tensor | float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(f, inv_d)`` of the module table from the fp32 row token counts ``n_b`` ``[B]``.

    ``global_count`` is the one ``select_global_count``/``check_global_count`` chose for
    ``loss_agg`` (or None: the local count). No host sync.
    """
    if global_count is not None:
        D = global_count
    elif loss_agg == "token-mean":
        D = n_b.sum()
    else:
        D = (n_b > 0).to(n_b.dtype).sum()
    D = effective_count(D, dtype=n_b.dtype, device=n_b.device)
    if loss_agg == "seq-mean-token-sum-norm":
        D = D * float(norm_length)
    f = 1.0 / n_b.clamp(min=1.0) if loss_agg == "seq-mean-token-mean" else torch.ones_like(n_b)
    return f, 1.0 / D


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_agg: str = "token-mean",
    norm_length: float | None = None,
    global_token_count: torch.Tensor | float | None = None,
    global_seq_count: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """A per-token loss ``[B, T]`` (or ``[B, 1]``, broadcast over the row) aggregated by the
    house rule (module table), differentiable wrt ``loss_mat``; fp32 (float64 stays float64).

    Values at masked-out positions are never read (NaN/inf there change nothing). The
    counts follow ``fastrl._checks.check_global_count`` (the same rule as ``policy_loss``).
    """
    check_float("loss_mat", loss_mat, ndim=2)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError("mask must be a [B, T] tensor")
    B, T = mask.shape
    check_mask("mask", mask, (B, T))
    check_same_device(loss_mat=loss_mat, mask=mask)
    if loss_mat.shape[0] != B or loss_mat.shape[1] not in (1, T):
        raise ValueError(f"loss_mat must have shape (B, T) = {(B, T)} or (B, 1), got {tuple(loss_mat.shape)}")
    check_choice("loss_agg", loss_agg, LOSS_AGGS)
    if loss_agg == "seq-mean-token-sum-norm":
        if norm_length is None:
            raise ValueError(NORM_LENGTH_REQUIRED)
        check_scalar("norm_length", norm_length, low=0.0, low_inclusive=False)
    name, count = select_global_count(loss_agg, global_token_count, global_seq_count)
    global_count = check_global_count(name, count, loss_mat.device)
    dtype = torch.promote_types(loss_mat.dtype, torch.float32)
    m = mask != 0
    n_b = m.sum(1, dtype=dtype)
    f, inv_d = aggregation_weights(n_b, loss_agg=loss_agg, norm_length=norm_length, global_count=global_count)
    rows = torch.where(m, loss_mat.to(dtype), torch.zeros((), dtype=dtype, device=loss_mat.device)).sum(1)
    return torch.dot(f, rows) * inv_d


__all__ = ["aggregate_loss", "aggregation_weights"]
