"""pytest-benchmark view of fastrl.bench.cases_turn_advantages (same case builders as ``fastrl bench``).

Run: ``python -m pytest benchmarks/test_bench_turn_advantages.py --benchmark-only``
(``FASTRL_BENCH_FULL=1`` for the full shapes). Each case's implementations share one
benchmark group, so fastrl and its baselines print side by side.
"""

import pytest

from fastrl.bench.pytest_view import bench_params, run_benchmark


@pytest.mark.parametrize("case, impl", bench_params("cases_turn_advantages"))
def test_bench(benchmark, case, impl):
    run_benchmark(benchmark, case, impl)
