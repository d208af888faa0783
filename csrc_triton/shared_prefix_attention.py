"""Shared-prefix attention for training: forward and backward over one packed row.

Layout (built on the host by ``fastrl.ops.shared_prefix_attention.SharedPrefixLayout``):
``q [N, Hq, D]``, ``k/v [N, Hkv, D]`` (token-major, any strides with a contiguous last
dim) and, per token, int32 ``doc_start``, ``prefix_end``, ``seg_start`` (query side) and
``query_end`` (key side). Query i attends key j iff::

    j <= i  and  (doc_start[i] <= j < prefix_end[i]  or  j >= seg_start[i])

All three per-query bounds are non-decreasing along the row, so the keys a tile of
queries ``[m0, m1]`` needs lie in two ranges: ``[doc_start[m0], min(prefix_end[m1],
seg_start[m0]))`` (its documents' prefixes) and ``[seg_start[m0], m1]`` (its own
segments). Other segments of the document are never visited; the element-wise mask
handles tiles that straddle a boundary.

* ``_fwd_kernel`` -- one program per (query tile, query head): online softmax over both
  key ranges, writes ``out`` and the log-sum-exp ``lse`` (of the scaled scores).
* ``_bwd_dq_kernel`` -- one program per (query tile, query head): the same key ranges,
  ``dq = scale * sum_j ds_ij k_j`` with ``ds = p * (dp - delta)``, ``delta = rowsum(dO * O)``.
* ``_bwd_dkdv_kernel`` -- one program per (key tile, kv head): walks the queries
  ``[j0, max query_end)`` of every query head sharing the kv head, so a prefix key tile
  accumulates over all segments' queries of its document (the gradient a repeated-prefix
  batch would sum over its G copies), a segment key tile only over its own segment.

Accumulation is fp32 (fp64 for fp64 inputs, used by the float64 tests). Under the CPU
interpreter bf16/fp16 tiles are upcast before ``tl.dot`` (its bf16 dot is wrong there).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# fp32 inputs use exact fp32 dot products; "tf32" trades accuracy for tensor-core speed.
FP32_DOT_PRECISION = "ieee"

# Untimed (no GPU was available): chosen so that bf16/fp16 at head dims 64 and 128
# compile for sm_90 without register spills (ptxas -v; 4 warps spill in both backward
# kernels at D=128). fp32 with "ieee" dots is a correctness path, not a fast one.
CUDA_TILES = {
    "fwd": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
    "bwd": dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2),
}
INTERPRETER_TILES = {
    "fwd": dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1),
    "bwd": dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1),
}


@triton.jit
def _allowed(rows, row_ok, cols, col_ok, doc_start, prefix_end, seg_start):
    c = cols[None, :]
    return (
        row_ok[:, None]
        & col_ok[None, :]
        & (c <= rows[:, None])
        & (((c >= doc_start[:, None]) & (c < prefix_end[:, None])) | (c >= seg_start[:, None]))
    )


@triton.jit
def _fwd_range(
    acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn,
    rows, row_ok, doc_start, prefix_end, seg_start, lo, hi, scale,
    offs_n, offs_d, d_ok,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr,
):
    s0 = lo
    while s0 < hi:  # a while loop: the bounds are loaded (the interpreter rejects range() over them)
        cols = s0 + offs_n
        c_ok = cols < hi  # never past the range: the next range must not count a key twice
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(ACC)
            v = v.to(ACC)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=ACC) * scale
        ok = _allowed(rows, row_ok, cols, c_ok, doc_start, prefix_end, seg_start)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.where(m_new == float("-inf"), 0.0, tl.exp(m_i - m_new))
        p = tl.where(ok, tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION, out_dtype=ACC)
        m_i = m_new
        s0 += BLOCK_N
    return acc, m_i, l_i


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, DOC_START, PREFIX_END, SEG_START, N,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh, stride_ln,
    SCALE,
    R: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr,
):
    scale = tl.load(SCALE)  # ACC's dtype (scale_arg)
    mb = tl.program_id(0)
    hq = tl.program_id(1)
    hk = hq // R
    first = mb * BLOCK_M
    last = tl.minimum(first + BLOCK_M, N) - 1
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    doc_start = tl.load(DOC_START + rows, mask=row_ok, other=0)
    prefix_end = tl.load(PREFIX_END + rows, mask=row_ok, other=0)
    seg_start = tl.load(SEG_START + rows, mask=row_ok, other=0)
    q = tl.load(Q + rows[:, None] * stride_qn + hq * stride_qh + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(ACC)

    m_i = tl.full((BLOCK_M,), float("-inf"), ACC)
    l_i = tl.zeros((BLOCK_M,), ACC)
    acc = tl.zeros((BLOCK_M, BLOCK_D), ACC)
    k_base = K + hk * stride_kh
    v_base = V + hk * stride_vh
    seg_lo = tl.load(SEG_START + first)
    prefix_lo = tl.load(DOC_START + first)
    prefix_hi = tl.minimum(tl.load(PREFIX_END + last), seg_lo)
    acc, m_i, l_i = _fwd_range(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, rows, row_ok, doc_start, prefix_end,
                               seg_start, prefix_lo, prefix_hi, scale, offs_n, offs_d, d_ok, BLOCK_N, PRECISION, UPCAST, ACC)
    acc, m_i, l_i = _fwd_range(acc, m_i, l_i, q, k_base, v_base, stride_kn, stride_vn, rows, row_ok, doc_start, prefix_end,
                               seg_start, seg_lo, last + 1, scale, offs_n, offs_d, d_ok, BLOCK_N, PRECISION, UPCAST, ACC)

    l_safe = tl.where(row_ok, l_i, 1.0)  # every real query attends at least to itself: l_i > 0
    o = acc / l_safe[:, None]
    tl.store(O + rows[:, None] * stride_on + hq * stride_oh + offs_d[None, :], o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + rows * stride_ln + hq, m_i + tl.log(l_safe), mask=row_ok)


@triton.jit
def _dq_range(
    dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn,
    rows, row_ok, doc_start, prefix_end, seg_start, lo, hi, scale,
    offs_n, offs_d, d_ok,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr,
):
    s0 = lo
    while s0 < hi:
        cols = s0 + offs_n
        c_ok = cols < hi
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(ACC)
            v = v.to(ACC)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=ACC) * scale
        ok = _allowed(rows, row_ok, cols, c_ok, doc_start, prefix_end, seg_start)
        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION, out_dtype=ACC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION, out_dtype=ACC)
        s0 += BLOCK_N
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, DOC_START, PREFIX_END, SEG_START, N,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_don, stride_doh,
    stride_ln, stride_dqn, stride_dqh,
    SCALE,
    R: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr,
):
    scale = tl.load(SCALE)  # ACC's dtype (scale_arg)
    mb = tl.program_id(0)
    hq = tl.program_id(1)
    hk = hq // R
    first = mb * BLOCK_M
    last = tl.minimum(first + BLOCK_M, N) - 1
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    doc_start = tl.load(DOC_START + rows, mask=row_ok, other=0)
    prefix_end = tl.load(PREFIX_END + rows, mask=row_ok, other=0)
    seg_start = tl.load(SEG_START + rows, mask=row_ok, other=0)
    qd_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + rows[:, None] * stride_qn + hq * stride_qh + offs_d[None, :], mask=qd_mask, other=0.0)
    do = tl.load(DO + rows[:, None] * stride_don + hq * stride_doh + offs_d[None, :], mask=qd_mask, other=0.0)
    if UPCAST:
        q = q.to(ACC)
        do = do.to(ACC)
    lse = tl.load(LSE + rows * stride_ln + hq, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + rows * stride_ln + hq, mask=row_ok, other=0.0)

    dq = tl.zeros((BLOCK_M, BLOCK_D), ACC)
    k_base = K + hk * stride_kh
    v_base = V + hk * stride_vh
    seg_lo = tl.load(SEG_START + first)
    prefix_lo = tl.load(DOC_START + first)
    prefix_hi = tl.minimum(tl.load(PREFIX_END + last), seg_lo)
    dq = _dq_range(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, rows, row_ok, doc_start, prefix_end, seg_start,
                   prefix_lo, prefix_hi, scale, offs_n, offs_d, d_ok, BLOCK_N, PRECISION, UPCAST, ACC)
    dq = _dq_range(dq, q, do, lse, delta, k_base, v_base, stride_kn, stride_vn, rows, row_ok, doc_start, prefix_end, seg_start,
                   seg_lo, last + 1, scale, offs_n, offs_d, d_ok, BLOCK_N, PRECISION, UPCAST, ACC)
    dq = dq * scale
    tl.store(DQ + rows[:, None] * stride_dqn + hq * stride_dqh + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=qd_mask)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DOC_START, PREFIX_END, SEG_START, QUERY_END, N,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_don, stride_doh,
    stride_ln, stride_dkn, stride_dkh, stride_dvn, stride_dvh,
    SCALE,
    R: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr,
):
    scale = tl.load(SCALE)  # ACC's dtype (scale_arg)
    nb = tl.program_id(0)
    hk = tl.program_id(1)
    first = nb * BLOCK_N
    cols = first + tl.arange(0, BLOCK_N)
    c_ok = cols < N
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    kd_mask = c_ok[:, None] & d_ok[None, :]
    k = tl.load(K + cols[:, None] * stride_kn + hk * stride_kh + offs_d[None, :], mask=kd_mask, other=0.0)
    v = tl.load(V + cols[:, None] * stride_vn + hk * stride_vh + offs_d[None, :], mask=kd_mask, other=0.0)
    if UPCAST:
        k = k.to(ACC)
        v = v.to(ACC)
    # queries that see any key of this tile: [first, max query_end) (a prefix key's
    # query_end is its document's end: every segment's queries)
    q_hi = tl.max(tl.load(QUERY_END + cols, mask=c_ok, other=0), axis=0)

    dk = tl.zeros((BLOCK_N, BLOCK_D), ACC)
    dv = tl.zeros((BLOCK_N, BLOCK_D), ACC)
    for r in range(R):  # the query heads sharing this kv head
        hq = hk * R + r
        m0 = first
        while m0 < q_hi:
            rows = m0 + offs_m
            row_ok = rows < q_hi
            qd_mask = row_ok[:, None] & d_ok[None, :]
            q = tl.load(Q + rows[:, None] * stride_qn + hq * stride_qh + offs_d[None, :], mask=qd_mask, other=0.0)
            do = tl.load(DO + rows[:, None] * stride_don + hq * stride_doh + offs_d[None, :], mask=qd_mask, other=0.0)
            if UPCAST:
                q = q.to(ACC)
                do = do.to(ACC)
            lse = tl.load(LSE + rows * stride_ln + hq, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + rows * stride_ln + hq, mask=row_ok, other=0.0)
            doc_start = tl.load(DOC_START + rows, mask=row_ok, other=0)
            prefix_end = tl.load(PREFIX_END + rows, mask=row_ok, other=0)
            seg_start = tl.load(SEG_START + rows, mask=row_ok, other=0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=ACC) * scale  # [BLOCK_M, BLOCK_N]
            ok = _allowed(rows, row_ok, cols, c_ok, doc_start, prefix_end, seg_start)
            p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION, out_dtype=ACC)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION, out_dtype=ACC)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION, out_dtype=ACC)
            m0 += BLOCK_M
    dk = dk * scale
    tl.store(DK + cols[:, None] * stride_dkn + hk * stride_dkh + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kd_mask)
    tl.store(DV + cols[:, None] * stride_dvn + hk * stride_dvh + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kd_mask)


def scale_arg(scale: float, acc_like: torch.Tensor) -> torch.Tensor:
    """The softmax scale as a 1-element tensor in the accumulation dtype (``acc_like``'s, the
    log-sum-exp's), loaded by the kernel: a Python float argument is typed fp32 in a compiled
    kernel, which put fp32 rounding into the fp64 path (errors of 1e-8 on the H200 where the
    interpreter, which keeps Python floats, gave 1e-16)."""
    return torch.full((1,), scale, dtype=acc_like.dtype, device=acc_like.device)


def _config(q: torch.Tensor) -> dict:
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    acc = tl.float64 if q.dtype == torch.float64 else tl.float32
    return dict(
        PRECISION=FP32_DOT_PRECISION if q.dtype in (torch.float32, torch.float64) else "tf32",
        UPCAST=interpret and q.dtype in (torch.bfloat16, torch.float16),
        ACC=acc,
    ), (INTERPRETER_TILES if q.device.type != "cuda" else CUDA_TILES)


def shared_prefix_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_start: torch.Tensor,
    prefix_end: torch.Tensor,
    seg_start: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [N, Hq, D]``, ``k/v [N, Hkv, D]``, per-query int32 bounds ``[N]`` ->
    ``(out [N, Hq, D] in q.dtype, lse [N, Hq] fp32 (fp64 for fp64 inputs))``."""
    N, Hq, D = q.shape
    R = Hq // k.shape[1]
    consts, tiles = _config(q)
    t = tiles["fwd"]
    BLOCK_D = max(16, triton.next_power_of_2(D))
    out = torch.empty(N, Hq, D, device=q.device, dtype=q.dtype)
    lse = torch.empty(N, Hq, device=q.device, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    grid = (triton.cdiv(N, t["BLOCK_M"]), Hq)
    _fwd_kernel[grid](
        q, k, v, out, lse, doc_start, prefix_end, seg_start, N,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), lse.stride(0),
        scale_arg(scale, lse),
        R=R, D=D, BLOCK_D=BLOCK_D, **t, **consts,
    )
    return out, lse


def shared_prefix_attention_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    doc_start: torch.Tensor,
    prefix_end: torch.Tensor,
    seg_start: torch.Tensor,
    query_end: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` in the dtypes of ``q, k, v``; ``lse [N, Hq]`` from the forward."""
    N, Hq, D = q.shape
    Hkv = k.shape[1]
    R = Hq // Hkv
    consts, tiles = _config(q)
    t = tiles["bwd"]
    BLOCK_D = max(16, triton.next_power_of_2(D))
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1).contiguous()  # [N, Hq]
    lse = lse.contiguous()
    scale_t = scale_arg(scale, lse)
    dq = torch.empty(N, Hq, D, device=q.device, dtype=q.dtype)
    dk = torch.empty(N, Hkv, D, device=q.device, dtype=k.dtype)
    dv = torch.empty(N, Hkv, D, device=q.device, dtype=v.dtype)
    _bwd_dq_kernel[(triton.cdiv(N, t["BLOCK_M"]), Hq)](
        q, k, v, grad_out, lse, delta, dq, doc_start, prefix_end, seg_start, N,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), grad_out.stride(0), grad_out.stride(1),
        lse.stride(0), dq.stride(0), dq.stride(1),
        scale_t,
        R=R, D=D, BLOCK_D=BLOCK_D, **t, **consts,
    )
    _bwd_dkdv_kernel[(triton.cdiv(N, t["BLOCK_N"]), Hkv)](
        q, k, v, grad_out, lse, delta, dk, dv, doc_start, prefix_end, seg_start, query_end, N,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), grad_out.stride(0), grad_out.stride(1),
        lse.stride(0), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        scale_t,
        R=R, D=D, BLOCK_D=BLOCK_D, **t, **consts,
    )
    return dq, dk, dv
