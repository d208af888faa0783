"""Triton kernels for the clipped policy-gradient loss (see ``fastrl.reference.policy_loss``).

Layout: ``[B, T]`` inputs with unit column stride (any row stride), a ``[B, T]`` mask of
any dtype (non-zero = in), per-row ``[B]`` or per-token ``[B, T]`` advantages. The grid is
``(B, NC)``: one program per row chunk of ``BLOCK`` tokens, so long rows still spread over
the whole GPU. All arithmetic is fp32.

Kernels (at most four launches per forward + backward):

1. ``_row_pre_kernel`` (sequence ratio or sequence IS weights only): per chunk, the masked
   token count, sum of log-ratios and sum of old - rollout log-prob differences.
2. ``_policy_fwd_kernel``: one pass over the inputs. Reads every input once and writes
   ``g`` = d(row loss)/d(logp) per token (before the row factor and the global denominator;
   in sequence mode only the KL part, the rest is a per-row constant), plus 13 partial
   sums per chunk (loss terms and metric numerators).
3. ``_policy_finalize_kernel`` (one program): reduces the partials in a fixed order
   (deterministic, no atomics), applies the aggregation denominators (a global count may be
   a device pointer: no host sync) and writes the loss, every metric and ``1/D`` into one
   fp32 vector, and per row the factor ``f_b`` and the sequence-ratio constant ``K_b``.
4. ``_policy_bwd_kernel``: ``dlogp = grad_out / D * (f_b g + K_b [m and inside the clamp])`` and
   ``dentropy = -entropy_coef grad_out / D f_b m``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from csrc_triton.kl import KL_ESTIMATOR_IDS, k3_f32, kl_value_grad
from csrc_triton.policy_loss_slots import NOUT, NPART, OUT, OUT_KEYS, PART  # noqa: F401  (OUT_KEYS: re-exported)

SURROGATE_IDS = {"ppo_clip": 0, "cispo": 1, "sapo": 2, "vespo": 3}
"""The fwd kernel's ``SURROGATE`` constexpr per ``PolicyLossConfig.surrogate``: each record's
``kernel_id`` (``fastrl.config.SURROGATE_SPECS``; this package imports nothing of fastrl, so
``tests/ops/test_surrogates.py`` holds the two equal)."""
LOGP_ONLY_SURROGATES = frozenset({"cispo", "vespo"})
"""The kernel's surrogates that differentiate ``logp`` alone, the ratio detached (the records
whose ``through_ratio`` is False; held equal by the same test)."""
_S_PPO_CLIP = tl.constexpr(SURROGATE_IDS["ppo_clip"])
_S_CISPO = tl.constexpr(SURROGATE_IDS["cispo"])
_S_SAPO = tl.constexpr(SURROGATE_IDS["sapo"])
_S_VESPO = tl.constexpr(SURROGATE_IDS["vespo"])
_VESPO_LOG_RATIO_CLAMP = 20.0  # VESPO's per-token log-ratio clamp (its row sum comes from the pre-pass)
AGG_IDS = {"token-mean": 0, "seq-mean-token-mean": 1, "seq-mean-token-sum": 2, "seq-mean-token-sum-norm": 3}
# the fwd kernel's partial-sum slots (named in csrc_triton.policy_loss_slots.PART_KEYS)
_P_N = tl.constexpr(PART["n"])
_P_PG = tl.constexpr(PART["pg"])
_P_KL = tl.constexpr(PART["kl"])
_P_ENT = tl.constexpr(PART["ent"])
_P_LOW = tl.constexpr(PART["low"])
_P_HIGH = tl.constexpr(PART["high"])
_P_SMET = tl.constexpr(PART["surrogate_metric"])
_P_AKL = tl.constexpr(PART["approx_kl"])
_P_RSUM = tl.constexpr(PART["ratio_sum"])
_P_RMIN = tl.constexpr(PART["ratio_min"])
_P_RMAX = tl.constexpr(PART["ratio_max"])
_P_WSUM = tl.constexpr(PART["is_weight_sum"])
_P_ROWC = tl.constexpr(PART["row_const"])
_NPART = tl.constexpr(NPART)
# the finalize kernel's output slots (csrc_triton.policy_loss_slots.OUT_KEYS)
_O_LOSS = tl.constexpr(OUT["loss"])
_O_PG_LOSS = tl.constexpr(OUT["pg_loss"])
_O_KL_LOSS = tl.constexpr(OUT["kl_loss"])
_O_ENTROPY_LOSS = tl.constexpr(OUT["entropy_loss"])
_O_CLIP_FRAC_LOW = tl.constexpr(OUT["clip_frac_low"])
_O_CLIP_FRAC_HIGH = tl.constexpr(OUT["clip_frac_high"])
_O_CLIP_FRAC = tl.constexpr(OUT["clip_frac"])
_O_SURROGATE_METRIC = tl.constexpr(OUT["surrogate_metric"])
_O_APPROX_KL = tl.constexpr(OUT["approx_kl"])
_O_KL_REF_MEAN = tl.constexpr(OUT["kl_ref_mean"])
_O_RATIO_MEAN = tl.constexpr(OUT["ratio_mean"])
_O_RATIO_MIN = tl.constexpr(OUT["ratio_min"])
_O_RATIO_MAX = tl.constexpr(OUT["ratio_max"])
_O_ENTROPY_MEAN = tl.constexpr(OUT["entropy_mean"])
_O_IS_WEIGHT_MEAN = tl.constexpr(OUT["is_weight_mean"])
_O_INV_DENOMINATOR = tl.constexpr(OUT["inv_denominator"])
# Tokens per program, whatever the row length T: a block that followed T (next_pow2(T)) made
# every kernel here compile again as the padded length changed from step to step. 1024 fp32
# per input per program keeps enough bytes in flight for these memory-bound passes; rows
# shorter than a block only mask lanes (masked lanes issue no memory traffic, and the ALU
# work they waste is idle in a memory-bound kernel anyway).
MAX_BLOCK_T = 1024
BLOCK_B = 32  # rows per step of the finalize loop
BLOCK_C = 8  # chunks per step of the loops over a row's chunk partials (a runtime count)
DEFAULT_TILES: dict[str, int] = {"block_t": MAX_BLOCK_T, "block_b": BLOCK_B, "block_c": BLOCK_C}
"""The launch tiles of ``policy_loss_fwd``/``policy_loss_bwd`` (``tiles=`` overrides any of
them; each a power of two). Results do not depend on them: tests pass small tiles so that
rows span several programs and the loops over partials take several steps."""


def resolve_tiles(tiles: dict[str, int] | None) -> dict[str, int]:
    """``DEFAULT_TILES`` with the given overrides; unknown names or values that are not
    positive powers of two are a ``ValueError``."""
    if not tiles:
        return DEFAULT_TILES
    unknown = set(tiles) - set(DEFAULT_TILES)
    if unknown:
        raise ValueError(f"tiles: unknown names {sorted(unknown)}; known: {sorted(DEFAULT_TILES)}")
    for name, v in tiles.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1):
            raise ValueError(f"tiles[{name!r}] must be a positive power of two, got {v!r}")
    return {**DEFAULT_TILES, **tiles}


# NC (and B) are runtime counts, exempt from the JIT's integer specialisation (== 1, % 16):
# they only address partials, so specialising them would buy nothing but compiles.
@triton.jit(do_not_specialize=["NC"])
def _row_pre_kernel(
    logp_ptr, old_ptr, mask_ptr, roll_ptr, pre_ptr,
    T, NC, s_logp, s_old, s_mask, s_roll, lr_clamp,
    SEQ_RATIO: tl.constexpr, SEQ_IS: tl.constexpr, HAS_LR_CLAMP: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    inb = offs < T
    m = tl.load(mask_ptr + b * s_mask + offs, mask=inb, other=0).to(tl.float32) != 0.0
    n = tl.sum(m.to(tl.float32), axis=0)
    old = tl.load(old_ptr + b * s_old + offs, mask=inb, other=0.0).to(tl.float32)
    s_lr = n * 0.0
    s_is = n * 0.0
    if SEQ_RATIO:
        lp = tl.load(logp_ptr + b * s_logp + offs, mask=inb, other=0.0).to(tl.float32)
        lr = tl.where(m, lp - old, 0.0)
        if HAS_LR_CLAMP:
            lr = tl.minimum(tl.maximum(lr, -lr_clamp), lr_clamp)
        s_lr = tl.sum(lr, axis=0)
    if SEQ_IS:
        ro = tl.load(roll_ptr + b * s_roll + offs, mask=inb, other=0.0).to(tl.float32)
        s_is = tl.sum(tl.where(m, old - ro, 0.0), axis=0)
    base = pre_ptr + (b * NC + c) * 3
    tl.store(base + 0, n)
    tl.store(base + 1, s_lr)
    tl.store(base + 2, s_is)


@triton.jit
def _row_pre_sums(pre_ptr, b, NC, BLOCK_C: tl.constexpr):
    """A row's totals of the pre-pass partials (tokens, log-ratio sum, IS log-weight sum),
    ``BLOCK_C`` chunks at a time up to the runtime chunk count ``NC``."""
    cols = tl.arange(0, BLOCK_C)
    acc_n = tl.zeros([BLOCK_C], tl.float32)
    acc_lr = tl.zeros([BLOCK_C], tl.float32)
    acc_is = tl.zeros([BLOCK_C], tl.float32)
    # a while loop: ``range`` over a runtime bound breaks the interpreter under NumPy >= 2.4
    c0 = NC * 0
    while c0 < NC:
        cm = c0 + cols < NC
        pre = pre_ptr + (b * NC + c0 + cols) * 3
        acc_n += tl.load(pre + 0, mask=cm, other=0.0)
        acc_lr += tl.load(pre + 1, mask=cm, other=0.0)
        acc_is += tl.load(pre + 2, mask=cm, other=0.0)
        c0 += BLOCK_C
    return tl.sum(acc_n, axis=0), tl.sum(acc_lr, axis=0), tl.sum(acc_is, axis=0)


@triton.jit(do_not_specialize=["NC"])
def _policy_fwd_kernel(
    logp_ptr, old_ptr, adv_ptr, mask_ptr, ref_ptr, ent_ptr, roll_ptr, isw_ptr, pre_ptr, grad_ptr, part_ptr,
    T, NC,
    s_logp, s_old, s_adv_row, s_adv_col, s_mask, s_ref, s_ent, s_roll, s_isw, s_grad,
    ratio_lo, ratio_hi, dual_clip, lr_clamp, kl_coef, kl_clamp, is_cap, sp0, sp1, sp2, sp3,
    SURROGATE: tl.constexpr,
    SEQ_RATIO: tl.constexpr, SEQ_IS: tl.constexpr, HAS_DUAL: tl.constexpr, HAS_LR_CLAMP: tl.constexpr,
    HAS_REF: tl.constexpr, KL_EST: tl.constexpr, HAS_KL_CLAMP: tl.constexpr, HAS_ENT: tl.constexpr,
    HAS_IS: tl.constexpr, HAS_IS_CAP: tl.constexpr, HAS_ISW: tl.constexpr, KL_GRAD: tl.constexpr,
    WRITE_GRAD: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr,
):
    # SURROGATE (SURROGATE_IDS, the _S_* constants): ppo_clip, cispo, sapo, vespo; sp0..sp3 its scalars
    # (fastrl.ops.surrogates.surrogate_params). ppo_clip and sapo differentiate through the
    # ratio (dpg = d pg / d ratio); cispo and vespo through logp only (dlp = d pg / d logp).
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    inb = offs < T
    m = tl.load(mask_ptr + b * s_mask + offs, mask=inb, other=0).to(tl.float32) != 0.0
    mf = m.to(tl.float32)
    lp = tl.load(logp_ptr + b * s_logp + offs, mask=inb, other=0.0).to(tl.float32)
    old = tl.load(old_ptr + b * s_old + offs, mask=inb, other=0.0).to(tl.float32)
    A = tl.load(adv_ptr + b * s_adv_row + offs * s_adv_col, mask=inb, other=0.0).to(tl.float32)
    A = tl.where(m, A, 0.0)
    lr = tl.where(m, lp - old, 0.0)
    if HAS_LR_CLAMP:
        inside_lr = (lr >= -lr_clamp) & (lr <= lr_clamp)
        lr = tl.minimum(tl.maximum(lr, -lr_clamp), lr_clamp)

    # per-row quantities of the sequence modes (and VESPO's row weight), from the pre-pass partials
    if SEQ_RATIO or SEQ_IS or SURROGATE == _S_VESPO:
        n_row, lr_row, is_row = _row_pre_sums(pre_ptr, b, NC, BLOCK_C)
    if SEQ_RATIO:
        s_row = lr_row / tl.maximum(n_row, 1.0)
        ratio_row = tl.exp(s_row)
        ratio = tl.zeros([BLOCK], tl.float32) + ratio_row
    else:
        ratio = tl.exp(lr)

    zero_t = tl.zeros([BLOCK], tl.float32)
    smet = zero_t  # the surrogate's own per-token metric (partial 6)
    dpg = zero_t
    dlp = zero_t
    if SURROGATE == _S_PPO_CLIP:
        # clipped surrogate and its derivative wrt the ratio
        clipped = tl.minimum(tl.maximum(ratio, ratio_lo), ratio_hi)
        pg1 = -A * ratio
        pg2 = -A * clipped
        take1 = pg1 >= pg2
        pg = tl.where(take1, pg1, pg2)
        dpg = tl.where(take1, -A, 0.0)
        if HAS_DUAL:
            pg3 = -A * dual_clip
            dual_on = (A < 0) & (pg > pg3)
            pg = tl.where(dual_on, pg3, pg)
            dpg = tl.where(dual_on, 0.0, dpg)
            smet = dual_on.to(tl.float32)
    elif SURROGATE == _S_CISPO:
        # CISPO: -sg(min(r, cispo_max)) A logp
        dlp = -tl.minimum(ratio, sp0) * A
        pg = dlp * tl.where(m, lp, 0.0)
        smet = ((ratio > sp0) & (A > 0)).to(tl.float32)
    elif SURROGATE == _S_SAPO:
        # SAPO: -(4 / tau) sigmoid(tau (r - 1)) A
        tau = tl.where(A > 0, sp0, sp1)
        gate = tl.sigmoid(tau * (ratio - 1.0))
        pg = -4.0 * gate * A / tau
        dpg = -4.0 * A * gate * (1.0 - gate)
    else:
        # VESPO: -sg(phi) A logp, phi = exp(lam + k log w - lam w) of the row's log weight
        log_w = lr_row
        if HAS_IS:
            log_w += is_row
        log_w = tl.minimum(tl.maximum(log_w, -18.420680743952367), 20.0)  # [log 1e-8, 20]
        nonneg = A >= 0
        k = tl.where(nonneg, sp0, sp2)
        lam = tl.maximum(tl.where(nonneg, sp1, sp3), 1e-4)
        phi = tl.exp(lam + k * log_w - lam * tl.exp(log_w))
        phi = tl.where((phi == phi) & (phi < float("inf")), phi, 0.0)
        dlp = -phi * A
        pg = dlp * tl.where(m, lp, 0.0)
        smet = tl.where(m, phi, 0.0)
    if HAS_IS or HAS_ISW:
        w = tl.where(m, 1.0, 0.0)
        if HAS_IS and SURROGATE != _S_VESPO:  # VESPO folded the rollout weight into phi
            if SEQ_IS:
                w = w * tl.exp(is_row)
            else:
                ro = tl.load(roll_ptr + b * s_roll + offs, mask=inb, other=0.0).to(tl.float32)
                w = tl.exp(tl.where(m, old - ro, 0.0))
            if HAS_IS_CAP:
                w = tl.minimum(w, is_cap)
        if HAS_ISW:
            w = w * tl.where(m, tl.load(isw_ptr + b * s_isw + offs, mask=inb, other=0.0).to(tl.float32), 0.0)
        pg = pg * w
        dpg = dpg * w
        dlp = dlp * w

    # where dpg == 0 (clipped, dual-clipped, A = 0, saturated gate) the gradient is exactly 0,
    # even when the ratio overflowed to inf (0 * inf would be NaN)
    if SURROGATE == _S_CISPO or SURROGATE == _S_VESPO:
        g = tl.where(m, dlp, 0.0)  # the ratio is detached: no row constant even in sequence mode
        c_part = tl.sum(mf, axis=0) * 0.0
    elif SEQ_RATIO:
        g = tl.zeros([BLOCK], tl.float32)
        dpg_sum = tl.sum(tl.where(m, dpg, 0.0), axis=0)
        c_part = tl.where(dpg_sum != 0.0, dpg_sum * ratio_row, 0.0) / tl.maximum(n_row, 1.0)
    else:
        g = tl.where(dpg != 0.0, dpg * ratio, 0.0)
        if HAS_LR_CLAMP:
            g = tl.where(inside_lr, g, 0.0)
        c_part = tl.sum(mf, axis=0) * 0.0

    if HAS_REF:
        rf = tl.load(ref_ptr + b * s_ref + offs, mask=inb, other=0.0).to(tl.float32)
        k, dk = kl_value_grad(tl.where(m, lp, 0.0), tl.where(m, rf, 0.0), kl_clamp, KL_EST, HAS_KL_CLAMP)
        k = tl.where(m, k, 0.0)
        if KL_GRAD:
            g = g + kl_coef * dk
    if WRITE_GRAD:
        tl.store(grad_ptr + b * s_grad + offs, tl.where(m, g, 0.0), mask=inb)

    # partial sums of this chunk
    n = tl.sum(mf, axis=0)
    zero = n * 0.0
    base = part_ptr + (b * NC + c) * _NPART
    tl.store(base + _P_N, n)
    tl.store(base + _P_PG, tl.sum(tl.where(m, pg, 0.0), axis=0))
    if HAS_REF:
        tl.store(base + _P_KL, tl.sum(k, axis=0))
    else:
        tl.store(base + _P_KL, zero)
    if HAS_ENT:
        e = tl.load(ent_ptr + b * s_ent + offs, mask=inb, other=0.0).to(tl.float32)
        tl.store(base + _P_ENT, tl.sum(tl.where(m, e, 0.0), axis=0))
    else:
        tl.store(base + _P_ENT, zero)
    low = m & (ratio < ratio_lo) & (A < 0)
    high = m & (ratio > ratio_hi) & (A > 0)
    tl.store(base + _P_LOW, tl.sum(low.to(tl.float32), axis=0))
    tl.store(base + _P_HIGH, tl.sum(high.to(tl.float32), axis=0))
    tl.store(base + _P_SMET, tl.sum(tl.where(m, smet, 0.0), axis=0))
    tl.store(base + _P_AKL, tl.sum(tl.where(m, k3_f32(lr), 0.0), axis=0))
    tl.store(base + _P_RSUM, tl.sum(tl.where(m, ratio, 0.0), axis=0))
    tl.store(base + _P_RMIN, tl.min(tl.where(m, ratio, float("inf")), axis=0))
    tl.store(base + _P_RMAX, tl.max(tl.where(m, ratio, float("-inf")), axis=0))
    if HAS_IS or HAS_ISW:
        tl.store(base + _P_WSUM, tl.sum(tl.where(m, w, 0.0), axis=0))
    else:
        tl.store(base + _P_WSUM, zero)
    tl.store(base + _P_ROWC, c_part)


@triton.jit(do_not_specialize=["B", "NC"])
def _policy_finalize_kernel(
    part_ptr, out_ptr, rowcoef_ptr, gcount_ptr,
    B, NC, gcount_val, norm_length, kl_coef, entropy_coef,
    AGG: tl.constexpr, HAS_GPTR: tl.constexpr, HAS_GVAL: tl.constexpr,
    USE_KL: tl.constexpr, USE_ENT: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_B)
    cols = tl.arange(0, BLOCK_C)
    zero = tl.sum(tl.zeros([BLOCK_B], tl.float32), axis=0)
    N = zero
    S = zero
    pg_t = zero
    kl_t = zero
    ent_t = zero
    low_t = zero
    high_t = zero
    smet_t = zero
    akl_t = zero
    kl_sum = zero
    ent_sum = zero
    r_sum = zero
    r_min = zero + float("inf")
    r_max = zero + float("-inf")
    w_sum = zero
    # while loops: ``range`` over a runtime bound breaks the interpreter under NumPy >= 2.4.
    # Rows BLOCK_B at a time; within them the chunk partials BLOCK_C columns at a time (the
    # per-row sums must be complete before the row factor f_b = 1/n_b is known).
    b0 = B * 0
    while b0 < B:
        rb = b0 + rows
        rmask = rb < B
        row_base = part_ptr + rb[:, None].to(tl.int64) * NC * _NPART
        n_b = tl.zeros([BLOCK_B], tl.float32)
        pg_b = tl.zeros([BLOCK_B], tl.float32)
        kl_b = tl.zeros([BLOCK_B], tl.float32)
        ent_b = tl.zeros([BLOCK_B], tl.float32)
        c_b = tl.zeros([BLOCK_B], tl.float32)
        low_b = tl.zeros([BLOCK_B], tl.float32)
        high_b = tl.zeros([BLOCK_B], tl.float32)
        smet_b = tl.zeros([BLOCK_B], tl.float32)
        akl_b = tl.zeros([BLOCK_B], tl.float32)
        r_b = tl.zeros([BLOCK_B], tl.float32)
        rmin_b = tl.full([BLOCK_B], float("inf"), tl.float32)
        rmax_b = tl.full([BLOCK_B], float("-inf"), tl.float32)
        w_b = tl.zeros([BLOCK_B], tl.float32)
        c0 = NC * 0
        while c0 < NC:
            cc = c0 + cols
            tmask = rmask[:, None] & (cc[None, :] < NC)
            base = row_base + cc[None, :] * _NPART
            n_b += tl.sum(tl.load(base + _P_N, mask=tmask, other=0.0), axis=1)
            pg_b += tl.sum(tl.load(base + _P_PG, mask=tmask, other=0.0), axis=1)
            kl_b += tl.sum(tl.load(base + _P_KL, mask=tmask, other=0.0), axis=1)
            ent_b += tl.sum(tl.load(base + _P_ENT, mask=tmask, other=0.0), axis=1)
            low_b += tl.sum(tl.load(base + _P_LOW, mask=tmask, other=0.0), axis=1)
            high_b += tl.sum(tl.load(base + _P_HIGH, mask=tmask, other=0.0), axis=1)
            smet_b += tl.sum(tl.load(base + _P_SMET, mask=tmask, other=0.0), axis=1)
            akl_b += tl.sum(tl.load(base + _P_AKL, mask=tmask, other=0.0), axis=1)
            r_b += tl.sum(tl.load(base + _P_RSUM, mask=tmask, other=0.0), axis=1)
            rmin_b = tl.minimum(rmin_b, tl.min(tl.load(base + _P_RMIN, mask=tmask, other=float("inf")), axis=1))
            rmax_b = tl.maximum(rmax_b, tl.max(tl.load(base + _P_RMAX, mask=tmask, other=float("-inf")), axis=1))
            w_b += tl.sum(tl.load(base + _P_WSUM, mask=tmask, other=0.0), axis=1)
            c_b += tl.sum(tl.load(base + _P_ROWC, mask=tmask, other=0.0), axis=1)
            c0 += BLOCK_C
        if AGG == 1:
            f_b = 1.0 / tl.maximum(n_b, 1.0)
        else:
            f_b = n_b * 0.0 + 1.0
        f_b = tl.where(rmask, f_b, 0.0)
        N += tl.sum(n_b, axis=0)
        S += tl.sum((n_b > 0).to(tl.float32), axis=0)
        pg_t += tl.sum(f_b * pg_b, axis=0)
        kl_t += tl.sum(f_b * kl_b, axis=0)
        ent_t += tl.sum(f_b * ent_b, axis=0)
        kl_sum += tl.sum(kl_b, axis=0)
        ent_sum += tl.sum(ent_b, axis=0)
        low_t += tl.sum(low_b, axis=0)
        high_t += tl.sum(high_b, axis=0)
        smet_t += tl.sum(smet_b, axis=0)
        akl_t += tl.sum(akl_b, axis=0)
        r_sum += tl.sum(r_b, axis=0)
        r_min = tl.minimum(r_min, tl.min(rmin_b, axis=0))
        r_max = tl.maximum(r_max, tl.max(rmax_b, axis=0))
        w_sum += tl.sum(w_b, axis=0)
        tl.store(rowcoef_ptr + rb * 2, f_b, mask=rmask)
        tl.store(rowcoef_ptr + rb * 2 + 1, f_b * c_b, mask=rmask)
        b0 += BLOCK_B

    if AGG == 0:
        D = N
    else:
        D = S
    if HAS_GPTR:
        D = zero + tl.load(gcount_ptr).to(tl.float32)
    if HAS_GVAL:
        D = zero + gcount_val
    D = tl.where(D > 0, D, 1.0)
    if AGG == 3:
        D = D * norm_length
    inv_d = 1.0 / D
    has_tok = N > 0
    inv_n = 1.0 / tl.where(has_tok, N, 1.0)
    pg_loss = pg_t * inv_d
    kl_loss = kl_t * inv_d
    ent_loss = ent_t * inv_d
    loss = pg_loss
    if USE_KL:
        loss = loss + kl_coef * kl_loss
    if USE_ENT:
        loss = loss - entropy_coef * ent_loss
    tl.store(out_ptr + _O_LOSS, loss)
    tl.store(out_ptr + _O_PG_LOSS, pg_loss)
    tl.store(out_ptr + _O_KL_LOSS, kl_loss)
    tl.store(out_ptr + _O_ENTROPY_LOSS, ent_loss)
    tl.store(out_ptr + _O_CLIP_FRAC_LOW, low_t * inv_n)
    tl.store(out_ptr + _O_CLIP_FRAC_HIGH, high_t * inv_n)
    tl.store(out_ptr + _O_CLIP_FRAC, low_t * inv_n + high_t * inv_n)
    tl.store(out_ptr + _O_SURROGATE_METRIC, smet_t * inv_n)
    tl.store(out_ptr + _O_APPROX_KL, akl_t * inv_n)
    tl.store(out_ptr + _O_KL_REF_MEAN, kl_sum * inv_n)
    tl.store(out_ptr + _O_RATIO_MEAN, r_sum * inv_n)
    tl.store(out_ptr + _O_RATIO_MIN, tl.where(has_tok, r_min, 0.0))
    tl.store(out_ptr + _O_RATIO_MAX, tl.where(has_tok, r_max, 0.0))
    tl.store(out_ptr + _O_ENTROPY_MEAN, ent_sum * inv_n)
    tl.store(out_ptr + _O_IS_WEIGHT_MEAN, w_sum * inv_n)
    tl.store(out_ptr + _O_INV_DENOMINATOR, inv_d)


@triton.jit
def _policy_bwd_kernel(
    gout_ptr, out_ptr, rowcoef_ptr, g_ptr, mask_ptr, logp_ptr, old_ptr, glogp_ptr, gent_ptr,
    T, s_g, s_mask, s_logp, s_old, s_glogp, s_gent, lr_clamp, entropy_coef,
    HAS_G: tl.constexpr, SEQ_RATIO: tl.constexpr, HAS_LR_CLAMP: tl.constexpr,
    WRITE_LOGP: tl.constexpr, WRITE_ENT: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    inb = offs < T
    scale = tl.load(gout_ptr).to(tl.float32) * tl.load(out_ptr + _O_INV_DENOMINATOR)
    f = tl.load(rowcoef_ptr + b * 2)
    m = tl.load(mask_ptr + b * s_mask + offs, mask=inb, other=0).to(tl.float32) != 0.0
    if WRITE_LOGP:
        if HAS_G:
            dl = f * tl.load(g_ptr + b * s_g + offs, mask=inb, other=0.0)
        else:
            dl = tl.zeros([BLOCK], tl.float32)
        if SEQ_RATIO:
            kb = tl.load(rowcoef_ptr + b * 2 + 1)
            p = m
            if HAS_LR_CLAMP:
                lp = tl.load(logp_ptr + b * s_logp + offs, mask=inb, other=0.0).to(tl.float32)
                old = tl.load(old_ptr + b * s_old + offs, mask=inb, other=0.0).to(tl.float32)
                lr = lp - old
                p = p & (lr >= -lr_clamp) & (lr <= lr_clamp)
            dl = dl + tl.where(p, kb, 0.0)
        tl.store(glogp_ptr + b * s_glogp + offs, (scale * dl).to(glogp_ptr.dtype.element_ty), mask=inb)
    if WRITE_ENT:
        ge = tl.where(m, -entropy_coef * f * scale, 0.0)
        tl.store(gent_ptr + b * s_gent + offs, ge.to(gent_ptr.dtype.element_ty), mask=inb)


def _mask_arg(mask: torch.Tensor) -> torch.Tensor:
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


def _blocks(T: int, block_t: int) -> tuple[int, int]:
    """(tokens per program, programs per row): a fixed block, so no compile key follows T."""
    return block_t, triton.cdiv(T, block_t)


def policy_loss_fwd(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None,
    entropy: torch.Tensor | None,
    rollout_logp: torch.Tensor | None,
    is_weight: torch.Tensor | None = None,
    *,
    surrogate: str = "ppo_clip",
    sur_params: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0),
    seq_ratio: bool,
    seq_is: bool,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    log_ratio_clamp: float | None,
    kl_coef: float,
    kl_estimator: str,
    kl_clamp: float | None,
    entropy_coef: float,
    is_cap: float | None,
    loss_agg: str,
    norm_length: float,
    global_count: torch.Tensor | float | None,
    write_grad: bool,
    tiles: dict[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Forward of the policy loss.

    All ``[B, T]`` inputs (``is_weight`` too) need a unit column stride; ``advantages`` is
    ``[B, T]`` or ``[B]``. ``surrogate`` names the fused variant (``SURROGATE_IDS``) and
    ``sur_params`` its scalars; ``tiles`` overrides ``DEFAULT_TILES``.
    Returns ``out`` (``[len(OUT_KEYS)]`` fp32: loss, metrics, 1/D), ``rowcoef`` (``[B, 2]``: f_b,
    K_b) and ``g`` (``[B, T]`` fp32, or None when not needed) for ``policy_loss_bwd``.
    """
    B, T = logp.shape
    dev = logp.device
    tiles = resolve_tiles(tiles)
    block, nc = _blocks(T, tiles["block_t"])
    mask = _mask_arg(mask)
    has_is = rollout_logp is not None
    seq_is = seq_is and has_is
    sur_id = SURROGATE_IDS[surrogate]
    vespo = sur_id == SURROGATE_IDS["vespo"]  # needs the row sums of the token (and rollout) log-ratios
    if seq_ratio or seq_is or vespo:
        pre = torch.empty((B, nc, 3), dtype=torch.float32, device=dev)
        pre_clamp = log_ratio_clamp
        if vespo:
            pre_clamp = min(float(log_ratio_clamp or _VESPO_LOG_RATIO_CLAMP), _VESPO_LOG_RATIO_CLAMP)
        _row_pre_kernel[(B, nc)](
            logp, old_logp, mask, rollout_logp if has_is else old_logp, pre,
            T, nc, logp.stride(0), old_logp.stride(0), mask.stride(0),
            rollout_logp.stride(0) if has_is else 0, float(pre_clamp or 0.0),
            SEQ_RATIO=seq_ratio or vespo, SEQ_IS=seq_is or (vespo and has_is),
            HAS_LR_CLAMP=pre_clamp is not None, BLOCK=block,
        )
    else:
        pre = logp  # unused
    has_ref = ref_logp is not None
    has_ent = entropy is not None
    # in sequence mode g holds only the KL part (and the logp-only surrogates' gradient);
    # without them there is nothing per token to keep
    direct = surrogate in LOGP_ONLY_SURROGATES
    write_g = write_grad and (not seq_ratio or direct or (has_ref and kl_coef != 0))
    has_isw = is_weight is not None
    g = torch.empty((B, T), dtype=torch.float32, device=dev) if write_g else None
    part = torch.empty((B, nc, NPART), dtype=torch.float32, device=dev)
    adv_per_seq = advantages.dim() == 1
    _policy_fwd_kernel[(B, nc)](
        logp, old_logp, advantages, mask,
        ref_logp if has_ref else logp, entropy if has_ent else logp, rollout_logp if has_is else logp,
        is_weight if has_isw else logp, pre, g if write_g else part, part,
        T, nc,
        logp.stride(0), old_logp.stride(0), advantages.stride(0), 0 if adv_per_seq else 1, mask.stride(0),
        ref_logp.stride(0) if has_ref else 0, entropy.stride(0) if has_ent else 0,
        rollout_logp.stride(0) if has_is else 0, is_weight.stride(0) if has_isw else 0, T,
        1.0 - clip_low, 1.0 + clip_high, float(dual_clip or 0.0), float(log_ratio_clamp or 0.0),
        float(kl_coef), float(kl_clamp or 0.0), float(is_cap or 0.0), *(float(x) for x in sur_params),
        SURROGATE=sur_id, SEQ_RATIO=seq_ratio, SEQ_IS=seq_is, HAS_DUAL=dual_clip is not None,
        HAS_LR_CLAMP=log_ratio_clamp is not None, HAS_REF=has_ref, KL_EST=KL_ESTIMATOR_IDS[kl_estimator],
        HAS_KL_CLAMP=kl_clamp is not None, HAS_ENT=has_ent, HAS_IS=has_is, HAS_IS_CAP=is_cap is not None,
        HAS_ISW=has_isw, KL_GRAD=has_ref and kl_coef != 0, WRITE_GRAD=write_g, BLOCK_C=tiles["block_c"], BLOCK=block,
    )
    out = torch.empty(NOUT, dtype=torch.float32, device=dev)
    rowcoef = torch.empty((B, 2), dtype=torch.float32, device=dev)
    g_is_ptr = isinstance(global_count, torch.Tensor)
    _policy_finalize_kernel[(1,)](
        part, out, rowcoef, global_count if g_is_ptr else out,
        B, nc, float(global_count) if (global_count is not None and not g_is_ptr) else 0.0,
        float(norm_length), float(kl_coef), float(entropy_coef),
        AGG=AGG_IDS[loss_agg], HAS_GPTR=g_is_ptr, HAS_GVAL=global_count is not None and not g_is_ptr,
        USE_KL=has_ref and kl_coef != 0, USE_ENT=has_ent and entropy_coef != 0,
        BLOCK_B=tiles["block_b"], BLOCK_C=tiles["block_c"],
    )
    return out, rowcoef, g


