"""The memory-bound kernels on the GPU, timed for the first time (issue 37, section 3): policy loss,
KL, value loss, group advantages, GAE, whitening and turn advantages, each at 64 x 8192 and
1024 x 8192 tokens (fp32), as fastrl's Triton kernel vs the op's PyTorch path vs ``torch.compile``
of that path, with the achieved bandwidth against a measured device-to-device copy.

Every implementation is checked before it is timed, and is timed only if its check passed: at
the first shape against ``fastrl.reference`` (the oracle, run on CPU copies of the inputs; for
group and turn advantages on the first whole groups only, its loops being too slow for all), at
the larger shape against the op's PyTorch path (checked at the first shape). Ops with a
gradient (policy loss, KL, value loss, whitening) are timed forward + backward and compared
on the loss and the gradient; the others forward.

Bytes: each input read once plus each output (gradients included) written once -- the
compulsory traffic; ``achieved_GBps`` = those bytes / the median time, ``share_of_copy`` = that
over the copy's bandwidth (issue 37's target: >= 0.6 at the large shapes, and never slower
than the ``torch.compile`` twin; the twins are compiled at the largest shape only, unless
``--compile-all-shapes``: each compile takes seconds). Times: CUDA-event medians, the L2 flushed
before each call (``device_timer.py``).

    python benchmarks/gpu/bench_memory_bound.py --out $OUT/memory_bound_gpu.json         # on the device
    python benchmarks/gpu/bench_memory_bound.py --dry-run --out /tmp/memory_bound.json   # CPU: tiny shapes, interpreter
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
for p in (ROOT, HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402

SHAPES = [(64, 8192), (1024, 8192)]
DRY_SHAPES = [(2, 32), (4, 16)]
RTOL, ATOL = 1e-4, 1e-5
"""Check tolerance (fp32 inputs; the reference may compute in float64)."""
GROUP = 8
"""Samples per group (group advantages, turn advantages)."""
TARGET_SHARE_OF_COPY = 0.6


@dataclass
class Op:
    """One op: ``make(B, T, device)`` -> inputs; ``run(x, backend)`` -> output tensors (a tuple,
    gradients included); ``reference(x)`` -> the same from ``fastrl.reference``."""

    name: str
    make: Callable
    run: Callable
    reference: Callable
    grad: bool
    ref_rows: int | None = None
    """The oracle's Python loops are too slow for the whole input: it checks the first ``ref_rows``
    rows (whole groups, independent of the rest), the op's PyTorch path checks all of them."""


def _grads_of(loss_or_out, leaf, grad_out=None):
    leaf.grad = None
    if grad_out is None:
        loss_or_out.backward()
    else:
        loss_or_out.backward(grad_out)
    return leaf.grad


# ---------------------------------------------------------------- the ops


def _policy_make(B, T, device):
    from fastrl.bench.cases_policy_loss import make_inputs

    x = make_inputs(B, T, device)
    x["logp"].requires_grad_(True)
    return x


def _policy_run(x, backend):
    from fastrl.bench.cases_policy_loss import FASTRL_CONFIGS
    from fastrl.ops import policy_loss

    loss, _ = policy_loss(x["logp"], x["old_logp"], x["advantages"], x["mask"], ref_logp=x["ref_logp"],
                          entropy=x["entropy"], config=FASTRL_CONFIGS["verl-grpo"], backend=backend)
    return loss.detach(), _grads_of(loss, x["logp"])


def _policy_ref(x):
    from fastrl.bench.cases_policy_loss import FASTRL_CONFIGS
    from fastrl.reference.policy_loss import policy_loss_reference

    logp = x["logp"].detach().clone().requires_grad_(True)
    loss, _ = policy_loss_reference(logp, x["old_logp"], x["advantages"], x["mask"], ref_logp=x["ref_logp"],
                                    entropy=x["entropy"], config=FASTRL_CONFIGS["verl-grpo"])
    loss.backward()
    return loss.detach(), logp.grad


