"""Check, then time: the GRPO loss from LM-head hidden states (forward + backward) and the
no-grad log-prob pass (old / reference log-probs), fastrl's paths against the baselines.

Run by benchmarks/gpu/run.sh on the device (``python benchmarks/gpu/bench_logprob_loss.py
--out $RESULTS/logprob_loss.json``); ``--dry-run`` runs the same plumbing on CPU at a tiny
shape (fastrl's Triton kernels in the interpreter).

Implementations (same inputs: ``fastrl.bench.cases_logprobs.build_grpo``'s; N tokens in rows
of 512, the last 1/8 of each row masked; bf16):

- ``fastrl_chunked`` / ``fastrl_triton`` / ``fastrl_torch``: ``fused_linear_policy_loss``
  (and ``linear_logprobs`` without grad) with that backend; ``path`` in the JSON says which
  path ran (``fastrl.ops.fused_policy_loss.which_path``).
- ``naive``: materialised logits, fp32 ``log_softmax``, ``gather``, the loss in PyTorch.
- ``naive_compile``: the same function under ``torch.compile`` (CUDA only).
- ``liger``: Liger-Kernel's ``LigerFusedLinearGRPOLoss`` (compiled on CUDA), forward + backward.
- ``cce`` / ``cce_filtered``: Cut Cross-Entropy's ``linear_cross_entropy(reduction="none")``
  as ``-logp`` under the same loss, gradient filter off (exact) / on (its default
  ``filter_eps``: an approximate gradient; its error is reported, not failed). CUDA only.

Every implementation is checked first at the shape's H and V with ``CHECK_TOKENS`` tokens
against the loss computed from fp32 logits of the same (rounded) inputs: values and both
gradients (relative max error); one that fails is reported and not timed. Timing: device
events around each call (perf_counter on CPU), warm-up first, the median of ``repeats``
calls; peak memory above the inputs (the gradients it returns included). Each row carries
the floor of ``logprob_floor.py``, the achieved TFLOP/s of the floor's useful FLOPs and the
share of the floor; the JSON also carries the model's predictions for the same shapes.
A time budget (``--budget-s``) skips what would not fit, in the order listed (the issue's
main shape first, the slowest implementations last).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, Path(__file__).resolve().parent):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402

import logprob_floor  # noqa: E402

SHAPES = [(8192, 3584, 151936), (8192, 1536, 151936), (8192, 4096, 128256), (32768, 1536, 151936)]
DRY_SHAPES = [(64, 32, 300)]
IMPLS = ("fastrl_chunked", "naive", "liger", "cce", "cce_filtered", "naive_compile", "fastrl_torch", "fastrl_triton")
MODES = ("fwd_bwd", "no_grad")
CUDA_ONLY = {"naive_compile", "cce", "cce_filtered"}
CHECK_TOKENS = 1024  # the check's tokens (its fp32 reference holds [tokens, V] fp32 logits twice)
SEQ = 512
TOL = {"loss": 1e-2, "grad_hidden": 3e-2, "grad_weight": 3e-2, "logp": 1e-2}  # bf16 inputs vs fp32 logits
TOL_FP32 = {"loss": 1e-5, "grad_hidden": 1e-4, "grad_weight": 1e-4, "logp": 1e-5}
APPROXIMATE = {"cce_filtered": {"grad_hidden", "grad_weight"}}  # reported, not failed
TARGET_SECONDS = 1.0  # timed calls per implementation: about this long, within [MIN_REPEATS, MAX_REPEATS]
MIN_REPEATS, MAX_REPEATS = 3, 10


def _log(msg: str) -> None:
    print(msg, flush=True)


def make_inputs(n, h, v, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = min(SEQ, n)
    B = max(1, n // T)
    hid = torch.randn(B, T, h, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) * h**-0.5).to(device, dtype).requires_grad_()
    y = torch.randint(0, v, (B, T), generator=g).to(device)
    mask = torch.ones(B, T, device=device)
    mask[:, T - T // 8:] = 0
    old = (-torch.rand(B, T, generator=g) * 8 - 8).to(device)
    ref = old + 0.05 * torch.randn(B, T, generator=g).to(device)
    adv = torch.randn(B, generator=g).to(device)
    return dict(h=hid, w=w, y=y, mask=mask, old=old, ref=ref, adv=adv, scored=int(mask.sum().item()))


def make(impl: str, mode: str, inp: dict, device):
    """A zero-argument callable doing ``mode`` for ``impl`` and returning (loss, logp) -- or
    None where ``impl`` has no such mode."""
    from fastrl.bench.cases_logprobs import BETA, EPS, _grpo_from_logp
    from fastrl.config import PolicyLossConfig
    from fastrl.ops import fused_linear_policy_loss, linear_logprobs

    h, w, y, mask, old, ref, adv = (inp[k] for k in ("h", "w", "y", "mask", "old", "ref", "adv"))
    y_eff = torch.where(mask != 0, y, torch.full_like(y, -100))
    cfg = PolicyLossConfig.preset("grpo")
    no_grad = mode == "no_grad"

    if impl.startswith("fastrl_"):
        backend = impl.split("_", 1)[1]
        if no_grad:
            return lambda: (None, linear_logprobs(h, w, y_eff, backend=backend))
        return lambda: (fused_linear_policy_loss(h, w, y, old, adv, mask, ref_logp=ref, config=cfg, backend=backend)[0], None)

    def naive_logp(hh, ww):
        return torch.log_softmax((hh @ ww.T).float(), dim=-1).gather(-1, y[..., None]).squeeze(-1)

    if impl in ("naive", "naive_compile"):
        if no_grad:
            fn = naive_logp if impl == "naive" else torch.compile(naive_logp, dynamic=False)
            return lambda: (None, fn(h, w))

        def loss_fn(hh, ww):
            return _grpo_from_logp(naive_logp(hh, ww), old, ref, adv, mask)

        fn = loss_fn if impl == "naive" else torch.compile(loss_fn, dynamic=False)
        return lambda: (fn(h, w), None)
    if impl == "liger":
        if no_grad:
            return None
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        lf = LigerFusedLinearGRPOLoss(beta=BETA, epsilon_low=EPS, epsilon_high=EPS, loss_type="grpo", use_ref_model=True,
                                      compiled=device.type == "cuda")
        return lambda: (lf(h, w, y, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)[0], None)
    if impl in ("cce", "cce_filtered"):
        from cut_cross_entropy import linear_cross_entropy

        if no_grad and impl == "cce_filtered":
            return None  # the filter only changes the gradient
        kw = {} if impl == "cce_filtered" else {"filter_eps": None}

        def cce_logp():
            return -linear_cross_entropy(h, w, y_eff, reduction="none", **kw).float()

        if no_grad:
            return lambda: (None, torch.where(mask != 0, cce_logp(), 0.0))
        return lambda: (_grpo_from_logp(cce_logp(), old, ref, adv, mask), None)
    raise ValueError(f"unknown implementation {impl!r}")


def _rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def check(impl: str, mode: str, h: int, v: int, dtype, device, tokens: int = CHECK_TOKENS) -> dict:
    """``impl``'s values (and gradients) at ``min(tokens, CHECK_TOKENS)`` tokens vs fp32 logits
    of the same inputs."""
    from fastrl.bench.cases_logprobs import _grpo_from_logp

    inp = make_inputs(min(CHECK_TOKENS, tokens), h, v, dtype, device, seed=1)
    fn = make(impl, mode, inp, device)
    if fn is None:
        return {"passed": False, "skipped": f"{impl} has no {mode} mode"}
    hh, ww = inp["h"], inp["w"]
    mask, y = inp["mask"], inp["y"]

    def ref_logp(h_, w_):
        lp = torch.log_softmax(h_.float() @ w_.float().T, dim=-1).gather(-1, y[..., None]).squeeze(-1)
        return torch.where(mask != 0, lp, 0.0)

    tol = TOL if dtype != torch.float32 else TOL_FP32
    if mode == "no_grad":
        with torch.no_grad():
            _, lp = fn()
            err = {"logp": _rel(torch.where(mask != 0, lp.float(), 0.0), ref_logp(hh, ww))}
    else:
        loss, _ = fn()
        loss.backward()
        got = {"loss": loss.detach().float(), "grad_hidden": hh.grad.float(), "grad_weight": ww.grad.float()}
        h32, w32 = hh.detach().float().requires_grad_(), ww.detach().float().requires_grad_()
        want_loss = _grpo_from_logp(ref_logp(h32, w32), inp["old"], inp["ref"], inp["adv"], mask)
        want_loss.backward()
        want = {"loss": want_loss.detach(), "grad_hidden": h32.grad, "grad_weight": w32.grad}
        err = {k: _rel(got[k], want[k]) for k in got}
    skip = APPROXIMATE.get(impl, set())
    passed = all(math.isfinite(e) and (e <= tol[k] or k in skip) for k, e in err.items())
    return {"rel_err_vs_fp32_logits": err, "tolerance": tol, "approximate": sorted(skip), "passed": passed}


def time_calls(fn, inp, device, no_grad: bool, *, repeats: tuple[int, int] = (MIN_REPEATS, MAX_REPEATS)) -> dict:
    """Median and min of timed calls (device events on CUDA), the peak memory above the inputs."""
    cuda = device.type == "cuda"

    def reset():
        inp["h"].grad = None
        inp["w"].grad = None

    def once():
        if no_grad:
            with torch.no_grad():
                fn()
        else:
            loss, _ = fn()
            loss.backward()

    reset()
    t0 = time.perf_counter()
    once()  # warm-up (compiles)
    if cuda:
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    reset()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    n_calls = max(repeats[0], min(repeats[1], int(TARGET_SECONDS / max(first, 1e-6))))
    times = []
    for _ in range(n_calls):
        reset()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            once()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            once()
            times.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else None
    reset()
    return {"median_ms": round(statistics.median(times), 3), "min_ms": round(min(times), 3), "repeats": n_calls,
            "first_call_s": round(first, 2), "peak_mib_above_inputs": round(peak, 1) if peak is not None else None}


def available(impl: str, device) -> str | None:
    """Why ``impl`` cannot run here, or None."""
    import importlib.util

    if impl in CUDA_ONLY and device.type != "cuda":
        return "CUDA only"
    pkg = {"liger": "liger_kernel", "cce": "cut_cross_entropy", "cce_filtered": "cut_cross_entropy"}.get(impl)
    if pkg and importlib.util.find_spec(pkg) is None:
        return f"{pkg} not installed (.whl/ carries it to the device: benchmarks/gpu/fetch_wheels.sh)"
    return None


def gpu_kind(device) -> str:
    if device.type != "cuda":
        return "h200"  # the model's default, for the dry run's arithmetic
    name = torch.cuda.get_device_name(device).lower()
    return "h100" if "h100" in name else "h200"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="tiny shape on CPU (Triton in the interpreter)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="skip what would start after this many seconds")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--shapes", help="N:H:V,... (default: the issue's four)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(":")) for s in args.shapes.split(",")]
    impls = [i for i in args.impls.split(",") if i]
    kind = gpu_kind(device)
    from fastrl.bench.harness import environment
    from fastrl.config import PolicyLossConfig
    from fastrl.ops.fused_policy_loss import which_path

    dname = str(dtype).replace("torch.", "")
    payload = {"environment": environment(device), "gpu_kind": kind, "dtype": dname,
               "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "command": "python benchmarks/gpu/bench_logprob_loss.py " + " ".join(sys.argv[1:] if argv is None else argv),
               "predicted": logprob_floor.table(shapes, dname if dname in logprob_floor.ELEM else "bfloat16", kind),
               "rows": []}

    def save():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=1) + "\n")

    failed = []
    for n, h, v in shapes:
        for impl in impls:
            for mode in MODES:
                row = {"N": n, "H": h, "V": v, "dtype": dname, "impl": impl, "mode": mode, "median_ms": None}
                if impl.startswith("fastrl_"):
                    row["path"] = which_path(impl.split("_", 1)[1], device, config=PolicyLossConfig.preset("grpo"),
                                             needs_grad=mode == "fwd_bwd", hidden=h, vocab=v, dtype=dtype)
                why = available(impl, device)
                if why is None and time.perf_counter() - t_start > args.budget_s:
                    why = f"time budget of {args.budget_s:.0f} s spent"
                if why is None and (impl == "liger" and mode == "no_grad" or impl == "cce_filtered" and mode == "no_grad"):
                    why = "no such mode"
                if why:
                    row["skipped"] = why
                    payload["rows"].append(row)
                    continue
                try:
                    row["check"] = check(impl, mode, h, v, dtype, device, tokens=n)
                    if not row["check"]["passed"]:
                        failed.append(f"{impl} {mode} N={n} H={h} V={v}")
                        _log(f"CHECK FAILED (not timed) {impl} {mode} N={n} H={h} V={v}: {row['check']}")
                    else:
                        inp = make_inputs(n, h, v, dtype, device)
                        row["scored"] = inp["scored"]
                        row.update(time_calls(make(impl, mode, inp, device), inp, device, mode == "no_grad",
                                              repeats=(1, 1) if args.dry_run else (MIN_REPEATS, MAX_REPEATS)))
                        del inp
                except Exception as exc:  # OOM or a baseline that breaks: reported, the rest goes on
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                    row["traceback"] = traceback.format_exc()[-1500:]
                    if not isinstance(exc, torch.cuda.OutOfMemoryError):
                        failed.append(f"{impl} {mode} N={n} H={h} V={v} (error)")
                if row.get("median_ms") is not None:
                    row.update(logprob_floor.achieved({"rows": [row]}, kind)[0])
                _log(json.dumps({k: row.get(k) for k in ("impl", "mode", "N", "H", "V", "path", "median_ms",
                                                         "peak_mib_above_inputs", "share_of_floor", "skipped", "error")}))
                payload["rows"].append(row)
                save()
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    save()
    _log(f"wrote {args.out}; {len(failed)} failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
