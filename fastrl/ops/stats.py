"""Batch statistics of a training step, written once for one process and for ``torchrun``.
Specification: ``fastrl/reference/stats.py``.

Each statistic that spans the batch takes ``all_reduce=`` (a sum over ranks; the identity in
one process, the default), so the formula is the same in both and only the partial sums
travel between ranks.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["every_kth", "explained_variance", "masked_mean_std", "pooled_mean_std", "sampled_mean"]

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def masked_mean_std(x: torch.Tensor, mask: torch.Tensor, *, all_reduce: AllReduce = _identity) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and population std (0-dim) of ``x`` over masked-in entries of every rank's batch."""
    n = all_reduce(mask.sum()).clamp(min=1)
    mean = all_reduce((x * mask).sum()) / n
    std = all_reduce(((x - mean) ** 2 * mask).sum()).div(n).sqrt()
    return mean, std


def every_kth(mask: torch.Tensor, k: int) -> torch.Tensor:
    """Bool, shape of ``mask``: every ``k``-th masked-in entry in flattened order, the first
    one included (none when the mask is empty). A cumulative count: no host sync."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    m = mask.reshape(-1) != 0
    return (m & ((torch.cumsum(m, 0) - 1) % k == 0)).reshape(mask.shape)


def sampled_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean (0-dim fp32) of ``x`` over the masked-in entries that are not NaN: a subsample's
    mean, where the entries outside the subsample are NaN (``linear_logprobs``'s
    ``entropy_rows``). NaN when no entry is in both."""
    keep = mask.bool() & ~torch.isnan(x)
    return torch.where(keep, x.float(), 0.0).sum() / keep.sum()


def pooled_mean_std(mean_sum: float, second_moment_sum: float, *, shards: int) -> tuple[float, float]:
    """Mean and population std of the union of ``shards`` equal-sized shards, from the sums over
    shards of their means and of their second moments ``std^2 + mean^2``."""
    mean = mean_sum / shards
    return mean, max(second_moment_sum / shards - mean**2, 0.0) ** 0.5


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var(returns - values) / Var(returns)`` over masked-in tokens (0-dim fp32).

    1 is a perfect critic, 0 is no better than a constant, negative is worse. NaN with fewer
    than two tokens; returns without variance give NaN (residuals without variance too) or -inf.
    """
    m = mask.bool()
    r = returns.float()[m]
    v = values.float()[m]
    if r.numel() < 2:
        return torch.tensor(float("nan"))
    var_r = r.var(unbiased=False)
    return 1.0 - (r - v).var(unbiased=False) / var_r
