"""Reference batch statistics: masked moments, moments pooled from equal shards, explained variance.

The specification of ``fastrl.ops.stats``, written in float64 over the masked-in entries.
"""

from __future__ import annotations

import math

import torch


def masked_mean_std_reference(x: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """Mean and population standard deviation of the masked-in entries (0 and 0 when none)."""
    vals = [float(v) for v, m in zip(x.reshape(-1).tolist(), mask.reshape(-1).tolist()) if m > 0]
    n = max(len(vals), 1)
    mean = sum(vals) / n
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / n)


def every_kth_reference(mask: torch.Tensor, k: int) -> list[bool]:
    """Flattened: True at the 1st, (k+1)-th, (2k+1)-th, ... masked-in entry."""
    out, seen = [], 0
    for m in mask.reshape(-1).tolist():
        out.append(bool(m) and seen % k == 0)
        seen += bool(m)
    return out


def sampled_mean_reference(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of the masked-in entries that are not NaN (NaN when none)."""
    vals = [float(v) for v, m in zip(x.reshape(-1).tolist(), mask.reshape(-1).tolist()) if m > 0 and not math.isnan(v)]
    return sum(vals) / len(vals) if vals else float("nan")


def pooled_mean_std_reference(means: list[float], stds: list[float]) -> tuple[float, float]:
    """Mean and population std of the union of equal-sized shards, from each shard's mean and
    population std: E[x^2] of a shard is std^2 + mean^2, and the union's variance is
    mean(E[x^2]) - mean^2 (clamped at 0 against rounding)."""
    world = len(means)
    mean = sum(means) / world
    second = sum(s * s + m * m for m, s in zip(means, stds)) / world
    return mean, math.sqrt(max(second - mean * mean, 0.0))


def explained_variance_reference(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(returns - values) / Var(returns)`` over the masked-in entries (population
    variances); NaN with fewer than two entries. Returns without variance give NaN when the
    residuals have none either (a perfect fit of a constant), else -inf."""
    pairs = [(float(r), float(v)) for r, v, m in zip(returns.reshape(-1).tolist(), values.reshape(-1).tolist(),
                                                     mask.reshape(-1).tolist()) if m > 0]
    if len(pairs) < 2:
        return float("nan")

    def var(xs: list[float]) -> float:
        mu = sum(xs) / len(xs)
        return sum((x - mu) ** 2 for x in xs) / len(xs)

    var_r = var([r for r, _ in pairs])
    var_res = var([r - v for r, v in pairs])
    if var_r == 0:
        return float("nan") if var_res == 0 else float("-inf")
    return 1.0 - var_res / var_r
