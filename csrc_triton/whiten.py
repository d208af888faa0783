"""Triton kernels for masked whitening (forward and backward).

Forward: ``_moments_kernel`` writes per-block (count, mean, M2) of the masked-in
entries (two passes over the block in registers); the launcher merges the blocks with
Chan's parallel formula on the device, and ``_whiten_apply_kernel`` writes the output.
Backward: ``_grad_sums_kernel`` writes per-block sum(m g) and sum(m g (x - mu)), and
``_whiten_bwd_kernel`` writes the input gradient. No host synchronisation anywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _moments_kernel(x_ptr, mask_ptr, cnt_ptr, mean_ptr, m2_ptr, N, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    inb = i < N
    m = (tl.load(mask_ptr + i, mask=inb, other=0).to(tl.float32) != 0.0) & inb
    x = tl.load(x_ptr + i, mask=m, other=0.0).to(tl.float32)
    cnt = tl.sum(m.to(tl.float32), axis=0)
    mean = tl.sum(x, axis=0) / tl.maximum(cnt, 1.0)
    d = tl.where(m, x - mean, 0.0)
    tl.store(cnt_ptr + pid, cnt)
    tl.store(mean_ptr + pid, mean)
    tl.store(m2_ptr + pid, tl.sum(d * d, axis=0))


@triton.jit
def _whiten_apply_kernel(x_ptr, mask_ptr, mu_ptr, rstd_ptr, y_ptr, N, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    inb = i < N
    m = tl.load(mask_ptr + i, mask=inb, other=0).to(tl.float32) != 0.0
    x = tl.load(x_ptr + i, mask=inb, other=0.0).to(tl.float32)
    mu = tl.load(mu_ptr)
    rstd = tl.load(rstd_ptr)
    y = (x - mu) * rstd
    if not SHIFT:
        y = y + mu
    tl.store(y_ptr + i, tl.where(m, y, 0.0), mask=inb)


@triton.jit
def _grad_sums_kernel(g_ptr, x_ptr, mask_ptr, mu_ptr, sg_ptr, sgx_ptr, N, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    inb = i < N
    m = (tl.load(mask_ptr + i, mask=inb, other=0).to(tl.float32) != 0.0) & inb
    g = tl.load(g_ptr + i, mask=m, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + i, mask=m, other=0.0).to(tl.float32)
    mu = tl.load(mu_ptr)
    tl.store(sg_ptr + pid, tl.sum(g, axis=0))
    tl.store(sgx_ptr + pid, tl.sum(tl.where(m, g * (x - mu), 0.0), axis=0))


@triton.jit
def _whiten_bwd_kernel(
    g_ptr, x_ptr, mask_ptr, mu_ptr, rstd_ptr, coef_g_ptr, coef_x_ptr, gx_ptr, N, SHIFT: tl.constexpr, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    inb = i < N
    m = tl.load(mask_ptr + i, mask=inb, other=0).to(tl.float32) != 0.0
    g = tl.load(g_ptr + i, mask=inb, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + i, mask=inb, other=0.0).to(tl.float32)
    mu = tl.load(mu_ptr)
    rstd = tl.load(rstd_ptr)
    coef_g = tl.load(coef_g_ptr)  # G / n
    coef_x = tl.load(coef_x_ptr)  # rstd^3 * H / d
    gx = rstd * (g - coef_g) - (x - mu) * coef_x
    if not SHIFT:
        gx = gx + coef_g
    tl.store(gx_ptr + i, tl.where(m, gx, 0.0), mask=inb)


def _merge_moments(cnt: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chan et al.'s parallel merge of per-block (count, mean, M2) into totals (0-dim)."""
    n = cnt.sum()
    mu = (cnt * mean).sum() / n.clamp(min=1.0)
    M2 = m2.sum() + (cnt * (mean - mu) ** 2).sum()
    return n, mu, M2


def masked_moments(x: torch.Tensor, mask: torch.Tensor, *, block: int = 1024) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, mean, M2) of the masked-in entries of flat ``x`` as 0-dim float32 tensors."""
    N = x.numel()
    nb = triton.cdiv(N, block)
    cnt = torch.empty(nb, dtype=torch.float32, device=x.device)
    mean = torch.empty_like(cnt)
    m2 = torch.empty_like(cnt)
    _moments_kernel[(nb,)](x, mask, cnt, mean, m2, N, BLOCK=block)
    return _merge_moments(cnt, mean, m2)


def whiten_forward(
    x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool, eps: float, block: int = 1024
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat contiguous ``x`` and ``mask`` -> (y float32, mu, rstd, n) (the last three 0-dim)."""
    N = x.numel()
    n, mu, M2 = masked_moments(x, mask, block=block)
    var = M2 / (n - 1.0).clamp(min=1.0)
    rstd = torch.rsqrt(var + eps)
    y = torch.empty(N, dtype=torch.float32, device=x.device)
    _whiten_apply_kernel[(triton.cdiv(N, block),)](x, mask, mu, rstd, y, N, SHIFT=shift_mean, BLOCK=block)
    return y, mu, rstd, n


def whiten_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    mask: torch.Tensor,
    mu: torch.Tensor,
    rstd: torch.Tensor,
    n: torch.Tensor,
    *,
    shift_mean: bool,
    block: int = 1024,
) -> torch.Tensor:
    """Gradient wrt flat ``x`` (float32):
    m * [rstd (g - G/n) - rstd^3 (x - mu) H / d + (not shift_mean) G/n],
    G = sum(m g), H = sum(m g (x - mu)), d = max(n - 1, 1)."""
    N = x.numel()
    nb = triton.cdiv(N, block)
    sg = torch.empty(nb, dtype=torch.float32, device=x.device)
    sgx = torch.empty_like(sg)
    _grad_sums_kernel[(nb,)](grad, x, mask, mu, sg, sgx, N, BLOCK=block)
    coef_g = sg.sum() / n.clamp(min=1.0)
    coef_x = rstd**3 * sgx.sum() / (n - 1.0).clamp(min=1.0)
    gx = torch.empty(N, dtype=torch.float32, device=x.device)
    _whiten_bwd_kernel[(nb,)](grad, x, mask, mu, rstd, coef_g, coef_x, gx, N, SHIFT=shift_mean, BLOCK=block)
    return gx
