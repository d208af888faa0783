"""Shared-prefix (cascade) decode attention: one query token per sample.

Samples come in groups that share one prompt. Each group's prompt keys/values are
stored once (``prefix_k``/``prefix_v``: ``[Hkv, N_prefix, D]``, prompts packed along
the token axis); each sample also has its own growing suffix (``suffix_k``/``suffix_v``:
``[B, Hkv, S, D]``, the first ``suffix_len[b]`` slots valid).

Two kernels, two launches, no other work:

* ``_prefix_attn_kernel`` -- the prefix phase, one program per (group, kv head, prefix
  chunk[, tile of query rows]). The query rows are the ``G * R`` (sample, query head) pairs
  of one group that read one kv head (``R = Hq / Hkv``): they are the M dimension of both
  dots, so each prefix key/value block is loaded once for the whole group (prefix traffic
  ``P``, not ``G * P``). A group's prompt is split into ``n_chunks`` equal chunks (sized on
  the device from its length, so the grid never depends on a host value) so that
  ``groups * Hkv * n_chunks`` programs fill the GPU. Each writes its chunk's partial output
  (normalised) and log-sum-exp, ``-inf`` for an empty chunk.
* ``_suffix_merge_kernel`` -- the suffix phase, one program per (sample, kv head) with the
  ``R`` query heads packed as the M dimension of both dots, so each sample's suffix is read
  once per kv head. It then merges its own (output, lse) with the ``n_chunks`` prefix
  partials in one pass: ``out = sum_i e^{lse_i} o_i / sum_i e^{lse_i}``.

KV loops are ``for`` loops over bounds loaded from memory (Triton software-pipelines those:
cp.async into a multi-buffered shared-memory ring on sm_80+; a ``while`` loop is not
pipelined). ``LOOP_FOR=False`` selects a ``while`` form of the same body, for Triton
interpreters older than 3.8 that reject ``range`` over a loaded bound.

Precision: when q, k and v share bf16 or fp16, all dots run on tensor cores with fp32
accumulation (the probabilities are rounded to the value dtype before the second dot, as in
flash attention; running max and sum stay fp32). fp32, fp64 or mixed inputs are computed with
exact fp32 dots (``UPCAST``). Tiles and warps follow the head dim and dtype (``prefix_tiles``,
``suffix_tiles``).

Launchers take tensors and write outputs; validation lives in ``fastrl.ops.decode_attention``.
:class:`CascadePlan` holds everything that does not change between the calls of one rollout
(grids, tiles, the partials' workspace, the output buffer), so a decode step is two kernel
launches with nothing else on the host: no checks, no allocation, no host sync, static
shapes (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SPLIT_TARGET_WAVES = 2
"""The prefix phase aims for this many programs per SM (two resident CTAs per SM at its tiles)."""
MAX_PREFIX_SPLITS = 16
"""At most this many prefix chunks per group (each adds one partial the merge reads)."""
DEFAULT_SM_COUNT = 132
"""SMs assumed when no CUDA device is asked (an H100/H200 SXM): ``meta`` tensors, the interpreter."""
INTERPRETER_RANGE_OK = tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 8)
"""Triton 3.8's interpreter runs ``range`` over a loaded bound (checked); older ones need the while form."""


