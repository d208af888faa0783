"""Prefix-tree attention for training, FlashAttention-2 shaped: forward and backward over one packed row.

Layout (built on the host by ``fastrl.ops.tree_attention.TreeLayout``): the segments of a
forest in depth-first pre-order, so every segment's subtree is one contiguous token range.
Then "key j is an ancestor-or-self token of query i" is one interval test::

    allowed(i, j) = j <= i < key_end[j]

with ``key_end[j]`` (int32, per key) the end of the subtree of ``j``'s segment. The
shared-prefix ``[prompt | c_1 | ... | c_G]`` layout is the depth-2 case (a prompt key's
``key_end`` is its group's end, a completion key's its completion's end):
``csrc_triton.shared_prefix_attention`` launches these kernels for it.

* ``_fwd_kernel`` -- one program per (query tile, query head): online softmax over the
  key blocks the tile needs, read from a block list (CSR: ``KV_PTR [tiles + 1]``,
  ``KV_BLOCKS``) that the host builds once per layout and tile shape -- the blocks of the
  tile's segments' ancestors and of its own segments, never a sibling's. Writes ``out``
  and ``lse``.
* ``_bwd_dq_kernel`` -- one program per (query tile, query head) over the same kind of
  block list: ``dq = scale * sum_j ds_ij k_j`` with ``ds = p * (dp - delta)``,
  ``delta = rowsum(dO * O)``.
* ``_bwd_dkdv_kernel`` -- one program per (work item, query head). The queries that attend
  a key tile are the contiguous range ``[first key, max key_end)`` (its keys' subtrees):
  a prefix key tile's range is every descendant's queries, thousands of rows where a leaf
  tile has a few hundred. A work item is (key tile, chunk): the host cuts each tile's range
  into chunks of ``q_chunk`` queries (``TreeLayout.dkdv_items``), so no program walks more
  than ``q_chunk`` rows and the long prefix ranges spread over many programs. Each program
  keeps its partial dK/dV in registers and adds it once, after its loop, into an fp32
  (fp64) accumulator with relaxed atomics (no fence, no read-modify-write in the MMA loop);
  the R query heads of a kv head and the chunks of a tile are the terms of that sum. With
  one head per kv head and one chunk per tile (``ATOMIC=False``) the program stores its
  result directly and the backward is bitwise deterministic; otherwise the fp32 sums'
  order varies from run to run (last-bit differences, as in FlashAttention-2's dQ).

Every key/query loop is a ``for`` over ``range(lo, hi)`` with bounds loaded from memory:
Triton software-pipelines such loops on the GPU (cp.async prefetch of the next tiles; a
``while`` loop gets synchronous loads). The CPU interpreter of Triton 3.8 runs the very same
loops, so CI tests the kernels the GPU compiles; where an older interpreter cannot
(``interpreter_for_loops``), the constexpr ``FOR_LOOPS=False`` swaps in a ``while`` header
around the same step functions (``_fwd_step``, ``_dq_step``, ``_dkdv_step``).

Accumulation is fp32 (fp64 for fp64 inputs). Under the CPU interpreter bf16/fp16 tiles are
upcast before ``tl.dot`` (its bf16 dot is wrong there).
"""

from __future__ import annotations

import os
import re

import torch
import triton
import triton.language as tl

__all__ = ["CUDA_TILES", "INTERPRETER_TILES", "tiles_for", "tree_attention_fwd", "tree_attention_bwd", "scale_arg"]

# fp32 inputs use exact fp32 dot products; "tf32" trades accuracy for tensor-core speed.
FP32_DOT_PRECISION = "ieee"

