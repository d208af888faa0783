"""Prefix-tree attention for training: forward and backward over one packed row.

Layout (built on the host by ``fastrl.ops.tree_attention.TreeLayout``): the segments of a
forest in depth-first pre-order, so every segment's subtree is one contiguous token range.
Then "key j is an ancestor-or-self token of query i" is one interval test::

    allowed(i, j) = j <= i < key_end[j]

with ``key_end[j]`` (int32, per key) the end of the subtree of ``j``'s segment. The
shared-prefix ``[prompt | c_1 | ... | c_G]`` layout is the depth-2 case (a prompt key's
``key_end`` is its group's end, a completion key's its completion's end).

* ``_fwd_kernel`` -- one program per (query tile, query head): online softmax over the
  key blocks the tile needs, read from a block list (CSR: ``KV_PTR [tiles + 1]``,
  ``KV_BLOCKS``) that the host builds once per layout and tile shape -- the blocks of the
  tile's segments' ancestors and of its own segments, never a sibling's. Writes ``out``
  and ``lse``.
* ``_bwd_dq_kernel`` -- one program per (query tile, query head) over the same block list:
  ``dq = scale * sum_j ds_ij k_j`` with ``ds = p * (dp - delta)``, ``delta = rowsum(dO * O)``.
* ``_bwd_dkdv_kernel`` -- one program per (key tile, kv head): the queries that attend a
  key tile are the contiguous range ``[first key, max key_end)`` (a key's subtree), so an
  ancestor key accumulates over every descendant's queries -- the gradient the unpacked
  batch sums over the sequences that repeat it.

Accumulation is fp32 (fp64 for fp64 inputs). Under the CPU interpreter bf16/fp16 tiles are
upcast before ``tl.dot`` (its bf16 dot is wrong there).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from csrc_triton.shared_prefix_attention import CUDA_TILES, FP32_DOT_PRECISION, INTERPRETER_TILES, scale_arg

__all__ = ["tiles_for", "tree_attention_fwd", "tree_attention_bwd"]


@triton.jit
def _allowed(rows, row_ok, cols, col_ok, key_end):
    return row_ok[:, None] & col_ok[None, :] & (cols[None, :] <= rows[:, None]) & (rows[:, None] < key_end[None, :])


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, KEY_END, KV_PTR, KV_BLOCKS, N,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh, stride_ln,
    SCALE,
    R: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr,
):
    scale = tl.load(SCALE)  # ACC's dtype (shared_prefix_attention.scale_arg)
    mb = tl.program_id(0)
    hq = tl.program_id(1)
    hk = hq // R
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(Q + rows[:, None] * stride_qn + hq * stride_qh + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(ACC)
    m_i = tl.full((BLOCK_M,), float("-inf"), ACC)
    l_i = tl.zeros((BLOCK_M,), ACC)
    acc = tl.zeros((BLOCK_M, BLOCK_D), ACC)
    k_base = K + hk * stride_kh
    v_base = V + hk * stride_vh
    b = tl.load(KV_PTR + mb)
    b_end = tl.load(KV_PTR + mb + 1)
    while b < b_end:  # a while loop: the bounds are loaded (the interpreter rejects range() over them)
        cols = tl.load(KV_BLOCKS + b) * BLOCK_N + offs_n
        c_ok = cols < N
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
        key_end = tl.load(KEY_END + cols, mask=c_ok, other=0)
        if UPCAST:
            k = k.to(ACC)
            v = v.to(ACC)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=ACC) * scale
        ok = _allowed(rows, row_ok, cols, c_ok, key_end)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.where(m_new == float("-inf"), 0.0, tl.exp(m_i - m_new))
        p = tl.where(ok, tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION, out_dtype=ACC)
        m_i = m_new
        b += 1
    l_safe = tl.where(row_ok, l_i, 1.0)  # every real query attends at least to itself: l_i > 0
    o = acc / l_safe[:, None]
    tl.store(O + rows[:, None] * stride_on + hq * stride_oh + offs_d[None, :], o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + rows * stride_ln + hq, m_i + tl.log(l_safe), mask=row_ok)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, KEY_END, KV_PTR, KV_BLOCKS, N,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_don, stride_doh,
    stride_ln, stride_dqn, stride_dqh,
    SCALE,
    R: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr,
):
    scale = tl.load(SCALE)  # ACC's dtype (shared_prefix_attention.scale_arg)
    mb = tl.program_id(0)
    hq = tl.program_id(1)
    hk = hq // R
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
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
    b = tl.load(KV_PTR + mb)
    b_end = tl.load(KV_PTR + mb + 1)
    while b < b_end:
        cols = tl.load(KV_BLOCKS + b) * BLOCK_N + offs_n
        c_ok = cols < N
        k = tl.load(k_base + cols[:, None] * stride_kn + offs_d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
        key_end = tl.load(KEY_END + cols, mask=c_ok, other=0)
        if UPCAST:
            k = k.to(ACC)
            v = v.to(ACC)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=ACC) * scale
        ok = _allowed(rows, row_ok, cols, c_ok, key_end)
        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION, out_dtype=ACC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION, out_dtype=ACC)
        b += 1
    dq = dq * scale
    tl.store(DQ + rows[:, None] * stride_dqn + hq * stride_dqh + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=qd_mask)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, KEY_END, N,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_don, stride_doh,
    stride_ln, stride_dkn, stride_dkh, stride_dvn, stride_dvh,
    SCALE,
    R: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr,
):
    scale = tl.load(SCALE)  # ACC's dtype (shared_prefix_attention.scale_arg)
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
    key_end = tl.load(KEY_END + cols, mask=c_ok, other=0)
    # the queries that see any key of this tile: [first, max key_end) -- its keys' subtrees
    q_hi = tl.max(key_end, axis=0)
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
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=ACC) * scale  # [BLOCK_M, BLOCK_N]
            ok = _allowed(rows, row_ok, cols, c_ok, key_end)
            p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION, out_dtype=ACC)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION, out_dtype=ACC)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION, out_dtype=ACC)
            m0 += BLOCK_M
    dk = dk * scale
    tl.store(DK + cols[:, None] * stride_dkn + hk * stride_dkh + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=kd_mask)
    tl.store(DV + cols[:, None] * stride_dvn + hk * stride_dvh + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=kd_mask)


def _config(q: torch.Tensor) -> dict:
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return dict(
        PRECISION=FP32_DOT_PRECISION if q.dtype in (torch.float32, torch.float64) else "tf32",
        UPCAST=interpret and q.dtype in (torch.bfloat16, torch.float16),
        ACC=tl.float64 if q.dtype == torch.float64 else tl.float32,
    )


def tiles_for(device: torch.device) -> dict:
    """The tile shapes of the forward (``"fwd"``) and backward (``"bwd"``) on ``device``
    (the interpreter's on ``cpu``; ``meta``, as the compile walk passes, is treated as
    CUDA): the host builds each one's key-block list (``TreeLayout.block_lists``)."""
    return INTERPRETER_TILES if device.type == "cpu" else CUDA_TILES


