"""Row kernels of the token-chunked log-prob path (``backend="chunked"``): the epilogue of a
cuBLAS logits GEMM.

The chunked path (``fastrl.ops.logprobs`` / ``fastrl.ops.fused_policy_loss``) computes a
chunk of ``C`` tokens' raw logits ``z = h @ W.T`` in fp32 with one GEMM, then these kernels
make one pass each over ``z``, row by row (one wave of programs, each the same number of
rows: ``row_grid``), ``BLOCK_V`` vocabulary entries per step
(``u = (z + bias) / temperature`` is formed in registers, never stored):

1. ``row_stats``: running max ``m``, ``s = sum exp(u - m)``, the entropy term
   ``w = sum exp(u - m) (u - m)`` (with entropy) and the target logit ``t`` -- the four
   numbers per row ``fastrl.ops.logprobs._combine`` turns into (lse, logp, entropy), also
   across tensor-parallel vocabulary shards. Reads ``4 V`` bytes per row.
2. ``row_grad``: given the per-token loss gradients ``gl = d loss / d logp`` and
   ``ge = d loss / d entropy``, writes ``d loss / d z`` of the row:

       g = (gl (onehot(y) - p) - ge p (log p + entropy)) / temperature,   p = exp(u - lse)

   in the dtype of the output buffer (in place over ``z`` when that is fp32; a separate
   bf16/fp16 buffer otherwise, which the gradient GEMMs read). Reads ``4 V`` and writes
   ``4 V`` (fp32) or ``2 V`` (bf16) bytes per row. A row with ``gl = ge = 0`` writes zeros
   whatever ``z`` holds (a row without a loss term changes no gradient).

Between the two, the per-token gradients come from the loss's own code (``policy_loss`` on
the chunk's log-probs, one home for every surrogate formula): a fused stats+gradient kernel
would make the same two passes over each row (the gradient needs the row's log-sum-exp
before its first entry can be written), so splitting them costs launches, not bytes.

Budget of every launch of the chunked path (bf16; N tokens of which 7/8 scored; chunks of
``fastrl.ops.logprobs.chunked_rows`` tokens; TFLOP of the scored tokens; bytes: device memory,
the GEMMs' operands and outputs once per chunk, the fp32 grad_weight read and written by each
chunk's addmm; predicted times serialise FLOPs at 790 TFLOP/s and bytes at 4.8 TB/s (H200);
``python benchmarks/gpu/logprob_floor.py`` prints it for any shape). At N = 8,192, H = 3,584,
V = 151,936 (4 chunks of 2,048):

    launch (per call)                 TFLOP   GB     in which pass
    logits GEMM (fp32 out)            7.81    8.8    forward; the two-pass backward again
    row_stats                         0       4.4    forward (and the no-grad pass)
    row_grad (bf16 g)                 0       6.5    one pass: forward; two pass: backward
    g @ W (grad_hidden)               7.81    6.6
    g.T @ h (fp32 grad_weight addmm)  7.81    19.7

    one pass (token-level losses)  23.4 TFLOP, 46 GB: predicted 39.2 ms (floor 29.6: 1.32x)
    two pass (sequence-level, linear_logprobs, vocab shards)  31.2 TFLOP, 55 GB: 50.9 ms
    no-grad pass (old / reference log-probs)  7.81 TFLOP, 13 GB: 12.6 ms (one GEMM 9.9: 1.28x)

The other shapes of the issue (one pass / no-grad, predicted, H200): N = 8,192, H = 1,536,
V = 151,936: 19.1 / 6.4 ms (floor 12.7 / 4.2); N = 8,192, H = 4,096, V = 128,256: 36.0 / 11.7
ms (floor 28.6 / 9.5); N = 32,768, H = 1,536, V = 151,936: 75.4 / 25.6 ms (floor 50.8 / 16.9:
the fp32 grad_weight re-accumulation, 14 chunks x 1.9 GB, is what a small H pays). The
measurement is pending a GPU (``benchmarks/gpu/bench_logprob_loss.py``). These are
memory-bound kernels: of the Hopper checks (``benchmarks/gpu/hopper_checks.py``) they take
the fence, waves and spill rules, which they pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048
"""Vocabulary entries per step of a row (fp32: 8 KB per step, 8 per thread at 8 warps)."""
NUM_WARPS = 8
PROGRAMS_PER_SM = 4
"""Resident programs per SM the grid plans for (8 warps each: 32 warps an SM, enough loads in
flight for these memory-bound passes; the kernels use <= 64 registers, so 4 fit)."""
INTERPRETER_PROGRAMS = 3  # on CPU: a few programs, so the tests run programs of several rows
ASSUMED_SM_COUNT = 132  # H100 / H200: what a launch on a device without properties (meta) plans for


def row_grid(n_rows: int, device: torch.device) -> tuple[int, int]:
    """(programs, rows per program): at most one wave of ``PROGRAMS_PER_SM`` programs per
    SM, every program the same number of rows (``ceil(n / ceil(n / max_programs))``
    programs), so no last wave runs part-empty: one program per row gave 2,048 one-row
    programs at 5 per SM = 3.1 waves, the last 10% full (``hopper_checks`` caught it)."""
    if device.type == "cuda":
        cap = torch.cuda.get_device_properties(device).multi_processor_count * PROGRAMS_PER_SM
    elif device.type == "cpu":
        cap = INTERPRETER_PROGRAMS
    else:
        cap = ASSUMED_SM_COUNT * PROGRAMS_PER_SM
    per = -(-max(n_rows, 1) // cap)
    return -(-max(n_rows, 1) // per), per
_NEG_INF = tl.constexpr(float("-inf"))  # a global a compiled kernel may read: a constexpr


# the row counts only bound loops: exempt from the JIT's integer specialisation (one compile
# per vocabulary and flags, whatever the chunk's token count)
@triton.jit(do_not_specialize=["n_rows", "rows_per_prog"])
def _row_stats_kernel(
    z_ptr, b_ptr, y_ptr, m_ptr, s_ptr, w_ptr, t_ptr,
    n_rows, rows_per_prog, stride_z, inv_temp,
    V: tl.constexpr, HAS_BIAS: tl.constexpr, WITH_ENT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # rows [pid * rows_per_prog, ...) of this program, one after the other (a while loop: a
    # runtime bound; no MMA in it, so nothing to software-pipeline across rows)
    first = tl.program_id(0).to(tl.int64) * rows_per_prog
    i = rows_per_prog * 0
    while i < rows_per_prog:
        row = first + i
        if row < n_rows:
            _stats_row(z_ptr, b_ptr, y_ptr, m_ptr, s_ptr, w_ptr, t_ptr, row, stride_z, inv_temp,
                       V, HAS_BIAS, WITH_ENT, BLOCK_V)
        i += 1


@triton.jit
def _stats_row(
    z_ptr, b_ptr, y_ptr, m_ptr, s_ptr, w_ptr, t_ptr, row, stride_z, inv_temp,
    V: tl.constexpr, HAS_BIAS: tl.constexpr, WITH_ENT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    base = z_ptr + row * stride_z
    cols = tl.arange(0, BLOCK_V)
    # per-lane running statistics, reduced across lanes once at the end
    m_vec = tl.full([BLOCK_V], _NEG_INF, tl.float32)
    s_vec = tl.zeros([BLOCK_V], tl.float32)
    w_vec = tl.zeros([BLOCK_V], tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + cols
        ok = offs < V
        u = tl.load(base + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            u += tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.where(ok, u * inv_temp, _NEG_INF)
        m_new = tl.maximum(m_vec, u)
        # lanes that have met no entry yet (a short last step) keep m = -inf; m_safe keeps
        # every difference below free of (-inf) - (-inf)
        m_safe = tl.where(m_new > _NEG_INF, m_new, 0.0)
        a = tl.exp(m_vec - m_safe)
        d = tl.where(ok, u - m_safe, 0.0)
        e = tl.where(ok, tl.exp(d), 0.0)
        if WITH_ENT:
            dm = tl.where(m_vec > _NEG_INF, m_vec, m_safe) - m_safe
            w_vec = a * (w_vec + dm * s_vec) + e * d
        s_vec = a * s_vec + e
        m_vec = m_new
    m = tl.max(m_vec, axis=0)
    live = m_vec > _NEG_INF
    scale = tl.where(live, tl.exp(m_vec - m), 0.0)
    s = tl.sum(scale * s_vec, axis=0)
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    if WITH_ENT:
        dm = tl.where(live, m_vec - m, 0.0)
        tl.store(w_ptr + row, tl.sum(scale * (w_vec + dm * s_vec), axis=0))
    y = tl.load(y_ptr + row)
    has_y = y >= 0
    y_safe = tl.where(has_y, y, 0)
    zt = tl.load(base + y_safe).to(tl.float32)
    if HAS_BIAS:
        zt += tl.load(b_ptr + y_safe).to(tl.float32)
    tl.store(t_ptr + row, tl.where(has_y, zt * inv_temp, 0.0))


@triton.jit(do_not_specialize=["n_rows", "rows_per_prog"])
def _row_grad_kernel(
    z_ptr, g_ptr, b_ptr, y_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr,
    n_rows, rows_per_prog, stride_z, stride_g, inv_temp,
    V: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    first = tl.program_id(0).to(tl.int64) * rows_per_prog
    i = rows_per_prog * 0
    while i < rows_per_prog:
        row = first + i
        if row < n_rows:
            _grad_row(z_ptr, g_ptr, b_ptr, y_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, row, stride_z, stride_g, inv_temp,
                      V, HAS_BIAS, HAS_GE, BLOCK_V)
        i += 1


@triton.jit
def _grad_row(
    z_ptr, g_ptr, b_ptr, y_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, row, stride_z, stride_g, inv_temp,
    V: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_GE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    zb = z_ptr + row * stride_z
    gb = g_ptr + row * stride_g
    cols = tl.arange(0, BLOCK_V)
    lse = tl.load(lse_ptr + row)
    gl = tl.load(gl_ptr + row)
    y = tl.load(y_ptr + row)
    live = gl != 0.0
    glt = gl * inv_temp
    if HAS_GE:
        ge = tl.load(ge_ptr + row)
        live = live | (ge != 0.0)
        get = ge * inv_temp
        ent = tl.load(ent_ptr + row)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + cols
        ok = offs < V
        u = tl.load(zb + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            u += tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        lp = u * inv_temp - lse
        p = tl.exp(lp)
        g = -glt * p
        if HAS_GE:
            g -= get * p * (lp + ent)
        g = tl.where(offs == y, g + glt, g)
        g = tl.where(live, g, 0.0)
        tl.store(gb + offs, g.to(g_ptr.dtype.element_ty), mask=ok)


def _check_rows(z: torch.Tensor, y: torch.Tensor) -> None:
    if z.dim() != 2 or z.dtype != torch.float32 or z.stride(1) != 1:
        raise ValueError(f"z must be a [rows, V] fp32 tensor with unit column stride, got {tuple(z.shape)} {z.dtype}")
    if y.shape != (z.shape[0],) or y.dtype != torch.int64 or not y.is_contiguous():
        raise ValueError("y must be a contiguous int64 [rows] tensor")


def row_stats(
    z: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, inv_temp: float, with_entropy: bool,
    *, block_v: int = BLOCK_V,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(m, s, w, t) of each row of the raw fp32 logits ``z`` (see the module docstring);
    ``y`` holds each row's target id in ``[0, V)`` or -1 (no target in this vocabulary:
    ``t = 0``). ``w`` is None without entropy."""
    _check_rows(z, y)
    n, v = z.shape
    f32 = dict(dtype=torch.float32, device=z.device)
    m, s, t = torch.empty(n, **f32), torch.empty(n, **f32), torch.empty(n, **f32)
    w = torch.empty(n, **f32) if with_entropy else m
    if n:
        progs, per = row_grid(n, z.device)
        _row_stats_kernel[(progs,)](
            z, bias if bias is not None else z, y, m, s, w, t, n, per, z.stride(0), float(inv_temp),
            V=v, HAS_BIAS=bias is not None, WITH_ENT=bool(with_entropy), BLOCK_V=block_v, num_warps=NUM_WARPS,
        )
    return m, s, (w if with_entropy else None), t