# Tile shapes per kernel. No GPU has timed them yet: they are the FlashAttention-2 shapes that
# compile for sm_90 at D = 128 in bf16 (Triton 3.8, ``benchmarks/gpu/sm90_compile.py``) with
# pipelined loads (cp.async), wgmma on every product and no register spills:
# - fwd: 128 queries x 128 keys, 8 warps (two m64 warpgroups), 2 stages: m64n128 wgmma for
#   S = QK^T and for PV; 248 registers, 164 KB shared memory.
# - dq: 128 queries x 64 keys (128 x 128 spills: S, P, dP and dS are all live): m64n64 for S
#   and dP, m64n128 for dQ.
# - dkdv: 128 keys x 64 queries, computed transposed (keys are the MMA's M): m64n64 for S^T and
#   dP^T, m64n128 for dK and dV; 255 registers, no spill (128 x 32 is the fallback: 227).
# ``q_chunk``: the most queries one dK/dV program walks (a multiple of the dkdv BLOCK_M). 2048
# is a completion's length at the benchmark's 32K-token group (P 2048 + 8 x 2048): a prompt key
# tile's 18,432 queries split into 9 programs of a completion tile's length, 272 items x 12
# heads = 3,264 programs on 132 SMs. Smaller chunks add relaxed-atomic traffic (one fp32
# 128 x D dK/dV pair per program) for no shorter critical path there.
CUDA_TILES = {
    "fwd": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
    "dq": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
    "dkdv": dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2),
    "q_chunk": 2048,
}
# The interpreter's: small tiles (it runs every program in Python), and a small chunk so the
# CPU tests split the key tiles' query ranges across programs. # Three different shapes, as on CUDA: the host's block lists and work items are built per shape.
INTERPRETER_TILES = {
    "fwd": dict(BLOCK_M=16, BLOCK_N=32, num_warps=1, num_stages=1),
    "dq": dict(BLOCK_M=32, BLOCK_N=16, num_warps=1, num_stages=1),
    "dkdv": dict(BLOCK_M=16, BLOCK_N=32, num_warps=1, num_stages=1),
    "q_chunk": 32,
}


@triton.jit
def _allowed(rows, row_ok, cols, col_ok, key_end):
    return row_ok[:, None] & col_ok[None, :] & (cols[None, :] <= rows[:, None]) & (rows[:, None] < key_end[None, :])


@triton.jit
def _allowed_t(cols, col_ok, rows, row_ok, key_end):
    """``_allowed`` transposed: ``[keys, queries]``."""
    return col_ok[:, None] & row_ok[None, :] & (cols[:, None] <= rows[None, :]) & (rows[None, :] < key_end[:, None])


