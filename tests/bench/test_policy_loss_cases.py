"""The benchmark's baselines (TRL's and verl's eager losses, written out) compute the same loss
and gradient as the fastrl configuration they are compared with: a ratio is only meaningful
between implementations of one formula."""

import pytest
import torch

from fastrl.bench.cases_policy_loss import cases

CASES = cases(torch.device("cpu"), quick=True)[:5]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.op)
def test_baselines_agree_with_fastrl(case):
    loss, grad = case.impls[case.fastrl]()
    for name, fn in case.impls.items():
        bl, bg = fn()
        torch.testing.assert_close(bl.float(), loss.float(), rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        # atol 1e-6: an eager k3 gradient -(exp(d) - 1) carries fp32's rounding of exp(d) near 1
        # (~1e-7, times grad_out); fastrl's k3 is exact to fp32 relative precision
        torch.testing.assert_close(bg.float(), grad.float(), rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
