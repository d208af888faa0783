"""Peak extra memory and time of fwd+bwd of the GRPO loss from hidden states, each
implementation in a fresh process (see fastrl.bench.memory), side by side.

    python benchmarks/bench_logprobs_memory.py                       # CPU acceptance shape
    python benchmarks/bench_logprobs_memory.py --shapes 2048:256:32000 8192:256:151936
    python benchmarks/bench_logprobs_memory.py --device cuda --dtype bfloat16 --shapes 8192:4096:151936

Writes benchmarks/results/logprobs-memory-<device>-<time>.json and prints, per shape,
each implementation's peak extra memory and time with the ratios to the naive path.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastrl.bench.cases_logprobs import IMPLS  # noqa: E402
from fastrl.bench.memory import measure_in_subprocess  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="*", default=["8192:256:151936"], help="tokens:hidden:vocab")
    p.add_argument("--impls", nargs="*", default=list(IMPLS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=1, help="calls per process (time = the fastest)")
    p.add_argument("--mem-limit-gb", type=float, default=None,
                   help="address-space cap per child (CPU): over-budget runs report oom instead of waking the OOM killer")
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from fastrl.bench.harness import environment

    import torch

    rows = []
    for spec in args.shapes:
        n, hd, v = (int(x) for x in spec.split(":"))
        per = {}
        for impl in args.impls:
            kwargs = dict(impl=impl, tokens=n, hidden=hd, vocab=v, dtype=args.dtype, device=args.device)
            res = measure_in_subprocess(
                "fastrl.bench.cases_logprobs:build_grpo", kwargs, repeats=args.repeats,
                timeout_s=args.timeout_s, mem_limit_gb=args.mem_limit_gb,
            )
            per[impl] = res
            rows.append({"tokens": n, "hidden": hd, "vocab": v, "dtype": args.dtype, "impl": impl, **res})
            if "error" in res:
                print(f"N={n} H={hd} V={v} {impl:<14} ERROR {res['error']}", flush=True)
            else:
                print(f"N={n} H={hd} V={v} {impl:<14} peak extra {res['peak_extra_mb']:9.1f} MB  "
                      f"time {res['min_time_s']:8.2f} s  ({res['method']})", flush=True)
        base = per.get("naive")
        if base and "error" not in base:
            for impl, res in per.items():
                if "error" in res:
                    continue
                res["mem_vs_naive"] = res["peak_extra_mb"] / base["peak_extra_mb"]
                res["time_vs_naive"] = res["min_time_s"] / base["min_time_s"]
                print(f"    {impl:<14} memory {res['mem_vs_naive']:.3f}x naive, time {res['time_vs_naive']:.2f}x naive")
        for r in rows:
            if r["tokens"] == n and r["hidden"] == hd and r["vocab"] == v and r["impl"] in per:
                r.update({k: per[r["impl"]][k] for k in ("mem_vs_naive", "time_vs_naive") if k in per[r["impl"]]})

    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / (
        f"logprobs-memory-{args.device.split(':')[0]}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "environment": environment(torch.device(args.device)),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
        "measure": "fwd+bwd of the GRPO loss from hidden states, one fresh process per implementation; "
                   "peak extra = peak RSS (CPU) / max_memory_allocated (CUDA) above the inputs",
        "results": rows,
    }
    out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
