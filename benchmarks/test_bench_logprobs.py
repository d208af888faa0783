"""pytest-benchmark view of fastrl.bench.cases_logprobs (same case builders as ``fastrl bench``).

Run: ``python -m pytest benchmarks/test_bench_logprobs.py --benchmark-only`` (quick shapes;
``FASTRL_BENCH_FULL=1`` for the full set). fastrl's fused GRPO loss shares a benchmark
group with the naive logits path, TRL's selective_log_softmax and Liger's fused GRPO loss.
Peak memory (fresh processes) is measured by ``benchmarks/bench_logprobs_memory.py``.
"""

import pytest

from fastrl.bench.pytest_view import bench_params, run_benchmark


@pytest.mark.parametrize("case, impl", bench_params("cases_logprobs"))
def test_bench(benchmark, case, impl):
    run_benchmark(benchmark, case, impl)
