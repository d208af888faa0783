"""Masked whitening (advantage normalisation), differentiable wrt ``x``."""

from __future__ import annotations

import torch

from fastrl._checks import check_float, check_mask, check_nonempty, check_same_device, check_scalar, resolve_backend
from fastrl.ops._segments import kernel_mask
from fastrl.ops.policy_loss import zero_masked

__all__ = ["masked_whiten"]


class _MaskedWhitenTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, mask: torch.Tensor, shift_mean: bool, eps: float) -> torch.Tensor:
        from csrc_triton.whiten import whiten_forward

        xf = x.contiguous().reshape(-1)
        m = kernel_mask(mask).reshape(-1)
        y, mu, rstd, n = whiten_forward(xf, m, shift_mean=shift_mean, eps=eps)
        ctx.save_for_backward(xf, m, mu, rstd, n)
        ctx.shift_mean = shift_mean
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return y.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from csrc_triton.whiten import whiten_backward

        xf, m, mu, rstd, n = ctx.saved_tensors
        gx = whiten_backward(grad.contiguous().reshape(-1), xf, m, mu, rstd, n, shift_mean=ctx.shift_mean)
        return gx.reshape(ctx.x_shape).to(ctx.x_dtype), None, None, None


class _ZeroMasked(torch.autograd.Function):
    """``zero_masked`` with its gradient: the incoming gradient where the mask is set, 0
    elsewhere (what ``torch.where(mask, x, 0.0)`` passes back, bit for bit)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(bits)
        return zero_masked(x, bits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (bits,) = ctx.saved_tensors
        return zero_masked(grad, bits), None


def _masked_whiten_torch(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool, eps: float) -> torch.Tensor:
    # the masked-in entries, +0.0 elsewhere whatever sits there (a select: NaN/inf padding cannot
    # leak); on a CPU as integer bit masks (zero_masked), several times faster than a bool
    # select and a bool -> float conversion, with the same values
    keep = (mask if mask.dtype == torch.bool else mask.bool()).reshape(-1)
    if x.device.type == "cpu":
        bits = keep.to(torch.int32).neg_()
        xf = _ZeroMasked.apply(x.to(torch.float32).reshape(-1), bits)
        mf = keep.to(torch.uint8).to(torch.float32)
    else:
        xf = torch.where(keep, x.to(torch.float32).reshape(-1), 0.0)
        mf = keep.to(torch.float32)
    n = mf.sum()
    mu = (xf * mf).sum() / n.clamp(min=1.0)  # not torch.dot: BLAS threading stalls on busy CPUs
    d = (xf - mu) * mf  # zero on masked-out entries
    var = (d * d).sum() / (n - 1.0).clamp(min=1.0)
    y = d * torch.rsqrt(var + eps)
    if not shift_mean:
        y = y + mu * mf
    return y.reshape(x.shape)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
    backend: str = "auto",
) -> torch.Tensor:
    """Whiten ``x`` with the mean and variance of its masked-in entries (over the whole tensor).

    With m = (mask != 0) and n = sum(m):

        mu  = sum(m x) / n
        var = sum(m (x - mu)^2) / (n - 1)      unbiased (TRL and OpenRLHF's convention;
                                               taken as 0 when n <= 1)
        y   = (x - mu) / sqrt(var + eps)       (+ mu when shift_mean=False: scale only)

    Masked-out entries of the output are 0 (TRL whitens them too; here padding stays
    clean). An all-masked input gives all zeros.

    Args:
        x: float tensor of any shape (any float dtype), e.g. advantages [B, T].
        mask: same shape, 0/1 (bool, integer or float).
        shift_mean: subtract the mean (True) or only rescale (False).
        eps: added to the variance inside the square root (> 0).
        backend: ``auto`` | ``triton`` | ``torch``.

    Returns float32 of ``x``'s shape, differentiable wrt ``x``.
    """
    check_float("x", x)
    check_nonempty("x", x)
    check_mask("mask", mask, tuple(x.shape))
    device = check_same_device(x=x, mask=mask)
    if not isinstance(shift_mean, bool):
        raise TypeError(f"shift_mean must be a bool, got {type(shift_mean).__name__}")
    eps = check_scalar("eps", eps, low=0.0, low_inclusive=False)
    if resolve_backend(backend, device) == "triton":
        return _MaskedWhitenTriton.apply(x, mask, shift_mean, eps)
    return _masked_whiten_torch(x, mask, shift_mean, eps)
