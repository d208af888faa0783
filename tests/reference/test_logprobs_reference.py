import math

import pytest
import torch

from fastrl.reference.logprobs import linear_logprobs_loop, linear_logprobs_reference


def test_hand_computed_two_token_vocab():
    # one token, H=1, V=2: logits (2, -1) -> logp(0) = -log(1 + e^-3)
    h = torch.tensor([[1.0]], dtype=torch.float64)
    w = torch.tensor([[2.0], [-1.0]], dtype=torch.float64)
    logp, ent = linear_logprobs_reference(h, w, torch.tensor([0]))
    p0 = 1 / (1 + math.exp(-3))
    assert logp.item() == pytest.approx(-math.log(1 + math.exp(-3)), abs=1e-12)
    assert ent.item() == pytest.approx(-(p0 * math.log(p0) + (1 - p0) * math.log(1 - p0)), abs=1e-12)


def test_uniform_distribution_entropy_is_log_v():
    h = torch.randn(4, 3, dtype=torch.float64)
    w = torch.zeros(7, 3, dtype=torch.float64)
    logp, ent = linear_logprobs_reference(h, w, torch.tensor([0, 3, 6, 2]))
    torch.testing.assert_close(logp, torch.full((4,), -math.log(7), dtype=torch.float64))
    torch.testing.assert_close(ent, torch.full((4,), math.log(7), dtype=torch.float64))


def test_matches_python_loop_with_bias_temperature_and_ignore():
    h = torch.randn(2, 3, 5, dtype=torch.float64)
    w = torch.randn(11, 5, dtype=torch.float64)
    b = torch.randn(11, dtype=torch.float64)
    y = torch.randint(0, 11, (2, 3))
    y[1, 2] = -100
    logp, ent = linear_logprobs_reference(h, w, y, bias=b, temperature=0.6)
    lp_loop, ent_loop = linear_logprobs_loop(h, w, y, bias=b, temperature=0.6)
    torch.testing.assert_close(logp.reshape(-1), torch.tensor(lp_loop, dtype=torch.float64))
    torch.testing.assert_close(ent.reshape(-1), torch.tensor(ent_loop, dtype=torch.float64))
    assert logp[1, 2].item() == 0.0 and ent[1, 2].item() == 0.0


def test_custom_ignore_index_and_float32_out_for_bf16():
    h = torch.randn(3, 4).bfloat16()
    w = torch.randn(6, 4).bfloat16()
    logp, ent = linear_logprobs_reference(h, w, torch.tensor([1, 5, 2]), ignore_index=5)
    assert logp.dtype == torch.float32 and logp[1].item() == 0.0 and ent[1].item() == 0.0
    assert (logp[[0, 2]] < 0).all()
