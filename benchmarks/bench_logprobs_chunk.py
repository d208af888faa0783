"""The PyTorch log-prob path's chunk rule, before and after (issue 20, section 2).

``fastrl.ops.linear_logprobs`` on the torch backend, forward + backward (logp only, the
training forward's case without an entropy term), with the gradient of the hidden states
and of the LM head weight, at the real shape of issue 20 (V = 151,936, H = 256, one
2,048-token micro-batch: 16 completions of 128 tokens). Two chunk rules, in one process,
interleaved round by round, best of n:

- ``before``: rows = TORCH_CHUNK_BYTES // (4 V) in every pass (82 rows at 48 MiB: the
  backward adds into the [V, H] weight gradient 25 times);
- ``after``: ``fastrl.ops.logprobs.chunk_rows`` as it is (at least H rows in a pass that
  forms the weight gradient: 8 additions).

The rule is swapped by replacing ``chunk_rows`` in the op's module for the duration of a
call (this script's own process; the op reads it at every call). One thread
(``torch.set_num_threads(1)``, OMP/MKL_NUM_THREADS=1); process CPU seconds per call are the
figure to quote on a shared machine (wall seconds are recorded too).

    python benchmarks/bench_logprobs_chunk.py            # writes results/logprobs-chunk-rule-cpu.json

Since 078e6be the backward of ``linear_logprobs`` tiles tokens x vocabulary
(``fastrl.ops.logprobs.backward_tile``) and no longer reads ``chunk_rows``: the two rules
here then differ only in the forward's chunks (``fused_linear_policy_loss`` still uses them);
the results JSON records the rules as they were measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import fastrl.ops.logprobs as lp_mod  # noqa: E402

CURRENT_RULE = lp_mod.chunk_rows


def budget_rule(vocab: int, *, weight_grad_hidden: int = 0) -> int:
    """The rule before issue 20: the byte budget alone, whatever the pass."""
    return max(1, lp_mod.TORCH_CHUNK_BYTES // (4 * max(vocab, 1)))


RULES = {"before": budget_rule, "after": CURRENT_RULE}


def one_call(rule, h, w, y) -> dict[str, float]:
    lp_mod.chunk_rows = rule
    try:
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        cpu0, t0 = time.process_time(), time.perf_counter()
        logp = lp_mod.linear_logprobs(hh, ww, y, backend="torch")
        cpu1, t1 = time.process_time(), time.perf_counter()
        logp.sum().backward()
        cpu2, t2 = time.process_time(), time.perf_counter()
    finally:
        lp_mod.chunk_rows = CURRENT_RULE
    return {"cpu_s": cpu2 - cpu0, "wall_s": t2 - t0, "forward_cpu_s": cpu1 - cpu0, "backward_cpu_s": cpu2 - cpu1,
            "grad_w_checksum": float(ww.grad.double().abs().sum())}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (best of n)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "logprobs-chunk-rule-cpu.json"))
    opts = p.parse_args(argv)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    n, hd, v = opts.tokens, opts.hidden, opts.vocab
    h = torch.randn(n, hd, generator=g)
    w = torch.randn(v, hd, generator=g) * hd**-0.5
    y = torch.randint(0, v, (n,), generator=g)
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in RULES}
    for r in range(opts.repeats):
        for name in (list(RULES) if r % 2 == 0 else list(RULES)[::-1]):  # A B, B A, ...
            runs[name].append(one_call(RULES[name], h, w, y))
            print(f"round {r} {name:6s} cpu {runs[name][-1]['cpu_s']:.2f}s wall {runs[name][-1]['wall_s']:.2f}s", flush=True)
    best = {k: min(x, key=lambda e: e["cpu_s"]) for k, x in runs.items()}
    rows = {k: {"forward_rows": RULES[k](v), "backward_rows": RULES[k](v, weight_grad_hidden=hd)} for k in RULES}
    for k in rows:
        rows[k]["weight_grad_additions"] = -(-n // rows[k]["backward_rows"])
        rows[k]["backward_chunk_buffer_mib"] = rows[k]["backward_rows"] * v * 4 / 2**20
    checks = {k: b["grad_w_checksum"] for k, b in best.items()}
    record = {
        "benchmark": "linear_logprobs torch path, forward + backward (logp, grad hidden + weight): chunk rule before/after",
        "command": "python " + " ".join([os.path.relpath(os.path.abspath(__file__), ROOT)] + (argv if argv is not None else sys.argv[1:])),
        "environment": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                        "cpu_count": os.cpu_count(), "load_average_at_end": list(os.getloadavg())},
        "shape": {"tokens": n, "hidden": hd, "vocab": v, "chunk_budget_mib": lp_mod.TORCH_CHUNK_BYTES / 2**20},
        "rows": rows, "best_of_n": best, "runs": runs,
        "after_over_before_cpu": best["after"]["cpu_s"] / best["before"]["cpu_s"],
        "after_over_before_backward_cpu": best["after"]["backward_cpu_s"] / best["before"]["backward_cpu_s"],
        "grad_w_checksums_agree_rel": abs(checks["after"] - checks["before"]) / checks["before"],
        "note": "shared, loaded 2-core CPU: process CPU seconds per call, best of n interleaved rounds",
    }
    os.makedirs(os.path.dirname(os.path.abspath(opts.out)), exist_ok=True)
    with open(opts.out, "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps({k: record[k] for k in ("rows", "after_over_before_cpu", "after_over_before_backward_cpu")}))
    print(f"wrote {opts.out}")
    return record


if __name__ == "__main__":
    main()
