"""Small Triton kernels that each embody one pattern ``hopper_checks.py`` must catch (and
one well-formed GEMM it must pass), compiled for sm_90 by ``sm90_compile.py --probes``.

- ``_mm_for``: a tiled matmul, K loop as a ``for``, fp32 accumulator in registers, one
  store at the end (128 x 128 x 64 tiles, 8 warps, 3 stages): passes every GEMM rule.
- ``_mm_narrow``: the same with 64-wide tiles (m64n64 wgmma): ``wgmma_n``.
- ``_mm_while``: the same K loop as a ``while``: ``while_dot``.
- ``_mm_rmw``: the fp32 accumulator loaded and stored from global memory every K step:
  ``acc_rmw`` (and ``pipelined``: the accumulator read is a synchronous load).
- ``_atomic_loop``: a loop of ``tl.atomic_add`` with the default ``acq_rel`` semantics
  (``RELAXED=False``: ``fence``) or ``sem="relaxed"`` (passes).
"""

from __future__ import annotations

import triton
import triton.language as tl

PROBES: dict[str, str] = {
    "hopper_probes._mm_for": "gemm",
    "hopper_probes._mm_narrow": "gemm",
    "hopper_probes._mm_while": "gemm",
    "hopper_probes._mm_rmw": "gemm",
    "hopper_probes._atomic_loop": "memory",
}
"""Probe kernel -> the kind of checks applied to it (``hopper_checks.CHECKED``'s kinds)."""


@triton.jit
def _tile_ptrs(a_ptr, b_ptr, K, sa, sb, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    return a_ptr + rm[:, None] * sa + rk[None, :], b_ptr + rk[:, None] * sb + rn[None, :], rm, rn


@triton.jit
def _mm_for(a_ptr, b_ptr, c_ptr, K, sa, sb, sc, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pa, pb, rm, rn = _tile_ptrs(a_ptr, b_ptr, K, sa, sb, BM, BN, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for _ in range(0, K, BK):
        acc += tl.dot(tl.load(pa), tl.load(pb))
        pa += BK
        pb += BK * sb
    tl.store(c_ptr + rm[:, None] * sc + rn[None, :], acc)


@triton.jit
def _mm_narrow(a_ptr, b_ptr, c_ptr, K, sa, sb, sc, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pa, pb, rm, rn = _tile_ptrs(a_ptr, b_ptr, K, sa, sb, BM, BN, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for _ in range(0, K, BK):
        acc += tl.dot(tl.load(pa), tl.load(pb))
        pa += BK
        pb += BK * sb
    tl.store(c_ptr + rm[:, None] * sc + rn[None, :], acc)


@triton.jit
def _mm_while(a_ptr, b_ptr, c_ptr, K, sa, sb, sc, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pa, pb, rm, rn = _tile_ptrs(a_ptr, b_ptr, K, sa, sb, BM, BN, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    k = K * 0
    while k < K:
        acc += tl.dot(tl.load(pa), tl.load(pb))
        pa += BK
        pb += BK * sb
        k += BK
    tl.store(c_ptr + rm[:, None] * sc + rn[None, :], acc)


@triton.jit
def _mm_rmw(a_ptr, b_ptr, c_ptr, K, sa, sb, sc, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pa, pb, rm, rn = _tile_ptrs(a_ptr, b_ptr, K, sa, sb, BM, BN, BK)
    pc = c_ptr + rm[:, None] * sc + rn[None, :]
    for _ in range(0, K, BK):
        acc = tl.load(pc)
        acc += tl.dot(tl.load(pa), tl.load(pb))
        tl.store(pc, acc)
        pa += BK
        pb += BK * sb


@triton.jit
def _atomic_loop(x_ptr, out_ptr, n, BLOCK: tl.constexpr, RELAXED: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    for i in range(0, n, BLOCK):
        v = tl.load(x_ptr + i + offs, mask=i + offs < n, other=0.0)
        if RELAXED:
            tl.atomic_add(out_ptr + pid * BLOCK + offs, v, sem="relaxed")
        else:
            tl.atomic_add(out_ptr + pid * BLOCK + offs, v)


def launch_all(meta) -> None:
    """Launch every probe on ``meta`` tensors (under ``sm90_compile.Recorder``): a 4096^3
    bf16 GEMM (1,024 CTAs at 128 x 128 tiles) and a 1,056-CTA atomic loop, both ways."""
    import torch

    m = n = k = 4096
    a, b = meta(m, k, dtype=torch.bfloat16), meta(k, n, dtype=torch.bfloat16)
    c = meta(m, n)
    for kern, tile in ((_mm_for, 128), (_mm_while, 128), (_mm_rmw, 128), (_mm_narrow, 64)):
        kern[(m // 128, n // tile)](a, b, c, k, a.stride(0), b.stride(0), c.stride(0), BM=128, BN=tile, BK=64,
                                    num_warps=8, num_stages=3)
    x = meta(1 << 20)
    for relaxed in (False, True):
        _atomic_loop[(1056,)](x, meta(1056 * 256), x.shape[0], BLOCK=256, RELAXED=relaxed, num_warps=4)
