"""pytest-benchmark: policy_loss / kl_penalty (fwd+bwd) vs the TRL and verl eager losses.

Run: ``python -m pytest benchmarks/test_bench_policy_loss.py --benchmark-only`` (quick
shapes; ``FASTRL_BENCH_FULL=1`` for the full ones). Each group holds one case's impls side
by side. On a shared CPU, ``OMP_NUM_THREADS=1`` and ``--benchmark-timer time.process_time``
measure CPU time instead of waiting time. The same case builders feed ``fastrl bench``;
``test_baselines_agree_with_fastrl`` checks that each baseline computes the loss (and the
gradient) the fastrl entry is configured for.
"""

import os

import pytest
import torch

from fastrl.bench.cases_policy_loss import cases

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CASES = cases(DEVICE, quick=not os.environ.get("FASTRL_BENCH_FULL"))
PARAMS = [pytest.param(c, name, id=f"{c.op}-{c.shape.replace(' ', '')}-{name}") for c in CASES for name in c.impls]


def _sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("case,impl", PARAMS)
def test_bench(benchmark, case, impl):
    fn = case.impls[impl]
    benchmark.group = f"{case.op} {case.shape}"

    def call():
        out = fn()
        _sync()
        return out

    call()  # warm-up (Triton compile)
    benchmark(call)


@pytest.mark.parametrize("case", CASES[:5], ids=lambda c: c.op)
def test_baselines_agree_with_fastrl(case):
    loss, grad = case.impls[case.fastrl]()
    for name, fn in case.impls.items():
        bl, bg = fn()
        torch.testing.assert_close(bl.float(), loss.float(), rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(bg.float(), grad.float(), rtol=1e-4, atol=1e-7, msg=lambda m: f"{name}: {m}")
