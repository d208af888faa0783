"""The advantages-family kernels compile for a real GPU (sm_90: TTIR -> PTX -> cubin).

The interpreter accepts some programs the compiler rejects (e.g. loop-carried values that
change type), so this lowers every kernel ahead of time with Triton's bundled ptxas. No
GPU is needed. It runs in a subprocess because tests/conftest.py turns the interpreter on.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a cache
    proc = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == 10, proc.stdout


def _jobs(A, V, W):
    seg = dict(vals_ptr="*fp32", order_ptr="*i64", valid_ptr="*u8", seg_start_ptr="*i64", seg_len_ptr="*i64",
               mean_ptr="*fp32", mean_lo_ptr="*fp32", std_ptr="*fp32", count_ptr="*fp32", distinct_ptr="*fp32")
    seg64 = {**seg, "vals_ptr": "*fp64", "mean_ptr": "*fp64", "mean_lo_ptr": "*fp64", "std_ptr": "*fp64"}
    grp = dict(r_ptr="*fp32", rank_ptr="*i64", mean_ptr="*fp32", mean_lo_ptr="*fp32", std_ptr="*fp32", count_ptr="*fp32",
               batch_std_ptr="*fp32", out_ptr="*fp32", N="i32", eps="fp32", floor="fp32")
    grp64 = {**grp, "r_ptr": "*fp64", "mean_ptr": "*fp64", "mean_lo_ptr": "*fp64", "std_ptr": "*fp64",
             "batch_std_ptr": "*fp64"}
    step = dict(r_ptr="*fp16", end_ptr="*i64", rank_ptr="*i64", mean_ptr="*fp64", mean_lo_ptr="*fp64", std_ptr="*fp64",
                mask_ptr="*u8",
                out_ptr="*fp32", S="i32", T="i32", eps="fp32")
    mom = dict(x_ptr="*bf16", mask_ptr="*u8", cnt_ptr="*fp32", mean_ptr="*fp32", m2_ptr="*fp32", N="i32")
    app = dict(x_ptr="*fp32", mask_ptr="*fp32", mu_ptr="*fp32", rstd_ptr="*fp32", y_ptr="*fp32", N="i32")
    gs = dict(g_ptr="*fp32", x_ptr="*fp16", mask_ptr="*i64", mu_ptr="*fp32", sg_ptr="*fp32", sgx_ptr="*fp32", N="i32")
    bwd = dict(g_ptr="*fp32", x_ptr="*fp32", mask_ptr="*u8", mu_ptr="*fp32", rstd_ptr="*fp32", coef_g_ptr="*fp32",
               coef_x_ptr="*fp32", gx_ptr="*fp32", N="i32")
    vl = dict(v_ptr="*bf16", vold_ptr="*bf16", ret_ptr="*fp32", mask_ptr="*u8", row_scale_ptr="*fp32", grad_ptr="*fp32",
              part_ptr="*fp32", N="i32", T="i32", NB="i32", clip="fp32")
    jobs = [
        (A._segment_stats_kernel, seg, dict(HAS_VALID=True, F64=False, BLOCK=256)),
        (A._segment_stats_kernel, seg64, dict(HAS_VALID=False, F64=True, BLOCK=256)),
        (A._group_adv_kernel, grp, dict(MODE=3, F64=False, BLOCK=1024)),
        (A._group_adv_kernel, grp64, dict(MODE=0, F64=True, BLOCK=1024)),
        (A._step_adv_kernel, step, dict(BLOCK_T=128, BLOCK_S=32)),
        (W._moments_kernel, mom, dict(BLOCK=1024)),
        (W._whiten_apply_kernel, app, dict(SHIFT=False, BLOCK=1024)),
        (W._grad_sums_kernel, gs, dict(BLOCK=1024)),
        (W._whiten_bwd_kernel, bwd, dict(SHIFT=True, BLOCK=1024)),
        (V._value_loss_kernel, vl, dict(HAS_CLIP=True, WRITE_GRAD=True, BLOCK=1024)),
    ]
    return [(fn, {**s, **{k: "constexpr" for k in c}}, c) for fn, s, c in jobs]


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from csrc_triton import advantages as A
    from csrc_triton import value_loss as V
    from csrc_triton import whiten as W

    target = GPUTarget("cuda", 90, 32)
    for fn, signature, constexprs in _jobs(A, V, W):
        kernel = triton.compile(ASTSource(fn, signature, constexprs), target=target)
        print("ok", fn.__name__, constexprs, len(kernel.asm["cubin"]), "bytes of cubin")
