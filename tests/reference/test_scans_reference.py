"""The reference scans against hand-computed cases and a second, literal implementation."""

from __future__ import annotations

import statistics

import pytest
import torch

from fastrl.reference.scans import discounted_returns, gae, masked_whiten_unbiased


def _t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_gae_hand_computed_all_masked_in():
    # gamma = lam = 0.5, so gamma*lam = 0.25.
    # t=2: delta = 2 + 0.5*0 - 0 = 2               A = 2
    # t=1: delta = 0 + 0.5*0 - 1 = -1              A = -1 + 0.25*2 = -0.5
    # t=0: delta = 1 + 0.5*1 - 0.5 = 1             A = 1 + 0.25*(-0.5) = 0.875
    adv, ret = gae(_t([[1.0, 0.0, 2.0]]), _t([[0.5, 1.0, 0.0]]), torch.ones(1, 3), gamma=0.5, lam=0.5)
    torch.testing.assert_close(adv, _t([[0.875, -0.5, 2.0]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, _t([[1.375, 0.5, 2.0]]), rtol=0, atol=1e-12)


def test_gae_hand_computed_observation_token_in_the_middle():
    # mask = [1, 1, 0, 1]: token 2 is a tool output; gamma = 0.9, lam = 0.5 (gamma*lam = 0.45).
    # t=3: delta = 2 + 0 - 3 = -1                  A3 = -1          (V_next=3, A_next=-1)
    # t=2: masked out                              A2 = 0           (state carries over; V=9, r=5 unused)
    # t=1: delta = 1 + 0.9*3 - 2 = 1.7             A1 = 1.7 + 0.45*(-1) = 1.25
    # t=0: delta = 0 + 0.9*2 - 1 = 0.8             A0 = 0.8 + 0.45*1.25 = 1.3625
    r, v, m = _t([[0.0, 1.0, 5.0, 2.0]]), _t([[1.0, 2.0, 9.0, 3.0]]), torch.tensor([[1, 1, 0, 1]])
    adv, ret = gae(r, v, m, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, _t([[1.3625, 1.25, 0.0, -1.0]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, _t([[2.3625, 3.25, 0.0, 2.0]]), rtol=0, atol=1e-12)


def test_discounted_returns_hand_computed_with_hole_and_padding():
    # mask = [1, 1, 0, 1, 0]; gamma = 0.9.
    # t=4: padding -> 0; t=3: G = 2; t=2: hole -> 0 (G_next stays 2);
    # t=1: G = 1 + 0.9*2 = 2.8; t=0: G = 0 + 0.9*2.8 = 2.52
    r = _t([[0.0, 1.0, 5.0, 2.0, 7.0]])
    m = torch.tensor([[True, True, False, True, False]])
    torch.testing.assert_close(
        discounted_returns(r, m, gamma=0.9), _t([[2.52, 2.8, 0.0, 2.0, 0.0]]), rtol=0, atol=1e-12
    )


def test_padding_and_fully_masked_rows_are_zero():
    r, v = _t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), _t([[0.5, 0.5, 0.5], [1.0, 1.0, 1.0]])
    m = torch.tensor([[1, 1, 0], [0, 0, 0]])
    adv, ret = gae(r, v, m, gamma=1.0, lam=1.0)
    # Row 0, gamma = lam = 1: A1 = 2 - 0.5 = 1.5; A0 = 1 + 0.5 - 0.5 + 1.5 = 2.5.
    torch.testing.assert_close(adv, _t([[2.5, 1.5, 0.0], [0.0, 0.0, 0.0]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, _t([[3.0, 2.0, 0.0], [0.0, 0.0, 0.0]]), rtol=0, atol=1e-12)
    assert discounted_returns(r, m, gamma=0.5)[1].abs().sum() == 0


def test_whiten_hand_computed_unbiased():
    r, v, m = _t([[0.0, 1.0, 5.0, 2.0]]), _t([[1.0, 2.0, 9.0, 3.0]]), torch.tensor([[1, 1, 0, 1]])
    adv, _ = gae(r, v, m, gamma=0.9, lam=0.5, whiten=True)
    raw = [1.3625, 1.25, -1.0]
    mu, sd = statistics.mean(raw), statistics.stdev(raw)  # stdev: n - 1 in the denominator
    expect = [(x - mu) / (sd**2 + 1e-8) ** 0.5 for x in raw]
    torch.testing.assert_close(adv, _t([[expect[0], expect[1], 0.0, expect[2]]]), rtol=0, atol=1e-12)


def test_whiten_degenerate_batches_are_zero():
    x = _t([[3.0, 4.0]])
    assert masked_whiten_unbiased(x, torch.tensor([[1, 0]])).abs().sum() == 0  # one token
    assert masked_whiten_unbiased(x, torch.tensor([[0, 0]])).abs().sum() == 0  # none


# A second, literal implementation: pull out each row's masked-in tokens, run the textbook
# recursion on plain Python floats, put the results back.
def _gae_compressed(r, v, m, gamma, lam):
    adv = [[0.0] * len(row) for row in r]
    ret = [[0.0] * len(row) for row in r]
    for b in range(len(r)):
        idx = [t for t in range(len(r[b])) if m[b][t]]
        a_next = v_next = 0.0
        for t in reversed(idx):
            a_next = r[b][t] + gamma * v_next - v[b][t] + gamma * lam * a_next
            v_next = v[b][t]
            adv[b][t], ret[b][t] = a_next, a_next + v[b][t]
    return adv, ret


def _returns_compressed(r, m, gamma):
    out = [[0.0] * len(row) for row in r]
    for b in range(len(r)):
        g = 0.0
        for t in reversed([t for t in range(len(r[b])) if m[b][t]]):
            g = r[b][t] + gamma * g
            out[b][t] = g
    return out


@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (1.0, 1.0), (0.0, 0.7), (0.6, 0.0)])
def test_reference_matches_second_implementation(gamma, lam):
    gen = torch.Generator().manual_seed(1)
    B, T = 5, 37
    r = torch.randn(B, T, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, generator=gen, dtype=torch.float64)
    m = torch.rand(B, T, generator=gen) > 0.35
    m[1] = False
    m[2, 1:] = False
    adv, ret = gae(r, v, m, gamma=gamma, lam=lam)
    e_adv, e_ret = _gae_compressed(r.tolist(), v.tolist(), m.tolist(), gamma, lam)
    torch.testing.assert_close(adv, _t(e_adv), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, _t(e_ret), rtol=1e-12, atol=1e-12)
    g = discounted_returns(r, m, gamma=gamma)
    torch.testing.assert_close(g, _t(_returns_compressed(r.tolist(), m.tolist(), gamma)), rtol=1e-12, atol=1e-12)


def test_closed_forms():
    gen = torch.Generator().manual_seed(2)
    r = torch.randn(3, 20, generator=gen, dtype=torch.float64)
    v = torch.randn(3, 20, generator=gen, dtype=torch.float64)
    m = torch.rand(3, 20, generator=gen) > 0.3
    mf = m.to(torch.float64)
    # gamma = 0: A = r - V (one-step, no bootstrap).
    adv, _ = gae(r, v, m, gamma=0.0, lam=0.3)
    torch.testing.assert_close(adv, (r - v) * mf)
    # gamma = lam = 1: A = (sum of masked-in rewards from t on) - V.
    adv, ret = gae(r, v, m, gamma=1.0, lam=1.0)
    togo = (r * mf).flip(1).cumsum(1).flip(1)
    torch.testing.assert_close(adv, (togo - v) * mf)
    torch.testing.assert_close(ret, togo * mf)
    torch.testing.assert_close(discounted_returns(r, m, gamma=1.0), togo * mf)


def test_dtype_rules():
    r = torch.randn(2, 5, dtype=torch.bfloat16)
    adv, ret = gae(r, r, torch.ones(2, 5), gamma=0.9, lam=0.9)
    assert adv.dtype == ret.dtype == torch.float32
    assert gae(r.double(), r.double(), torch.ones(2, 5), gamma=0.9, lam=0.9)[0].dtype == torch.float64
