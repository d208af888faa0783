"""pytest-benchmark view of fastrl.bench.cases_scans (same case builders as ``fastrl bench``).

Run: ``python -m pytest benchmarks/test_bench_scans.py --benchmark-only`` (quick shapes;
``FASTRL_BENCH_FULL=1`` adds B=64, T=8192, the acceptance shape). fastrl's GAE and
discounted returns share a benchmark group with the Python-loop-over-T baselines.
"""

import pytest

from fastrl.bench.pytest_view import bench_params, run_benchmark


@pytest.mark.parametrize("case, impl", bench_params("cases_scans"))
def test_bench(benchmark, case, impl):
    run_benchmark(benchmark, case, impl)
