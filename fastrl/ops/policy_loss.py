"""Policy-gradient loss for PPO/GRPO/DAPO/Dr. GRPO/GSPO/CISPO/SAPO/VESPO: ``policy_loss``.

The formula, aggregation modes and metrics are specified in ``fastrl.reference.policy_loss``
(the surrogates in ``fastrl.reference.surrogates``) and configured by
``fastrl.PolicyLossConfig``; the PyTorch backend's surrogates are ``fastrl.ops.surrogates``,
its aggregation ``fastrl.ops.aggregation``, and the ``out`` vector both backends fill is laid
out by ``csrc_triton.policy_loss_slots``. Both backends compute the loss and its
gradient wrt ``logp`` in the forward pass (one pass over the inputs); the backward only
scales the saved per-token gradient by ``grad_out / D`` (D: the aggregation denominator,
kept on the device, so global counts never synchronise with the host).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.autograd.function import once_differentiable

from csrc_triton.policy_loss_slots import OUT, OUT_KEYS
from fastrl._checks import (
    check_is_weight,
    check_float,
    check_mask,
    check_nonempty,
    check_same_device,
    resolve_backend,
)
from fastrl.config import PolicyLossConfig
from fastrl.ops.aggregation import GlobalCounts, aggregation_weights, resolve_global_count
from fastrl.ops.kl import k3_expm1
from fastrl.ops.packing import PackedLayout, packed_to_rows
from fastrl.ops.surrogates import FOLDS_ROLLOUT_WEIGHT, METRIC_NAME, SURROGATES, THROUGH_RATIO, surrogate_params


# ----------------------------------------------------------------------------------------
# PyTorch backend: the same decomposition as the Triton kernels, vectorised over [B, T]
# ----------------------------------------------------------------------------------------


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def _masks(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bool mask, 0/1 fp32 mask, int32 bit mask: -1 (all ones) / 0) of ``mask != 0``, with as
    few passes as the dtype allows. On CPU a bool -> float conversion is several times slower
    than the detour through uint8 (one vectorised pass each; measured in torch 2.13)."""
    if mask.dtype == torch.bool:
        m = mask
        mf = mask.to(torch.uint8).to(torch.float32)
    else:
        mf = _f32(mask).abs().sign()
        m = mf.bool()
    return m, mf, m.to(torch.int32).neg_()