@triton.jit
def _load_tile(base, idx, idx_ok, stride_n, offs_d, d_ok, UPCAST: tl.constexpr, ACC: tl.constexpr):
    """Rows ``idx`` of one head's ``[N, D]`` slice at ``base`` (masked rows and lanes read 0),
    upcast to ``ACC`` under the interpreter."""
    x = tl.load(base + idx[:, None] * stride_n + offs_d[None, :], mask=idx_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        x = x.to(ACC)
    return x


@triton.jit
def _fwd_step(acc, m_i, l_i, q, b, KV_BLOCKS, KEY_END, k_base, v_base, stride_kn, stride_vn, N, rows, row_ok,
              offs_n, offs_d, d_ok, scale,
              BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr):
    """One key block (entry ``b`` of the block list) of the forward's online softmax."""
    cols = tl.load(KV_BLOCKS + b) * BLOCK_N + offs_n
    c_ok = cols < N
    k = _load_tile(k_base, cols, c_ok, stride_kn, offs_d, d_ok, UPCAST, ACC)
    v = _load_tile(v_base, cols, c_ok, stride_vn, offs_d, d_ok, UPCAST, ACC)
    key_end = tl.load(KEY_END + cols, mask=c_ok, other=0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=ACC) * scale
    ok = _allowed(rows, row_ok, cols, c_ok, key_end)
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.where(m_new == float("-inf"), 0.0, tl.exp(m_i - m_new))
    p = tl.where(ok, tl.exp(s - m_new[:, None]), 0.0)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION, out_dtype=ACC)
    return acc, m_new, l_i


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, KEY_END, KV_PTR, KV_BLOCKS, N,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh, stride_ln,
    SCALE,
    R: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr, FOR_LOOPS: tl.constexpr,
):
    scale = tl.load(SCALE)  # ACC's dtype (scale_arg)
    mb = tl.program_id(0)
    hq = tl.program_id(1)
    hk = hq // R
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = _load_tile(Q + hq * stride_qh, rows, row_ok, stride_qn, offs_d, d_ok, UPCAST, ACC)
    m_i = tl.full((BLOCK_M,), float("-inf"), ACC)
    l_i = tl.zeros((BLOCK_M,), ACC)
    acc = tl.zeros((BLOCK_M, BLOCK_D), ACC)
    k_base = K + hk * stride_kh
    v_base = V + hk * stride_vh
    b_lo = tl.load(KV_PTR + mb)
    b_hi = tl.load(KV_PTR + mb + 1)
    if FOR_LOOPS:
        for b in range(b_lo, b_hi):
            acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, b, KV_BLOCKS, KEY_END, k_base, v_base, stride_kn, stride_vn, N, rows,
                                      row_ok, offs_n, offs_d, d_ok, scale, BLOCK_N, PRECISION, UPCAST, ACC)
    else:
        b = b_lo
        while b < b_hi:
            acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, b, KV_BLOCKS, KEY_END, k_base, v_base, stride_kn, stride_vn, N, rows,
                                      row_ok, offs_n, offs_d, d_ok, scale, BLOCK_N, PRECISION, UPCAST, ACC)
            b += 1
    l_safe = tl.where(row_ok, l_i, 1.0)  # every real query attends at least to itself: l_i > 0
    o = acc / l_safe[:, None]
    tl.store(O + rows[:, None] * stride_on + hq * stride_oh + offs_d[None, :], o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + rows * stride_ln + hq, m_i + tl.log(l_safe), mask=row_ok)