@triton.jit
def _kv_block(q, base_k, base_v, s0, end, offs_n, offs_d, d_ok, stride_kn, stride_vn, m_i, l_i, acc, scale,
              UPCAST: tl.constexpr):
    """The keys/values ``s0 + offs_n`` (those below ``end``) loaded and folded into the online
    softmax state (the body of both kernels' KV loops, in their ``for`` and ``while`` forms)."""
    keys = s0 + offs_n
    k_ok = keys < end
    kv_mask = k_ok[:, None] & d_ok[None, :]
    k = tl.load(base_k + keys[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(base_v + keys[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    return _online_block(q, k, v, k_ok, m_i, l_i, acc, scale, UPCAST)


@triton.jit
def _online_block(q, k, v, k_ok, m_i, l_i, acc, scale, UPCAST: tl.constexpr):
    """One key/value block of an online softmax: ``q [M, D]``, ``k``/``v [N, D]``."""
    if UPCAST:  # exact fp32 dots ("ieee", no TF32)
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:  # bf16/fp16 tensor-core dots with fp32 accumulation
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
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["n_chunks"])  # the split follows the batch: one compile for all
def _prefix_attn_kernel(
    Q, K, V, START, LEN, OP, LSEP,
    n_chunks,
    stride_qb, stride_qh,
    stride_kh, stride_kn,
    stride_vh, stride_vn,
    scale,
    G: tl.constexpr, R: tl.constexpr, D: tl.constexpr, M_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, LOOP_FOR: tl.constexpr,
):
    n = tl.program_id(0)  # group (prompt)
    h = tl.program_id(1)  # kv head
    c = tl.program_id(2) // M_TILES  # chunk of the group's prompt
    mt = tl.program_id(2) % M_TILES  # tile of the group's G*R query rows
    # the partials' workspace is the plan's, contiguous [n_chunks, B, Hq, D] and [n_chunks, B, Hq]
    q_heads = tl.num_programs(1) * R
    stride_lb = q_heads
    stride_lc = tl.num_programs(0) * G * q_heads
    stride_pb = q_heads * D
    stride_pc = stride_lc * D

    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < G * R
    b = n * G + rows // R  # sample
    hq = h * R + rows % R  # query head
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(Q + b[:, None] * stride_qb + hq[:, None] * stride_qh + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    start = tl.load(START + n)
    length = tl.load(LEN + n)
    chunk = tl.cdiv(tl.cdiv(length, n_chunks), BLOCK_N) * BLOCK_N  # the same chunks for every head and row tile
    lo = c * chunk
    hi = tl.minimum(lo + chunk, length)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    base_k = K + h * stride_kh + start * stride_kn
    base_v = V + h * stride_vh + start * stride_vn
    if LOOP_FOR:
        for s0 in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _kv_block(q, base_k, base_v, s0, hi, offs_n, offs_d, d_ok, stride_kn, stride_vn, m_i, l_i,
                                      acc, scale, UPCAST)
    else:
        s0 = lo
        while s0 < hi:
            m_i, l_i, acc = _kv_block(q, base_k, base_v, s0, hi, offs_n, offs_d, d_ok, stride_kn, stride_vn, m_i, l_i,
                                      acc, scale, UPCAST)
            s0 += BLOCK_N

    o = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)  # an empty chunk contributes nothing (lse -inf)
    lse = tl.where(l_i > 0, m_i + tl.log(l_i), float("-inf"))
    tl.store(OP + c * stride_pc + b[:, None] * stride_pb + hq[:, None] * D + offs_d[None, :], o,
             mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSEP + c * stride_lc + b * stride_lb + hq, lse, mask=row_ok)


@triton.jit(do_not_specialize=["n_chunks"])
def _suffix_merge_kernel(
    Q, KS, VS, SLEN, OP, LSEP, OUT,
    n_chunks,
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    scale,
    R: tl.constexpr, D: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, LOOP_FOR: tl.constexpr,
):
    b = tl.program_id(0)  # sample
    h = tl.program_id(1)  # kv head
    # the plan's buffers are contiguous: partials [n_chunks, B, Hq, D] and [n_chunks, B, Hq], output [B, Hq, D]
    q_heads = tl.num_programs(1) * R
    stride_lb = q_heads
    stride_lc = tl.num_programs(0) * q_heads
    stride_pb = q_heads * D
    stride_pc = stride_lc * D
    rows = tl.arange(0, BLOCK_R)
    row_ok = rows < R
    hq = h * R + rows  # the R query heads reading kv head h
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    rd_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * stride_qb + hq[:, None] * stride_qh + offs_d[None, :], mask=rd_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    length = tl.load(SLEN + b)

    m_i = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    base_k = KS + b * stride_kb + h * stride_kh
    base_v = VS + b * stride_vb + h * stride_vh
    if LOOP_FOR:
        for s0 in range(0, length, BLOCK_N):
            m_i, l_i, acc = _kv_block(q, base_k, base_v, s0, length, offs_n, offs_d, d_ok, stride_kn, stride_vn, m_i, l_i,
                                      acc, scale, UPCAST)
    else:
        s0 = 0
        while s0 < length:
            m_i, l_i, acc = _kv_block(q, base_k, base_v, s0, length, offs_n, offs_d, d_ok, stride_kn, stride_vn, m_i, l_i,
                                      acc, scale, UPCAST)
            s0 += BLOCK_N

    # Merge: (m_i, l_i, acc) is the suffix's state (acc un-normalised, scaled to e^{m_i});
    # each prefix chunk adds e^{lse_c} o_c to it. Empty parts have lse -inf and weigh 0.
    p_rows = b * stride_pb + hq * D
    l_rows = b * stride_lb + hq
    for c in range(n_chunks):
        lse_c = tl.load(LSEP + c * stride_lc + l_rows, mask=row_ok, other=float("-inf"))
        o_c = tl.load(OP + c * stride_pc + p_rows[:, None] + offs_d[None, :], mask=rd_mask, other=0.0)
        m_new = tl.maximum(m_i, lse_c)
        dead = m_new == float("-inf")
        alpha = tl.where(dead, 0.0, tl.exp(m_i - m_new))
        w_c = tl.where(dead, 0.0, tl.exp(lse_c - m_new))
        l_i = l_i * alpha + w_c
        acc = acc * alpha[:, None] + w_c[:, None] * o_c
        m_i = m_new
    out = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)
    tl.store(OUT + b * stride_pb + hq[:, None] * D + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=rd_mask)


def prefix_tiles(block_d: int, rows: int, dtype: torch.dtype) -> dict[str, int]:
    """Tiles and warps of ``_prefix_attn_kernel`` for a head dim (padded to ``block_d``), the
    ``rows = G * R`` query rows of a group and the input dtype (fp32 = the exact-dot path)."""
    if dtype == torch.float32:  # exact fp32 dots run on the FMA units and hold whole tiles in registers
        return dict(BLOCK_M=16, BLOCK_N=32 if block_d <= 64 else 16, num_warps=8)
    # up to 128 rows in one tile (a group's rows past a tile re-read the prompt); 8 warps for
    # 128 rows or D > 64 (4 warps at 128 x 64 need 253 registers on sm_90)
    block_m = max(16, min(128, triton.next_power_of_2(rows)))
    return dict(BLOCK_M=block_m, BLOCK_N=64 if block_d <= 128 else 32, num_warps=4 if block_d <= 64 and block_m <= 64 else 8)


def suffix_tiles(block_d: int, r: int, dtype: torch.dtype) -> dict[str, int]:
    """Tiles and warps of ``_suffix_merge_kernel``: the ``R`` query heads of a kv head padded to
    ``BLOCK_R`` (tl.dot needs at least 16 rows), key blocks of ``BLOCK_N``."""
    block_r = max(16, triton.next_power_of_2(r))
    if dtype == torch.float32:
        return dict(BLOCK_R=block_r, BLOCK_N=32 if block_d <= 64 else 16, num_warps=4)
    return dict(BLOCK_R=block_r, BLOCK_N=64 if block_d <= 128 else 32, num_warps=4)


def prefix_splits(num_groups: int, kv_heads: int, m_tiles: int, sm_count: int, max_prefix_len: int | None, block_n: int) -> int:
    """Chunks per group prompt so that the prefix phase runs about ``SPLIT_TARGET_WAVES`` programs
    per SM (rounded to the nearest count), at most ``MAX_PREFIX_SPLITS`` and, when the longest
    prompt is known, no more than it has key blocks."""
    base = num_groups * kv_heads * m_tiles
    splits = max(1, (SPLIT_TARGET_WAVES * sm_count + base // 2) // base)
    if max_prefix_len is not None:
        splits = min(splits, max(1, triton.cdiv(max_prefix_len, block_n)))
    return min(splits, MAX_PREFIX_SPLITS)


class CascadePlan:
    """The launches of one decode configuration, made once (per rollout) and run per layer and step.

    Fixed at construction: batch ``B``, heads, head dim, group size, dtypes, device, the split
    of the prefix phase, the tiles, the fp32 partials' workspace (``[n_chunks, B, Hq, D]`` and
    ``[n_chunks, B, Hq]``) and the output buffer. :meth:`run` reads only strides from its
    tensors and launches both kernels; its result is the plan's output buffer, overwritten by
    the next call (copy it to keep it).
    """

    def __init__(self, *, batch: int, q_heads: int, kv_heads: int, head_dim: int, group_size: int, dtype: torch.dtype,
                 kv_dtype: torch.dtype | None = None, device: torch.device | str, max_prefix_len: int | None = None,
                 sm_count: int | None = None, loop_for: bool | None = None, splits: int | None = None):
        device = torch.device(device)
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        self.batch, self.q_heads, self.kv_heads, self.head_dim, self.group_size = batch, q_heads, kv_heads, head_dim, group_size
        self.num_groups = batch // group_size
        R = q_heads // kv_heads
        G = group_size
        BLOCK_D = max(16, triton.next_power_of_2(head_dim))
        # Tensor-core dots when q, k and v share a 16-bit dtype; anything else (fp32, fp64, mixed)
        # is computed in exact fp32. The interpreter computes bf16 tl.dot wrongly
        # (csrc_triton/README.md): there bf16 takes the fp32 path too (CPU tensors only run there).
        half = dtype in (torch.bfloat16, torch.float16) and kv_dtype == dtype
        upcast = not half or (device.type == "cpu" and dtype == torch.bfloat16)
        tile_dtype = torch.float32 if upcast else dtype
        pcfg = prefix_tiles(BLOCK_D, G * R, tile_dtype)
        scfg = suffix_tiles(BLOCK_D, R, tile_dtype)
        m_tiles = triton.cdiv(G * R, pcfg["BLOCK_M"])
        if sm_count is None:
            sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else DEFAULT_SM_COUNT
        if splits is None:
            splits = prefix_splits(self.num_groups, kv_heads, m_tiles, sm_count, max_prefix_len, pcfg["BLOCK_N"])
        if loop_for is None:
            loop_for = device.type != "cpu" or INTERPRETER_RANGE_OK
        self.splits = splits
        self.o_p = torch.empty(splits, batch, q_heads, head_dim, device=device, dtype=torch.float32)
        self.lse_p = torch.empty(splits, batch, q_heads, device=device, dtype=torch.float32)
        self.out = torch.empty(batch, q_heads, head_dim, device=device, dtype=dtype)
        self.prefix_grid = (self.num_groups, kv_heads, splits * m_tiles)
        self.suffix_grid = (batch, kv_heads)
        common = dict(D=head_dim, BLOCK_D=BLOCK_D, UPCAST=upcast, LOOP_FOR=loop_for)
        self.prefix_meta = dict(G=G, R=R, M_TILES=m_tiles, **common, **pcfg)
        self.suffix_meta = dict(R=R, **common, **scfg)

    def run(self, q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, prefix_start: torch.Tensor,
            prefix_len: torch.Tensor, suffix_k: torch.Tensor, suffix_v: torch.Tensor, suffix_len: torch.Tensor,
            scale: float) -> torch.Tensor:
        """``q [B, Hq, D]`` -> the plan's ``[B, Hq, D]`` output buffer. Unchecked: the tensors
        must match the plan (``fastrl.ops.decode_attention`` validates them once)."""
        qs, pk, pv, sk, sv = q.stride(), prefix_k.stride(), prefix_v.stride(), suffix_k.stride(), suffix_v.stride()
        o_p, lse_p, splits = self.o_p, self.lse_p, self.splits
        _prefix_attn_kernel[self.prefix_grid](
            q, prefix_k, prefix_v, prefix_start, prefix_len, o_p, lse_p, splits,
            qs[0], qs[1], pk[0], pk[1], pv[0], pv[1], scale, **self.prefix_meta,
        )
        _suffix_merge_kernel[self.suffix_grid](
            q, suffix_k, suffix_v, suffix_len, o_p, lse_p, self.out, splits,
            qs[0], qs[1], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], scale, **self.suffix_meta,
        )
        return self.out


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
    max_prefix_len: int | None = None,
) -> torch.Tensor:
    """One call: a fresh :class:`CascadePlan`, run once. ``q [B, Hq, D]`` -> ``[B, Hq, D]`` in ``q.dtype``.

    ``prefix_k/v [Hkv, N, D]``, ``prefix_start/len [num_groups]`` int,
    ``suffix_k/v [B, Hkv, S, D]``, ``suffix_len [B]`` int. The last dimension of every
    tensor must be contiguous (stride 1); other strides are free. ``max_prefix_len`` (an
    upper bound on ``prefix_len``, optional) caps the prefix split at the prompt's key blocks.
    """
    B, Hq, D = q.shape
    kv_dtypes = {prefix_k.dtype, prefix_v.dtype, suffix_k.dtype, suffix_v.dtype}
    kv_dtype = kv_dtypes.pop() if len(kv_dtypes) == 1 else torch.float64  # mixed: the exact path
    plan = CascadePlan(batch=B, q_heads=Hq, kv_heads=prefix_k.shape[0], head_dim=D, group_size=group_size, dtype=q.dtype,
                       kv_dtype=kv_dtype, device=q.device, max_prefix_len=max_prefix_len)
    return plan.run(q, prefix_k, prefix_v, prefix_start, prefix_len, suffix_k, suffix_v, suffix_len, scale)
