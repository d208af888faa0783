"""Compile every Triton kernel's launcher-produced specialisations for sm_90, without a GPU.

Run from the repo root, without TRITON_INTERPRET:

    python benchmarks/gpu/sm90_compile.py                 # full variant set, report to stdout
    python benchmarks/gpu/sm90_compile.py --subset --report benchmarks/results/sm90_compile_report.json

How the variants are found: each launcher in ``csrc_triton`` is called with ``meta``
tensors (shapes and dtypes, no storage) over the flags, dtypes and model shapes the ops
pass, while ``JITFunction.run`` is replaced by a recorder. The recorder runs Triton's own
binder (``create_function_from_signature`` with the CUDA backend for sm_90) and
``_pack_args``, so each record holds exactly what the JIT would hand to ``triton.compile``
on an H200: the signature, the constexprs, the integer/alignment specialisation
(``tt.divisibility``) and the launch options, plus the JIT's cache key. Launchers treat
``meta`` like ``cuda`` (only ``cpu`` means the interpreter); the SM count they would read
from the device is ``H200_SM_COUNT``.

Each distinct record is then compiled with Triton 3.6's bundled ptxas; the ptxas log gives
registers, spills and stack, the compiled metadata the shared memory. A record fails on a
compile error, on shared memory above the H200's per-block limit (227 KB), or on spills
when a case that must be spill-free produced it (``strict`` cases: decode attention at
D in {64, 128} and the log-prob kernels at real model shapes, bf16/fp16).

The kernels declared in ``hopper_checks.CHECKED`` also get the Hopper checks of
``hopper_checks.py`` over the same compile (TTGIR, PTX, SASS, resources, the recorded grid):
a rule broken outside ``hopper_checks.KNOWN_FAILING`` is a failure, and so is a listed
failure that no variant shows. ``--probes`` compiles the small probe kernels of
``hopper_probes.py`` instead and prints each one's broken rules (JSON).

Launchers see ``meta`` tensors as CUDA tensors: every launcher picks its interpreter tiles for
``cpu`` only (the shared-prefix attention launcher once tested ``!= "cuda"`` and handed its
interpreter tiles to the compiler; ``--fp64-scalars`` reports the tiles its launches recorded).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import itertools
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise SystemExit("sm90_compile: unset TRITON_INTERPRET (the interpreter has no compiler to ask)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402
from triton.runtime import jit as triton_jit  # noqa: E402

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import hopper_checks  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
H200_SM_COUNT = 132
H200_SMEM_PER_BLOCK = 227 * 1024  # bytes: cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90
META = torch.device("meta")
# constexprs whose other value only the CPU interpreter runs (bf16 tiles upcast before tl.dot;
# the while-loop forms of the attention kernels' loops, for interpreters older than Triton 3.8):
# the sm_90 compile takes the CUDA value only
INTERPRETER_ONLY_FLAGS = {"UPCAST", "LOOP_FOR", "FOR_LOOPS"}

# Real model shapes (hidden size, vocabulary): Qwen2.5-0.5B/1.5B/7B, Llama-3.2-1B, Llama-2/3-8B.
LOGPROB_HIDDEN = (896, 1536, 2048, 3584, 4096)
LOGPROB_VOCAB = (32000, 128256, 151936)
# Decode attention: (query heads, kv heads, head dim) of Qwen2.5-0.5B/1.5B/7B, Llama-3-8B, a D=64 model.
ATTN_HEADS = ((14, 2, 64), (12, 2, 128), (28, 4, 128), (32, 8, 128), (16, 16, 64))


# ----------------------------------------------------------------------------- capture


@dataclasses.dataclass
class Launch:
    """One kernel launch as the JIT sees it on sm_90."""

    kernel: triton_jit.JITFunction
    key: str  # the JIT's cache key: a new key is a new compile
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    grid: tuple

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    def constexpr_values(self) -> dict[str, object]:
        """Named constexprs the launcher passed (int specialisations to 1 are left out)."""
        names = [p.name for p in self.kernel.params]
        out = {}
        for path, val in self.constexprs.items():
            p = self.kernel.params[path[0]]
            if p.is_constexpr:
                out[names[path[0]]] = val
        return out


class Recorder:
    """Replaces ``JITFunction.run`` while active: records launches, launches nothing."""

    def __init__(self) -> None:
        self.backend = make_backend(SM90)
        self.binders: dict[int, Callable] = {}
        self.launches: list[Launch] = []
        self.label = ""
        self.labels: dict[tuple[str, str], set[str]] = {}

    def _run(self, kernel, *args, grid, warmup, **kwargs):
        kwargs["debug"] = kwargs.get("debug", kernel.debug) or triton.knobs.runtime.debug
        kwargs["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
        binder = self.binders.get(id(kernel))
        if binder is None:
            binder = triton_jit.create_function_from_signature(kernel.signature, kernel.params, self.backend)
            self.binders[id(kernel)] = binder
        bound_args, specialization, options = binder(*args, **kwargs)
        key = triton_jit.compute_cache_key({}, specialization, options)
        opts, signature, constexprs, attrs = kernel._pack_args(self.backend, kwargs, bound_args, specialization, options)
        grid = tuple(grid(bound_args) if callable(grid) else grid)
        self.launches.append(Launch(kernel, key, signature, constexprs, attrs, opts.__dict__, grid))
        self.labels.setdefault((kernel.fn.__name__, key), set()).add(self.label)
        return None

    @contextlib.contextmanager
    def active(self) -> Iterator["Recorder"]:
        recorder = self
        original = triton_jit.JITFunction.run

        def run(kernel, *args, grid, warmup, **kwargs):
            return recorder._run(kernel, *args, grid=grid, warmup=warmup, **kwargs)

        triton_jit.JITFunction.run = run
        try:
            yield self
        finally:
            triton_jit.JITFunction.run = original

    def distinct(self) -> dict[tuple[str, str], Launch]:
        out: dict[tuple[str, str], Launch] = {}
        for launch in self.launches:
            out.setdefault((launch.name, launch.key), launch)
        return out


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device=META)


# ----------------------------------------------------------------------------- launcher cases
# Each case function calls launchers on meta tensors; ``rec.label`` names what was asked for.
# A label starting with "strict:" marks a configuration that must compile without spills.

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
LOW = (torch.bfloat16, torch.float16)


def _logprob_call(rec: Recorder, n: int, h: int, v: int, dtype, *, bias: bool, entropy: bool, splits=None,
                  need_hidden=True, need_weight=True) -> None:
    from csrc_triton import logprobs as L

    tiles = None
    if splits is not None:
        tiles = {k: dict(cfg, SPLITS=splits) for k, cfg in L.HOPPER_TILES.items()}
    hidden, weight = meta(n, h, dtype=dtype), meta(v, h, dtype=dtype)
    b = meta(v, dtype=dtype) if bias else None
    targets, n_valid = meta(n, dtype=torch.int64), meta(1, dtype=torch.int32)
    L.logprobs_fwd(hidden, weight, b, targets, n_valid, inv_temp=1.0, with_entropy=entropy, tiles=tiles)
    lse = meta(n)
    ent, ge = (meta(n), meta(n)) if entropy else (None, None)
    L.logprobs_bwd(hidden, weight, b, targets, n_valid, lse, ent, meta(n), ge, inv_temp=1.0,
                   need_hidden=need_hidden, need_weight=need_weight, tiles=tiles)


def cases_logprobs(rec: Recorder, full: bool) -> None:
    # full: every model shape x bf16/fp16 x bias x entropy; subset: both flags both ways, two
    # hidden sizes, both dtypes. Every vocabulary size compiles to the same key (V is a runtime
    # argument), and so does every token count but for the atomic flag (a few thousand tokens
    # split the vocabulary and add into grad_hidden atomically; 64K tokens do not).
    if full:
        grid = list(itertools.product(LOGPROB_HIDDEN, LOGPROB_VOCAB, LOW, (False, True), (False, True)))
    else:
        grid = [(4096, 151936, torch.bfloat16, False, False), (4096, 151936, torch.bfloat16, True, True),
                (896, 151936, torch.float16, False, True)]
    for h, v, dtype, bias, ent in grid:
        rec.label = f"strict:logprobs H={h} V={v} {str(dtype)[6:]} bias={bias} entropy={ent}"
        for n in (2048, 65536):
            _logprob_call(rec, n, h, v, dtype, bias=bias, entropy=ent)
    # fp32 inputs (what the CUDA tests run; exact dots), and a hidden size that is not a multiple of 16
    for h, dtype in itertools.product((896, 1000), FLOATS) if full else [(896, torch.float32), (1000, torch.bfloat16)]:
        rec.label = f"logprobs H={h} V=32000 {str(dtype)[6:]}"
        for n in (100, 65536) if full else (100,):
            _logprob_call(rec, n, h, 32000, dtype, bias=True, entropy=True)


def _attn_call(rec: Recorder, hq: int, hkv: int, d: int, g: int, dtype, n_groups: int = 4, prefix: int = 512,
               suffix: int = 256, loop_for: bool = True) -> None:
    """One decode step as the sampler runs it: a plan prepared for the store (the padded prompt
    length bounds the prefix split), then its call -- the cascade's two kernels, CUDA tiles.
    ``loop_for=False``: the while-loop form (for interpreters older than Triton 3.8)."""
    from csrc_triton.decode_attention import CascadePlan

    b = n_groups * g
    plan = CascadePlan(batch=b, q_heads=hq, kv_heads=hkv, head_dim=d, group_size=g, dtype=dtype, device=META,
                       max_prefix_len=prefix, sm_count=H200_SM_COUNT, loop_for=loop_for)
    # the prompts' [N, Hkv, D] storage seen as [Hkv, N, D] (the model's key projection layout)
    plan.run(meta(b, hq, d, dtype=dtype), meta(n_groups * prefix, hkv, d, dtype=dtype).transpose(0, 1),
             meta(n_groups * prefix, hkv, d, dtype=dtype).transpose(0, 1), meta(n_groups, dtype=torch.int32),
             meta(n_groups, dtype=torch.int32), meta(b, hkv, suffix, d, dtype=dtype),
             meta(b, hkv, suffix, d, dtype=dtype), meta(b, dtype=torch.int32), d**-0.5)


# Issue 37's decode shapes (B = 16 prompts x G = 8): Hq/Hkv 28/4 at D=128, P=1024, S=256, and 14/2 at D=64, P=2048, S=512.
DECODE_BENCH_SHAPES = (((28, 4, 128), 8, 16, 1024, 256), ((14, 2, 64), 8, 16, 2048, 512))


def cases_logprob_rows(rec: Recorder, full: bool) -> None:
    # the chunked path's row kernels at the default chunk (fastrl.ops.logprobs.chunked_rows): V is
    # a constexpr (one compile per vocabulary), the gradient is written in fp32 (in place) or bf16/fp16
    from csrc_triton.logprob_rows import row_grad, row_stats
    from fastrl.ops.logprobs import chunked_rows

    vocabs = LOGPROB_VOCAB if full else (151936,)
    combos = list(itertools.product((False, True), (False, True), FLOATS)) if full else \
        [(False, False, torch.bfloat16), (True, True, torch.float32), (True, True, torch.float16)]
    for v in vocabs:
        rows = chunked_rows(v, 1 << 20)
        for bias, ent, out_dtype in combos:
            rec.label = f"strict:logprob_rows V={v} rows={rows} bias={bias} entropy={ent} g={str(out_dtype)[6:]}"
            z, y, b = meta(rows, v), meta(rows, dtype=torch.int64), (meta(v, dtype=out_dtype) if bias else None)
            m, s, w, t = row_stats(z, b, y, 1.0, ent)
            e = meta(rows) if ent else None
            row_grad(z, z if out_dtype == torch.float32 else meta(rows, v, dtype=out_dtype), b, y, m, e, meta(rows),
                     meta(rows) if ent else None, 1.0)


def cases_decode_attention(rec: Recorder, full: bool) -> None:
    for (hq, hkv, d), g, groups, prefix, suffix in DECODE_BENCH_SHAPES:
        for dtype in LOW:
            rec.label = f"strict:decode_attention bench Hq={hq} Hkv={hkv} D={d} G={g} P={prefix} S={suffix} {str(dtype)[6:]}"
            _attn_call(rec, hq, hkv, d, g, dtype, n_groups=groups, prefix=prefix, suffix=suffix)
    if full:
        grid = list(itertools.product(ATTN_HEADS, (1, 4, 8, 16, 64), FLOATS))
    else:  # D = 64 and 128, one and many query rows per tile, every dtype
        grid = [(ATTN_HEADS[0], 1, torch.bfloat16), (ATTN_HEADS[0], 16, torch.bfloat16),
                (ATTN_HEADS[3], 1, torch.float16), (ATTN_HEADS[3], 16, torch.bfloat16),
                (ATTN_HEADS[2], 16, torch.float16), (ATTN_HEADS[3], 16, torch.float32)]
    for (hq, hkv, d), g, dtype in grid:
        strict = "strict:" if dtype in LOW and d in (64, 128) else ""
        rec.label = f"{strict}decode_attention Hq={hq} Hkv={hkv} D={d} G={g} {str(dtype)[6:]}"
        _attn_call(rec, hq, hkv, d, g, dtype)


def _policy_call(rec: Recorder, B: int, T: int, dtype, *, seq_ratio=False, seq_is=False, dual=None, lr_clamp=None,
                 ref=False, kl_est="k3", kl_clamp=None, ent=False, is_=False, is_cap=None, kl_coef=0.1,
                 entropy_coef=0.01, agg="token-mean", gcount=None, write_grad=True, adv_per_seq=False,
                 mask_dtype=torch.bool, need_logp=True, surrogate="ppo_clip", isw=False) -> None:
    from csrc_triton import policy_loss as P

    logp = meta(B, T, dtype=dtype)
    out, rowcoef, g = P.policy_loss_fwd(
        logp, meta(B, T), meta(B) if adv_per_seq else meta(B, T), meta(B, T, dtype=mask_dtype),
        meta(B, T, dtype=dtype) if ref else None, meta(B, T, dtype=dtype) if ent else None,
        meta(B, T) if is_ else None, meta(B, T) if isw else None,
        surrogate=surrogate, sur_params=(1.0, 1.05, 3.0, 2.0),
        seq_ratio=seq_ratio, seq_is=seq_is, clip_low=0.2, clip_high=0.28, dual_clip=dual, log_ratio_clamp=lr_clamp,
        kl_coef=kl_coef if ref else 0.0, kl_estimator=kl_est, kl_clamp=kl_clamp, entropy_coef=entropy_coef,
        is_cap=is_cap, loss_agg=agg, norm_length=float(T), global_count=gcount, write_grad=write_grad,
    )
    if write_grad:
        P.policy_loss_bwd(meta(()), out, rowcoef, g, meta(B, T, dtype=mask_dtype), logp, meta(B, T),
                          meta(B, T, dtype=dtype) if ent else None, seq_ratio=seq_ratio, log_ratio_clamp=lr_clamp,
                          entropy_coef=entropy_coef, need_logp=need_logp, need_entropy=ent)


def cases_policy_loss(rec: Recorder, full: bool) -> None:
    from csrc_triton.policy_loss import AGG_IDS

    lengths = (1000, 4096, 16384) if full else (1000,)
    for T, dtype in itertools.product(lengths, (torch.float32, torch.bfloat16) if full else (torch.bfloat16,)):
        # every flag both ways, in a few combinations
        for i, (sr, si, dual, clamp, ref, est, kcl, ent, is_, cap, agg) in enumerate([
            (False, False, None, None, False, "k3", None, False, False, None, "token-mean"),
            (False, False, 3.0, 20.0, True, "k1", 10.0, True, True, 2.0, "seq-mean-token-mean"),
            (False, True, None, None, True, "k2", None, False, True, None, "seq-mean-token-sum"),
            (True, False, 3.0, 20.0, True, "k3", 10.0, True, False, None, "seq-mean-token-sum-norm"),
            (True, True, None, None, False, "k3", None, False, True, 2.0, "token-mean"),
        ]):
            rec.label = f"policy_loss T={T} {str(dtype)[6:]} combo={i}"
            _policy_call(rec, 8, T, dtype, seq_ratio=sr, seq_is=si, dual=dual, lr_clamp=clamp, ref=ref, kl_est=est,
                         kl_clamp=kcl, ent=ent, is_=is_, is_cap=cap, agg=agg, adv_per_seq=bool(i % 2))
        for sur, sr, is_, isw in (("cispo", True, True, True), ("sapo", False, False, True), ("vespo", False, True, False)):
            rec.label = f"policy_loss T={T} {str(dtype)[6:]} surrogate={sur}"
            _policy_call(rec, 8, T, dtype, surrogate=sur, seq_ratio=sr, is_=is_, isw=isw, ref=True, adv_per_seq=True)
        rec.label = f"policy_loss T={T} {str(dtype)[6:]} no-grad, counts, no kl"
        _policy_call(rec, 8, T, dtype, write_grad=False, gcount=meta((), dtype=torch.int64))
        _policy_call(rec, 8, T, dtype, ref=True, kl_coef=0.0, gcount=100.0, ent=True, entropy_coef=0.0,
                     mask_dtype=torch.float32, need_logp=False)
        if full:
            for agg in AGG_IDS:
                _policy_call(rec, 8, T, dtype, agg=agg, ref=True, ent=True)


def cases_kl(rec: Recorder, full: bool) -> None:
    from csrc_triton.kl import kl_bwd, kl_fwd

    needs = ((True, True), (True, False), (False, True))
    if full:
        grid = [(e, c, d, n) for e, c, d in itertools.product(("k1", "k2", "k3"), (None, 10.0), (torch.float32, torch.bfloat16))
                for n in needs]
    else:
        grid = [("k1", None, torch.bfloat16, needs[0]), ("k2", 10.0, torch.float32, needs[1]),
                ("k3", None, torch.bfloat16, needs[2]), ("k3", 10.0, torch.bfloat16, needs[0])]
    for est, clamp, dtype, (need_logp, need_ref) in grid:
        rec.label = f"kl {est} clamp={clamp} {str(dtype)[6:]}"
        a, b = meta(8, 1000, dtype=dtype), meta(8, 1000)
        kl_fwd(a, b, estimator=est, clamp=clamp)
        kl_bwd(a, b, meta(8, 1000), estimator=est, clamp=clamp, need_logp=need_logp, need_ref=need_ref)


def cases_value_loss(rec: Recorder, full: bool) -> None:
    from csrc_triton.value_loss import value_loss_fused

    grid = itertools.product((None, 0.2), (False, True), (torch.float32, torch.bfloat16)) if full else \
        [(None, False, torch.float32), (0.2, True, torch.bfloat16)]
    for clip, wg, dtype in grid:
        rec.label = f"value_loss clip={clip} write_grad={wg} {str(dtype)[6:]}"
        value_loss_fused(meta(8, 1000, dtype=dtype), meta(8, 1000, dtype=dtype), meta(8, 1000),
                         meta(8, 1000, dtype=torch.uint8), meta(8), clip=clip, write_grad=wg)


def cases_whiten(rec: Recorder, full: bool) -> None:
    from csrc_triton.whiten import whiten_backward, whiten_forward

    for shift, dtype in itertools.product((False, True), (torch.float32, torch.bfloat16)) if full else \
            [(False, torch.float32), (True, torch.bfloat16)]:
        rec.label = f"whiten shift={shift} {str(dtype)[6:]}"
        x, m = meta(8000, dtype=dtype), meta(8000, dtype=torch.bool)
        y, mu, rstd, n = whiten_forward(x, m, shift_mean=shift, eps=1e-8)
        whiten_backward(meta(8000), x, m, mu, rstd, n, shift_mean=shift)


def cases_scans(rec: Recorder, full: bool) -> None:
    from csrc_triton.scans import discounted_returns_fwd, gae_fwd

    for T, dtype in itertools.product((100, 8192), (torch.float32, torch.bfloat16)) if full else \
            [(8192, torch.bfloat16)]:
        rec.label = f"scans T={T} {str(dtype)[6:]}"
        gae_fwd(meta(8, T, dtype=dtype), meta(8, T, dtype=dtype), meta(8, T, dtype=torch.bool), 0.99, 0.95)
        discounted_returns_fwd(meta(8, T, dtype=dtype), meta(8, T, dtype=torch.bool), 0.99)


def cases_advantages(rec: Recorder, full: bool) -> None:
    from csrc_triton.advantages import MODE_CODES, group_advantages_elementwise, segment_stats, step_advantages_tokens

    N, G = 1024, 128
    for valid in (False, True):
        for vdtype in (torch.float32, torch.float64):  # float64 rewards accumulate in float64
            rec.label = f"advantages segment_stats valid={valid} {str(vdtype)[6:]}"
            segment_stats(meta(N, dtype=vdtype), meta(N, dtype=torch.int64), meta(G, dtype=torch.int64),
                          meta(G, dtype=torch.int64), meta(N, dtype=torch.uint8) if valid else None)
    for mode in sorted(set(MODE_CODES.values())):
        for stats in (torch.float32, torch.float64):  # float64 group statistics for float64 rewards
            rec.label = f"advantages group mode={mode} stats={str(stats)[6:]}"
            group_advantages_elementwise(meta(N), meta(N, dtype=torch.int64), meta(G, dtype=stats), meta(G, dtype=stats),
                                         meta(G, dtype=stats), meta(G), meta((), dtype=stats), mode=mode, eps=1e-6, floor=1e-6)
    for dtype in (torch.float32, torch.bfloat16) if full else (torch.bfloat16,):
        for stats in (torch.float32, torch.float64):
            rec.label = f"advantages step {str(dtype)[6:]} stats={str(stats)[6:]}"
            step_advantages_tokens(meta(16, 8, dtype=dtype), meta(16, 8, dtype=torch.int64), meta(16, dtype=torch.int64),
                                   meta(4, dtype=stats), meta(4, dtype=stats), meta(4, dtype=stats),
                                   meta(16, 1000, dtype=torch.uint8), eps=1e-6)


def cases_turn_advantages(rec: Recorder, full: bool) -> None:
    from csrc_triton.turn_advantages import expand_turn_advantages, turn_combine

    B, K, T = 16, 8, 1000
    for use_std in (False, True):
        for stats in (torch.float32, torch.float64):  # float64 group statistics for float64 returns
            rec.label = f"turn advantages combine std={use_std} stats={str(stats)[6:]}"
            turn_combine(meta(B, K), meta(B * K, dtype=torch.uint8), meta(B * K, dtype=torch.int64),
                         meta(B * K, dtype=stats), meta(B * K, dtype=stats), meta(B * K, dtype=stats), meta(B * K),
                         meta(B), c_ep=1.0, c_rel=0.5, use_std=use_std, eps=1e-6)
    for use_turn in (False, True):
        rec.label = f"turn advantages expand use_turn={use_turn}"
        expand_turn_advantages(meta(B, K if use_turn else 1), meta(B, T, dtype=torch.int64),
                               meta(B, T, dtype=torch.uint8), meta(B, dtype=torch.int64), use_turn=use_turn)


def cases_tree_attention(rec: Recorder, full: bool) -> None:
    from csrc_triton.shared_prefix_attention import shared_prefix_attention_bwd, shared_prefix_attention_fwd
    from csrc_triton.tree_attention import CUDA_TILES, tree_attention_bwd, tree_attention_fwd
    from fastrl.ops.shared_prefix_attention import SharedPrefixLayout
    from fastrl.ops.tree_attention import TreeLayout

    # The training attention (one kernel family: the shared prefix is the depth-2 tree) with its
    # CUDA tiles. The block lists and dK/dV work items are runtime data; their lengths are those
    # of the GRPO benchmark's group (G = 8 completions of P = L tokens) at 8K and 32K tokens per
    # group on the Qwen2.5-1.5B heads (Hq 12, Hkv 2, D 128), where the dK/dV of a prompt key tile
    # is split over programs (relaxed atomic adds: ATOMIC=True).
    def tree_case(label, hq, hkv, d, dtype, tree: TreeLayout, split: bool = True, for_loops: bool | None = None):
        rec.label = label
        n = tree.num_tokens
        q, k, v = meta(n, hq, d, dtype=dtype), meta(n, hkv, d, dtype=dtype), meta(n, hkv, d, dtype=dtype)
        fwd, dq, kv = CUDA_TILES["fwd"], CUDA_TILES["dq"], CUDA_TILES["dkdv"]
        ptr, blocks = tree.block_lists(fwd["BLOCK_M"], fwd["BLOCK_N"])
        out, lse = tree_attention_fwd(q, k, v, meta(n, dtype=torch.int32), meta(*ptr.shape, dtype=torch.int32),
                                      meta(*blocks.shape, dtype=torch.int32), d**-0.5, for_loops=for_loops)
        ptr, blocks = tree.block_lists(dq["BLOCK_M"], dq["BLOCK_N"])
        items = tree.dkdv_items(kv["BLOCK_N"], CUDA_TILES["q_chunk"]) if split else None
        tree_attention_bwd(meta(n, hq, d, dtype=dtype), q, k, v, out, lse, meta(n, dtype=torch.int32),
                           meta(*ptr.shape, dtype=torch.int32), meta(*blocks.shape, dtype=torch.int32), d**-0.5,
                           dkdv_items=None if items is None else meta(*items.shape, dtype=torch.int32),
                           q_chunk=CUDA_TILES["q_chunk"], for_loops=for_loops)

    def group(tokens: int, G: int = 8) -> TreeLayout:
        P = L = tokens // (2 * G)
        return TreeLayout.from_shared_prefix(SharedPrefixLayout.from_lengths([P], [[L] * G]))

    for tokens in (8192, 32768):
        tree_case(f"tree_attention 1.5B group of {tokens} tokens bf16", 12, 2, 128, torch.bfloat16, group(tokens))
    # one program per (key tile, kv head): multi-head attention without a split stores (ATOMIC=False)
    tree_case("tree_attention Hq=Hkv=16 D=64 unsplit fp16", 16, 16, 64, torch.float16, group(2048), split=False)
    grid = list(itertools.product(ATTN_HEADS, FLOATS)) if full else [(ATTN_HEADS[0], torch.float16)]  # D = 64
    for (hq, hkv, d), dtype in grid:
        tree_case(f"tree_attention Hq={hq} Hkv={hkv} D={d} {str(dtype)[6:]}", hq, hkv, d, dtype, group(4096))
    # the shared-prefix launchers (per-token bounds; lists and key_end derived on the device)
    rec.label = "shared_prefix_attention 1.5B bf16"
    n = 18432
    q, k, v = meta(n, 12, 128, dtype=torch.bfloat16), meta(n, 2, 128, dtype=torch.bfloat16), meta(n, 2, 128, dtype=torch.bfloat16)
    bounds = [meta(n, dtype=torch.int32) for _ in range(4)]
    out, lse = shared_prefix_attention_fwd(q, k, v, *bounds[:3], 128**-0.5)
    shared_prefix_attention_bwd(meta(n, 12, 128, dtype=torch.bfloat16), q, k, v, out, lse, *bounds, 128**-0.5)


CASES = {
    "logprobs": cases_logprobs,
    "logprob_rows": cases_logprob_rows,
    "decode_attention": cases_decode_attention,
    "policy_loss": cases_policy_loss,
    "kl": cases_kl,
    "value_loss": cases_value_loss,
    "whiten": cases_whiten,
    "scans": cases_scans,
    "advantages": cases_advantages,
    "turn_advantages": cases_turn_advantages,
    "tree_attention": cases_tree_attention,
}


def all_kernels() -> list[triton_jit.JITFunction]:
    """Every ``@triton.jit`` kernel (not helper) defined in csrc_triton: what a complete run must cover."""
    import importlib

    kernels = []
    for family in CASES:
        mod = importlib.import_module(f"csrc_triton.{family}")
        for name, obj in vars(mod).items():
            if isinstance(obj, triton_jit.JITFunction) and obj.__module__ == mod.__name__ and name.endswith("_kernel"):
                kernels.append(obj)
    return kernels


def record(full: bool, families=None) -> Recorder:
    rec = Recorder()
    with rec.active():
        for family, fn in CASES.items():
            if families is None or family in families:
                fn(rec, full)
    return rec


# ----------------------------------------------------------------------------- fp64 scalars
# A Python float argument is typed fp32 by the JIT (the interpreter keeps it a double), so in a
# float64 launch it rounds to fp32 where CPU tests cannot see it: the attention kernels' softmax
# scale did, and their float64 oracle tests missed by 1e-8 on the H200 (they now load it from a
# tensor of the accumulation dtype). Those left, each with why its rounding is harmless:
FP64_LAUNCH_FP32_SCALARS = {
    "_group_adv_kernel": {"eps", "floor"},  # added to a std and a floor under it: a relative 3e-8 of 1e-6
    "_step_adv_kernel": {"eps"},  # likewise
    "_turn_combine_kernel": {"eps", "c_rel", "c_ep"},  # eps as above; the turn/episode mixing weights: 6e-8 relative
}


def cases_fp64_attention(rec: Recorder) -> None:
    """The training attention kernels launched as the float64 tests launch them."""
    from csrc_triton.shared_prefix_attention import shared_prefix_attention_bwd, shared_prefix_attention_fwd
    from csrc_triton.tree_attention import tree_attention_bwd, tree_attention_fwd

    f64, n = torch.float64, 256
    q, k, v, go = meta(n, 4, 16, dtype=f64), meta(n, 2, 16, dtype=f64), meta(n, 2, 16, dtype=f64), meta(n, 4, 16, dtype=f64)
    bounds = [meta(n, dtype=torch.int32) for _ in range(4)]
    rec.label = "shared_prefix_attention float64"
    out, lse = shared_prefix_attention_fwd(q, k, v, *bounds[:3], 0.25)
    shared_prefix_attention_bwd(go, q, k, v, out, lse, *bounds, 0.25)
    rec.label = "tree_attention float64"
    ptr, blocks = meta(n // 64 + 2, dtype=torch.int32), meta(99, dtype=torch.int32)
    out, lse = tree_attention_fwd(q, k, v, bounds[0], ptr, blocks, 0.25)
    tree_attention_bwd(go, q, k, v, out, lse, bounds[0], ptr, blocks, 0.25)


def fp32_scalars_in_fp64_launches(rec: Recorder) -> dict[str, list[str]]:
    """Kernel -> the fp32 scalar arguments of its launches that also take a float64 tensor."""
    found: dict[str, set[str]] = {}
    for (name, _), launch in rec.distinct().items():
        types = {p: str(t) for p, t in launch.signature.items()}
        if "*fp64" in types.values():
            found.setdefault(name, set()).update(p for p, t in types.items() if t == "fp32")
    return {name: sorted(params) for name, params in found.items() if params}


def fp64_scalar_problems(found: dict[str, list[str]]) -> list[str]:
    """The fp32 scalars of float64 launches not in ``FP64_LAUNCH_FP32_SCALARS``."""
    return [f"{name}: {p} is an fp32 scalar in a float64 launch" for name, params in sorted(found.items())
            for p in params if p not in FP64_LAUNCH_FP32_SCALARS.get(name, set())]


# ----------------------------------------------------------------------------- compile


_PTXAS_FN = re.compile(r"Compiling entry function '(\w+)'")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def compile_launch(launch: Launch) -> dict:
    """Compile one record for sm_90 and return its resource report."""
    pointers = [v for v in launch.signature.values() if v.startswith("*")]
    out = {"kernel": launch.name, "input_dtype": pointers[0][1:] if pointers else None,
           "constexprs": {k: _jsonable(v) for k, v in launch.constexpr_values().items()},
           "signature": {k: v for k, v in launch.signature.items() if v != "constexpr"},
           "divisible_by_16": sorted(launch.kernel.params[p[0]].name for p, a in launch.attrs.items()
                                     if ["tt.divisibility", 16] in [list(x) for x in a]),
           "num_warps": launch.options["num_warps"], "num_stages": launch.options["num_stages"]}
    triton.knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(ASTSource(launch.kernel, launch.signature, launch.constexprs, launch.attrs),
                                    target=SM90, options=launch.options)
    except Exception as exc:  # a compile error is a result to report
        out["error"] = f"{type(exc).__name__}: {exc}"[:4000]
        return out
    out["compile_s"] = round(time.perf_counter() - t0, 2)
    text = log.getvalue()
    frame = _PTXAS_FRAME.search(text)
    used = _PTXAS_USED.search(text)
    smem = _PTXAS_SMEM.search(text)
    if frame is None or used is None:
        out["error"] = "no ptxas report in the log: " + text[-2000:]
        return out
    out["registers"] = int(used.group(1))
    out["stack_bytes"], out["spill_store_bytes"], out["spill_load_bytes"] = (int(x) for x in frame.groups())
    out["shared_bytes"] = int(kernel.metadata.shared) + (int(smem.group(1)) if smem else 0)
    qualname = f"{launch.kernel.fn.__module__}.{launch.name}"
    kind = hopper_checks.CHECKED.get(qualname) or _probe_kinds().get(qualname)
    if kind:
        compiled = hopper_checks.Compiled(
            name=qualname, ttgir=kernel.asm["ttgir"], ptx=kernel.asm["ptx"], sass=hopper_checks.sass_of(kernel.asm["cubin"]),
            registers=out["registers"], spill_bytes=out["spill_store_bytes"] + out["spill_load_bytes"],
            shared_bytes=out["shared_bytes"], num_warps=out["num_warps"], grid=launch.grid)
        out["hopper"] = {"qualname": qualname, "kind": kind, "grid": list(launch.grid),
                         "problems": hopper_checks.check_kernel(compiled, kind)}
    return out


def _probe_kinds() -> dict[str, str]:
    mod = sys.modules.get("hopper_probes")
    return mod.PROBES if mod is not None else {}


def _jsonable(v):
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    return str(v)


def check(report: dict) -> list[str]:
    """The failures of one compiled variant (empty: fine)."""
    problems = []
    if "error" in report:
        return [f"compile error: {report['error'][:300]}"]
    if report["shared_bytes"] > H200_SMEM_PER_BLOCK:
        problems.append(f"shared memory {report['shared_bytes']} B > {H200_SMEM_PER_BLOCK} B")
    if report["strict"] and (report["spill_store_bytes"] or report["spill_load_bytes"]):
        problems.append(f"spills {report['spill_store_bytes']}/{report['spill_load_bytes']} B store/load "
                        f"in a configuration that must not spill")
    hop = report.get("hopper")
    if hop and hop["qualname"] in hopper_checks.CHECKED:
        problems += [f"hopper {p}" for p in hopper_checks.verdict(hop["qualname"], hop["problems"])]
    return problems


def hopper_stale(reports: list[dict]) -> list[str]:
    """``hopper_checks.KNOWN_FAILING`` entries that no compiled variant bears out."""
    seen: dict[str, set[str]] = {}
    for r in reports:
        hop = r.get("hopper")
        if hop:
            seen.setdefault(hop["qualname"], set()).update(hop["problems"])
    return hopper_checks.stale_known_failures(seen)


def run_probes(jobs: int) -> dict[str, dict[str, str]]:
    """Compile the probe kernels of ``hopper_probes.py``; probe (with its flags) -> broken rules."""
    import hopper_probes

    rec = Recorder()
    with rec.active():
        hopper_probes.launch_all(meta)
    out = {}
    for r in compile_all(rec, jobs=jobs):
        if "error" in r:
            raise SystemExit(f"probe {r['kernel']} failed to compile: {r['error'][:500]}")
        flags = {k: v for k, v in r["constexprs"].items() if isinstance(v, bool)}
        tag = r["hopper"]["qualname"].split(".", 1)[1] + "".join(f" {k}={v}" for k, v in sorted(flags.items()))
        out[tag] = r["hopper"]["problems"]
    return out


def _compile_index(i: int) -> dict:
    return compile_launch(_POOL_LAUNCHES[i])


_POOL_LAUNCHES: list[Launch] = []


def compile_all(rec: Recorder, *, jobs: int = 1, progress=None) -> list[dict]:
    """Compile every distinct record (strict ones first), ``jobs`` at a time (forked workers)."""
    items = sorted(rec.distinct().items(), key=lambda kv: (not _is_strict(rec, kv[0]), kv[0]))
    launches = [launch for _, launch in items]
    if jobs > 1:
        import multiprocessing

        _POOL_LAUNCHES[:] = launches  # inherited by the forked workers
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            compiled = pool.imap(_compile_index, range(len(launches)))
            return [_finish(rec, key, r, progress) for (key, _), r in zip(items, compiled)]
    return [_finish(rec, key, compile_launch(launch), progress) for key, launch in items]


def _is_strict(rec: Recorder, key) -> bool:
    return any(lbl.startswith("strict:") for lbl in rec.labels[key])


def _finish(rec: Recorder, key, r: dict, progress) -> dict:
    labels = sorted(rec.labels[key])
    r["cases"] = labels[:6] + ([f"... {len(labels) - 6} more"] if len(labels) > 6 else [])
    r["strict"] = _is_strict(rec, key)
    r["problems"] = check(r)
    if progress:
        progress(r)
    return r


def flag_coverage(rec: Recorder) -> list[str]:
    """Boolean constexprs of recorded kernels not seen both ways, and kernels never launched."""
    missing = []
    seen: dict[str, dict[str, set]] = {}
    for launch in rec.launches:
        for k, v in launch.constexpr_values().items():
            seen.setdefault(launch.name, {}).setdefault(k, set()).add(v)
    for kernel in all_kernels():
        name = kernel.fn.__name__
        if name not in seen:
            missing.append(f"{name}: never launched")
            continue
        for k, vals in seen[name].items():
            if k in INTERPRETER_ONLY_FLAGS:
                continue
            if all(isinstance(v, bool) for v in vals) and vals != {False, True}:
                missing.append(f"{name}.{k}: only {sorted(vals)}")
    return missing


def _line(r: dict) -> str:
    if "error" in r:
        return f"FAIL {r['kernel']} {r['constexprs']}: {r['error'][:200]}"
    flag = "FAIL" if r["problems"] else "ok  "
    return (f"{flag} {r['kernel']:<27} {r['input_dtype']:<4} regs={r['registers']:<3} spill={r['spill_store_bytes']}/{r['spill_load_bytes']} "
            f"stack={r['stack_bytes']} smem={r['shared_bytes']} w={r['num_warps']} s={r['num_stages']} "
            f"t={r['compile_s']}s {'strict ' if r['strict'] else ''}{r['constexprs']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--subset", action="store_true", help="the CI subset (every kernel, every flag) instead of the full set")
    ap.add_argument("--only", nargs="*", choices=sorted(CASES), help="kernel families to compile (default: all)")
    ap.add_argument("--report", type=Path, help="write the JSON report here")
    ap.add_argument("--list", action="store_true", help="only list the variants, compile nothing")
    ap.add_argument("--jobs", type=int, default=1, help="compile this many variants at a time")
    ap.add_argument("--fp64-scalars", action="store_true",
                    help="compile nothing: print (JSON) the fp32 scalar arguments of float64 launches; exit 1 on any "
                         "not in FP64_LAUNCH_FP32_SCALARS")
    ap.add_argument("--probes", action="store_true",
                    help="compile the hopper_probes.py kernels and print (JSON) the Hopper rules each breaks")
    ap.add_argument("--with-probes", action="store_true",
                    help="also compile the probes and put their broken rules in the report (\"probes\")")
    args = ap.parse_args(argv)

    if args.probes:
        print(json.dumps(run_probes(args.jobs), indent=1))
        return 0

    if args.fp64_scalars:
        rec = record(full=True)
        with rec.active():
            cases_fp64_attention(rec)
        found = fp32_scalars_in_fp64_launches(rec)
        problems = fp64_scalar_problems(found)
        # the tiles the shared-prefix attention launchers' launches (the tree kernels) were recorded with
        tiles = {launch.name: {k: v for k, v in launch.constexpr_values().items() if k.startswith("BLOCK_")}
                 | {"num_warps": launch.options["num_warps"]}
                 for launch in rec.launches
                 if any(label.startswith("shared_prefix_attention") for label in rec.labels[(launch.name, launch.key)])}
        print(json.dumps({"found": found, "problems": problems, "shared_prefix_tiles": tiles}))
        return 1 if problems else 0

    rec = record(full=not args.subset, families=args.only)
    distinct = rec.distinct()
    per_kernel: dict[str, int] = {}
    for name, _ in distinct:
        per_kernel[name] = per_kernel.get(name, 0) + 1
    print(f"{len(distinct)} distinct specialisations over {len(per_kernel)} kernels: {per_kernel}", flush=True)
    coverage = flag_coverage(rec) if args.only is None else []
    for m in coverage:
        print("COVERAGE", m)
    if args.list:
        for (name, key), launch in sorted(distinct.items(), key=lambda kv: kv[0]):
            print(name, launch.constexpr_values(), sorted(rec.labels[(name, key)])[:2])
        return 0
    t0 = time.perf_counter()
    done: list[dict] = []

    def progress(r: dict) -> None:
        print(_line(r), flush=True)
        done.append(r)
        if args.report and len(done) % 20 == 0:  # a long run that is stopped keeps what it compiled
            write(done, partial=True)

    def write(reports: list[dict], partial: bool = False) -> list[str]:
        failures = [f"{r['kernel']} {r['constexprs']}: {p}" for r in reports for p in r["problems"]] + coverage
        if not partial:
            failures += hopper_stale(reports)
        summary = {
            "target": "cuda sm_90 (H200), Triton's bundled ptxas, no GPU",
            "set": "subset" if args.subset else "full",
            "command": "python benchmarks/gpu/sm90_compile.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "triton": triton.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "ptxas": triton.knobs.nvidia.ptxas.path.rsplit("/", 1)[-1] + " " + str(triton.knobs.nvidia.ptxas.version),
            "smem_limit_bytes": H200_SMEM_PER_BLOCK, "variants": len(reports), "per_kernel": per_kernel,
            "compile_seconds": round(time.perf_counter() - t0, 1), "partial": partial, "failures": failures,
            "reports": reports,
        }
        if args.report:
            args.report.parent.mkdir(parents=True, exist_ok=True)
            args.report.write_text(json.dumps(summary, indent=1) + "\n")
        return failures

    reports = compile_all(rec, jobs=args.jobs, progress=progress)
    probes = run_probes(args.jobs) if args.with_probes else None
    failures = write(reports)
    if probes is not None and args.report:  # one process for both: CI pays the imports once
        summary = json.loads(args.report.read_text())
        summary["probes"] = probes
        args.report.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"compiled {len(reports)} variants in {round(time.perf_counter() - t0, 1)} s; {len(failures)} failures")
    for f in failures:
        print("FAILURE", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
