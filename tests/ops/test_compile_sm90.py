"""Every Triton kernel compiles for sm_90 (H200) as its launcher specialises it; no GPU needed.

``benchmarks/gpu/sm90_compile.py --subset`` calls every launcher in ``csrc_triton`` on
``meta`` tensors, records what Triton's JIT would compile on an H200 (signature,
constexprs, alignment specialisation, launch options) and compiles each distinct record
with Triton's bundled ptxas. It fails on a compile error, on shared memory above the
H200's per-block limit, on spills in the configurations that must be spill-free (decode
attention at D in {64, 128} and the log-prob kernels at real model shapes, bf16/fp16),
and when a kernel is never launched or a boolean constexpr is not seen both ways. The same
compiles feed the Hopper checks (``benchmarks/gpu/hopper_checks.py``) of the declared kernels.

The subset (about 80 variants) covers every kernel and every flag; the full set (every
model shape, dtype and flag combination, about 470 variants, ~15 min on 2 cores) is
``python benchmarks/gpu/sm90_compile.py --report benchmarks/results/sm90_compile_report.json``.
It runs in a subprocess because tests/conftest.py turns the interpreter on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_compiles_for_sm90_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # compile for real, not from a cache
    report_path = tmp_path / "sm90_compile_report.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu/sm90_compile.py", "--subset", "--with-probes", "--jobs", "2", "--report",
         str(report_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    report = json.loads(report_path.read_text())
    assert report["failures"] == []
    kernels = {r["kernel"] for r in report["reports"]}
    assert len(kernels) == 26, sorted(kernels)  # names: tree_attention._fwd_kernel shares logprobs._fwd_kernel's
    for r in report["reports"]:
        assert r["registers"] > 0 and r["shared_bytes"] <= report["smem_limit_bytes"], r
    strict = [r for r in report["reports"] if r["strict"]]
    rows = {"_row_stats_kernel", "_row_grad_kernel"}  # the chunked path's row kernels read fp32 logits
    assert {r["kernel"] for r in strict} == {"_fwd_kernel", "_bwd_hidden_kernel", "_bwd_weight_kernel",
                                             "_prefix_attn_kernel", "_suffix_merge_kernel"} | rows
    assert {r["input_dtype"] for r in strict if r["kernel"] not in rows} == {"bf16", "fp16"}
    assert all(r["spill_store_bytes"] == r["spill_load_bytes"] == 0 for r in strict)
    # the Hopper checks (benchmarks/gpu/hopper_checks.py) over the same compiles: the chunked
    # path's row kernels pass every rule that applies to them; the fused log-prob kernels
    # (backend="triton") break the rules the GPU audit found them breaking, and only those
    hopper = [r["hopper"] for r in report["reports"] if "hopper" in r]
    row_checks = [h for h in hopper if h["qualname"].startswith("csrc_triton.logprob_rows.")]
    assert len(row_checks) >= 4 and all(h["problems"] == {} for h in row_checks), row_checks
    broken = {}
    for h in hopper:
        broken.setdefault(h["qualname"].rsplit(".", 1)[1], set()).update(h["problems"])
    assert broken["_bwd_weight_kernel"] >= {"acc_rmw", "pipelined", "wgmma_n"}
    assert broken["_bwd_hidden_kernel"] >= {"acc_rmw", "fence", "wgmma_n"}
    assert broken["_fwd_kernel"] >= {"wgmma_n"}
    # the attention kernels (issue 37's rewrite): pipelined for loops, accumulators in registers,
    # fence-free atomics, no spills; their narrow dots and thin waves are listed in KNOWN_FAILING
    attention = {}
    for h in hopper:
        if h["qualname"].startswith(("csrc_triton.decode_attention.", "csrc_triton.tree_attention.")):
            attention.setdefault(h["qualname"], set()).update(h["problems"])
    assert len(attention) == 5, sorted(attention)
    for name, rules in attention.items():
        assert not rules & {"while_dot", "acc_rmw", "fence", "spills"}, (name, rules)
    # each probe kernel of benchmarks/gpu/hopper_probes.py breaks the rule it embodies, and a
    # well-formed matmul (for loop, accumulator in registers, 128-wide tiles) breaks none
    got = report["probes"]
    assert got["_mm_for"] == {}
    assert "acc_rmw" in got["_mm_rmw"]
    assert "while_dot" in got["_mm_while"] and "pipelined" in got["_mm_while"]
    assert "wgmma_n" in got["_mm_narrow"] and "m64n64" in got["_mm_narrow"]["wgmma_n"]
    assert "fence" in got["_atomic_loop RELAXED=False"]
    assert got["_atomic_loop RELAXED=True"] == {}


def test_float64_launches_take_no_fp32_scalar_but_the_listed_ones():
    # a Python float is an fp32 kernel argument on a GPU and a double in the interpreter: in a
    # float64 launch it rounds where no CPU test sees it (the attention scale did, found on the H200)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "benchmarks/gpu/sm90_compile.py", "--fp64-scalars"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])["found"]
    # the walk sees fp32 scalars where they are (the listed, harmless ones), and none in attention
    assert found["_group_adv_kernel"] == ["eps", "floor"]
    assert not any(name in found for name in ("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"))
    # launches on meta tensors get the CUDA tiles (the shared-prefix launcher once tested != "cuda"
    # and compiled its interpreter tiles); its launchers run the tree kernels
    from csrc_triton.tree_attention import CUDA_TILES

    tiles = json.loads(proc.stdout.strip().splitlines()[-1])["shared_prefix_tiles"]
    assert set(tiles) == {"_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"}, tiles
    for name, t in tiles.items():
        want = CUDA_TILES[{"_fwd_kernel": "fwd", "_bwd_dq_kernel": "dq", "_bwd_dkdv_kernel": "dkdv"}[name]]
        assert (t["BLOCK_M"], t["BLOCK_N"], t["num_warps"]) == (want["BLOCK_M"], want["BLOCK_N"], want["num_warps"]), name
