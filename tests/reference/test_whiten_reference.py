"""fastrl.reference.whiten against hand-computed cases and a literal Python loop."""

from __future__ import annotations

import math
import random

import pytest
import torch

from fastrl.reference.whiten import masked_whiten_reference


def loop_whiten(x: list[float], mask: list[int], shift_mean: bool, eps: float) -> list[float]:
    vals = [a for a, m in zip(x, mask) if m]
    n = len(vals)
    mu = sum(vals) / n if n else 0.0
    var = sum((a - mu) ** 2 for a in vals) / (n - 1) if n > 1 else 0.0
    out = []
    for a, m in zip(x, mask):
        y = (a - mu) / math.sqrt(var + eps) + (0.0 if shift_mean else mu)
        out.append(y if m else 0.0)
    return out


def test_hand_computed():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0], dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 0])
    # masked mean 2, unbiased variance 1
    torch.testing.assert_close(masked_whiten_reference(x, mask, eps=0.0), torch.tensor([-1.0, 0.0, 1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(
        masked_whiten_reference(x, mask, shift_mean=False, eps=0.0), torch.tensor([1.0, 2.0, 3.0, 0.0], dtype=torch.float64)
    )


@pytest.mark.parametrize("shift_mean", [True, False])
def test_matches_python_loop(shift_mean):
    rng = random.Random(4)
    x = [rng.gauss(3, 2) for _ in range(30)]
    mask = [int(rng.random() > 0.4) for _ in range(30)]
    y = masked_whiten_reference(torch.tensor(x, dtype=torch.float64).reshape(5, 6), torch.tensor(mask).reshape(5, 6), shift_mean=shift_mean)
    torch.testing.assert_close(y.reshape(-1), torch.tensor(loop_whiten(x, mask, shift_mean, 1e-8), dtype=torch.float64))


def test_degenerate_counts():
    x = torch.tensor([5.0, 7.0], dtype=torch.float64)
    assert torch.equal(masked_whiten_reference(x, torch.tensor([0, 1])), torch.zeros(2, dtype=torch.float64))
    assert torch.equal(masked_whiten_reference(x, torch.tensor([0, 0])), torch.zeros(2, dtype=torch.float64))


def test_gradcheck():
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(3, 5) > 0.3
    for shift in (True, False):
        assert torch.autograd.gradcheck(lambda t: masked_whiten_reference(t, mask, shift_mean=shift), (x,))
