"""Shared-prefix (cascade) decode attention: one query token per sample.

Samples come in groups that share one prompt. Each group's prompt keys/values are
stored once (``prefix_k``/``prefix_v``: ``[Hkv, N_prefix, D]``, prompts packed along
the token axis); each sample also has its own growing suffix (``suffix_k``/``suffix_v``:
``[B, Hkv, S, D]``, the first ``suffix_len[b]`` slots valid).

Two kernels:

* ``_prefix_attn_kernel`` -- one program per (group, kv head, tile of query rows).
  The query rows of a tile are the (sample, query head) pairs of one group that map to
  one kv head, so each prefix key/value block is loaded once for all G samples and all
  query heads sharing it (the point of the cascade: prefix traffic is ``P``, not
  ``G * P``). Writes the partial output and its log-sum-exp.
* ``_suffix_merge_kernel`` -- one program per (sample, query head): attention over the
  sample's own suffix, then the merge with the prefix partial via the two log-sum-exps:
  ``out = (e^{lse_p} o_p + e^{lse_s} o_s) / (e^{lse_p} + e^{lse_s})``.

Precision: when q, k and v share bf16 or fp16, both dots of the prefix kernel run on tensor
cores with fp32 accumulation (the probabilities are rounded to the value dtype before the
second dot, as in flash attention; running max and sum stay fp32). fp32, fp64 or mixed
inputs are computed with exact fp32 dots. Tiles and warps follow the head dim and dtype
(``prefix_tiles``; spill-free on sm_90, see benchmarks/gpu/README.md).

Launchers take tensors and write outputs; validation lives in
``fastrl.ops.decode_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _prefix_attn_kernel(
    Q, K, V, START, LEN, O, LSE,
    stride_qb, stride_qh,
    stride_kh, stride_kn,
    stride_vh, stride_vn,
    stride_ob, stride_oh,
    stride_lb,
    scale,
    G: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
):
    n = tl.program_id(0)  # group (prompt)
    h = tl.program_id(1)  # kv head
    mt = tl.program_id(2)  # tile of the group's G*R query rows

    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < G * R
    b = n * G + rows // R  # sample
    hq = h * R + rows % R  # query head
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D

    q = tl.load(
        Q + b[:, None] * stride_qb + hq[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    start = tl.load(START + n)
    length = tl.load(LEN + n)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    s0 = 0
    while s0 < length:  # a while loop: the bound is loaded, and the CPU interpreter rejects range() over it
        keys = s0 + offs_n
        k_ok = keys < length
        tok = start + keys
        k = tl.load(
            K + h * stride_kh + tok[:, None] * stride_kn + offs_d[None, :],
            mask=k_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        v = tl.load(
            V + h * stride_vh + tok[:, None] * stride_vn + offs_d[None, :],
            mask=k_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        # UPCAST: exact fp32 dots ("ieee", no TF32); else bf16/fp16 tensor-core dots with fp32 accumulation
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(k_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.where(m_new == float("-inf"), 0.0, tl.exp(m_i - m_new))
        p = tl.where(k_ok[None, :], tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST:
            acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
        else:  # p rounded to the value dtype, as in flash attention; the sum l_i stays fp32
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
        s0 += BLOCK_N

    o = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)  # an empty prefix contributes nothing
    lse = m_i + tl.log(l_i)
    tl.store(
        O + b[:, None] * stride_ob + hq[:, None] * stride_oh + offs_d[None, :],
        o,
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(LSE + b * stride_lb + hq, lse, mask=row_ok)


@triton.jit
def _suffix_merge_kernel(
    Q, KS, VS, SLEN, OP, LSEP, OUT,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_pb, stride_ph,
    stride_lb,
    stride_ob, stride_oh,
    scale,
    R: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    h = hq // R
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(Q + b * stride_qb + hq * stride_qh + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    length = tl.load(SLEN + b)

    # Running max / sum / accumulator over the suffix, kept as BLOCK_N-wide vectors
    # merged at the end (a scalar online softmax written with vector ops).
    m_i = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_N,), tl.float32)
    acc = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    base_k = KS + b * stride_kb + h * stride_kh
    base_v = VS + b * stride_vb + h * stride_vh
    s0 = 0
    while s0 < length:
        keys = s0 + offs_n
        k_ok = keys < length
        k = tl.load(base_k + keys[:, None] * stride_kn + offs_d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        v = tl.load(base_v + keys[:, None] * stride_vn + offs_d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(k_ok, s, float("-inf"))
        # lane-wise online softmax: lane j holds keys j, j + BLOCK_N, ...
        m_new = tl.maximum(m_i, s)
        alpha = tl.where(m_new == float("-inf"), 0.0, tl.exp(m_i - m_new))
        p = tl.where(k_ok, tl.exp(s - m_new), 0.0)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v
        m_i = m_new
        s0 += BLOCK_N

    # reduce the lanes: suffix log-sum-exp and normalised output
    m_s = tl.max(m_i, axis=0)
    w = tl.where(m_i == float("-inf"), 0.0, tl.exp(m_i - m_s))
    l_s = tl.sum(l_i * w, axis=0)
    o_s = tl.sum(acc * w[:, None], axis=0)  # un-normalised, scaled to e^{m_s}
    lse_s = m_s + tl.log(l_s)

    o_p = tl.load(OP + b * stride_pb + hq * stride_ph + offs_d, mask=d_ok, other=0.0)
    lse_p = tl.load(LSEP + b * stride_lb + hq)
    mx = tl.maximum(lse_p, lse_s)
    w_p = tl.exp(lse_p - mx)
    w_s = tl.exp(lse_s - mx)
    o_s = tl.where(l_s > 0, o_s / l_s, 0.0)  # an empty suffix contributes nothing
    out = (w_p * o_p + w_s * o_s) / (w_p + w_s)
    tl.store(OUT + b * stride_ob + hq * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=d_ok)


def prefix_tiles(block_d: int, rows: int, dtype: torch.dtype) -> dict[str, int]:
    """Tiles and warps of ``_prefix_attn_kernel`` for a head dim (padded to ``block_d``), the
    ``rows = G * R`` query rows of a group and the input dtype.

    Chosen from sm_90 compile reports (benchmarks/gpu/sm90_compile.py): no spills at D in
    {64, 128} for bf16/fp16 (tensor-core dots) and fp32 (exact fp32 dots, more registers per
    product, hence narrower key tiles).
    """
    if dtype == torch.float32:  # exact fp32 dots run on the FMA units and hold whole tiles in registers
        return dict(BLOCK_M=16, BLOCK_N=32 if block_d <= 64 else 16, num_warps=8)
    block_m = max(16, min(64, triton.next_power_of_2(rows)))
    return dict(BLOCK_M=block_m, BLOCK_N=64 if block_d <= 128 else 32, num_warps=4 if block_d <= 64 else 8)


def shared_prefix_decode_attention_triton(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    prefix_start: torch.Tensor,
    prefix_len: torch.Tensor,
    suffix_k: torch.Tensor,
    suffix_v: torch.Tensor,
    suffix_len: torch.Tensor,
    group_size: int,
    scale: float,
) -> torch.Tensor:
    """Launch both kernels. ``q [B, Hq, D]`` -> ``[B, Hq, D]`` in ``q.dtype``.

    ``prefix_k/v [Hkv, N, D]``, ``prefix_start/len [num_groups]`` int,
    ``suffix_k/v [B, Hkv, S, D]``, ``suffix_len [B]`` int. The last dimension of every
    tensor must be contiguous (stride 1); other strides are free.
    """
    B, Hq, D = q.shape
    Hkv = prefix_k.shape[0]
    R = Hq // Hkv
    num_groups = prefix_start.shape[0]
    G = group_size
    BLOCK_D = max(16, triton.next_power_of_2(D))
    # Tensor-core dots when q, k and v share a 16-bit dtype; anything else (fp32, fp64, mixed)
    # is computed in exact fp32. The interpreter computes bf16 tl.dot wrongly
    # (csrc_triton/README.md): there bf16 takes the fp32 path too (CPU tensors only run there).
    half = q.dtype in (torch.bfloat16, torch.float16) and prefix_k.dtype == prefix_v.dtype == q.dtype
    upcast = not half or (q.device.type == "cpu" and q.dtype == torch.bfloat16)
    cfg = prefix_tiles(BLOCK_D, G * R, torch.float32 if upcast else q.dtype)
    o_p = torch.empty(B, Hq, D, device=q.device, dtype=torch.float32)
    lse_p = torch.empty(B, Hq, device=q.device, dtype=torch.float32)
    grid = (num_groups, Hkv, triton.cdiv(G * R, cfg["BLOCK_M"]))
    _prefix_attn_kernel[grid](
        q, prefix_k, prefix_v, prefix_start, prefix_len, o_p, lse_p,
        q.stride(0), q.stride(1),
        prefix_k.stride(0), prefix_k.stride(1),
        prefix_v.stride(0), prefix_v.stride(1),
        o_p.stride(0), o_p.stride(1),
        lse_p.stride(0),
        scale,
        G=G, R=R, D=D, BLOCK_D=BLOCK_D, UPCAST=upcast, **cfg,
    )
    out = torch.empty(B, Hq, D, device=q.device, dtype=q.dtype)
    BLOCK_NS = 32 if BLOCK_D > 64 else 64
    _suffix_merge_kernel[(B, Hq)](
        q, suffix_k, suffix_v, suffix_len, o_p, lse_p, out,
        q.stride(0), q.stride(1),
        suffix_k.stride(0), suffix_k.stride(1), suffix_k.stride(2),
        suffix_v.stride(0), suffix_v.stride(1), suffix_v.stride(2),
        o_p.stride(0), o_p.stride(1),
        lse_p.stride(0),
        out.stride(0), out.stride(1),
        scale,
        R=R, D=D, BLOCK_N=BLOCK_NS, BLOCK_D=BLOCK_D,
    )
    return out
