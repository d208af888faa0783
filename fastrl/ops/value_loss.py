"""PPO value (critic) loss with optional value clipping, differentiable wrt ``values``.

Both backends compute the per-token gradient in the forward pass (the loss is a
weighted sum of per-token terms, so d loss / d values is known there) and the backward
only scales it by the incoming gradient: no graph of intermediate tensors is kept.
"""

from __future__ import annotations

from typing import Sequence

import torch

from fastrl._checks import (
    check_choice,
    check_float,
    check_mask,
    check_nonempty,
    check_same_device,
    check_scalar,
    resolve_backend,
)
from fastrl.config import LOSS_AGGS, NORM_LENGTH_REQUIRED, LossAgg
from fastrl.ops._segments import kernel_mask
from fastrl.ops.packing import PackedLayout, packed_to_rows
from fastrl.ops.aggregation import GlobalCounts, aggregation_weights, resolve_global_count

__all__ = ["value_loss"]


def _row_scale(mask: torch.Tensor, loss_agg: str, norm_length: float | None, global_count) -> torch.Tensor:
    """Per-row token weight [B] so that loss = sum_bt m[b,t] * row_scale[b] * l[b,t]
    (``fastrl.ops.aggregation``: ``f_b / D``)."""
    n_b = (mask != 0).sum(dim=1, dtype=torch.float32)
    f, inv_d = aggregation_weights(n_b, loss_agg=loss_agg, norm_length=norm_length, global_count=global_count)
    return f * inv_d


