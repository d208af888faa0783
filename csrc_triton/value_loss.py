"""Triton kernel for the PPO (clipped) value loss: loss, gradient and metrics in one pass.

The launcher gets a per-row weight ``row_scale[b]`` that already folds in the
aggregation (1 / D_tok, 1 / (n_b D_seq), ...), so each token's loss weight is
w = m * row_scale[row] and the kernel writes d(loss)/d(values) = w * dl/dv in the same
pass that reads the inputs. Per-block partial sums (weighted loss, clip count, token
count, sum of values, and (mean, M2) of R and of R - v for the explained variance) are
merged on the device by the launcher; nothing is synchronised with the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NPART = 8  # loss, clipped, count, sum_v, mean_R, M2_R, mean_e, M2_e


# T (row length, for the row index) and NB (the partials' row stride) are runtime values the
# JIT need not specialise (== 1, % 16): only N's specialisation helps (vectorised masked loads).
@triton.jit(do_not_specialize=["T", "NB"])
def _value_loss_kernel(
    v_ptr,
    vold_ptr,
    ret_ptr,
    mask_ptr,
    row_scale_ptr,
    grad_ptr,
    part_ptr,
    N,
    T,
    NB,
    clip,
    HAS_CLIP: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    inb = i < N
    m = (tl.load(mask_ptr + i, mask=inb, other=0).to(tl.float32) != 0.0) & inb
    # masked-out inputs are never loaded (they read as 0): NaN/inf padding cannot leak
    v = tl.load(v_ptr + i, mask=m, other=0.0).to(tl.float32)
    R = tl.load(ret_ptr + i, mask=m, other=0.0).to(tl.float32)
    w = tl.load(row_scale_ptr + i // T, mask=inb, other=0.0)
    w = tl.where(m, w, 0.0)
    d1 = v - R
    l1 = d1 * d1
    if HAS_CLIP:
        vold = tl.load(vold_ptr + i, mask=m, other=0.0).to(tl.float32)
        delta = v - vold
        vc = vold + tl.minimum(tl.maximum(delta, -clip), clip)
        d2 = vc - R
        l2 = d2 * d2
        use_clip = l2 > l1
        loss_t = 0.5 * tl.where(use_clip, l2, l1)
        # d/dv of the clipped branch: d2 where the clamp passes v through (bounds
        # inclusive, as torch.clamp's gradient), 0 outside. Ties take the unclipped branch.
        inside = (delta >= -clip) & (delta <= clip)
        dl = tl.where(use_clip, tl.where(inside, d2, 0.0), d1)
        clipped = tl.where(m & use_clip, 1.0, 0.0)
    else:
        loss_t = 0.5 * l1
        dl = d1
        clipped = tl.zeros([BLOCK], dtype=tl.float32)
    if WRITE_GRAD:
        tl.store(grad_ptr + i, w * dl, mask=inb)
    mf = m.to(tl.float32)
    cnt = tl.sum(mf, axis=0)
    vm = tl.where(m, v, 0.0)
    Rm = tl.where(m, R, 0.0)
    e = Rm - vm
    mean_R = tl.sum(Rm, axis=0) / tl.maximum(cnt, 1.0)
    mean_e = tl.sum(e, axis=0) / tl.maximum(cnt, 1.0)
    dR = tl.where(m, R - mean_R, 0.0)
    de = tl.where(m, e - mean_e, 0.0)
    tl.store(part_ptr + 0 * NB + pid, tl.sum(w * loss_t, axis=0))
    tl.store(part_ptr + 1 * NB + pid, tl.sum(clipped, axis=0))
    tl.store(part_ptr + 2 * NB + pid, cnt)
    tl.store(part_ptr + 3 * NB + pid, tl.sum(vm, axis=0))
    tl.store(part_ptr + 4 * NB + pid, mean_R)
    tl.store(part_ptr + 5 * NB + pid, tl.sum(dR * dR, axis=0))
    tl.store(part_ptr + 6 * NB + pid, mean_e)
    tl.store(part_ptr + 7 * NB + pid, tl.sum(de * de, axis=0))


def _merge(cnt: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mu = (cnt * mean).sum() / n.clamp(min=1.0)
    return mu, m2.sum() + (cnt * (mean - mu) ** 2).sum()


def value_loss_fused(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    row_scale: torch.Tensor,
    *,
    clip: float | None,
    write_grad: bool,
    block: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """Contiguous [B, T] inputs, ``row_scale`` [B] float32 ->
    (loss 0-dim, grad wrt values [B, T] float32 or None, sums).

    ``sums`` holds 0-dim float32 tensors: ``clipped`` (count of tokens using the clipped
    branch), ``count``, ``sum_v``, ``sum_R``, ``var_R``/``var_e`` (population variances of
    R and R - v over masked-in tokens).
    """
    B, T = values.shape
    N = B * T
    nb = triton.cdiv(N, block)
    part = torch.empty(_NPART, nb, dtype=torch.float32, device=values.device)
    grad = torch.empty(B, T, dtype=torch.float32, device=values.device) if write_grad else None
    _value_loss_kernel[(nb,)](
        values,
        old_values,
        returns,
        mask,
        row_scale,
        grad if grad is not None else part,
        part,
        N,
        T,
        nb,
        float(clip) if clip is not None else 0.0,
        HAS_CLIP=clip is not None,
        WRITE_GRAD=write_grad,
        BLOCK=block,
    )
    cnt_b = part[2]
    n = cnt_b.sum()
    mean_R, M2_R = _merge(cnt_b, part[4], part[5], n)
    _, M2_e = _merge(cnt_b, part[6], part[7], n)
    nn = n.clamp(min=1.0)
    sums = dict(
        clipped=part[1].sum(),
        count=n,
        sum_v=part[3].sum(),
        sum_R=mean_R * n,
        var_R=M2_R / nn,
        var_e=M2_e / nn,
    )
    return part[0].sum(), grad, sums