def _kl_make(B, T, device):
    from fastrl.bench.cases_policy_loss import make_inputs

    x = make_inputs(B, T, device)
    return {"logp": x["logp"].requires_grad_(True), "ref_logp": x["ref_logp"], "grad_out": torch.ones_like(x["logp"])}


def _kl_run(x, backend):
    from fastrl.ops import kl_penalty

    out = kl_penalty(x["logp"], x["ref_logp"], estimator="k3", clamp=10.0, backend=backend)
    return out.detach(), _grads_of(out, x["logp"], x["grad_out"])


def _kl_ref(x):
    from fastrl.reference.kl import kl_penalty_reference

    logp = x["logp"].detach().clone().requires_grad_(True)
    out = kl_penalty_reference(logp, x["ref_logp"], estimator="k3", clamp=10.0)
    out.backward(x["grad_out"].to(out.dtype))
    return out.detach(), logp.grad


def _value_make(B, T, device):
    g = torch.Generator().manual_seed(1)
    values = torch.randn(B, T, generator=g)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    out = dict(values=values, old_values=values + 0.1 * torch.randn(B, T, generator=g), returns=torch.randn(B, T, generator=g),
               mask=(torch.arange(T)[None, :] < lengths[:, None]).float())
    out = {k: v.to(device) for k, v in out.items()}
    out["values"].requires_grad_(True)
    return out


def _value_run(x, backend):
    from fastrl.ops import value_loss

    loss, _ = value_loss(x["values"], x["old_values"], x["returns"], x["mask"], clip=0.2, backend=backend)
    return loss.detach(), _grads_of(loss, x["values"])


def _value_ref(x):
    from fastrl.reference.value_loss import value_loss_reference

    values = x["values"].detach().clone().requires_grad_(True)
    loss, _ = value_loss_reference(values, x["old_values"], x["returns"], x["mask"], clip=0.2)
    loss.backward()
    return loss.detach(), values.grad


