"""The LM head of a decode step on CPU: ``F.linear(h, W)`` (``W`` ``[V, H]``, what the model's
``lm_head`` does) vs ``h @ W^T`` with ``W^T`` stored contiguous (``[H, V]``, what
``HFGroupSampler`` does for up to ``TRANSPOSED_HEAD_MAX_ROWS`` rows), and the copy that makes
``W^T`` (once per rollout). Issue 20's real shape: V = 151,936, H = 256, fp32; rows 1..64.
Interleaved, best of ``--rounds``, one intra-op thread; wall and process CPU seconds; also
checks that both layouts give the same logits (max abs difference recorded).

    taskset -c 1 python benchmarks/bench_lm_head_layout.py --rounds 7
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastrl.bench.harness import environment, write_payload  # noqa: E402


def _best(fn, rounds):
    fn()
    wall, cpu = [], []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return min(wall), min(cpu)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rows", default="1,4,8,16,32,64")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    W = torch.randn(args.vocab, args.hidden, generator=g) * 0.02
    transpose_wall, transpose_cpu = _best(lambda: W.t().contiguous(), max(3, args.rounds // 2))
    Wt = W.t().contiguous()
    rows = []
    for n in (int(r) for r in args.rows.split(",")):
        h = torch.randn(n, args.hidden, generator=g)
        a = _best(lambda: F.linear(h, W), args.rounds)
        b = _best(lambda: torch.matmul(h, Wt), args.rounds)
        rows.append({"rows": n, "linear_s": a[0], "transposed_s": b[0], "linear_cpu_s": a[1], "transposed_cpu_s": b[1],
                     "speed_transposed_vs_linear": a[0] / b[0], "cpu_speed_transposed_vs_linear": a[1] / b[1],
                     "max_abs_diff": float((F.linear(h, W) - torch.matmul(h, Wt)).abs().max())})
        print(rows[-1], flush=True)
    payload = {
        "benchmark": "lm_head_layout_cpu",
        "command": "python benchmarks/bench_lm_head_layout.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "environment": environment(torch.device("cpu")),
        "threads": 1,
        "note": "best of rounds; the 2-core machine was shared with other jobs (load average 10-20): the CPU-time ratios are the reliable ones",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "shape": {"vocab": args.vocab, "hidden": args.hidden, "dtype": "float32"},
        "transpose_copy_s": transpose_wall, "transpose_copy_cpu_s": transpose_cpu,
        "rows": rows,
    }
    write_payload(payload, args.out, stem="lm-head-layout-cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