def zero_masked(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` where the mask is set, +0.0 elsewhere, whatever sits there (NaN, inf): the
    value of ``torch.where(mask, x, 0.0)``, bit for bit, as an integer AND of the float's bits
    with ``bits`` (``_masks``'s -1/0), a vectorised pass where CPU ``where`` on a bool mask is
    several times slower. ``x`` has the mask's shape."""
    x = _f32(x).contiguous()
    return (x.view(torch.int32) & bits).view(torch.float32)


def _step(x: torch.Tensor) -> torch.Tensor:
    """1.0 where x > 0, else 0.0, in fp32 arithmetic (comparisons producing bool tensors and
    selects on them are several times slower than float ops on CPU)."""
    return torch.sign(x).clamp_(min=0.0)


def _torch_fwd(
    logp, old_logp, advantages, mask, ref_logp, entropy, rollout_logp, is_weight, *,
    surrogate, sur_params, seq_ratio, seq_is, clip_low, clip_high, dual_clip, log_ratio_clamp, kl_coef, kl_estimator,
    kl_clamp, entropy_coef, is_cap, loss_agg, norm_length, global_count, write_grad,
):
    """Vectorised eager PyTorch in few passes. Inputs are zeroed once at masked-out positions
    (``where``, so NaN/inf padding cannot leak); after that every masked-out token has
    lr = 0, A = 0 and d = 0 and adds exactly 0 to every sum, so the rest needs no select. On a
    CPU the zeroing is ``zero_masked`` (the same values as the ``where``, several times faster)."""
    f32 = torch.float32
    dev = logp.device
    zero = torch.zeros((), dtype=f32, device=dev)
    m, mf, bits = _masks(mask)

    def keep(x: torch.Tensor) -> torch.Tensor:  # torch.where(m, x, 0.0) of a [B, T] x
        return zero_masked(x, bits) if dev.type == "cpu" else torch.where(m, _f32(x), zero)

    n = mf.sum(1)
    N = n.sum()
    n1 = n.clamp(min=1.0)
    lp = _f32(logp)
    old = _f32(old_logp)
    lr = keep(lp - old)
    if log_ratio_clamp is not None:
        inside = 1.0 - _step(lr.abs() - log_ratio_clamp)  # closed interval
        lr = lr.clamp(-log_ratio_clamp, log_ratio_clamp)
    if seq_ratio:
        ratio_row = torch.exp(lr.sum(1) / n1)
        # 1 at masked-out tokens (as in token mode), so an overflowed row ratio times A = 0
        # there cannot make a NaN
        ratio = torch.where(m, ratio_row[:, None], 1.0)
    else:
        ratio = torch.exp(lr)
    A = _f32(advantages)
    if A.dim() == 1:
        A = torch.where(n > 0, A, zero)[:, None] * mf  # NaN of a row with tokens still propagates
    else:
        A = keep(A)

    # the surrogate (fastrl.ops.surrogates) and the importance weight that multiplies it
    log_is = keep(old - _f32(rollout_logp)) if rollout_logp is not None else None
    folds = surrogate in FOLDS_ROLLOUT_WEIGHT
    lp_m = None if surrogate in THROUGH_RATIO else keep(lp)  # (their loss value holds logp)
    terms = SURROGATES[surrogate](ratio, A, lp_m, lr, mf, log_is if folds else None, sur_params,
                                  dual_clip is not None, write_grad)
    pg = terms.pg
    dpg, dlogp = terms.d_ratio, terms.d_logp
    w = None
    if log_is is not None and not folds:
        w = torch.exp(log_is.sum(1, keepdim=True)) if seq_is else torch.exp(log_is)
        if is_cap is not None:
            w = w.clamp(max=is_cap)
    if is_weight is not None:
        v = torch.where(m, _f32(is_weight).reshape(lr.shape[0], -1), zero)
        w = v if w is None else w * v
    elif w is None and log_is is not None:
        w = mf  # the surrogate folded the rollout weight: reported as 1
    if w is not None:
        pg = pg * w
        if write_grad:
            if dpg is not None:
                dpg = dpg * w
            if dlogp is not None:
                dlogp = dlogp * w

    g = None
    c_row = None
    if write_grad and dlogp is not None:
        g = dlogp  # the ratio is detached: no row constant even in sequence mode
    elif write_grad:
        # where dpg == 0 (clipped, dual-clipped, A = 0, saturated gate) the gradient is exactly 0,
        # even when the ratio overflowed to inf (0 * inf would be NaN and poison the update)
        if seq_ratio:
            dpg_row = dpg.sum(1)
            c_row = torch.where(dpg_row != 0, dpg_row * ratio_row, 0.0) / n1
        else:
            g = zero_masked(dpg * ratio, dpg.bool().to(torch.int32).neg_()) if dev.type == "cpu" \
                else torch.where(dpg != 0, dpg * ratio, 0.0)  # (x.bool() is x != 0: fast on a CPU, unlike x != 0)
            if log_ratio_clamp is not None:
                g.mul_(inside)
    kl = None
    if ref_logp is not None:
        kl_grad = write_grad and kl_coef != 0
        d = keep(_f32(ref_logp) - lp)
        if kl_estimator == "k1":
            kl = -d
            dk = mf if kl_grad else None  # d k1 / d logp = 1 on the masked-in tokens
        elif kl_estimator == "k2":
            kl = 0.5 * d * d
            dk = -d if kl_grad else None
        else:
            kl, em1 = k3_expm1(d)  # in float64: full relative precision near d = 0
            dk = em1.neg_() if kl_grad else None
        if kl_clamp is not None:
            if kl_grad:
                dk = dk * (1.0 - _step(kl.abs() - kl_clamp))
            kl = kl.clamp(-kl_clamp, kl_clamp)
        if kl_grad:
            g = kl_coef * dk if g is None else g.add_(dk, alpha=kl_coef)

    # aggregation (fastrl.ops.aggregation: the rule every loss shares)
    f, inv_d = aggregation_weights(n, loss_agg=loss_agg, norm_length=norm_length, global_count=global_count)
    inv_n = 1.0 / torch.where(N > 0, N, 1.0)

    pg_loss = torch.dot(f, pg.sum(1)) * inv_d
    loss = pg_loss
    kl_loss = ent_loss = kl_mean = ent_mean = w_mean = sur_metric = zero
    if kl is not None:
        kl_rows = kl.sum(1)
        kl_loss = torch.dot(f, kl_rows) * inv_d
        kl_mean = kl_rows.sum() * inv_n
        if kl_coef != 0:
            loss = loss + kl_coef * kl_loss
    if entropy is not None:
        ent_rows = keep(entropy).sum(1)
        ent_loss = torch.dot(f, ent_rows) * inv_d
        ent_mean = ent_rows.sum() * inv_n
        if entropy_coef != 0:
            loss = loss - entropy_coef * ent_loss

    # metrics; A = 0 at masked-out tokens, so the sign tests need no mask
    lo, hi = 1.0 - clip_low, 1.0 + clip_high
    sA = torch.sign(A)
    r_bt = ratio.expand_as(lr)
    low = torch.dot(_step(lo - r_bt).reshape(-1), (-sA).clamp_(min=0.0).reshape(-1)) * inv_n
    high = torch.dot(_step(r_bt - hi).reshape(-1), sA.clamp_(min=0.0).reshape(-1)) * inv_n
    if terms.metric is not None:
        sur_metric = terms.metric.sum() * inv_n  # the surrogate's own metric (METRIC_NAME)
    approx_kl = k3_expm1(lr)[0].sum() * inv_n  # (rho - 1) - log rho of the token ratio rho = exp(lr)
    if seq_ratio:
        r_mean = torch.dot(ratio_row, n) * inv_n
        r_min = torch.where(n > 0, ratio_row, torch.inf).min()
        r_max = torch.where(n > 0, ratio_row, -torch.inf).max()
    else:
        r_mean = torch.dot(ratio.reshape(-1), mf.reshape(-1)) * inv_n
        big = (1.0 - mf) * torch.finfo(f32).max  # +-max at masked-out tokens (where the ratio is 1)
        r_min = (ratio + big).min()
        r_max = (ratio - big).max()
    has_tok = N > 0
    r_min = torch.where(has_tok, r_min, zero)
    r_max = torch.where(has_tok, r_max, zero)
    if w is not None:
        w_mean = (torch.dot(w[:, 0], n) if w.shape[1] == 1 else torch.dot(w.reshape(-1), mf.reshape(-1))) * inv_n
    slots = dict(
        loss=loss, pg_loss=pg_loss, kl_loss=kl_loss, entropy_loss=ent_loss, clip_frac_low=low, clip_frac_high=high,
        clip_frac=low + high, surrogate_metric=sur_metric, approx_kl=approx_kl, kl_ref_mean=kl_mean, ratio_mean=r_mean,
        ratio_min=r_min, ratio_max=r_max, entropy_mean=ent_mean, is_weight_mean=w_mean, inv_denominator=inv_d,
    )
    out = torch.stack([slots[k] for k in OUT_KEYS])  # the kernels' layout (csrc_triton.policy_loss_slots)
    rowcoef = torch.stack([f, f * c_row if c_row is not None else torch.zeros_like(f)], dim=1)
    return out, rowcoef, g


def _torch_bwd(grad_out, out, rowcoef, g, mask, logp, old_logp, entropy, *,
               seq_ratio, log_ratio_clamp, entropy_coef, need_logp, need_entropy):
    scale = grad_out.reshape(-1)[0].float() * out[OUT["inv_denominator"]]
    mf = _masks(mask)[1] if (seq_ratio or need_entropy) else None
    f = rowcoef[:, 0:1]
    glogp = gent = None
    if need_logp:
        dl = f * g if g is not None else None
        if seq_ratio:
            p = mf
            if log_ratio_clamp is not None:
                lr = torch.where(mf > 0, _f32(logp) - _f32(old_logp), 0.0)
                p = p * (1.0 - _step(lr.abs() - log_ratio_clamp))
            kterm = p * rowcoef[:, 1:2]
            dl = kterm if dl is None else dl + kterm
        glogp = (scale * dl).to(logp.dtype)
    if need_entropy:
        gent = (mf * ((-entropy_coef) * scale * f)).to(entropy.dtype)
    return glogp, gent


# ----------------------------------------------------------------------------------------
# autograd and the public op
# ----------------------------------------------------------------------------------------


class _PolicyLossFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, entropy, old_logp, advantages, mask, ref_logp, rollout_logp, is_weight, global_count, kw, backend, tiles):  # type: ignore[override]
        write_grad = ctx.needs_input_grad[0]
        launch = {}
        if backend == "triton":
            from csrc_triton.policy_loss import policy_loss_fwd as fwd

            launch = {"tiles": tiles}
        else:
            fwd = _torch_fwd
        out, rowcoef, g = fwd(logp, old_logp, advantages, mask, ref_logp, entropy, rollout_logp, is_weight,
                              global_count=global_count, write_grad=write_grad, **kw, **launch)
        ctx.kw, ctx.backend, ctx.launch = kw, backend, launch
        ctx.save_for_backward(out, rowcoef, g, mask, logp, old_logp, entropy)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        out, rowcoef, g, mask, logp, old_logp, entropy = ctx.saved_tensors
        kw = ctx.kw
        need_logp = ctx.needs_input_grad[0]
        need_entropy = ctx.needs_input_grad[1] and kw["entropy_coef"] != 0
        if ctx.backend == "triton":
            from csrc_triton.policy_loss import policy_loss_bwd as bwd
        else:
            bwd = _torch_bwd
        glogp, gent = bwd(grad_out.contiguous(), out, rowcoef, g, mask, logp, old_logp, entropy,
                          seq_ratio=kw["seq_ratio"], log_ratio_clamp=kw["log_ratio_clamp"],
                          entropy_coef=kw["entropy_coef"], need_logp=need_logp, need_entropy=need_entropy,
                          **ctx.launch)
        return glogp, gent, None, None, None, None, None, None, None, None, None, None


def _unit_col(x: torch.Tensor | None) -> torch.Tensor | None:
    if x is None or x.shape[-1] <= 1 or x.stride(-1) == 1:
        return x
    return x.contiguous()


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    is_weight: torch.Tensor | None = None,
    proximal_logp: torch.Tensor | None = None,
    config: PolicyLossConfig = PolicyLossConfig(),
    global_token_count: torch.Tensor | float | None = None,
    global_seq_count: torch.Tensor | float | None = None,
    global_counts: GlobalCounts | None = None,
    backend: str = "auto",
    cu_seqlens: PackedLayout | torch.Tensor | Sequence[int] | None = None,
    tiles: dict[str, int] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy-gradient loss (``config.surrogate``: PPO clip, CISPO, SAPO, VESPO) with KL and
    entropy terms, and its metrics.

    Args:
        logp: ``[B, T]`` log-probs of the sampled tokens under the policy being trained
            (differentiable), right-padded, any float dtype.
        old_logp: ``[B, T]`` log-probs under the policy that the ratio is taken against.
        advantages: ``[B, T]`` per-token or ``[B]`` per-sequence advantages (a ``[B]`` value
            applies to every token of its row).
        mask: ``[B, T]`` response mask, any dtype; non-zero marks the tokens of the loss.
            Values of the other inputs at masked-out positions are ignored (may be NaN/inf).
        ref_logp: ``[B, T]`` reference-policy log-probs; required when ``config.kl_coef != 0``,
            and with it the KL metrics are reported even when ``kl_coef == 0``.
        entropy: ``[B, T]`` per-token entropy; required when ``config.entropy_coef != 0``
            (differentiable then).
        rollout_logp: ``[B, T]`` log-probs of the sampler (e.g. vLLM): enables the truncated
            importance weights ``min(exp(old_logp - rollout_logp), config.is_cap)``
            (``surrogate="vespo"`` takes the log-weight into its sequence weight instead).
        is_weight: ready-made importance weights (no gradient) that multiply the
            policy-gradient term: ``[B, T]`` per token, or ``[B]`` / ``[B, 1]`` per sequence
            (e.g. a trainer's vLLM correction or token masks); with ``rollout_logp`` the two
            multiply. Non-negative finite values are expected (not checked: no host sync).
        proximal_logp: ``[B, T]`` decoupled PPO (AReaL, arXiv 2505.24298; asynchronous
            training): log-probs of the *proximal* policy (the trainer's at the start of the
            update), which the ratio is taken and clipped against; ``old_logp`` is then the
            *behaviour* policy that sampled the tokens (a sampler some updates behind), and
            the policy-gradient term is weighted (no gradient) by the behaviour weight
            ``min(exp(proximal_logp - old_logp), config.is_cap)`` at ``config.is_level``. It is
            the rollout weight with the roles named (``reference.policy_loss``): not with
            ``rollout_logp``.
        config: ``PolicyLossConfig`` (see its field docs and ``PolicyLossConfig.preset``).
        global_token_count: replaces the local token count of ``loss_agg="token-mean"``
            (gradient accumulation / data parallel: pass the count of the whole batch).
        global_seq_count: replaces the local count of non-empty rows of the ``seq-*`` modes.
            Either count: a number >= 0 or a 1-element tensor on the inputs' device (read on
            the device, no host sync); 0 is taken as 1, so a fully masked batch has loss 0.
            The rule is ``fastrl._checks.check_global_count``, shared by every loss op.
        global_counts: ``fastrl.ops.GlobalCounts(tokens, sequences)``, the whole batch's
            counts (gradient accumulation / data parallel); the aggregation rule uses the
            one ``config.loss_agg`` needs (``fastrl.ops.aggregation.global_count_for``).
            The alternative to the explicit ``global_token_count`` / ``global_seq_count``.
        backend: ``"auto"`` (Triton on CUDA, PyTorch otherwise), ``"triton"`` or ``"torch"``.
        cu_seqlens: packed inputs: the per-token tensors are ``[N]`` or ``[1, N]`` (``S``
            sequences back to back) and this is their ``fastrl.ops.PackedLayout`` or host
            ``cu_seqlens`` (``[S + 1]``); ``advantages`` may be per sequence ``[S]``. Loss,
            metrics and gradients equal those of the padded ``[S, T]`` rows
            (``fastrl.ops.packing``).
        tiles: Triton launch tiles, any of ``block_t`` (tokens per program), ``block_b``
            (rows per finalize step), ``block_c`` (chunk partials per step); powers of two,
            defaults ``csrc_triton.policy_loss.DEFAULT_TILES``. Results do not depend on
            them (tests use small tiles so a row spans several programs); ignored by the
            PyTorch backend.

    Returns:
        ``(loss, metrics)``: the 0-dim fp32 loss and a dict of 0-dim fp32 tensors: pg_loss,
        approx_kl, ratio_mean, ratio_min, ratio_max; for ``ppo_clip`` clip_frac_low,
        clip_frac_high, clip_frac and dual_clip_frac (if ``config.dual_clip``);
        cispo_clip_frac (``cispo``), vespo_phi_mean (``vespo``); kl_loss and kl_ref_mean (if
        ``ref_logp``), entropy_loss and entropy_mean (if ``entropy``), is_weight_mean (if
        ``rollout_logp`` or ``is_weight``). Definitions: ``fastrl.reference.policy_loss``.
    """
    if not isinstance(config, PolicyLossConfig):
        raise TypeError(f"config must be a PolicyLossConfig, got {type(config).__name__}")
    if proximal_logp is not None:
        if rollout_logp is not None:
            raise ValueError("proximal_logp (decoupled PPO) weights by the behaviour policy old_logp already: "
                             "rollout_logp must be None with it")
        check_float("proximal_logp", proximal_logp, shape=tuple(getattr(old_logp, "shape", ())) or None)
        # decoupled PPO is the rollout-weighted loss with the roles named: the ratio against the
        # proximal policy, the weight exp(proximal - behaviour) (fastrl.reference.policy_loss)
        old_logp, rollout_logp = proximal_logp, old_logp
    if cu_seqlens is not None:  # packed rows: this op on their padded [S, T] view
        _, (logp, old_logp, advantages, mask, ref_logp, entropy, rollout_logp, is_weight) = packed_to_rows(
            cu_seqlens, logp=logp, old_logp=old_logp, advantages=advantages, mask=mask, ref_logp=ref_logp,
            entropy=entropy, rollout_logp=rollout_logp, is_weight=is_weight, per_sequence=("advantages", "is_weight"))
    check_float("logp", logp, ndim=2)
    check_nonempty("logp", logp)
    B, T = logp.shape
    check_float("old_logp", old_logp, shape=(B, T))
    check_float("advantages", advantages)
    if tuple(advantages.shape) not in ((B, T), (B,)):
        raise ValueError(f"advantages must have shape (B, T) = {(B, T)} or (B,) = {(B,)}, got {tuple(advantages.shape)}")
    check_mask("mask", mask, (B, T))
    for name, t in (("ref_logp", ref_logp), ("entropy", entropy), ("rollout_logp", rollout_logp)):
        if t is not None:
            check_float(name, t, shape=(B, T))
    check_is_weight(is_weight, B, T)
    if config.kl_coef != 0 and ref_logp is None:
        raise ValueError(f"ref_logp is required when config.kl_coef != 0 (got kl_coef={config.kl_coef})")
    if config.entropy_coef != 0 and entropy is None:
        raise ValueError(f"entropy is required when config.entropy_coef != 0 (got entropy_coef={config.entropy_coef})")
    device = check_same_device(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask,
                               ref_logp=ref_logp, entropy=entropy, rollout_logp=rollout_logp,
                               is_weight=is_weight)
    global_count = resolve_global_count(config.loss_agg, device, global_counts=global_counts,
                                        global_token_count=global_token_count, global_seq_count=global_seq_count)
    impl = resolve_backend(backend, device)
    if impl == "triton" and tiles:
        from csrc_triton.policy_loss import resolve_tiles

        tiles = resolve_tiles(tiles)  # bad names/values fail here, before any work

    kw = dict(
        surrogate=config.surrogate,
        sur_params=surrogate_params(config),
        seq_ratio=config.ratio_level == "sequence",
        seq_is=config.is_level == "sequence",
        clip_low=config.clip_low,
        clip_high=config.clip_high,
        dual_clip=config.dual_clip,
        log_ratio_clamp=config.log_ratio_clamp,
        kl_coef=config.kl_coef,
        kl_estimator=config.kl_estimator,
        kl_clamp=config.kl_clamp,
        entropy_coef=config.entropy_coef,
        is_cap=config.is_cap,
        loss_agg=config.loss_agg,
        norm_length=float(config.norm_length or 1.0),  # (required by the config for the mode that uses it)
    )
    if impl == "triton":
        logp, old_logp, mask, ref_logp, entropy, rollout_logp = (
            _unit_col(t) for t in (logp, old_logp, mask, ref_logp, entropy, rollout_logp))
        if advantages.dim() == 2:
            advantages = _unit_col(advantages)
        if is_weight is not None:  # the kernel reads a [B, T] unit-stride weight
            is_weight = is_weight.reshape(B, -1).expand(B, T).contiguous()
    if is_weight is not None:
        is_weight = is_weight.detach()
    out = _PolicyLossFn.apply(logp, entropy, old_logp, advantages, mask, ref_logp, rollout_logp, is_weight,
                              global_count, kw, impl, tiles)
    loss = out[0]
    od = out.detach()
    metrics = {k: od[OUT[k]] for k in ("pg_loss", "approx_kl", "ratio_mean", "ratio_min", "ratio_max")}
    if config.surrogate == "ppo_clip":
        metrics.update((k, od[OUT[k]]) for k in ("clip_frac_low", "clip_frac_high", "clip_frac"))
    if config.surrogate != "ppo_clip" or config.dual_clip is not None:
        if config.surrogate in METRIC_NAME:  # the surrogate's own metric shares the dual-clip slot
            metrics[METRIC_NAME[config.surrogate]] = od[OUT["surrogate_metric"]]
    keys = []
    if ref_logp is not None:
        keys += ["kl_loss", "kl_ref_mean"]
    if entropy is not None:
        keys += ["entropy_loss", "entropy_mean"]
    if rollout_logp is not None or is_weight is not None:
        keys.append("is_weight_mean")
    metrics.update((k, od[OUT[k]]) for k in keys)
    return loss, metrics


__all__ = ["policy_loss"]