def _group_make(B, T, device):
    n = B * T  # one reward per sample, B * T samples in groups of GROUP: the kernel's memory-bound regime
    g = torch.Generator().manual_seed(2)
    return {"rewards": torch.randn(n, generator=g).to(device), "ids": torch.arange(n // GROUP).repeat_interleave(GROUP).to(device)}


def _group_run(x, backend):
    from fastrl.ops import group_advantages

    adv, _ = group_advantages(x["rewards"], x["ids"], mode="grpo", backend=backend, cpu_host_path=False)
    return (adv,)


def _group_ref(x):
    from fastrl.reference.advantages import group_advantages_reference

    return (group_advantages_reference(x["rewards"], x["ids"], mode="grpo")[0],)


def _gae_make(B, T, device):
    from fastrl.bench.cases_scans import make_inputs

    r, v, m = make_inputs(B, T, device)
    return {"rewards": r, "values": v, "mask": m}


def _gae_run(x, backend):
    from fastrl.ops import gae

    return tuple(gae(x["rewards"], x["values"], x["mask"], gamma=1.0, lam=0.95, backend=backend))


def _gae_ref(x):
    from fastrl.reference.scans import gae

    return tuple(gae(x["rewards"], x["values"], x["mask"], gamma=1.0, lam=0.95))


def _whiten_make(B, T, device):
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    x = torch.randn(B, T, generator=g).to(device).requires_grad_(True)
    return {"x": x, "mask": (torch.arange(T)[None, :] < lengths[:, None]).to(device), "grad_out": torch.ones(B, T, device=device)}


def _whiten_run(x, backend):
    from fastrl.ops import masked_whiten

    out = masked_whiten(x["x"], x["mask"], backend=backend)
    return out.detach(), _grads_of(out, x["x"], x["grad_out"])


def _whiten_ref(x):
    from fastrl.reference.whiten import masked_whiten_reference

    leaf = x["x"].detach().clone().requires_grad_(True)
    out = masked_whiten_reference(leaf, x["mask"])
    out.backward(x["grad_out"].to(out.dtype))
    return out.detach(), leaf.grad


TURNS, ENV_SHARE = 16, 4
"""Turn advantages: 16 turns a trajectory, a quarter of each turn's tokens from the environment."""


def _turn_make(B, T, device):
    from fastrl.bench.cases_turn_advantages import _trajectories

    span = T // TURNS
    _, ti, lm, r, keys, out, ids, _ = _trajectories(B, TURNS, span - span // ENV_SHARE, span // ENV_SHARE, group=min(GROUP, B))
    nt = torch.full((B,), TURNS)
    return {k: v.to(device) for k, v in dict(ti=ti, lm=lm, r=r, nt=nt, out=out, ids=ids, keys=keys).items()}


def _turn_run(x, backend):
    from fastrl.ops import turn_advantages

    adv, _ = turn_advantages(x["ti"], x["lm"], x["r"], x["nt"], x["out"], x["ids"], mode="gigpo", state_keys=x["keys"],
                             gamma=0.95, backend=backend, cpu_host_path=False)
    return (adv,)


def _turn_ref(x):
    from fastrl.reference.turn_advantages import turn_advantages_reference

    return (turn_advantages_reference(x["ti"], x["lm"], x["r"], x["nt"], x["out"], x["ids"], mode="gigpo", state_keys=x["keys"],
                                      gamma=0.95)[0],)


OPS = [
    Op("policy_loss (verl GRPO: dual clip, k3 KL, entropy) fwd+bwd", _policy_make, _policy_run, _policy_ref, True),
    Op("kl_penalty k3 clamp fwd+bwd", _kl_make, _kl_run, _kl_ref, True),
    Op("value_loss clip fwd+bwd", _value_make, _value_run, _value_ref, True),
    Op("group_advantages grpo (B*T samples)", _group_make, _group_run, _group_ref, False, ref_rows=512 * GROUP),
    Op("gae", _gae_make, _gae_run, _gae_ref, False),
    Op("masked_whiten fwd+bwd", _whiten_make, _whiten_run, _whiten_ref, True),
    Op("turn_advantages gigpo (16 turns)", _turn_make, _turn_run, _turn_ref, False, ref_rows=2 * GROUP),
]


# ---------------------------------------------------------------- check, then time


def _on_cpu(x: dict) -> dict:
    return {k: v.detach().cpu().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v for k, v in x.items()}


def compulsory_bytes(x: dict, outputs: tuple) -> int:
    tensors = [v for k, v in x.items() if isinstance(v, torch.Tensor) and k != "grad_out"]
    return sum(t.numel() * t.element_size() for t in tensors) + sum(o.numel() * o.element_size() for o in outputs)


def compare(got: tuple, want: tuple) -> dict:
    errs = [float((a.double() - b.double()).abs().max()) if a.numel() else 0.0 for a, b in zip(got, want)]
    ok = len(got) == len(want) and all(a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=RTOL, atol=ATOL)
                                       for a, b in zip(got, want))
    return {"max_abs_err": max(errs) if errs else 0.0, "passed": bool(ok)}


def op_case(op: Op, B: int, T: int, device: torch.device, timer, *, against_reference: bool, compile_: bool) -> dict:
    x = op.make(B, T, device)
    impls: dict[str, Callable] = {"fastrl_triton": lambda: op.run(x, "triton"), "torch": lambda: op.run(x, "torch")}
    if compile_:
        impls["torch_compile"] = torch.compile(lambda: op.run(x, "torch"), dynamic=False)
    case: dict = {"op": op.name, "B": B, "T": T, "checked_against": "reference" if against_reference else "torch path",
                  "checks": {}, "times": {}}
    t0 = time.perf_counter()
    # the oracle runs on CPU copies: its Python loops (over groups, turns, time steps) launch
    # tiny ops one by one, far faster on the host than as GPU kernels
    rows = op.ref_rows if against_reference and op.ref_rows is not None else None
    if against_reference:
        sub = _on_cpu(x) if rows is None else {k: v[:rows] if isinstance(v, torch.Tensor) else v for k, v in _on_cpu(x).items()}
        want = tuple(t.to(device) for t in op.reference(sub))
    else:
        want = op.run(x, "torch")
    full = tuple(t.detach() for t in op.run(x, "torch")) if rows is not None else None
    case["check_seconds_of_the_oracle"] = round(time.perf_counter() - t0, 2)
    if rows is not None:
        case["reference_rows"] = rows
    for name, fn in impls.items():
        try:
            got = tuple(t.detach() for t in fn())
            if rows is None:
                case["checks"][name] = compare(got, tuple(t.detach() for t in want))
            else:  # the first rows against the oracle, all of them against the torch path
                head, rest = compare(tuple(t[:rows] for t in got), want), compare(got, full)
                case["checks"][name] = {"max_abs_err": max(head["max_abs_err"], rest["max_abs_err"]),
                                        "passed": head["passed"] and rest["passed"]}
        except Exception as exc:  # reported, not fatal
            case["checks"][name] = {"passed": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    case["bytes"] = compulsory_bytes(x, op.run(x, "torch"))
    for name, fn in impls.items():
        if case["checks"][name]["passed"]:  # timed only after its check passed
            t = timer.time_fn(fn)
            t["achieved_GBps"] = case["bytes"] / (t["median_ms"] * 1e-3) / 1e9
            case["times"][name] = t
    return case


def main(argv: list[str] | None = None) -> int:
    from device_timer import DeviceTimer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton in the interpreter")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile twins")
    ap.add_argument("--compile-all-shapes", action="store_true",
                    help="compile the twins at every shape (default: the largest only, where the target applies)")
    ap.add_argument("--ops", default="", help="comma-separated substrings of op names to run (default: all)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"))
    shapes = SHAPES if device.type == "cuda" and not args.dry_run else DRY_SHAPES
    timer = DeviceTimer(device, repeats=args.repeats if device.type == "cuda" else 1)
    torch.backends.cuda.matmul.allow_tf32 = False
    out: dict = {"benchmark": "memory_bound_kernels", "command": "python benchmarks/gpu/bench_memory_bound.py " + " ".join(argv or sys.argv[1:]),
                 "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter; plumbing only)",
                 "torch": torch.__version__, "dtype": "float32", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "target_share_of_copy": TARGET_SHARE_OF_COPY, "cases": []}

    def save() -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")

    out["copy"] = timer.copy_bandwidth()
    save()
    wanted = [s.strip() for s in args.ops.split(",") if s.strip()]
    failed = []
    for op in OPS:
        if wanted and not any(w in op.name for w in wanted):
            continue
        for i, (B, T) in enumerate(shapes):
            try:
                compile_ = not args.no_compile and (args.compile_all_shapes or i == len(shapes) - 1)
                case = op_case(op, B, T, device, timer, against_reference=i == 0, compile_=compile_)
            except Exception:
                case = {"op": op.name, "B": B, "T": T, "error": traceback.format_exc()[-2000:]}
            copy_bw = out["copy"]["GBps"]
            for t in case.get("times", {}).values():
                t["share_of_copy"] = t["achieved_GBps"] / copy_bw
            if "torch_compile" in case.get("times", {}) and "fastrl_triton" in case["times"]:
                case["triton_vs_compile"] = case["times"]["torch_compile"]["median_ms"] / case["times"]["fastrl_triton"]["median_ms"]
            out["cases"].append(case)
            save()
            if "error" in case or not case["checks"].get("fastrl_triton", {}).get("passed"):
                failed.append(f"{op.name} B={B} T={T}")
            print(json.dumps({k: case.get(k) for k in ("op", "B", "T", "checks", "times", "error") if k in case}), flush=True)
    print(f"wrote {args.out}; failed: {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
