"""The policy's AdamW: torch's fused kernel on CPU (no full-size temporaries), the same update
as the default one-tensor-at-a-time AdamW up to float rounding."""

from __future__ import annotations

import torch

from fastrl.train import TrainConfig
from fastrl.train.optimizers import build_optimizers, fused_adamw
from fastrl.train.task import char_tokenizer, tiny_model


def test_policy_adamw_is_fused_on_cpu_and_steps_like_the_default_adamw():
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1, adam_betas=[0.8, 0.99], steps=4).resolved(model_given=True)
    a = tiny_model(char_tokenizer(), hidden_size=32, layers=1, seed=0)
    b = tiny_model(char_tokenizer(), hidden_size=32, layers=1, seed=0)
    opt = build_optimizers(cfg, a, None).optimizer
    assert opt.defaults["fused"] is True and fused_adamw(list(a.parameters()))
    plain = torch.optim.AdamW(b.parameters(), lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, foreach=False)
    ids = torch.randint(3, 40, (3, 8))
    for _ in range(3):
        for model, o in ((a, opt), (b, plain)):
            o.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
            o.step()
    start = tiny_model(char_tokenizer(), hidden_size=32, layers=1, seed=0).state_dict()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert not torch.equal(pa, start[name]), name  # it moved (lr 1e-2 x 3 steps)
        torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6, msg=name)
    assert set(opt.state_dict()["state"][0]) == set(plain.state_dict()["state"][0])  # step, exp_avg, exp_avg_sq: checkpoints load either way


def test_fused_adamw_rule():
    assert not fused_adamw([])
    assert fused_adamw([torch.zeros(2, requires_grad=True)])
    assert not fused_adamw([torch.zeros(2, dtype=torch.long)])
