"""Triton kernels for the per-token KL penalty (elementwise, one pass each way).

``d = ref - logp``; estimators k1 = -d, k2 = d^2/2, k3 = exp(d) - d - 1 (evaluated with a
Taylor series for |d| < 0.5 so small values keep full relative precision), optionally
clamped to [-c, c]. The forward reads both inputs once and writes the estimate; the
backward recomputes the derivative from the inputs (nothing is saved but the inputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KL_ESTIMATOR_IDS = {"k1": 0, "k2": 1, "k3": 2}
BLOCK = 1024


@triton.jit
def _exp_series_tail(xs):
    """1 + x/3 (1 + x/4 (... (1 + x/8))): the shared Horner tail of the exp Taylor series."""
    p = 1.0 + xs * (1.0 / 8.0)
    p = 1.0 + xs * (1.0 / 7.0) * p
    p = 1.0 + xs * (1.0 / 6.0) * p
    p = 1.0 + xs * (1.0 / 5.0) * p
    p = 1.0 + xs * (1.0 / 4.0) * p
    return 1.0 + xs * (1.0 / 3.0) * p


@triton.jit
def expm1_f32(x):
    """exp(x) - 1 in fp32, accurate near 0 (degree-8 Taylor series for |x| < 0.5)."""
    small = tl.abs(x) < 0.5
    xs = tl.where(small, x, 0.0)
    p = 1.0 + xs * 0.5 * _exp_series_tail(xs)
    return tl.where(small, xs * p, tl.exp(x) - 1.0)


@triton.jit
def k3_f32(x):
    """exp(x) - 1 - x in fp32, accurate near 0 (Taylor series x^2/2 + ... + x^8/8! for |x| < 0.5)."""
    small = tl.abs(x) < 0.5
    xs = tl.where(small, x, 0.0)
    return tl.where(small, 0.5 * xs * xs * _exp_series_tail(xs), tl.exp(x) - 1.0 - x)


@triton.jit
def kl_value_grad(logp, ref, clamp, EST: tl.constexpr, HAS_CLAMP: tl.constexpr):
    """The KL estimate and its derivative wrt ``logp`` (the derivative wrt ``ref`` is minus it)."""
    d = ref - logp
    if EST == 0:
        k = -d
        g = tl.full(d.shape, 1.0, tl.float32)
    elif EST == 1:
        k = 0.5 * d * d
        g = -d
    else:
        k = k3_f32(d)
        g = -expm1_f32(d)
    if HAS_CLAMP:
        inside = (k >= -clamp) & (k <= clamp)
        k = tl.minimum(tl.maximum(k, -clamp), clamp)
        g = tl.where(inside, g, 0.0)
    return k, g


@triton.jit
def _kl_fwd_kernel(logp_ptr, ref_ptr, out_ptr, n, clamp,
                   EST: tl.constexpr, HAS_CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    lp = tl.load(logp_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    rf = tl.load(ref_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    k, g = kl_value_grad(lp, rf, clamp, EST, HAS_CLAMP)
    tl.store(out_ptr + offs, k, mask=inb)


@triton.jit
def _kl_bwd_kernel(logp_ptr, ref_ptr, gout_ptr, glogp_ptr, gref_ptr, n, clamp,
                   EST: tl.constexpr, HAS_CLAMP: tl.constexpr,
                   WRITE_LOGP: tl.constexpr, WRITE_REF: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    lp = tl.load(logp_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    rf = tl.load(ref_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    go = tl.load(gout_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    k, g = kl_value_grad(lp, rf, clamp, EST, HAS_CLAMP)
    if WRITE_LOGP:
        tl.store(glogp_ptr + offs, (go * g).to(glogp_ptr.dtype.element_ty), mask=inb)
    if WRITE_REF:
        tl.store(gref_ptr + offs, (-go * g).to(gref_ptr.dtype.element_ty), mask=inb)


def kl_fwd(logp: torch.Tensor, ref_logp: torch.Tensor, *, estimator: str, clamp: float | None) -> torch.Tensor:
    """KL estimate of contiguous same-shape tensors, fp32 out."""
    out = torch.empty(logp.shape, dtype=torch.float32, device=logp.device)
    n = logp.numel()
    _kl_fwd_kernel[(triton.cdiv(n, BLOCK),)](
        logp, ref_logp, out, n, float(clamp or 0.0),
        EST=KL_ESTIMATOR_IDS[estimator], HAS_CLAMP=clamp is not None, BLOCK=BLOCK,
    )
    return out


def kl_bwd(
    logp: torch.Tensor, ref_logp: torch.Tensor, grad_out: torch.Tensor, *,
    estimator: str, clamp: float | None, need_logp: bool, need_ref: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients wrt ``logp`` and ``ref_logp`` (in their dtypes) given ``grad_out`` (contiguous)."""
    n = logp.numel()
    glogp = torch.empty_like(logp) if need_logp else None
    gref = torch.empty_like(ref_logp) if need_ref else None
    _kl_bwd_kernel[(triton.cdiv(n, BLOCK),)](
        logp, ref_logp, grad_out, glogp if need_logp else logp, gref if need_ref else ref_logp, n,
        float(clamp or 0.0),
        EST=KL_ESTIMATOR_IDS[estimator], HAS_CLAMP=clamp is not None,
        WRITE_LOGP=need_logp, WRITE_REF=need_ref, BLOCK=BLOCK,
    )
    return glogp, gref
