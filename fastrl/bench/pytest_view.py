"""The pytest-benchmark view of the ``fastrl bench`` cases (used by ``benchmarks/test_bench_*.py``).

Quick shapes by default; ``FASTRL_BENCH_FULL=1`` runs the full ones.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from fastrl.bench.harness import BenchCase

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def bench_cases(module_name: str) -> list[BenchCase]:
    quick = os.environ.get("FASTRL_BENCH_FULL", "0") in ("", "0")
    return importlib.import_module(f"fastrl.bench.{module_name}").cases(DEVICE, quick=quick)


def bench_params(module_name: str) -> list:
    """One pytest param per (case, implementation), ids like ``gae[B=64 T=1024]-fastrl``."""
    return [pytest.param(case, impl, id=f"{case.op}[{case.shape}]-{impl}") for case in bench_cases(module_name) for impl in case.impls]


def run_benchmark(benchmark, case: BenchCase, impl: str) -> None:
    fn = case.impls[impl]

    def run():
        out = fn()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        return out

    benchmark.group = f"{case.op} {case.shape}"
    benchmark.extra_info.update(op=case.op, shape=case.shape, impl=impl, device=str(DEVICE), note=case.note)
    benchmark.pedantic(run, rounds=case.repeats, iterations=1, warmup_rounds=1)