def _value_loss_torch(
    values: torch.Tensor,
    old_values: torch.Tensor | None,
    returns: torch.Tensor,
    mask: torch.Tensor,
    row_scale: torch.Tensor,
    clip: float | None,
    write_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """Vectorised PyTorch twin of ``csrc_triton.value_loss.value_loss_fused``."""
    m = mask != 0
    mf = m.to(torch.float32)
    # selects, not 0/1 products: NaN/inf padding must not reach any sum or gradient
    v = torch.where(m, values.to(torch.float32), 0.0)
    R = torch.where(m, returns.to(torch.float32), 0.0)
    d1 = v - R
    l1 = d1 * d1
    if clip is None:
        loss_t, dl = 0.5 * l1, d1
        clipped = torch.zeros((), dtype=torch.float32, device=v.device)
    else:
        vold = torch.where(m, old_values.to(torch.float32), 0.0)
        delta = v - vold
        d2 = vold + delta.clamp(-clip, clip) - R
        l2 = d2 * d2
        use_clip = l2 > l1
        loss_t = 0.5 * torch.where(use_clip, l2, l1)
        inside = (delta >= -clip) & (delta <= clip)
        dl = torch.where(use_clip, torch.where(inside, d2, 0.0), d1)
        clipped = (use_clip & m).sum(dtype=torch.float32)
    w = mf * row_scale[:, None]
    loss = (w * loss_t).sum()
    grad = w * dl if write_grad else None
    n = mf.sum()
    nn = n.clamp(min=1.0)
    Rm, vm = R * mf, v * mf
    mean_R = Rm.sum() / nn
    e = Rm - vm
    mean_e = e.sum() / nn
    dR = (R - mean_R) * mf
    de = (e - mean_e) * mf
    sums = dict(
        clipped=clipped,
        count=n,
        sum_v=vm.sum(),
        sum_R=Rm.sum(),
        var_R=(dR * dR).sum() / nn,
        var_e=(de * de).sum() / nn,
    )
    return loss, grad, sums


_SUM_KEYS = ("clipped", "count", "sum_v", "sum_R", "var_R", "var_e")


class _ValueLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, old_values, returns, mask, row_scale, clip, impl):
        write_grad = ctx.needs_input_grad[0]
        if impl == "triton":
            from csrc_triton.value_loss import value_loss_fused

            loss, grad, sums = value_loss_fused(
                values.contiguous(),
                (old_values if old_values is not None else values).contiguous(),
                returns.contiguous(),
                kernel_mask(mask),
                row_scale.contiguous(),
                clip=clip,
                write_grad=write_grad,
            )
        else:
            loss, grad, sums = _value_loss_torch(values, old_values, returns, mask, row_scale, clip, write_grad)
        ctx.save_for_backward(grad if grad is not None else torch.empty(0))
        ctx.values_dtype = values.dtype
        outs = tuple(sums[k] for k in _SUM_KEYS)
        ctx.mark_non_differentiable(*outs)
        return (loss, *outs)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        (grad,) = ctx.saved_tensors
        g = (grad * grad_loss).to(ctx.values_dtype) if ctx.needs_input_grad[0] else None
        return g, None, None, None, None, None, None


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor | None,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None = None,
    loss_agg: LossAgg = "token-mean",
    norm_length: float | None = None,
    global_token_count: float | torch.Tensor | None = None,
    global_seq_count: float | torch.Tensor | None = None,
    global_counts: GlobalCounts | None = None,
    backend: str = "auto",
    cu_seqlens: PackedLayout | torch.Tensor | Sequence[int] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO value loss, 0.5 * max((v - R)^2, (v_clip - R)^2), aggregated over masked tokens.

    Per token, v_clip = old_values + clamp(values - old_values, -clip, clip); with
    ``clip=None`` the loss is the plain 0.5 * (v - R)^2 (``old_values`` may then be None).

    Args:
        values: [B, T] float, the critic's current predictions (gets the gradient).
        old_values: [B, T] float, predictions at rollout time (no gradient).
        returns: [B, T] float, the regression targets R (no gradient).
        mask: [B, T] response mask (0/1, any dtype).
        clip: value clip range (> 0) or None.
        loss_agg: a ``fastrl.config.LossAgg`` name, as in ``PolicyLossConfig.loss_agg``
            (the aggregation rule of ``fastrl.ops.aggregation``).
        norm_length: constant of ``seq-mean-token-sum-norm``, required by (and only for) that
            mode (see ``PolicyLossConfig.norm_length``).
        global_token_count: replaces the local masked-token count (``token-mean`` only),
            for gradient accumulation / data parallelism.
        global_seq_count: replaces the local count of non-empty rows (``seq-*`` modes only).
            Either count: a number >= 0 or a 1-element tensor on the inputs' device (no host
            sync); 0 is taken as 1. The rule is ``fastrl._checks.check_global_count``, the
            same as ``policy_loss``'s.
        global_counts: ``fastrl.ops.GlobalCounts(tokens, sequences)`` instead of the explicit
            count: the aggregation rule uses the one ``loss_agg`` needs.
        backend: ``auto`` | ``triton`` | ``torch``.
        cu_seqlens: packed inputs: every tensor is ``[N]`` or ``[1, N]`` (``S`` sequences
            back to back) and this is their ``fastrl.ops.PackedLayout`` or host
            ``cu_seqlens`` (``[S + 1]``); the result equals that of the padded ``[S, T]``
            rows (``fastrl.ops.packing``).

    Denominators (local or global) of 0 are taken as 1: an all-masked batch gives loss 0.

    Returns:
        ``(loss, metrics)``: loss a 0-dim float32 tensor differentiable wrt ``values``;
        metrics 0-dim float32 over masked-in tokens (0 when there are none):
        ``vf_clip_frac`` (fraction of tokens where the clipped term is strictly larger;
        0 without clip), ``explained_variance`` (1 - Var(R - v) / Var(R), 0 when
        Var(R) = 0), ``value_mean``, ``return_mean``.
    """
    if cu_seqlens is not None:  # packed rows: this op on their padded [S, T] view
        _, (values, old_values, returns, mask) = packed_to_rows(
            cu_seqlens, values=values, old_values=old_values, returns=returns, mask=mask)
    check_float("values", values, ndim=2)
    check_nonempty("values", values)
    shape = tuple(values.shape)
    clip = check_scalar("clip", clip, low=0.0, low_inclusive=False, allow_none=True)
    if old_values is None:
        if clip is not None:
            raise ValueError("old_values is required when clip is set")
    else:
        check_float("old_values", old_values, shape=shape)
    check_float("returns", returns, shape=shape)
    check_mask("mask", mask, shape)
    device = check_same_device(values=values, old_values=old_values, returns=returns, mask=mask)
    check_choice("loss_agg", loss_agg, LOSS_AGGS)
    norm_length = check_scalar("norm_length", norm_length, low=0.0, low_inclusive=False, allow_none=True)
    if norm_length is not None and loss_agg != "seq-mean-token-sum-norm":
        raise ValueError(f"norm_length is only used by loss_agg='seq-mean-token-sum-norm', got loss_agg={loss_agg!r}")
    if norm_length is None and loss_agg == "seq-mean-token-sum-norm":
        raise ValueError(NORM_LENGTH_REQUIRED)
    global_count = resolve_global_count(loss_agg, device, global_counts=global_counts,
                                        global_token_count=global_token_count, global_seq_count=global_seq_count)
    impl = resolve_backend(backend, device)

    with torch.no_grad():
        row_scale = _row_scale(mask, loss_agg, norm_length, global_count)
    old = old_values.detach() if old_values is not None else None
    loss, clipped, count, sum_v, sum_R, var_R, var_e = _ValueLoss.apply(
        values, old, returns.detach(), mask, row_scale, clip, impl
    )
    nn = count.clamp(min=1.0)
    explained = torch.where(var_R > 0, 1.0 - var_e / var_R.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    metrics = {
        "vf_clip_frac": clipped / nn,
        "explained_variance": explained,
        "value_mean": sum_v / nn,
        "return_mean": sum_R / nn,
    }
    return loss, metrics
