"""Check, then time: decode attention and the fused log-prob loss on the GPU against their baselines.

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
- the GRPO loss from LM-head hidden states, forward + backward: ``fastrl``
  (``fused_linear_policy_loss``, the Triton kernels; ``fastrl_torch``: its chunked PyTorch path) vs ``liger`` (Liger-Kernel's ``LigerFusedLinearGRPOLoss``,
  compiled on CUDA) and ``naive`` (full logits), with the inputs of
  ``fastrl.bench.cases_logprobs.build_grpo``.
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


# ----------------------------------------------------------------------------- log-prob loss


def logprob_case(tokens, hidden, vocab, device, dtype: str, *, repeats: int) -> tuple[BenchCase | None, dict]:
    from fastrl.bench.cases_logprobs import available_impls, build_grpo

    check = check_grpo_loss(tokens, hidden, vocab, device, getattr(torch, dtype))
    if not check["passed"]:
        return None, check
    impls = {name: build_grpo(name, tokens, hidden, vocab, dtype=dtype, device=str(device),
                              backend="triton" if name == "fastrl" else "auto")
             for name in ("fastrl", "liger", "naive") if name in available_impls()}
    # fastrl's chunked PyTorch path (the CPU default) beside its kernel: on the first H200 run the
    # kernel took 13x the naive GEMMs' time, so the GPU's choice between the two is measured here
    impls["fastrl_torch"] = build_grpo("fastrl", tokens, hidden, vocab, dtype=dtype, device=str(device), backend="torch")
    if "liger_error" in check:
        impls.pop("liger", None)
    return BenchCase(op="grpo_loss_fwd_bwd", shape=f"N={tokens} H={hidden} V={vocab} {dtype}", impls=impls,
                     repeats=repeats, note="liger compiled on CUDA, eager on CPU"), check


def check_grpo_loss(tokens, hidden, vocab, device, dtype, seq_len=512) -> dict:
    """fastrl's fused GRPO loss (values and gradients) vs the full-logits formula in fp32 on the
    same (rounded) inputs; Liger's loss on the same inputs is reported alongside."""
    from fastrl.bench.cases_logprobs import BETA, EPS, _grpo_from_logp
    from fastrl.config import PolicyLossConfig
    from fastrl.ops import fused_linear_policy_loss

    g = torch.Generator().manual_seed(1)
    T = min(seq_len, tokens)
    B = max(1, tokens // T)
    h0 = torch.randn(B, T, hidden, generator=g).to(device, dtype)
    w0 = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).to(device, dtype)
    y = torch.randint(0, vocab, (B, T), generator=g).to(device)
    mask = torch.ones(B, T, device=device)
    mask[:, T - T // 8:] = 0
    old = (-torch.rand(B, T, generator=g) * 8 - 8).to(device)
    ref = old + 0.05 * torch.randn(B, T, generator=g).to(device)
    adv = torch.randn(B, generator=g).to(device)

    def grads(fn, h, w):
        h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        loss = fn(h, w)
        loss.backward()
        return {"loss": loss.detach().float(), "grad_hidden": h.grad.float(), "grad_weight": w.grad.float()}

    def naive_fp32(h, w):
        logp = torch.log_softmax(h @ w.T, dim=-1).gather(-1, y[..., None]).squeeze(-1)
        return _grpo_from_logp(logp, old, ref, adv, mask)

    cfg = PolicyLossConfig.preset("grpo")
    got = grads(lambda h, w: fused_linear_policy_loss(h, w, y, old, adv, mask, ref_logp=ref, config=cfg,
                                                      backend="triton")[0], h0, w0)
    want = grads(naive_fp32, h0.float(), w0.float())
    low = dtype != torch.float32
    err = {k: _rel(got[k], want[k]) for k in got}
    tol = {"loss": 1e-2 if low else 1e-5, "grad_hidden": 3e-2 if low else 1e-4, "grad_weight": 3e-2 if low else 1e-4}
    check = {"rel_err_vs_fp32_formula": err, "tolerance": tol,
             "passed": all(err[k] <= tol[k] and math.isfinite(err[k]) for k in err)}
    del want
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        liger = LigerFusedLinearGRPOLoss(beta=BETA, epsilon_low=EPS, epsilon_high=EPS, loss_type="grpo",
                                         use_ref_model=True, compiled=device.type == "cuda")
        lg = grads(lambda h, w: liger(h, w, y, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)[0], h0, w0)
        check["rel_err_liger_vs_fastrl"] = {k: _rel(lg[k], got[k]) for k in got}
    except Exception as exc:  # an optional baseline: reported, not fatal
        check["liger_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return check


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (Triton interpreter)")
    args = ap.parse_args(argv)

    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.dry_run:
        attn_shapes = [dict(groups=2, G=2, Hq=4, Hkv=2, D=16, prefix=24, suffix=5)]
        lp_shapes = [(64, 32, 300)]
        attn_dtypes, lp_dtype, repeats = (torch.float32, torch.bfloat16), "float32", 1
    else:
        # Qwen2.5-7B heads (Hq=28, Hkv=4, D=128) and a D=64 model; 16 prompts x 8 samples
        attn_shapes = [dict(groups=16, G=8, Hq=28, Hkv=4, D=128, prefix=1024, suffix=256),
                       dict(groups=16, G=8, Hq=14, Hkv=2, D=64, prefix=2048, suffix=512)]
        lp_shapes = [(8192, 3584, 151936)]  # Qwen2.5-7B head
        attn_dtypes, lp_dtype, repeats = (torch.bfloat16,), "bfloat16", 10
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
    for n, h, v in lp_shapes:
        _run(lambda: logprob_case(n, h, v, device, lp_dtype, repeats=repeats), device, results, checks,
             f"grpo_loss N={n} H={h} V={v} {lp_dtype}")
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