@triton.jit
def _dq_step(dq, q, do, lse, delta, b, KV_BLOCKS, KEY_END, k_base, v_base, stride_kn, stride_vn, N, rows, row_ok,
             offs_n, offs_d, d_ok, scale,
             BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr):
    """One key block (entry ``b`` of the block list) of ``dq``."""
    cols = tl.load(KV_BLOCKS + b) * BLOCK_N + offs_n
    c_ok = cols < N
    k = _load_tile(k_base, cols, c_ok, stride_kn, offs_d, d_ok, UPCAST, ACC)
    v = _load_tile(v_base, cols, c_ok, stride_vn, offs_d, d_ok, UPCAST, ACC)
    key_end = tl.load(KEY_END + cols, mask=c_ok, other=0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION, out_dtype=ACC) * scale
    ok = _allowed(rows, row_ok, cols, c_ok, key_end)
    p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION, out_dtype=ACC)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION, out_dtype=ACC)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, KEY_END, KV_PTR, KV_BLOCKS, N,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_don, stride_doh,
    stride_ln, stride_dqn, stride_dqh,
    SCALE,
    R: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr, FOR_LOOPS: tl.constexpr,
):
    scale = tl.load(SCALE)  # ACC's dtype (scale_arg)
    mb = tl.program_id(0)
    hq = tl.program_id(1)
    hk = hq // R
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = _load_tile(Q + hq * stride_qh, rows, row_ok, stride_qn, offs_d, d_ok, UPCAST, ACC)
    do = _load_tile(DO + hq * stride_doh, rows, row_ok, stride_don, offs_d, d_ok, UPCAST, ACC)
    lse = tl.load(LSE + rows * stride_ln + hq, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + rows * stride_ln + hq, mask=row_ok, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), ACC)
    k_base = K + hk * stride_kh
    v_base = V + hk * stride_vh
    b_lo = tl.load(KV_PTR + mb)
    b_hi = tl.load(KV_PTR + mb + 1)
    if FOR_LOOPS:
        for b in range(b_lo, b_hi):
            dq = _dq_step(dq, q, do, lse, delta, b, KV_BLOCKS, KEY_END, k_base, v_base, stride_kn, stride_vn, N, rows, row_ok,
                          offs_n, offs_d, d_ok, scale, BLOCK_N, PRECISION, UPCAST, ACC)
    else:
        b = b_lo
        while b < b_hi:
            dq = _dq_step(dq, q, do, lse, delta, b, KV_BLOCKS, KEY_END, k_base, v_base, stride_kn, stride_vn, N, rows, row_ok,
                          offs_n, offs_d, d_ok, scale, BLOCK_N, PRECISION, UPCAST, ACC)
            b += 1
    dq = dq * scale
    tl.store(DQ + rows[:, None] * stride_dqn + hq * stride_dqh + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _dkdv_step(dk, dv, k, v, key_end, cols, c_ok, m0, q_hi, Q, DO, LSE, DELTA, hq, stride_qn, stride_qh,
               stride_don, stride_doh, stride_ln, offs_m, offs_d, d_ok, scale,
               PRECISION: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr):
    """The queries ``m0 + offs_m`` (below ``q_hi``) of one key tile's dK/dV, transposed."""
    rows = m0 + offs_m
    row_ok = rows < q_hi
    q = _load_tile(Q + hq * stride_qh, rows, row_ok, stride_qn, offs_d, d_ok, UPCAST, ACC)
    do = _load_tile(DO + hq * stride_doh, rows, row_ok, stride_don, offs_d, d_ok, UPCAST, ACC)
    lse = tl.load(LSE + rows * stride_ln + hq, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + rows * stride_ln + hq, mask=row_ok, other=0.0)
    s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION, out_dtype=ACC) * scale  # [BLOCK_N, BLOCK_M]
    ok_t = _allowed_t(cols, c_ok, rows, row_ok, key_end)
    p_t = tl.where(ok_t, tl.exp(s_t - lse[None, :]), 0.0)
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION, out_dtype=ACC)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION, out_dtype=ACC)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION, out_dtype=ACC)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, KEY_END, ITEMS, N, Q_CHUNK,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_don, stride_doh,
    stride_ln, stride_dkn, stride_dkh, stride_dvn, stride_dvh,
    SCALE,
    R: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, ACC: tl.constexpr, FOR_LOOPS: tl.constexpr, ATOMIC: tl.constexpr,
):
    scale = tl.load(SCALE)  # ACC's dtype (scale_arg)
    item = tl.program_id(0)
    hq = tl.program_id(1)
    hk = hq // R
    first = tl.load(ITEMS + 2 * item) * BLOCK_N  # the key tile
    cols = first + tl.arange(0, BLOCK_N)
    c_ok = cols < N
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    kd_mask = c_ok[:, None] & d_ok[None, :]
    k = _load_tile(K + hk * stride_kh, cols, c_ok, stride_kn, offs_d, d_ok, UPCAST, ACC)
    v = _load_tile(V + hk * stride_vh, cols, c_ok, stride_vn, offs_d, d_ok, UPCAST, ACC)
    key_end = tl.load(KEY_END + cols, mask=c_ok, other=0)
    # the queries that see any key of this tile: [first, max key_end) -- its keys' subtrees;
    # this item's chunk of them
    q_lo = first + tl.load(ITEMS + 2 * item + 1) * Q_CHUNK
    q_hi = tl.minimum(tl.max(key_end, axis=0), q_lo + Q_CHUNK)
    dk = tl.zeros((BLOCK_N, BLOCK_D), ACC)
    dv = tl.zeros((BLOCK_N, BLOCK_D), ACC)
    # transposed (keys as the MMA's M): every product is [BLOCK_N, *]
    if FOR_LOOPS:
        for m0 in range(q_lo, q_hi, BLOCK_M):
            dk, dv = _dkdv_step(dk, dv, k, v, key_end, cols, c_ok, m0, q_hi, Q, DO, LSE, DELTA, hq, stride_qn, stride_qh,
                                stride_don, stride_doh, stride_ln, offs_m, offs_d, d_ok, scale, PRECISION, UPCAST, ACC)
    else:
        m0 = q_lo
        while m0 < q_hi:
            dk, dv = _dkdv_step(dk, dv, k, v, key_end, cols, c_ok, m0, q_hi, Q, DO, LSE, DELTA, hq, stride_qn, stride_qh,
                                stride_don, stride_doh, stride_ln, offs_m, offs_d, d_ok, scale, PRECISION, UPCAST, ACC)
            m0 += BLOCK_M
    dk = dk * scale
    dk_ptr = DK + cols[:, None] * stride_dkn + hk * stride_dkh + offs_d[None, :]
    dv_ptr = DV + cols[:, None] * stride_dvn + hk * stride_dvh + offs_d[None, :]
    if ATOMIC:  # once per program, after the loop; relaxed: fire-and-forget reductions, no fence
        tl.atomic_add(dk_ptr, dk, mask=kd_mask, sem="relaxed")
        tl.atomic_add(dv_ptr, dv, mask=kd_mask, sem="relaxed")
    else:  # the only program of this key tile and kv head
        tl.store(dk_ptr, dk.to(DK.dtype.element_ty), mask=kd_mask)
        tl.store(dv_ptr, dv.to(DV.dtype.element_ty), mask=kd_mask)


