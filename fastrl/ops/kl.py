"""Per-token KL penalty to a reference policy: ``kl_penalty``.

Formula (see ``fastrl.reference.kl``): with ``d = ref_logp - logp``, ``k1 = -d``,
``k2 = d^2 / 2``, ``k3 = exp(d) - d - 1`` (>= 0, with full relative precision near d = 0 on
every backend), optionally clamped to ``[-clamp, clamp]``.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from fastrl._checks import check_choice, check_float, check_nonempty, check_same_device, check_scalar, resolve_backend
from fastrl.config import KL_ESTIMATORS


def k3_expm1(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k3 = expm1(d) - d, expm1(d)), both fp32, for any float ``d``.

    Evaluated in float64: k3 ~ d^2 / 2 is the difference of two nearly equal numbers for
    small |d|, and in fp32 it has no correct digit below |d| ~ 1e-3 (and can come out
    negative). In float64 it keeps fp32 relative precision down to |d| ~ 1e-9 and is never
    negative. (The Triton kernel uses a Taylor series instead.)"""
    d64 = d.to(torch.float64)
    em1 = torch.expm1(d64)
    return (em1 - d64).to(torch.float32), em1.to(torch.float32)


def _torch_value_grad(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str, clamp: float | None,
                      *, want_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The estimate and its derivative wrt ``logp`` (fp32), vectorised PyTorch (k3 via
    ``k3_expm1``, in float64)."""
    d = _f32(ref_logp) - _f32(logp)
    g = None
    if estimator == "k1":
        k = -d
        if want_grad:
            g = torch.ones_like(d)
    elif estimator == "k2":
        k = 0.5 * d * d
        if want_grad:
            g = -d
    else:
        if ref_logp.dtype == torch.float64 or logp.dtype == torch.float64:
            d = ref_logp.to(torch.float64) - logp.to(torch.float64)  # exact d for float64 inputs
        k, em1 = k3_expm1(d)
        if want_grad:
            g = em1.neg_()
    if clamp is not None:
        if want_grad:
            g = g * (1.0 - torch.sign(k.abs() - clamp).clamp_(min=0.0))  # closed interval
        k = torch.clamp(k, -clamp, clamp)
    return k, g


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


class _KLPenaltyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, ref_logp, estimator, clamp, backend):  # type: ignore[override]
        ctx.estimator, ctx.clamp, ctx.backend = estimator, clamp, backend
        ctx.dtypes = (logp.dtype, ref_logp.dtype)
        if backend == "triton":
            from csrc_triton.kl import kl_fwd

            ctx.save_for_backward(logp, ref_logp)
            return kl_fwd(logp.contiguous(), ref_logp.contiguous(), estimator=estimator, clamp=clamp)
        # PyTorch path: the derivative is computed with the value and kept for backward
        want_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        k, g = _torch_value_grad(logp, ref_logp, estimator, clamp, want_grad=want_grad)
        ctx.save_for_backward(g)
        return k

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        need_logp, need_ref = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.backend == "triton":
            from csrc_triton.kl import kl_bwd

            logp, ref_logp = ctx.saved_tensors
            gl, gr = kl_bwd(logp.contiguous(), ref_logp.contiguous(), grad_out.contiguous(),
                            estimator=ctx.estimator, clamp=ctx.clamp, need_logp=need_logp, need_ref=need_ref)
        else:
            (g,) = ctx.saved_tensors
            g = grad_out * g
            gl = g.to(ctx.dtypes[0]) if need_logp else None
            gr = (-g).to(ctx.dtypes[1]) if need_ref else None
        return gl, gr, None, None, None


def kl_penalty(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    *,
    estimator: str = "k3",
    clamp: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Per-element estimate of KL(pi || pi_ref) from log-probs of tokens sampled from pi.

    Args:
        logp: log pi(y_t) of the sampled tokens, any shape, any float dtype.
        ref_logp: log pi_ref(y_t) of the same tokens, same shape (any float dtype).
        estimator: ``"k1"`` (-d), ``"k2"`` (d^2/2) or ``"k3"`` (exp(d) - d - 1, unbiased and
            non-negative; GRPO's choice), with ``d = ref_logp - logp`` (Schulman 2020).
        clamp: if set (> 0), the estimate is clamped to ``[-clamp, clamp]`` (zero gradient
            outside; verl clamps k3 to [-10, 10]).
        backend: ``"auto"`` (Triton on CUDA, PyTorch otherwise), ``"triton"`` or ``"torch"``.

    Returns:
        fp32 tensor of ``logp``'s shape, differentiable wrt ``logp`` and ``ref_logp``.
        Non-finite inputs give non-finite outputs (nothing is checked on the device).
    """
    check_float("logp", logp)
    check_nonempty("logp", logp)
    check_float("ref_logp", ref_logp, shape=tuple(logp.shape))
    check_choice("estimator", estimator, KL_ESTIMATORS)
    clamp = check_scalar("clamp", clamp, low=0.0, low_inclusive=False, allow_none=True)
    device = check_same_device(logp=logp, ref_logp=ref_logp)
    impl = resolve_backend(backend, device)
    return _KLPenaltyFn.apply(logp, ref_logp, estimator, clamp, impl)
