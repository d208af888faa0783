"""Group rollouts: shared-prefix sampling vs the duplicated-prompt baseline.

HF backend part: ``HFGroupSampler`` (prompt prefilled once, G samples decode against one
copy of its keys/values) vs ``model.generate`` on G copies of the prompt (standard
``DynamicCache``), on a tiny Llama built from a config, in one process. For each
(P, G, L): prefill tokens, KV-cache bytes, median wall time and the ratios. Writes JSON to
``benchmarks/results/``.

    python benchmarks/bench_rollout.py                 # P in {512, 2048}, G in {4, 8, 16}, L in {64, 256}
    python benchmarks/bench_rollout.py --quick         # P=2048, G=8, L=64 and P=512, G=8, L=64
    python benchmarks/bench_rollout.py --threads 1     # CPU: pin intra-op threads (shared machines)
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastrl.bench.harness import environment, write_payload  # noqa: E402
from fastrl.bench.rollout_cases import compare, tiny_bench_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    ap.add_argument("--backend", default="auto", choices=("auto", "triton", "torch"), help="decode-attention backend")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size of the tiny Llama (heads of 16 dims)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        grid = [(2048, 8, 64), (512, 8, 64)]
    else:
        grid = list(itertools.product((512, 2048), (4, 8, 16), (64, 256)))
    model = tiny_bench_model(device=device, hidden=args.hidden, layers=args.layers, heads=args.hidden // 16,
                             kv_heads=max(1, args.hidden // 32))
    rows = []
    print(f"{'P':>5} {'G':>3} {'L':>4} {'prefill tok':>12} {'KV MB shared/dup':>18} {'KV/(P+GL)':>9} {'s shared':>9} {'s dup':>8} {'speedup':>8}")
    for P, G, L in grid:
        r = compare(model, P=P, G=G, L=L, repeats=args.repeats, backend=args.backend)
        rows.append(r)
        print(
            f"{P:>5} {G:>3} {L:>4} {r['prefill_tokens_shared']:>5}/{r['prefill_tokens_duplicated']:<6} "
            f"{r['kv_bytes_shared'] / 2**20:>8.2f}/{r['kv_bytes_duplicated'] / 2**20:<9.2f} {r['kv_shared_over_ideal']:>9.3f} "
            f"{r['seconds_shared']:>9.3f} {r['seconds_duplicated']:>8.3f} {r['speedup']:>7.2f}x",
            flush=True,
        )
    c = model.config
    payload = {
        "benchmark": "rollout_hf_shared_prefix_vs_duplicated",
        "environment": environment(device),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": {"arch": "llama", "vocab": c.vocab_size, "hidden": c.hidden_size, "layers": c.num_hidden_layers,
                  "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads, "dtype": str(next(model.parameters()).dtype)},
        "repeats": args.repeats,
        "backend": args.backend,
        "rows": rows,
    }
    write_payload(payload, args.out, stem=f"rollout-hf-{device.type}-{'quick' if args.quick else 'full'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
