"""Triton kernels: log-probs and entropy of a linear LM head without [tokens, vocab] logits.

Layout: ``hidden`` [N, H] (row-major), ``weight`` [V, H] (row-major), optional ``bias`` [V],
``targets`` [N] int (a row's target column, or -1 when the target is not among these V
rows: tensor-parallel shards). Rows are sorted so that the ``n_valid`` rows that need
work come first; ``n_valid`` is read from device memory, so no host sync is needed and
ignored rows cost nothing.

Forward (``logprobs_fwd``): one program per tile of BLOCK_N tokens walks the vocabulary
in tiles of BLOCK_V columns. Each logits tile is a ``tl.dot`` GEMM over H in BLOCK_K
steps with fp32 accumulation, scaled by 1/temperature; columns past V are set to -inf
(never 0). It keeps per row only a running max ``m``, the sum of exponentials ``s`` and
``w = sum exp(u - m) * (u - m)`` (both relative to ``m``) and the target logit ``t``, so

    lse = m + log s,   logp = t - lse,   entropy = log s - w / s.

The four statistics are returned unreduced so tensor-parallel shards can combine them.

With few tokens the vocabulary is also split over a second grid axis (``SPLITS``, chosen
for about two programs per SM); the launcher merges the per-split statistics with the
same online-softmax rule (O(splits x tokens) numbers).

Backward: the gradient wrt the tempered logits of row n, column v is

    g[n, v] = (gl[n] * (1[v == y] - p) - ge[n] * p * (u - lse + entropy)) / temperature

with gl, ge the incoming gradients of logp and entropy. It is recomputed tile by tile
and never stored: ``logprobs_bwd_hidden`` (one program per token tile) accumulates
g @ W into grad_hidden; ``logprobs_bwd_weight`` (one program per vocab tile) accumulates
g^T @ hidden into grad_weight and the column sums into grad_bias. Both accumulate in
fp32 in their own output rows (grad_hidden with fp32 atomics when the vocabulary is
split): no workspace bigger than a tile, no [tokens, vocab] buffer.

Budget and standing (``backend="triton"``, selectable by name; ``auto`` on CUDA takes the
token-chunked cuBLAS path of ``csrc_triton/logprob_rows.py`` instead). Per launch at the
issue's shape (N = 8,192 tokens of which 7,168 scored, H = 3,584, V = 151,936, bf16; one
N V H GEMM = 7.81 TFLOP; counts from the loop structure, ``benchmarks/gpu/logprob_floor.py``):

    launch                        TFLOP (x GEMM)   bytes outside the MMA operands
    _fwd_kernel (no-grad pass)    7.81  (1.0)      operand tiles L2 -> SM: 183 GB
    _bwd_hidden_kernel            15.61 (2.0)      fp32 atomics into grad_hidden: 122 GB
    _bwd_weight_kernel            15.61 (2.0)      fp32 grad_weight tile RMW every K step: 488 GB
    total fwd + bwd               39.0  (5.0)      vs a floor of 3 GEMMs (23.4 TFLOP, 29.6 ms at 790 TFLOP/s)

Measured on the first H200 run: 673 ms forward + backward (``benchmarks/results/
gpu_h200_20261204/kernels.json``). The sm_90 compile shows why (``benchmarks/gpu/
hopper_checks.py`` checks it in CI, ``KNOWN_FAILING``): the backward kernels load/store or
atomically add their fp32 accumulators in the MMA loop (acq_rel atomics: a MEMBAR.GPU each),
every kernel issues 64- or 32-wide wgmma, and the logits are recomputed in each backward
kernel (5 GEMM-equivalents for 3).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tile sizes. The CUDA defaults target Hopper (H200: 228 KiB shared memory per SM);
# they are plain dicts so they can be tuned without touching the kernels.
HOPPER_TILES = {
    "fwd": dict(BLOCK_N=64, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=3),
    "bwd_hidden": dict(BLOCK_N=64, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=2),
    "bwd_weight": dict(BLOCK_N=64, BLOCK_V=128, BLOCK_K=64, num_warps=8, num_stages=2),
}
# fp32 inputs with exact ("ieee") dots run on the FMA units, which hold whole operand slices in
# registers (and "tf32x3" splits each operand in three): narrower K steps, and token tiles in
# the weight gradient, keep them from spilling.
HOPPER_TILES_FP32 = {
    "fwd": dict(BLOCK_N=64, BLOCK_V=128, BLOCK_K=32, num_warps=8, num_stages=3),
    "bwd_hidden": dict(BLOCK_N=64, BLOCK_V=128, BLOCK_K=32, num_warps=8, num_stages=2),
    "bwd_weight": dict(BLOCK_N=32, BLOCK_V=128, BLOCK_K=32, num_warps=8, num_stages=2),
}
# Small tiles for the CPU interpreter, so small test shapes still span several tiles.
INTERPRETER_TILES = {
    "fwd": dict(BLOCK_N=16, BLOCK_V=32, BLOCK_K=16, num_warps=1, num_stages=1),
    "bwd_hidden": dict(BLOCK_N=16, BLOCK_V=32, BLOCK_K=16, num_warps=1, num_stages=1),
    "bwd_weight": dict(BLOCK_N=16, BLOCK_V=32, BLOCK_K=16, num_warps=1, num_stages=1),
}

# fp32 inputs use exact fp32 dot products ("ieee") so results match fp32 math to ~1e-6;
# set to "tf32" / "tf32x3" to trade accuracy for tensor-core speed.
FP32_DOT_PRECISION = "ieee"

# SM count assumed when the launcher plans for a device it cannot query (``meta`` tensors:
# ahead-of-time compiles in benchmarks/gpu/sm90_compile.py): an H200.
ASSUMED_SM_COUNT = 132


def _interpreted(device: torch.device) -> bool:
    """CPU tensors only ever run in the Triton interpreter; any other device (``cuda``, or
    ``meta`` when planning compiles) gets the GPU choices."""
    return device.type == "cpu"


def default_tiles(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict[str, dict[str, int]]:
    """Tile sizes for inputs of ``dtype`` on ``device`` (all spill-free on sm_90 at real model
    shapes: see benchmarks/results/sm90_compile_report.json)."""
    if _interpreted(device):
        return INTERPRETER_TILES
    if dtype == torch.float32:  # "ieee" and "tf32x3" spill with the bf16 tiles
        return HOPPER_TILES_FP32
    return HOPPER_TILES


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return ASSUMED_SM_COUNT


@triton.jit
def _logits_tile(
    h_ptr, w_ptr, b_ptr, rows, row_mask, cols, col_mask, stride_h, stride_w, inv_temp, H: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """Tempered logits of a [BLOCK_N, BLOCK_V] tile in fp32; invalid columns are -inf."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + ks
        k_mask = k < H
        h = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + k[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + k[None, :],
                    mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        acc = acc + b[None, :]
    acc = acc * inv_temp
    return tl.where(col_mask[None, :], acc, float("-inf"))


@triton.jit
def _fwd_kernel(
    h_ptr, w_ptr, b_ptr, y_ptr, nvalid_ptr, m_ptr, s_ptr, ent_ptr, t_ptr,
    stride_h_q, stride_w_q, inv_temp, V, v_per_split, H: tl.constexpr, ROW_ALIGN: tl.constexpr,
    HAS_BIAS: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # program (i, j): token tile i, vocabulary columns [j * v_per_split, (j + 1) * v_per_split)
    stride_h, stride_w = stride_h_q * ROW_ALIGN, stride_w_q * ROW_ALIGN  # see _row_align
    pid = tl.program_id(0)
    split = tl.program_id(1)
    v_lo = split * v_per_split
    v_end = tl.minimum(v_lo + v_per_split, V)
    out_off = split * tl.num_programs(0) * BLOCK_N
    n_valid = tl.load(nvalid_ptr)
    row_start = pid * BLOCK_N
    if row_start >= n_valid:
        return
    rows = row_start + tl.arange(0, BLOCK_N)
    row_mask = rows < n_valid
    y = tl.load(y_ptr + rows, mask=row_mask, other=-1)
    # finite "minus infinity" keeps 0 * (m_old - m_new) finite on the first tile
    m = tl.full((BLOCK_N,), -1.0e38, tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    w_sum = tl.zeros((BLOCK_N,), tl.float32)
    t = tl.zeros((BLOCK_N,), tl.float32)
    # a while loop: the split width is a runtime argument (it follows the token count, and a
    # constexpr would recompile the kernel whenever that changes)
    v0 = v_lo
    while v0 < v_end:
        cols = v0 + tl.arange(0, BLOCK_V)
        v0 += BLOCK_V
        col_mask = cols < V
        u = _logits_tile(h_ptr, w_ptr, b_ptr, rows, row_mask, cols, col_mask, stride_h, stride_w, inv_temp, H,
                         HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_K, PRECISION, UPCAST)
        m_new = tl.maximum(m, tl.max(u, 1))
        alpha = tl.exp(m - m_new)
        d = u - m_new[:, None]  # -inf on padding columns
        e = tl.exp(d)  # 0 on padding columns
        if WITH_ENTROPY:
            # w relative to m_new: alpha * (w_old + (m_old - m_new) * s_old) + sum e * d
            d0 = tl.where(col_mask[None, :], d, 0.0)  # avoid 0 * -inf on padding columns
            w_sum = alpha * (w_sum + (m - m_new) * s) + tl.sum(e * d0, 1)
        s = alpha * s + tl.sum(e, 1)
        m = m_new
        t += tl.sum(tl.where(cols[None, :] == y[:, None], u, 0.0), 1)
    tl.store(m_ptr + out_off + rows, m, mask=row_mask)
    tl.store(s_ptr + out_off + rows, s, mask=row_mask)
    tl.store(t_ptr + out_off + rows, t, mask=row_mask)
    if WITH_ENTROPY:
        tl.store(ent_ptr + out_off + rows, w_sum, mask=row_mask)


@triton.jit
def _grad_logits_tile(u, cols, col_mask, y, lse, ent, gl, ge, inv_temp, WITH_ENTROPY: tl.constexpr):
    """d loss / d raw logits for one tile (fp32), zero on padding columns."""
    d = u - lse[:, None]
    p = tl.exp(d)
    onehot = (cols[None, :] == y[:, None]).to(tl.float32)
    g = gl[:, None] * (onehot - p)
    if WITH_ENTROPY:
        d0 = tl.where(col_mask[None, :], d, 0.0)  # avoid 0 * -inf on padding columns
        g -= ge[:, None] * p * (d0 + ent[:, None])
    g = g * inv_temp
    return tl.where(col_mask[None, :], g, 0.0)


@triton.jit
def _load_row_stats(y_ptr, lse_ptr, gl_ptr, ent_ptr, ge_ptr, rows, row_mask, WITH_ENTROPY: tl.constexpr):
    """What the backward needs of each token: target, saved logsumexp and the upstream
    gradients of log-prob and (when entropy was asked for) entropy and its saved value."""
    y = tl.load(y_ptr + rows, mask=row_mask, other=-1)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    gl = tl.load(gl_ptr + rows, mask=row_mask, other=0.0)
    if WITH_ENTROPY:
        ent = tl.load(ent_ptr + rows, mask=row_mask, other=0.0)
        ge = tl.load(ge_ptr + rows, mask=row_mask, other=0.0)
    else:
        ent = lse
        ge = gl
    return y, lse, gl, ent, ge


@triton.jit
def _bwd_hidden_kernel(
    h_ptr, w_ptr, b_ptr, y_ptr, nvalid_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, gh_ptr,
    stride_h_q, stride_w_q, stride_gh_q, inv_temp, V, v_per_split, H: tl.constexpr, ROW_ALIGN: tl.constexpr,
    HAS_BIAS: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, ATOMIC: tl.constexpr,
):
    # program (i, j): token tile i, vocabulary columns [j * v_per_split, (j + 1) * v_per_split);
    # with several splits the programs of one token tile add into grad_hidden atomically
    stride_h, stride_w, stride_gh = stride_h_q * ROW_ALIGN, stride_w_q * ROW_ALIGN, stride_gh_q * ROW_ALIGN
    pid = tl.program_id(0)
    v_lo = tl.program_id(1) * v_per_split
    v_end = tl.minimum(v_lo + v_per_split, V)
    n_valid = tl.load(nvalid_ptr)
    row_start = pid * BLOCK_N
    if row_start >= n_valid:
        return
    rows = row_start + tl.arange(0, BLOCK_N)
    row_mask = rows < n_valid
    y, lse, gl, ent, ge = _load_row_stats(y_ptr, lse_ptr, gl_ptr, ent_ptr, ge_ptr, rows, row_mask, WITH_ENTROPY)
    ks = tl.arange(0, BLOCK_K)
    v0 = v_lo
    while v0 < v_end:  # runtime bound, as in the forward
        cols = v0 + tl.arange(0, BLOCK_V)
        v0 += BLOCK_V
        col_mask = cols < V
        u = _logits_tile(h_ptr, w_ptr, b_ptr, rows, row_mask, cols, col_mask, stride_h, stride_w, inv_temp, H,
                         HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_K, PRECISION, UPCAST)
        g = _grad_logits_tile(u, cols, col_mask, y, lse, ent, gl, ge, inv_temp, WITH_ENTROPY)
        if not UPCAST:
            g = g.to(w_ptr.dtype.element_ty)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + ks
            k_mask = k < H
            w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + k[None, :],
                        mask=col_mask[:, None] & k_mask[None, :], other=0.0)
            if UPCAST:
                w = w.to(tl.float32)
            gh_ptrs = gh_ptr + rows[:, None].to(tl.int64) * stride_gh + k[None, :]
            gh_mask = row_mask[:, None] & k_mask[None, :]
            if ATOMIC:
                tl.atomic_add(gh_ptrs, tl.dot(g, w, input_precision=PRECISION), mask=gh_mask)
            else:
                gh = tl.load(gh_ptrs, mask=gh_mask, other=0.0)
                gh = tl.dot(g, w, gh, input_precision=PRECISION)
                tl.store(gh_ptrs, gh, mask=gh_mask)


@triton.jit
def _bwd_weight_kernel(
    h_ptr, w_ptr, b_ptr, y_ptr, nvalid_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, gw_ptr, gb_ptr,
    stride_h_q, stride_w_q, stride_gw_q, inv_temp, V, H: tl.constexpr, ROW_ALIGN: tl.constexpr,
    HAS_BIAS: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    stride_h, stride_w, stride_gw = stride_h_q * ROW_ALIGN, stride_w_q * ROW_ALIGN, stride_gw_q * ROW_ALIGN
    pid = tl.program_id(0)
    n_valid = tl.load(nvalid_ptr)
    cols = pid * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = cols < V
    ks = tl.arange(0, BLOCK_K)
    gb = tl.zeros((BLOCK_V,), tl.float32)
    # a while loop: the row count is read from device memory (no host sync), and the
    # interpreter cannot take a loaded scalar as a range() bound
    r0 = 0
    while r0 < n_valid:
        rows = r0 + tl.arange(0, BLOCK_N)
        r0 += BLOCK_N
        row_mask = rows < n_valid
        y, lse, gl, ent, ge = _load_row_stats(y_ptr, lse_ptr, gl_ptr, ent_ptr, ge_ptr, rows, row_mask, WITH_ENTROPY)
        u = _logits_tile(h_ptr, w_ptr, b_ptr, rows, row_mask, cols, col_mask, stride_h, stride_w, inv_temp, H,
                         HAS_BIAS, BLOCK_N, BLOCK_V, BLOCK_K, PRECISION, UPCAST)
        g = _grad_logits_tile(u, cols, col_mask, y, lse, ent, gl, ge, inv_temp, WITH_ENTROPY)
        g = tl.where(row_mask[:, None], g, 0.0)
        if HAS_BIAS:
            gb += tl.sum(g, 0)
        if UPCAST:
            gt = tl.trans(g)
        else:
            gt = tl.trans(g.to(h_ptr.dtype.element_ty))
        for k0 in range(0, H, BLOCK_K):
            k = k0 + ks
            k_mask = k < H
            h = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + k[None, :],
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            gw_ptrs = gw_ptr + cols[:, None].to(tl.int64) * stride_gw + k[None, :]
            gw_mask = col_mask[:, None] & k_mask[None, :]
            gw = tl.load(gw_ptrs, mask=gw_mask, other=0.0)
            if UPCAST:
                h = h.to(tl.float32)
            gw = tl.dot(gt, h, gw, input_precision=PRECISION)
            tl.store(gw_ptrs, gw, mask=gw_mask)
    if HAS_BIAS:
        tl.store(gb_ptr + cols, gb, mask=col_mask)


def _precision(dtype: torch.dtype) -> str | None:
    # the input precision only concerns fp32 operands; bf16/fp16 use the default MMA path
    return FP32_DOT_PRECISION if dtype == torch.float32 else None


def _upcast(t: torch.Tensor) -> bool:
    """The Triton interpreter (numpy) has no bf16 GEMM: there, tiles are upcast to fp32 before
    tl.dot. bf16 x bf16 products are exact in fp32, so this matches a bf16 tensor-core dot
    with fp32 accumulation up to summation order. (The rounding of the logits gradient to
    bf16 before the grad GEMMs is skipped too, so the interpreter is slightly more exact.)"""
    return t.dtype == torch.bfloat16 and _interpreted(t.device)


def _row_align(*strides: int) -> int:
    """The largest power of two up to 16 dividing every row stride (in elements).

    Triton's JIT marks an integer argument "divisible by 16" or nothing. A hidden size such
    as 1000 is a multiple of 8: bf16 rows still start on 16-byte boundaries, but the kernel
    would not know it and would load element by element (more registers, spills). The
    strides are passed divided by this number and multiplied back by it as a constexpr, so
    the compiler sees the true alignment. Real model sizes give 16: no extra variant.
    """
    align = 16
    while any(s % align for s in strides):
        align //= 2
    return align


def _split(cfg: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    blocks = {k: v for k, v in cfg.items() if k.startswith("BLOCK_")}
    launch = {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages")}
    return blocks, launch


def _vocab_splits(cfg: dict[str, int], n_rows: int, vocab: int, device: torch.device) -> tuple[int, int]:
    """(number of vocabulary splits, columns per split, a multiple of BLOCK_V).

    One program per token tile leaves most of a GPU idle for a few thousand tokens, so the
    vocabulary is split until there are about two programs per SM. ``cfg["SPLITS"]``
    overrides the choice. The split width reaches the kernels as a runtime argument, so a
    new token count never means a new compile.
    """
    v_tiles = triton.cdiv(vocab, cfg["BLOCK_V"])
    splits = cfg.get("SPLITS")
    if splits is None:
        if _interpreted(device):
            splits = 1
        else:
            splits = triton.cdiv(2 * _sm_count(device), triton.cdiv(n_rows, cfg["BLOCK_N"]))
    splits = max(1, min(int(splits), v_tiles))
    per = triton.cdiv(v_tiles, splits) * cfg["BLOCK_V"]
    return triton.cdiv(vocab, per), per


def _merge_splits(m, s, w, t):
    """Combine per-split (m, s, w, t) [splits, N] into one row each (online-softmax merge)."""
    if m.shape[0] == 1:
        return m[0], s[0], (w[0] if w is not None else None), t[0]
    mg = m.amax(0)
    a = torch.exp(m - mg)
    s_new = (a * s).sum(0)
    w_new = (a * (w + (m - mg) * s)).sum(0) if w is not None else None
    return mg, s_new, w_new, t.sum(0)


def logprobs_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    n_valid: torch.Tensor,
    *,
    inv_temp: float,
    with_entropy: bool,
    tiles: dict[str, dict[str, int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-row statistics ``(m, s, w, t)`` in fp32 (see the module docstring).

    ``hidden`` [N, H] and ``weight`` [V, H] contiguous and of one dtype; ``targets`` [N]
    int; ``n_valid`` a 1-element int32 device tensor: rows >= n_valid are left untouched
    (their outputs are zero). ``w`` is None unless ``with_entropy``.
    """
    N, H = hidden.shape
    V = weight.shape[0]
    cfg = (tiles or default_tiles(hidden.device, hidden.dtype))["fwd"]
    blocks, launch = _split(cfg)
    dev = hidden.device
    splits, per = _vocab_splits(cfg, N, V, dev)
    align = _row_align(hidden.stride(0), weight.stride(0))
    n_tiles = triton.cdiv(N, blocks["BLOCK_N"])
    # rows past n_valid are never written: give them the statistics of "logp = 0"
    shape = (splits, n_tiles * blocks["BLOCK_N"])
    m = torch.zeros(shape, device=dev, dtype=torch.float32)
    s = torch.zeros(shape, device=dev, dtype=torch.float32)
    s[0] = 1.0
    t = torch.zeros(shape, device=dev, dtype=torch.float32)
    w = torch.zeros(shape, device=dev, dtype=torch.float32) if with_entropy else None
    _fwd_kernel[(n_tiles, splits)](
        hidden, weight, bias if bias is not None else hidden, targets, n_valid, m, s, w if w is not None else m, t,
        hidden.stride(0) // align, weight.stride(0) // align, inv_temp, V, per, H=H, ROW_ALIGN=align,
        HAS_BIAS=bias is not None, WITH_ENTROPY=with_entropy, PRECISION=_precision(hidden.dtype),
        UPCAST=_upcast(hidden), **blocks, **launch,
    )
    m, s, w, t = _merge_splits(m[:, :N], s[:, :N], w[:, :N] if w is not None else None, t[:, :N])
    return m, s, w, t


def logprobs_bwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    n_valid: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    *,
    inv_temp: float,
    need_hidden: bool = True,
    need_weight: bool = True,
    tiles: dict[str, dict[str, int]] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(grad_hidden [N, H], grad_weight [V, H], grad_bias [V])`` in fp32.

    ``lse``/``entropy``/``grad_logp``/``grad_entropy`` are fp32 [N]; pass
    ``entropy=grad_entropy=None`` when no gradient flows through the entropy.
    """
    N, H = hidden.shape
    V = weight.shape[0]
    tiles = tiles or default_tiles(hidden.device, hidden.dtype)
    with_ent = grad_entropy is not None
    prec = _precision(hidden.dtype)
    dev = hidden.device
    ent_arg = entropy if with_ent else lse
    ge_arg = grad_entropy if with_ent else grad_logp
    b_arg = bias if bias is not None else hidden
    align = _row_align(hidden.stride(0), weight.stride(0), H)  # H: the row stride of grad_hidden/grad_weight
    gh = gw = gb = None
    if need_hidden:
        cfg = tiles["bwd_hidden"]
        blocks, launch = _split(cfg)
        splits, per = _vocab_splits(cfg, N, V, dev)
        gh = torch.zeros(N, H, device=dev, dtype=torch.float32)
        _bwd_hidden_kernel[(triton.cdiv(N, blocks["BLOCK_N"]), splits)](
            hidden, weight, b_arg, targets, n_valid, lse, ent_arg, grad_logp, ge_arg, gh,
            hidden.stride(0) // align, weight.stride(0) // align, gh.stride(0) // align, inv_temp, V, per, H=H,
            ROW_ALIGN=align,
            HAS_BIAS=bias is not None, WITH_ENTROPY=with_ent, PRECISION=prec, UPCAST=_upcast(hidden),
            ATOMIC=splits > 1, **blocks, **launch,
        )
    if need_weight:
        blocks, launch = _split(tiles["bwd_weight"])
        gw = torch.zeros(V, H, device=dev, dtype=torch.float32)
        gb = torch.zeros(V, device=dev, dtype=torch.float32) if bias is not None else None
        _bwd_weight_kernel[(triton.cdiv(V, blocks["BLOCK_V"]),)](
            hidden, weight, b_arg, targets, n_valid, lse, ent_arg, grad_logp, ge_arg, gw, gb if gb is not None else gw,
            hidden.stride(0) // align, weight.stride(0) // align, gw.stride(0) // align, inv_temp, V, H=H,
            ROW_ALIGN=align,
            HAS_BIAS=bias is not None, WITH_ENTROPY=with_ent, PRECISION=prec, UPCAST=_upcast(hidden), **blocks, **launch,
        )
    return gh, gw, gb
