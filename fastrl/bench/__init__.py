"""Side-by-side benchmarks of fastrl ops and the baselines users run today.

Each ``fastrl/bench/cases_*.py`` module exposes ``cases(device, quick) -> list[BenchCase]``.
``fastrl bench`` runs them all and prints one table; ``benchmarks/`` runs the same cases
under pytest-benchmark.
"""

from fastrl.bench.harness import BenchCase, BenchResult, run_case, run_cases, write_results

__all__ = ["BenchCase", "BenchResult", "run_case", "run_cases", "write_results"]
