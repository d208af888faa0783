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

The global count of a batch split into micro-batches or ranks is handed over as its
inputs, ``GlobalCounts(tokens=N_global, sequences=S_global)``; which one replaces ``D`` is
decided here, by ``global_count_for`` from ``loss_agg`` (the one place that choice is
made, for every loss op, adapter and the trainer). A count of 0 is taken as 1
(``fastrl._checks.effective_count``), so a batch without any masked-in token has loss 0. ``policy_loss`` (PyTorch backend), ``value_loss`` and the
adapters use these functions; the Triton finalize kernel implements the same table, and
``fastrl.reference.policy_loss`` restates it independently (it is the oracle).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fastrl._checks import (
    check_choice,
    check_float,
    check_global_count,
    check_mask,
    check_same_device,
    check_scalar,
    effective_count,
)
from fastrl.config import LOSS_AGGS, NORM_LENGTH_REQUIRED, LossAgg

Count = torch.Tensor | float | int
"""A global count: a Python number >= 0 or a 1-element tensor on the inputs' device
(``fastrl._checks.check_global_count``)."""


class GlobalCounts(NamedTuple):
    """The denominators of a whole batch (all micro-batches and ranks), for losses computed
    piecewise that must add up to the loss of the whole batch.

    Pass both when known; the aggregation rule (``global_count_for``) uses ``tokens`` for
    ``loss_agg="token-mean"`` and ``sequences`` for the ``seq-*`` modes, so the caller never
    repeats that choice. A field left ``None`` means "the local count" for the modes that
    would use it. Each field follows ``fastrl._checks.check_global_count`` (a number >= 0
    or a 1-element tensor on the inputs' device, read there without a host sync).

    Attributes:
        tokens: the number of masked-in (trained-on) tokens of the whole batch.
        sequences: the number of rows of the whole batch (the ``S`` of the module table:
            rows with at least one masked-in token, or however the caller counts rows).
    """

    tokens: Count | None = None
    sequences: Count | None = None


def global_count_for(loss_agg: str, counts: GlobalCounts) -> tuple[str, Count | None]:
    """The count of ``counts`` that replaces the local denominator of ``loss_agg`` (module
    table): ``("tokens", counts.tokens)`` for ``token-mean``, ``("sequences",
    counts.sequences)`` for the ``seq-*`` modes. The value may be None (the local count)."""
    check_choice("loss_agg", loss_agg, LOSS_AGGS)
    if loss_agg == "token-mean":
        return "tokens", counts.tokens
    return "sequences", counts.sequences


def resolve_global_count(
    loss_agg: str,
    device: torch.device,
    *,
    global_counts: GlobalCounts | None = None,
    global_token_count: Count | None = None,
    global_seq_count: Count | None = None,
) -> torch.Tensor | float | None:
    """The validated global denominator of a loss op (``check_global_count``), from either
    form a loss accepts:

    - ``global_counts=GlobalCounts(tokens, sequences)``: the rule picks (``global_count_for``);
    - the explicit count of the mode, ``global_token_count=`` (``token-mean``) or
      ``global_seq_count=`` (``seq-*``); passing the one the mode does not use is an error
      (it would be silently ignored).

    Giving ``global_counts`` together with an explicit count is an error. None: local count.
    """
    explicit = global_token_count is not None or global_seq_count is not None
    if global_counts is not None:
        if not isinstance(global_counts, GlobalCounts):
            raise TypeError(f"global_counts must be a fastrl.ops.GlobalCounts, got {type(global_counts).__name__}")
        if explicit:
            raise ValueError("pass either global_counts or global_token_count/global_seq_count, not both")
        field, value = global_count_for(loss_agg, global_counts)
        return check_global_count(f"global_counts.{field}", value, device)
    field, _ = global_count_for(loss_agg, GlobalCounts())
    name, other = ("global_token_count", "global_seq_count") if field == "tokens" else ("global_seq_count", "global_token_count")
    value, other_value = (global_token_count, global_seq_count) if field == "tokens" else (global_seq_count, global_token_count)
    if other_value is not None:
        raise ValueError(f"{other} does not apply to loss_agg={loss_agg!r}: pass {name} "
                         "(or global_counts=GlobalCounts(tokens=..., sequences=...) and let the rule choose)")
    return check_global_count(name, value, device)


def aggregation_weights(
    n_b: torch.Tensor,
    *,
    loss_agg: str,
    norm_length: float | None,
    global_count: torch.Tensor | float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(f, inv_d)`` of the module table from the fp32 row token counts ``n_b`` ``[B]``.

    ``global_count`` is the one ``resolve_global_count`` chose and validated for
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
    loss_agg: LossAgg = "token-mean",
    norm_length: float | None = None,
    global_token_count: torch.Tensor | float | None = None,
    global_seq_count: torch.Tensor | float | None = None,
    global_counts: GlobalCounts | None = None,
) -> torch.Tensor:
    """A per-token loss ``[B, T]`` (or ``[B, 1]``, broadcast over the row) aggregated by the
    house rule (module table), differentiable wrt ``loss_mat``; fp32 (float64 stays float64).

    Values at masked-out positions are never read (NaN/inf there change nothing). The
    counts: ``global_counts=GlobalCounts(tokens, sequences)`` (the rule picks the one
    ``loss_agg`` uses) or the explicit ``global_token_count``/``global_seq_count``
    (``resolve_global_count``, the same rule as ``policy_loss``).
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
    global_count = resolve_global_count(loss_agg, loss_mat.device, global_counts=global_counts,
                                        global_token_count=global_token_count, global_seq_count=global_seq_count)
    dtype = torch.promote_types(loss_mat.dtype, torch.float32)
    m = mask != 0
    n_b = m.sum(1, dtype=dtype)
    f, inv_d = aggregation_weights(n_b, loss_agg=loss_agg, norm_length=norm_length, global_count=global_count)
    rows = torch.where(m, loss_mat.to(dtype), torch.zeros((), dtype=dtype, device=loss_mat.device)).sum(1)
    return torch.dot(f, rows) * inv_d


__all__ = ["GlobalCounts", "aggregate_loss", "aggregation_weights", "global_count_for", "resolve_global_count"]
