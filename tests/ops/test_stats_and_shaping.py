"""The step statistics (``fastrl.ops.stats``) and reward shaping (``fastrl.ops.shaping``)
against their references, on hand-computed cases and random ones."""

from __future__ import annotations

import math

import pytest
import torch

from fastrl.ops.shaping import sequence_rewards, token_rewards
from fastrl.ops.stats import every_kth, explained_variance, masked_mean_std, pooled_mean_std, sampled_mean
from fastrl.reference.shaping import sequence_rewards_reference, token_rewards_reference
from fastrl.reference.stats import (
    every_kth_reference, explained_variance_reference, masked_mean_std_reference, pooled_mean_std_reference,
    sampled_mean_reference,
)


def test_token_rewards_by_hand():
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    outcome = torch.tensor([2.0, -1.0, 5.0])
    kl = torch.tensor([[0.0, 0.5, 1.0, 0.0], [0.25, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    expected = torch.tensor([[0.0, 0.0, 2.0, 0.0], [-1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(token_rewards(outcome, mask), expected)
    shaped = expected - 0.1 * kl
    torch.testing.assert_close(token_rewards(outcome, mask, token_kl=kl, kl_coef=0.1), shaped)
    torch.testing.assert_close(token_rewards_reference(outcome, mask, token_kl=kl, kl_coef=0.1), shaped)
    torch.testing.assert_close(sequence_rewards(outcome, token_kl=kl, kl_coef=0.1), torch.tensor([1.85, -1.025, 5.0]))
    assert sequence_rewards(outcome) is outcome


@pytest.mark.parametrize("seed", range(3))
def test_shaping_matches_the_reference(seed):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(6, 9, generator=g) > 0.4).float()
    outcome, kl = torch.randn(6, generator=g), torch.randn(6, 9, generator=g) * mask
    torch.testing.assert_close(token_rewards(outcome, mask, token_kl=kl, kl_coef=0.3),
                               token_rewards_reference(outcome, mask, token_kl=kl, kl_coef=0.3))
    torch.testing.assert_close(sequence_rewards(outcome, token_kl=kl, kl_coef=0.3),
                               sequence_rewards_reference(outcome, token_kl=kl, kl_coef=0.3))


def test_shaping_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="token_kl"):
        token_rewards(torch.zeros(2), torch.ones(2, 3), token_kl=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="outcome"):
        token_rewards(torch.zeros(3), torch.ones(2, 3))


def test_masked_mean_std_by_hand_and_against_the_reference():
    x = torch.tensor([[1.0, 3.0, 100.0], [5.0, 7.0, -50.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    mean, std = masked_mean_std(x, mask)
    assert float(mean) == 4.0 and float(std) == pytest.approx(math.sqrt(5.0))
    g = torch.Generator().manual_seed(0)
    x, mask = torch.randn(5, 7, generator=g), (torch.rand(5, 7, generator=g) > 0.5).float()
    mean, std = masked_mean_std(x, mask)
    ref_mean, ref_std = masked_mean_std_reference(x, mask)
    assert float(mean) == pytest.approx(ref_mean, abs=1e-6) and float(std) == pytest.approx(ref_std, abs=1e-6)
    # the all-reduce hook sees exactly the partial sums: doubling them (two equal ranks) keeps the statistics
    twice = masked_mean_std(x, mask, all_reduce=lambda t: 2 * t)
    torch.testing.assert_close(torch.stack(twice), torch.stack([mean, std]))
    assert [float(v) for v in masked_mean_std(x, torch.zeros_like(mask))] == [0.0, 0.0]


def test_every_kth_by_hand_and_against_the_reference():
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    assert every_kth(mask, 2).tolist() == [[False, True, False, False], [True, False, True, False]]
    assert every_kth(mask, 1).tolist() == (mask != 0).tolist() and not every_kth(0 * mask, 3).any()
    g = torch.Generator().manual_seed(1)
    for k in (1, 3, 7):
        m = (torch.rand(6, 11, generator=g) < 0.6).float()
        assert every_kth(m, k).reshape(-1).tolist() == every_kth_reference(m, k)
    with pytest.raises(ValueError, match="k must be an int >= 1"):
        every_kth(mask, 0)


def test_sampled_mean_by_hand_and_against_the_reference():
    nan = float("nan")
    x = torch.tensor([[1.0, nan, 3.0], [nan, 8.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert float(sampled_mean(x, mask)) == (1.0 + 3.0 + 8.0) / 3 == sampled_mean_reference(x, mask)
    assert math.isnan(float(sampled_mean(x, torch.zeros_like(mask)))) and math.isnan(sampled_mean_reference(x, 0 * mask))
    g = torch.Generator().manual_seed(0)
    y = torch.randn(5, 9, generator=g).masked_fill(torch.rand(5, 9, generator=g) < 0.4, nan)
    m = (torch.rand(5, 9, generator=g) < 0.7).float()
    assert float(sampled_mean(y, m)) == pytest.approx(sampled_mean_reference(y, m), rel=1e-6)


def test_pooled_mean_std_equals_the_statistics_of_the_union():
    shards = [torch.tensor([1.0, 2.0, 6.0]), torch.tensor([-3.0, 0.0, 9.0])]
    means = [float(s.mean()) for s in shards]
    stds = [float(s.std(unbiased=False)) for s in shards]
    union = torch.cat(shards)
    mean, std = pooled_mean_std(sum(means), sum(s * s + m * m for m, s in zip(means, stds)), shards=2)
    assert mean == pytest.approx(float(union.mean())) and std == pytest.approx(float(union.std(unbiased=False)))
    assert (mean, std) == pytest.approx(pooled_mean_std_reference(means, stds))
    assert pooled_mean_std(2.0, 2.0 - 1e-12, shards=2) == (1.0, 0.0)  # rounding below zero clamps


def test_explained_variance_against_the_reference():
    g = torch.Generator().manual_seed(1)
    r, v = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    assert float(explained_variance(v, r, mask)) == pytest.approx(explained_variance_reference(v, r, mask), abs=1e-5)
    assert float(explained_variance(r, r, mask)) == 1.0 == explained_variance_reference(r, r, mask)
    flat = torch.ones(2, 3)
    assert math.isnan(float(explained_variance(flat, flat, flat))) and math.isnan(explained_variance_reference(flat, flat, flat))
    assert float(explained_variance(r[:2, :3], flat, flat)) == float("-inf") == explained_variance_reference(r[:2, :3], flat, flat)
    assert math.isnan(float(explained_variance(v, r, torch.zeros_like(mask))))
