"""Interleaved CPU-time measurement of the policy-loss cases, for a busy shared CPU.

    OMP_NUM_THREADS=1 python benchmarks/interleaved_policy_loss.py [--quick] [--rounds 10]

Each round runs every impl of a case once, alternating, timed with ``time.thread_time`` (CPU
time of this thread, so waiting for a core does not count); the minimum over rounds is
reported. Wall-clock harness numbers (``fastrl bench``) are the reference on a quiet machine.
"""

import argparse
import time

import torch

from fastrl.bench.cases_policy_loss import cases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for c in cases(torch.device("cpu"), quick=args.quick):
        times = {k: [] for k in c.impls}
        for fn in c.impls.values():
            fn()
        for _ in range(args.rounds):
            for k, fn in c.impls.items():
                t0 = time.thread_time()
                fn()
                times[k].append(time.thread_time() - t0)
        best = {k: min(v) * 1e3 for k, v in times.items()}
        base = [k for k in best if k != c.fastrl]
        ratios = ", ".join(f"{k} {best[k]:.2f} ms ({best[k] / best[c.fastrl]:.2f}x)" for k in base)
        print(f"{c.op:<24} {c.shape:<14} fastrl {best[c.fastrl]:.2f} ms | {ratios}")


if __name__ == "__main__":
    main()
