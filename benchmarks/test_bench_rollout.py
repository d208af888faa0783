"""pytest-benchmark view of fastrl.bench.cases_rollout (same case builders as ``fastrl bench``).

Run: ``python -m pytest benchmarks/test_bench_rollout.py --benchmark-only`` (quick shape;
``FASTRL_BENCH_FULL=1`` for the full set). HFGroupSampler (each prompt prefilled once)
shares a benchmark group with ``model.generate`` on G copies of the prompt. Prefill tokens
and KV bytes over the full grid: ``benchmarks/bench_rollout.py``.
"""

import pytest

from fastrl.bench.pytest_view import bench_params, run_benchmark


@pytest.mark.parametrize("case, impl", bench_params("cases_rollout"))
def test_bench(benchmark, case, impl):
    run_benchmark(benchmark, case, impl)