def policy_loss_bwd(
    grad_out: torch.Tensor,
    out: torch.Tensor,
    rowcoef: torch.Tensor,
    g: torch.Tensor | None,
    mask: torch.Tensor,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    entropy: torch.Tensor | None,
    *,
    seq_ratio: bool,
    log_ratio_clamp: float | None,
    entropy_coef: float,
    need_logp: bool,
    need_entropy: bool,
    tiles: dict[str, int] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients wrt ``logp`` and ``entropy`` (in their dtypes) from ``policy_loss_fwd``'s outputs
    (``tiles``: the same as the forward's)."""
    B, T = logp.shape
    block, nc = _blocks(T, resolve_tiles(tiles)["block_t"])
    mask = _mask_arg(mask)
    glogp = torch.empty((B, T), dtype=logp.dtype, device=logp.device) if need_logp else None
    gent = torch.empty((B, T), dtype=entropy.dtype, device=logp.device) if need_entropy else None
    _policy_bwd_kernel[(B, nc)](
        grad_out, out, rowcoef, g if g is not None else out, mask, logp, old_logp,
        glogp if need_logp else out, gent if need_entropy else out,
        T, T, mask.stride(0), logp.stride(0), old_logp.stride(0), T, T,
        float(log_ratio_clamp or 0.0), float(entropy_coef),
        HAS_G=g is not None, SEQ_RATIO=seq_ratio, HAS_LR_CLAMP=log_ratio_clamp is not None,
        WRITE_LOGP=need_logp, WRITE_ENT=need_entropy, BLOCK=block,
    )
    return glogp, gent
