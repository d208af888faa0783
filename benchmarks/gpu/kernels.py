"""Check, then time: decode attention on the GPU against its baselines.

Run by benchmarks/gpu/run.sh on the device (``python benchmarks/gpu/kernels.py --out $OUT/kernels.json``);
``--dry-run`` does the same on CPU with tiny shapes (Triton in the interpreter) so the script
itself is tested without a GPU.

Each case first checks fastrl's output (and gradients) against the reference on the same
inputs; a case that fails its check is reported and not timed. Then fastrl and each
baseline are timed side by side (best-of-n and median; CUDA synchronised around each call):

- decode attention, one query token per sample, G samples sharing each prompt:
  ``fastrl`` (the cascade kernels: the prompt's K/V read once per group) vs
  ``sdpa_expanded`` (``scaled_dot_product_attention`` over per-sample K/V = [prompt ; suffix],
  the layout a cache without prefix sharing holds; built before timing) and
  ``flex_expanded`` (``flex_attention`` under ``torch.compile`` on the same expanded K/V).
The GRPO loss from LM-head hidden states (fastrl's paths, naive, torch.compile, Liger, Cut
Cross-Entropy; forward + backward and the no-grad pass) has its own stage:
``bench_logprob_loss.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fastrl.bench.harness import BenchCase, environment, format_header, format_row, run_case  # noqa: E402


def _log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- decode attention


def attention_inputs(*, groups, G, Hq, Hkv, D, prefix, suffix, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = groups * G
    mk = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    # prompts packed along the token axis, [N, Hkv, D] storage seen as [Hkv, N, D] (like a k projection)
    prefix_k, prefix_v = mk(groups * prefix, Hkv, D).transpose(0, 1), mk(groups * prefix, Hkv, D).transpose(0, 1)
    i32 = dict(dtype=torch.int32, device=device)
    return dict(
        q=mk(B, Hq, D), prefix_k=prefix_k, prefix_v=prefix_v,
        prefix_start=torch.arange(groups, **i32) * prefix, prefix_len=torch.full((groups,), prefix, **i32),
        suffix_k=mk(B, Hkv, suffix, D), suffix_v=mk(B, Hkv, suffix, D), suffix_len=torch.full((B,), suffix, **i32),
    )


def expand(inp, G, prefix):
    """Per-sample K/V [B, Hkv, prefix + suffix, D]: what attention without prefix sharing reads."""
    groups = inp["prefix_start"].shape[0]
    Hkv, _, D = inp["prefix_k"].shape

    def cat(pre, suf):
        p = pre.reshape(Hkv, groups, prefix, D).transpose(0, 1)  # [groups, Hkv, P, D]
        p = p.repeat_interleave(G, dim=0)  # [B, Hkv, P, D]
        return torch.cat([p, suf], dim=2).contiguous()

    return cat(inp["prefix_k"], inp["suffix_k"]), cat(inp["prefix_v"], inp["suffix_v"])


def attention_case(shape: dict, device: torch.device, dtype: torch.dtype, *, flex: bool, repeats: int) -> tuple[BenchCase | None, dict]:
    from fastrl.ops import shared_prefix_decode_attention
    from fastrl.reference.decode_attention import shared_prefix_decode_attention_reference as reference

    G, D = shape["G"], shape["D"]
    scale = 1.0 / math.sqrt(D)
    inp = attention_inputs(**shape, dtype=dtype, device=device)
    k_full, v_full = expand(inp, G, shape["prefix"])
    q4 = inp["q"][:, :, None, :]  # [B, Hq, 1, D]

    def fastrl():
        return shared_prefix_decode_attention(**inp, group_size=G, scale=scale, backend="triton")

    def sdpa():
        return F.scaled_dot_product_attention(q4, k_full, v_full, scale=scale, enable_gqa=True)[:, :, 0]

    # correctness first: fastrl vs the reference (fp32 math on the same inputs) and vs SDPA
    out = fastrl().float()
    ref = reference(**{k: (v.float() if v.is_floating_point() else v) for k, v in inp.items()}, group_size=G,
                    scale=scale).float()
    err_ref = (out - ref).abs().max().item()
    err_sdpa = (out - sdpa().float()).abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16/fp16: one rounding of the output and of p
    check = {"max_abs_err_vs_reference": err_ref, "max_abs_err_vs_sdpa": err_sdpa, "tolerance": tol,
             "passed": bool(err_ref <= tol and math.isfinite(err_ref))}
    if not check["passed"]:
        return None, check
    impls = {"fastrl": fastrl, "sdpa_expanded": sdpa}
    if flex:
        try:
            from torch.nn.attention.flex_attention import flex_attention

            flex_fn = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention
            t0 = time.perf_counter()
            got = flex_fn(q4, k_full, v_full, scale=scale, enable_gqa=True)[:, :, 0]
            check["flex_compile_s"] = round(time.perf_counter() - t0, 1)
            check["max_abs_err_flex_vs_reference"] = (got.float() - ref).abs().max().item()
            impls["flex_expanded"] = lambda: flex_fn(q4, k_full, v_full, scale=scale, enable_gqa=True)
        except Exception as exc:  # a baseline that does not run is reported, not fatal
            check["flex_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    s = shape
    label = f"B={s['groups'] * G} G={G} Hq={s['Hq']} Hkv={s['Hkv']} D={D} P={s['prefix']} S={s['suffix']}"
    return BenchCase(op="decode_attention", shape=f"{label} {str(dtype)[6:]}", impls=impls, repeats=repeats,
                     note="prefix K/V expanded per sample for the baselines (built before timing)"), check


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (Triton interpreter)")
    args = ap.parse_args(argv)

    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.dry_run:
        attn_shapes = [dict(groups=2, G=2, Hq=4, Hkv=2, D=16, prefix=24, suffix=5)]
        attn_dtypes, repeats = (torch.float32, torch.bfloat16), 1
    else:
        # Qwen2.5-7B heads (Hq=28, Hkv=4, D=128) and a D=64 model; 16 prompts x 8 samples
        attn_shapes = [dict(groups=16, G=8, Hq=28, Hkv=4, D=128, prefix=1024, suffix=256),
                       dict(groups=16, G=8, Hq=14, Hkv=2, D=64, prefix=2048, suffix=512)]
        attn_dtypes, repeats = (torch.bfloat16,), 10
    results, checks = [], []
    _log(format_header())

    def save() -> None:  # after every case: a stage timeout keeps what was measured
        payload = {"environment": environment(device), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "checks": checks, "results": [r.__dict__ for r in results]}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=2) + "\n")

    for i, shape in enumerate(attn_shapes):
        for dtype in attn_dtypes:
            # FlexAttention compiles for each shape (tens of seconds): one shape is enough
            _run(lambda: attention_case(shape, device, dtype, flex=i == 0, repeats=repeats), device, results, checks,
                 f"decode_attention {shape} {dtype}")
            save()
    failed = [c["case"] for c in checks if not c.get("passed")]
    _log(f"wrote {args.out}; {len(checks)} cases checked, {len(failed)} failed: {failed}")
    return 1 if failed else 0


def _run(build, device, results, checks, name) -> None:
    try:
        case, check = build()
    except Exception as exc:
        checks.append({"case": name, "passed": False, "error": traceback.format_exc()[-2000:]})
        _log(f"ERROR {name}: {type(exc).__name__}: {exc}")
        return
    check = {"case": name, **check}
    checks.append(check)
    if case is None:
        _log(f"CHECK FAILED (not timed) {name}: {check}")
        return
    _log(f"check ok {name}")
    if device.type != "cuda":
        case.min_seconds = 0.0  # the dry run checks the plumbing, not the speed
    for r in run_case(case, device):
        results.append(r)
        _log(format_row(r))
    if device.type == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
