"""Shared prefix vs repeated prefix: forward + backward of the GRPO log-prob loss, CPU.

One group of G completions of length L of one prompt of length P, on a small Qwen2
(random init, fp32), the loss from fastrl's fused LM-head policy loss in both modes:

- ``shared``: the group packed as one row ``[prompt | c_1 .. c_G]`` (``P + G * L`` tokens,
  ``fastrl.ops.hf_packed.packed_causal_lm_policy_loss``, shared-prefix attention);
- ``repeated``: the usual ``[G, P + L]`` batch (``G * (P + L)`` tokens,
  ``fastrl.ops.hf.causal_lm_policy_loss``, the model's SDPA causal attention).

No activation checkpointing in either. Each (mode, shape) runs in a fresh process
(``fastrl.bench.memory``: peak RSS above the post-setup baseline, best-of-n time); each
child saves its parameter gradients and the parent prints their largest relative
difference (per parameter: max |g_shared - g_repeated| / max |g_repeated|, the maximum over
parameters).

The default vocabulary is 32768, not 151936: the LM head costs the same in both modes
(both score the G * L completion tokens), and on this 4-layer, 256-wide model a
151936-token head would be ~80% of the FLOPs per token, against ~15% for a real
Qwen2.5-1.5B; ``--vocab 151936`` measures that case.

    OMP_NUM_THREADS=2 python benchmarks/bench_shared_prefix.py            # the grid below
    OMP_NUM_THREADS=2 python benchmarks/bench_shared_prefix.py --quick    # tiny, ~1 min
    # the time ratio from alternating steps in one process (robust on a loaded machine):
    OMP_NUM_THREADS=1 python benchmarks/bench_shared_prefix.py --shapes 4096x512 --threads 1 --interleaved-rounds 3

Default grid: (P, L) in {1024, 4096} x {256, 1024} plus (4096, 512), G = 8.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench_long_trajectory import CHILD_ENV, build_model, environment, make_group  # noqa: E402

MODES = ("shared", "repeated")


def build_step(
    *,
    mode: str,
    prompt_len: int,
    completion_len: int,
    group_size: int = 8,
    hidden: int = 256,
    layers: int = 4,
    vocab: int = 32768,
    heads: int = 4,
    kv_heads: int = 2,
    threads: int = 2,
    grads_out: str | None = None,
) -> Callable[[], None]:
    """One forward + backward of the GRPO loss in ``mode`` (``MODES``); grads cleared first.
    ``grads_out``: the parameter gradients of the first call are saved there."""
    import gc

    import torch

    from fastrl.config import PolicyLossConfig

    torch.set_num_threads(threads)
    P, L, G = prompt_len, completion_len, group_size
    model = build_model(hidden=hidden, layers=layers, vocab=vocab, heads=heads, kv_heads=kv_heads, max_positions=P + L + 8)
    prompt, completions, advantages = make_group(prompt_len=P, completion_len=L, group_size=G, vocab=vocab)
    cfg = PolicyLossConfig.preset("grpo", kl_coef=0.0)

    if mode == "shared":
        from fastrl.ops.hf_packed import packed_causal_lm_logprobs, packed_causal_lm_policy_loss
        from fastrl.ops.shared_prefix_attention import PackedGroups

        packed = PackedGroups.from_groups([(prompt.tolist(), completions.tolist())])
        with torch.no_grad():  # old-policy log-probs (not measured)
            old = packed.to_completion_layout(packed_causal_lm_logprobs(model, packed))

        def step() -> None:
            model.zero_grad(set_to_none=True)
            loss, _ = packed_causal_lm_policy_loss(model, packed, old, advantages, config=cfg)
            loss.backward()

    elif mode == "repeated":
        from fastrl.ops.hf import causal_lm_logprobs, causal_lm_policy_loss

        input_ids = torch.cat([prompt[None].expand(G, P), completions], dim=1)
        mask = torch.ones(G, L, dtype=torch.bool)
        with torch.no_grad():
            old = causal_lm_logprobs(model, input_ids, None, logits_to_keep=L)

        def step() -> None:
            model.zero_grad(set_to_none=True)
            loss, _ = causal_lm_policy_loss(model, input_ids, None, mask, old, advantages, config=cfg)
            loss.backward()

    else:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")

    calls = [0]

    def run() -> None:
        step()
        calls[0] += 1
        if grads_out is not None and calls[0] == 1:
            torch.save({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}, grads_out)

    gc.collect()
    run.device = torch.device("cpu")
    return run


def grad_rel_diff(path_a: str, path_b: str) -> tuple[float, str]:
    """max over parameters of max|a - b| / max|b|, and the parameter where it occurs."""
    import torch

    a, b = torch.load(path_a), torch.load(path_b)
    if set(a) != set(b):
        raise RuntimeError(f"gradients of different parameters: {sorted(set(a) ^ set(b))[:5]}")
    worst, where = 0.0, ""
    for name in a:
        ga, gb = a[name].double(), b[name].double()
        scale = gb.abs().max().item()
        d = (ga - gb).abs().max().item() / (scale if scale > 0 else 1.0)
        if d > worst:
            worst, where = d, name
    return worst, where


def interleaved_times(kwargs: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    """Step times of both modes in ONE process, alternating shared/repeated ``rounds`` times
    after one warm-up step each. On a shared machine the load drifts over minutes; steps
    taken back to back see the same load, so the best-of-``rounds`` ratio is robust where
    two fresh processes minutes apart are not."""
    import gc

    steps = {mode: build_step(mode=mode, **kwargs) for mode in MODES}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for mode in MODES:
        steps[mode]()
    for _ in range(rounds):
        for mode in MODES:
            gc.collect()
            t0 = time.perf_counter()
            steps[mode]()
            times[mode].append(time.perf_counter() - t0)
    return times


def _interleaved_in_child(kwargs: dict[str, Any], rounds: int, env: dict[str, str], timeout_s: float) -> dict[str, list[float]]:
    import subprocess

    code = ("import json, sys; sys.path[:0] = [%r, %r]; from bench_shared_prefix import interleaved_times; "
            "print(json.dumps(interleaved_times(json.loads(sys.argv[1]), int(sys.argv[2]))))") % (ROOT, HERE)
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(kwargs), str(rounds)], capture_output=True,
                          text=True, timeout=timeout_s, env={**os.environ, **env})
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from fastrl.bench.memory import measure_in_subprocess

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model and shapes (smoke test)")
    p.add_argument("--shapes", default=None, help="comma-separated PxL pairs, e.g. 4096x512,1024x256")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument("--repeats", type=int, default=2, help="steps per child (best-of)")
    p.add_argument("--interleaved-rounds", type=int, default=0,
                   help="also time both modes alternately in one fresh process, best of N rounds each; "
                        "the speedup then comes from these (robust to a drifting machine load)")
    p.add_argument("--mem-cap-gb", type=float, default=20.0, help="address-space limit of each child")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--out", default=None)
    p.add_argument("--append", action="store_true", help="merge into --out's earlier results (same model)")
    args = p.parse_args(argv)

    hidden = args.hidden or (32 if args.quick else 256)
    vocab = args.vocab or (1024 if args.quick else 32768)
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    elif args.quick:
        shapes = [(64, 16), (128, 32)]
    else:
        shapes = [(1024, 256), (1024, 1024), (4096, 256), (4096, 512), (4096, 1024)]
    G = args.group_size
    model_shape = dict(hidden=hidden, layers=args.layers, vocab=vocab, heads=4, kv_heads=2)
    out = args.out or os.path.join(HERE, "results", f"shared_prefix_cpu{'_quick' if args.quick else ''}.json")
    rows: list[dict[str, Any]] = []
    if args.append and os.path.exists(out):
        with open(out) as f:
            previous = json.load(f)
        if {k: previous["shapes"].get(k) for k in model_shape} != model_shape:
            raise SystemExit(f"--append: {out} has another model")
        rows = previous["results"]
    tmp = tempfile.mkdtemp(prefix="fastrl_shared_prefix_")
    env = dict(CHILD_ENV, OMP_NUM_THREADS=str(args.threads))
    for P, L in shapes:
        row: dict[str, Any] = {"prompt_len": P, "completion_len": L, "group_size": G,
                               "tokens": {"shared": P + G * L, "repeated": G * (P + L)}}
        grads = {}
        for mode in MODES:
            grads[mode] = os.path.join(tmp, f"{mode}_{P}_{L}.pt")
            kwargs = dict(mode=mode, prompt_len=P, completion_len=L, group_size=G, threads=args.threads,
                          grads_out=grads[mode], **model_shape)
            t0 = time.perf_counter()
            r = measure_in_subprocess("bench_shared_prefix:build_step", kwargs, repeats=args.repeats,
                                      timeout_s=args.timeout_s, mem_limit_gb=args.mem_cap_gb, env=env)
            r["wall_s"] = time.perf_counter() - t0
            row[mode] = r
            msg = f"{r['peak_extra_mb']:9.1f} MiB {r['min_time_s']:8.2f} s" if "error" not in r else f"FAILED ({r['error'][:80]})"
            print(f"  {mode:8s} P={P} L={L} G={G}: {msg}", flush=True)
        if all("error" not in row[m] for m in MODES):
            row["speedup_time"] = row["repeated"]["min_time_s"] / row["shared"]["min_time_s"]
            row["memory_ratio_repeated_over_shared"] = row["repeated"]["peak_extra_mb"] / max(row["shared"]["peak_extra_mb"], 1e-9)
            row["grad_max_rel_diff"], row["grad_max_rel_diff_param"] = grad_rel_diff(grads["shared"], grads["repeated"])
        if args.interleaved_rounds > 0:
            kwargs = dict(prompt_len=P, completion_len=L, group_size=G, threads=args.threads, **model_shape)
            times = _interleaved_in_child(kwargs, args.interleaved_rounds, env, args.timeout_s)
            row["interleaved"] = {"rounds": args.interleaved_rounds, "times_s": times,
                                  "min_time_s": {m: min(t) for m, t in times.items()}}
            row["speedup_time_fresh_processes"] = row.get("speedup_time")
            row["speedup_time"] = min(times["repeated"]) / min(times["shared"])
            print(f"  interleaved (best of {args.interleaved_rounds}): shared {min(times['shared']):.2f} s, "
                  f"repeated {min(times['repeated']):.2f} s, speedup {row['speedup_time']:.2f}x", flush=True)
        for path in grads.values():
            if os.path.exists(path):
                os.remove(path)
        rows = [x for x in rows if (x["prompt_len"], x["completion_len"], x["group_size"]) != (P, L, G)] + [row]

    rows.sort(key=lambda r: (r["prompt_len"], r["completion_len"]))
    record = {
        "benchmark": "shared prefix vs repeated prefix: GRPO log-prob loss forward + backward (fastrl fused head in both)",
        **environment(args.threads),
        "quick": args.quick,
        "shapes": {"model": "Qwen2 (random init, fp32)", **model_shape, "intermediate": 4 * hidden, "group_size": G,
                   "grid": [[r["prompt_len"], r["completion_len"]] for r in rows]},
        "memory": "peak RSS above the post-setup baseline, fresh process per point (fastrl.bench.memory), "
                  f"RLIMIT_AS cap {args.mem_cap_gb} GiB, MALLOC_MMAP_THRESHOLD_=131072",
        "time": (f"best of {args.interleaved_rounds} alternating rounds in one process (speedup_time); "
                 f"fresh-process best of {args.repeats} kept per mode" if args.interleaved_rounds
                 else f"best of {args.repeats} steps per child"),
        "results": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=2)

    print(f"\n{'P':>5s} {'L':>5s} {'shared s':>9s} {'repeat s':>9s} {'speedup':>8s} {'shared MiB':>11s} {'repeat MiB':>11s} {'grad rel diff':>14s}")
    for r in rows:
        s, rp = r["shared"], r["repeated"]
        if "speedup_time" in r:
            t_s, t_r = (r["interleaved"]["min_time_s"][m] for m in MODES) if "interleaved" in r else (s["min_time_s"], rp["min_time_s"])
            print(f"{r['prompt_len']:5d} {r['completion_len']:5d} {t_s:9.2f} {t_r:9.2f} "
                  f"{r['speedup_time']:7.2f}x {s['peak_extra_mb']:11.1f} {rp['peak_extra_mb']:11.1f} {r['grad_max_rel_diff']:14.2e}")
        else:
            print(f"{r['prompt_len']:5d} {r['completion_len']:5d} failed: {s.get('error') or rp.get('error')}")
    print(f"wrote {out}")
    return record


if __name__ == "__main__":
    main()