def scale_arg(scale: float, acc_like: torch.Tensor) -> torch.Tensor:
    """The softmax scale as a 1-element tensor in the accumulation dtype (``acc_like``'s, the
    log-sum-exp's), loaded by the kernel: a Python float argument is typed fp32 in a compiled
    kernel, which put fp32 rounding into the fp64 path (errors of 1e-8 on the H200 where the
    interpreter, which keeps Python floats, gave 1e-16)."""
    return torch.full((1,), scale, dtype=acc_like.dtype, device=acc_like.device)


def _version(text: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m[1]), int(m[2])) if m else (0, 0)


def interpreter_for_loops() -> bool:
    """Whether the CPU interpreter runs ``for b in range(lo, hi)`` over bounds loaded from
    memory: Triton 3.8's does (checked with numpy 2.3 and 2.4); Triton 3.6's fails on them with
    numpy >= 2.4 ("only 0-dimensional arrays can be converted to Python scalars"), so there the
    kernels take their ``while`` form (``FOR_LOOPS=False``: the same step functions, another
    loop header)."""
    import numpy

    return _version(triton.__version__) >= (3, 8) or _version(numpy.__version__) < (2, 4)


def _config(q: torch.Tensor, for_loops: bool | None) -> dict:
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return dict(
        PRECISION=FP32_DOT_PRECISION if q.dtype in (torch.float32, torch.float64) else "tf32",
        UPCAST=interpret and q.dtype in (torch.bfloat16, torch.float16),
        ACC=tl.float64 if q.dtype == torch.float64 else tl.float32,
        # on the GPU always: Triton software-pipelines for loops, not while loops
        FOR_LOOPS=(not interpret or interpreter_for_loops()) if for_loops is None else for_loops,
    )


def tiles_for(device: torch.device) -> dict:
    """The tile shapes of the ``"fwd"``, ``"dq"`` and ``"dkdv"`` kernels and the dK/dV
    ``"q_chunk"`` on ``device``: the interpreter's on ``cpu``, the CUDA ones otherwise
    (``meta`` included, as the sm_90 compile walk passes). The host builds the forward's and
    dq's key-block lists and the dK/dV work items for these shapes (``TreeLayout``)."""
    return INTERPRETER_TILES if device.type == "cpu" else CUDA_TILES


def one_item_per_tile(n: int, block_n: int, device: torch.device) -> torch.Tensor:
    """dK/dV work items without splitting: ``(tile, chunk 0)`` for every key tile (int32
    ``[tiles, 2]``), for callers that have no host layout to split by (no host sync)."""
    tiles = torch.arange(triton.cdiv(n, block_n), dtype=torch.int32, device=device)
    return torch.stack([tiles, torch.zeros_like(tiles)], dim=1)


