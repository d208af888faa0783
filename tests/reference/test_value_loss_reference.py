"""fastrl.reference.value_loss against hand-computed cases and a literal Python loop."""

from __future__ import annotations

import random

import pytest
import torch

from fastrl.config import LOSS_AGGS
from fastrl.reference.value_loss import aggregate_reference, value_loss_reference


def loop_value_loss(v, v_old, R, mask, clip, loss_agg, norm_length=None):
    """Per-token PPO value loss and its aggregation, one Python float at a time."""
    B, T = len(v), len(v[0])
    rows = []
    for b in range(B):
        terms = []
        for t in range(T):
            if not mask[b][t]:
                continue
            l1 = (v[b][t] - R[b][t]) ** 2
            if clip is None:
                terms.append(0.5 * l1)
            else:
                vc = v_old[b][t] + min(max(v[b][t] - v_old[b][t], -clip), clip)
                terms.append(0.5 * max(l1, (vc - R[b][t]) ** 2))
        rows.append(terms)
    if loss_agg == "token-mean":
        flat = [x for r in rows for x in r]
        return sum(flat) / max(len(flat), 1)
    nonempty = [r for r in rows if r]
    if loss_agg == "seq-mean-token-mean":
        per = [sum(r) / len(r) for r in nonempty]
    elif loss_agg == "seq-mean-token-sum":
        per = [sum(r) for r in nonempty]
    else:
        per = [sum(r) / (T if norm_length is None else norm_length) for r in nonempty]
    return sum(per) / max(len(nonempty), 1)


def test_hand_computed_clip():
    v = torch.tensor([[1.0, 2.0, 0.1]], dtype=torch.float64, requires_grad=True)
    v_old = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    R = torch.zeros(1, 3, dtype=torch.float64)
    loss, m = value_loss_reference(v, v_old, R, torch.ones(1, 3), clip=0.5)
    # tokens 0, 1: unclipped terms 1 and 4 dominate the clipped (0.5)^2.
    # token 2: v_clip = 1 - 0.5 = 0.5, (0.5)^2 = 0.25 > 0.01: clipped branch, zero gradient.
    assert loss.item() == pytest.approx(0.5 * (1 + 4 + 0.25) / 3)
    assert m["vf_clip_frac"].item() == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(v.grad, torch.tensor([[1 / 3, 2 / 3, 0.0]], dtype=torch.float64))


def test_hand_computed_metrics():
    v = torch.tensor([[1.0, 2.0, 3.0, 7.0]])
    R = torch.tensor([[1.0, 3.0, 5.0, -7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    _, m = value_loss_reference(v, v, R, mask)
    # R - v = [0, 1, 2] (var 2/3), R = [1, 3, 5] (var 8/3)
    assert m["explained_variance"].item() == pytest.approx(1 - (2 / 3) / (8 / 3))
    assert m["value_mean"].item() == pytest.approx(2.0)
    assert m["return_mean"].item() == pytest.approx(3.0)
    assert m["vf_clip_frac"].item() == 0.0


def test_explained_variance_constant_returns_is_zero():
    _, m = value_loss_reference(torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3), torch.ones(2, 3))
    assert m["explained_variance"].item() == 0.0


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
@pytest.mark.parametrize("clip", [None, 0.2])
def test_matches_python_loop(loss_agg, clip):
    rng = random.Random(3)
    B, T = 5, 7
    v = [[rng.gauss(0, 1) for _ in range(T)] for _ in range(B)]
    v_old = [[x + rng.gauss(0, 0.3) for x in row] for row in v]
    R = [[rng.gauss(0, 1) for _ in range(T)] for _ in range(B)]
    mask = [[int(rng.random() > 0.3) for _ in range(T)] for _ in range(B)]
    mask[2] = [0] * T  # a fully masked row
    norm_length = 11.0 if loss_agg == "seq-mean-token-sum-norm" else None
    loss, _ = value_loss_reference(
        torch.tensor(v, dtype=torch.float64), torch.tensor(v_old, dtype=torch.float64), torch.tensor(R, dtype=torch.float64),
        torch.tensor(mask), clip=clip, loss_agg=loss_agg, norm_length=norm_length,
    )
    assert loss.item() == pytest.approx(loop_value_loss(v, v_old, R, mask, clip, loss_agg, norm_length), rel=1e-12)


def test_norm_length_and_global_counts():
    lt = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate_reference(lt, mask, loss_agg="seq-mean-token-sum-norm", norm_length=2.0).item() == pytest.approx((6 / 2 + 4 / 2) / 2)
    with pytest.raises(ValueError, match="norm_length is required"):
        aggregate_reference(lt, mask, loss_agg="seq-mean-token-sum-norm")
    assert aggregate_reference(lt, mask, loss_agg="token-mean", global_token_count=10).item() == pytest.approx(10 / 10)
    assert aggregate_reference(lt, mask, loss_agg="seq-mean-token-mean", global_seq_count=4).item() == pytest.approx((2 + 4) / 4)


def test_all_masked_is_zero():
    loss, m = value_loss_reference(torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3), torch.zeros(2, 3), clip=0.2)
    assert loss.item() == 0.0
    assert all(x.item() == 0.0 for x in m.values())
