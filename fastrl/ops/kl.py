"""Per-token KL penalty to a reference policy: ``kl_penalty``.

Formula (see ``fastrl.reference.kl``): with ``d = ref_logp - logp``, ``k1 = -d``,
``k2 = d^2 / 2``, ``k3 = exp(d) - d - 1``, optionally clamped to ``[-clamp, clamp]``.
"""

from __future__ import annotations

import torch

from fastrl._checks import check_choice, check_float, check_nonempty, check_same_device, check_scalar, resolve_backend
from fastrl.config import KL_ESTIMATORS


def _torch_value_grad(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str, clamp: float | None,
                      *, want_value: bool, want_grad: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The estimate and its derivative wrt ``logp`` (fp32), vectorised PyTorch."""
    d = ref_logp.float() - logp.float()
    k = g = None
    if estimator == "k1":
        k = -d if (want_value or clamp is not None) else None
        g = torch.ones_like(d) if want_grad else None
    elif estimator == "k2":
        k = 0.5 * d * d if (want_value or clamp is not None) else None
        g = -d if want_grad else None
    else:
        em1 = torch.expm1(d)
        k = em1 - d if (want_value or clamp is not None) else None
        g = -em1 if want_grad else None
    if clamp is not None:
        if want_grad:
            g = torch.where((k >= -clamp) & (k <= clamp), g, torch.zeros((), dtype=g.dtype, device=g.device))
        k = torch.clamp(k, -clamp, clamp)
    return (k if want_value else None), g


class _KLPenaltyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, ref_logp, estimator, clamp, backend):  # type: ignore[override]
        ctx.estimator, ctx.clamp, ctx.backend = estimator, clamp, backend
        ctx.save_for_backward(logp, ref_logp)
        if backend == "triton":
            from csrc_triton.kl import kl_fwd

            return kl_fwd(logp.contiguous(), ref_logp.contiguous(), estimator=estimator, clamp=clamp)
        k, _ = _torch_value_grad(logp, ref_logp, estimator, clamp, want_value=True, want_grad=False)
        return k

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        logp, ref_logp = ctx.saved_tensors
        need_logp, need_ref = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.backend == "triton":
            from csrc_triton.kl import kl_bwd

            gl, gr = kl_bwd(logp.contiguous(), ref_logp.contiguous(), grad_out.contiguous(),
                            estimator=ctx.estimator, clamp=ctx.clamp, need_logp=need_logp, need_ref=need_ref)
        else:
            _, g = _torch_value_grad(logp, ref_logp, ctx.estimator, ctx.clamp, want_value=False, want_grad=True)
            g = grad_out.float() * g
            gl = g.to(logp.dtype) if need_logp else None
            gr = (-g).to(ref_logp.dtype) if need_ref else None
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