def tree_attention_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_end: torch.Tensor,
    kv_ptr: torch.Tensor, kv_blocks: torch.Tensor, scale: float, *, for_loops: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [N, Hq, D]``, ``k/v [N, Hkv, D]``, int32 ``key_end [N]`` and the block list of the
    ``"fwd"`` tile shape -> ``(out [N, Hq, D] in q.dtype, lse [N, Hq] fp32 (fp64 for fp64))``.
    ``for_loops``: the loop form (default: ``for`` wherever it runs, see ``interpreter_for_loops``)."""
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
        R=R, D=D, BLOCK_D=BLOCK_D, **t, **_config(q, for_loops),
    )
    return out, lse


def tree_attention_bwd(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    key_end: torch.Tensor, kv_ptr: torch.Tensor, kv_blocks: torch.Tensor, scale: float,
    *, dkdv_items: torch.Tensor | None = None, q_chunk: int | None = None, for_loops: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` in the dtypes of ``q, k, v``; ``lse`` from the forward,
    ``kv_ptr``/``kv_blocks`` the block list of the ``"dq"`` tile shape.

    ``dkdv_items`` (int32 ``[items, 2]``: key tile, chunk) with the ``q_chunk`` they were cut
    by (``TreeLayout.dkdv_items``) split the key tiles' query ranges across programs; without
    them every key tile is one item (``one_item_per_tile``)."""
    N, Hq, D = q.shape
    Hkv = k.shape[1]
    R = Hq // Hkv
    tiles = tiles_for(q.device)
    t_dq, t_kv = tiles["dq"], tiles["dkdv"]
    consts = _config(q, for_loops)
    if dkdv_items is None:
        dkdv_items, q_chunk = one_item_per_tile(N, t_kv["BLOCK_N"], q.device), N
    elif q_chunk is None or q_chunk <= 0 or q_chunk % t_kv["BLOCK_M"]:
        raise ValueError(f"q_chunk must be a positive multiple of {t_kv['BLOCK_M']} with dkdv_items, got {q_chunk!r}")
    n_items = dkdv_items.shape[0]
    # one program per (key tile, kv head) writes its result: a plain store; else relaxed atomics
    atomic = R > 1 or n_items != triton.cdiv(N, t_kv["BLOCK_N"])
    BLOCK_D = max(16, triton.next_power_of_2(D))
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1).contiguous()  # [N, Hq]
    lse = lse.contiguous()
    scale_t = scale_arg(scale, lse)
    dq = torch.empty(N, Hq, D, device=q.device, dtype=q.dtype)
    if atomic:
        dk = torch.zeros(N, Hkv, D, device=q.device, dtype=lse.dtype)
        dv = torch.zeros(N, Hkv, D, device=q.device, dtype=lse.dtype)
    else:
        dk = torch.empty(N, Hkv, D, device=q.device, dtype=k.dtype)
        dv = torch.empty(N, Hkv, D, device=q.device, dtype=v.dtype)
    _bwd_dq_kernel[(triton.cdiv(N, t_dq["BLOCK_M"]), Hq)](
        q, k, v, grad_out, lse, delta, dq, key_end, kv_ptr, kv_blocks, N,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), grad_out.stride(0), grad_out.stride(1),
        lse.stride(0), dq.stride(0), dq.stride(1),
        scale_t,
        R=R, D=D, BLOCK_D=BLOCK_D, **t_dq, **consts,
    )
    if n_items:
        _bwd_dkdv_kernel[(n_items, Hq)](
            q, k, v, grad_out, lse, delta, dk, dv, key_end, dkdv_items, N, q_chunk,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), grad_out.stride(0), grad_out.stride(1),
            lse.stride(0), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
            scale_t,
            R=R, D=D, BLOCK_D=BLOCK_D, **t_kv, **consts, ATOMIC=atomic,
        )
    return dq, dk.to(k.dtype), dv.to(v.dtype)
