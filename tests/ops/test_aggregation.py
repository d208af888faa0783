"""``fastrl.ops.aggregate_loss``: the house aggregation rule, against the reference policy
loss's aggregation (a k1 KL term of coefficient 1 aggregates ``logp - ref_logp`` exactly)."""

from __future__ import annotations

import pytest
import torch

from fastrl import PolicyLossConfig
from fastrl.ops import aggregate_loss
from fastrl.reference.policy_loss import policy_loss_reference

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def _batch(B=5, T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.tensor([T, 1, 0, 4, T - 2][:B])
    mask = (torch.arange(T)[None] < lengths[:, None]).to(torch.float32)
    return x, mask


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("count", [None, 7.0, 0])
def test_matches_reference_aggregation(agg, count):
    x, mask = _batch()
    norm = 16.0 if agg.endswith("-norm") else None
    counts = {} if count is None else {("global_token_count" if agg == "token-mean" else "global_seq_count"): count}
    cfg = PolicyLossConfig(kl_coef=1.0, kl_estimator="k1", loss_agg=agg, norm_length=norm)
    zeros = torch.zeros_like(x)
    _, metrics = policy_loss_reference(zeros, zeros, zeros, mask, ref_logp=-x, config=cfg, **counts)
    x = x.clone().requires_grad_()
    got = aggregate_loss(x, mask, loss_agg=agg, norm_length=norm, **counts)
    torch.testing.assert_close(got.detach(), metrics["kl_loss"], rtol=1e-12, atol=1e-12)
    (grad,) = torch.autograd.grad(got, x)
    assert torch.all(grad[mask == 0] == 0)


def test_padding_garbage_row_broadcast_and_errors():
    x, mask = _batch()
    dirty = x.clone()
    dirty[mask == 0] = float("nan")
    clean = aggregate_loss(x, mask, loss_agg="seq-mean-token-mean")
    assert torch.equal(aggregate_loss(dirty, mask, loss_agg="seq-mean-token-mean"), clean)
    row = torch.randn(x.shape[0], 1, dtype=torch.float64)
    torch.testing.assert_close(aggregate_loss(row, mask, loss_agg="token-mean"),
                               aggregate_loss(row.expand_as(x), mask, loss_agg="token-mean"))
    assert aggregate_loss(x, torch.zeros_like(mask)) == 0
    with pytest.raises(ValueError, match="norm_length"):
        aggregate_loss(x, mask, loss_agg="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="global_seq_count"):
        aggregate_loss(x, mask, loss_agg="token-mean", global_seq_count=3)
    with pytest.raises(ValueError, match="loss_mat"):
        aggregate_loss(x[:, :3], mask)