def row_grad(
    z: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, lse: torch.Tensor,
    ent: torch.Tensor | None, gl: torch.Tensor, ge: torch.Tensor | None, inv_temp: float,
    *, block_v: int = BLOCK_V,
) -> torch.Tensor:
    """Writes ``d loss / d z`` of every row into ``out`` ([rows, V], unit column stride, any
    float dtype; ``out`` may be ``z`` itself) and returns it. ``gl``/``ge``/``lse``/``ent``
    are fp32 [rows]; ``ge`` None: no entropy term."""
    _check_rows(z, y)
    n, v = z.shape
    if out.shape != z.shape or out.stride(1) != 1:
        raise ValueError(f"out must be a [rows, V] tensor with unit column stride like z, got {tuple(out.shape)}")
    if ge is not None and ent is None:
        raise ValueError("ge needs ent (the entropy term's gradient uses it)")
    for name, x in (("lse", lse), ("gl", gl), ("ge", ge), ("ent", ent)):
        if x is not None and (x.shape != (n,) or x.dtype != torch.float32 or not x.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous fp32 [rows] tensor")
    if n:
        progs, per = row_grid(n, z.device)
        _row_grad_kernel[(progs,)](
            z, out, bias if bias is not None else z, y, lse, ent if ge is not None else lse, gl,
            ge if ge is not None else gl, n, per, z.stride(0), out.stride(0), float(inv_temp),
            V=v, HAS_BIAS=bias is not None, HAS_GE=ge is not None, BLOCK_V=block_v, num_warps=NUM_WARPS,
        )
    return out
