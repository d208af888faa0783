"""Reference masked whitening (advantage normalisation over the masked-in entries)."""

from __future__ import annotations

import torch


def masked_whiten_reference(
    x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Whiten ``x`` with the mean and variance of its masked-in entries (whole tensor).

    With m = (mask != 0), n = sum(m):

        mu  = sum(m * x) / n
        var = sum(m * (x - mu)^2) / (n - 1)          (unbiased, as TRL and OpenRLHF;
                                                      taken as 0 when n <= 1)
        y   = (x - mu) / sqrt(var + eps)              (shift_mean=True)
        y   = (x - mu) / sqrt(var + eps) + mu         (shift_mean=False: scale only)

    and y = 0 on masked-out entries (whose values are never read: they may be NaN/inf) (unlike TRL, which whitens the padding too). When no
    entry is masked in, everything is 0. Differentiable wrt ``x``. Computed in float32,
    or float64 when ``x`` is float64.
    """
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    keep = mask != 0
    xf = torch.where(keep, x.to(dt), 0.0)  # a select: NaN/inf padding cannot leak
    m = keep.to(dt)
    n = m.sum()
    mu = (m * xf).sum() / n.clamp(min=1)
    var = (m * (xf - mu) ** 2).sum() / (n - 1).clamp(min=1)
    y = (xf - mu) * torch.rsqrt(var + eps)
    if not shift_mean:
        y = y + mu
    return y * m
