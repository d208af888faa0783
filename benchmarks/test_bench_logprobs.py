"""pytest-benchmark view of fastrl.bench.cases_logprobs (same case builders as ``fastrl bench``).

Run: ``python -m pytest benchmarks/test_bench_logprobs.py --benchmark-only`` (quick shapes;
``FASTRL_BENCH_FULL=1`` for the full set). fastrl's fused GRPO loss shares a benchmark
group with the naive logits path, TRL's selective_log_softmax and Liger's fused GRPO loss.
Peak memory (fresh processes) is measured by ``benchmarks/bench_logprobs_memory.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

from fastrl.bench.cases_logprobs import cases

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
QUICK = os.environ.get("FASTRL_BENCH_FULL", "0") in ("", "0")
CASES = cases(DEVICE, quick=QUICK)
PARAMS = [pytest.param(case, impl, id=f"{case.op}[{case.shape}]-{impl}") for case in CASES for impl in case.impls]


@pytest.mark.parametrize("case, impl", PARAMS)
def test_bench(benchmark, case, impl):
    fn = case.impls[impl]

    def run():
        out = fn()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        return out

    benchmark.group = f"{case.op} {case.shape}"
    benchmark.extra_info.update(op=case.op, shape=case.shape, impl=impl, device=str(DEVICE))
    benchmark.pedantic(run, rounds=case.repeats, iterations=1, warmup_rounds=1)
