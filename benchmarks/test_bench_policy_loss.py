"""pytest-benchmark: policy_loss / kl_penalty (fwd+bwd) vs the TRL and verl eager losses.

Run: ``python -m pytest benchmarks/test_bench_policy_loss.py --benchmark-only`` (quick
shapes; ``FASTRL_BENCH_FULL=1`` for the full ones). Each group holds one case's impls side
by side. On a shared CPU, ``OMP_NUM_THREADS=1`` and ``--benchmark-timer time.process_time``
measure CPU time instead of waiting time. The same case builders feed ``fastrl bench``;
``tests/bench/test_policy_loss_cases.py`` checks that each baseline computes the loss (and the
gradient) the fastrl entry is configured for.
"""

import pytest

from fastrl.bench.pytest_view import bench_params, run_benchmark

@pytest.mark.parametrize("case, impl", bench_params("cases_policy_loss"))
def test_bench(benchmark, case, impl):
    run_benchmark(benchmark, case, impl)