def tree_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_end: torch.Tensor,
    kv_ptr: torch.Tensor, kv_blocks: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [N, Hq, D]``, ``k/v [N, Hkv, D]``, int32 ``key_end [N]`` and the forward tile
    shape's block list -> ``(out [N, Hq, D] in q.dtype, lse [N, Hq] fp32 (fp64 for fp64))``."""
    N, Hq, D = q.shape
    R = Hq // k.shape[1]
    t = tiles_for(q.device)["fwd"]
    BLOCK_D = max(16, triton.next_power_of_2(D))
    out = torch.empty(N, Hq, D, device=q.device, dtype=q.dtype)
    lse = torch.empty(N, Hq, device=q.device, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    _fwd_kernel[(triton.cdiv(N, t["BLOCK_M"]), Hq)](
        q, k, v, out, lse, key_end, kv_ptr, kv_blocks, N,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1), lse.stride(0),
        scale_arg(scale, lse),
        R=R, D=D, BLOCK_D=BLOCK_D, **t, **_config(q),
    )
    return out, lse


def tree_attention_bwd(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    key_end: torch.Tensor, kv_ptr: torch.Tensor, kv_blocks: torch.Tensor, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` in the dtypes of ``q, k, v``; ``lse`` from the forward,
    the block list of the backward tile shape."""
    N, Hq, D = q.shape
    Hkv = k.shape[1]
    R = Hq // Hkv
    t = tiles_for(q.device)["bwd"]
    consts = _config(q)
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
        q, k, v, grad_out, lse, delta, dq, key_end, kv_ptr, kv_blocks, N,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), grad_out.stride(0), grad_out.stride(1),
        lse.stride(0), dq.stride(0), dq.stride(1),
        scale_t,
        R=R, D=D, BLOCK_D=BLOCK_D, **t, **consts,
    )
    _bwd_dkdv_kernel[(triton.cdiv(N, t["BLOCK_N"]), Hkv)](
        q, k, v, grad_out, lse, delta, dk, dv, key_end, N,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), grad_out.stride(0), grad_out.stride(1),
        lse.stride(0), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
        scale_t,
        R=R, D=D, BLOCK_D=BLOCK_D, **t, **consts,
    )
    return dq, dk, dv
