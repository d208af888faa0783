import math

import pytest
import torch

from fastrl.train.schedule import AdaptiveKLController, warmup_cosine


def test_warmup_then_cosine_to_the_floor():
    p = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = warmup_cosine(opt, total_steps=10, warmup_steps=2, min_lr_ratio=0.1)
    lrs = []
    for _ in range(10):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.5) and lrs[1] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
    # halfway through the decay: the midpoint between 1 and the floor
    assert lrs[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 8)))
    assert sched.get_last_lr()[0] == pytest.approx(0.1)


def test_adaptive_kl_moves_toward_the_target_and_is_bounded():
    ctl = AdaptiveKLController(0.1, target=1.0, horizon=100)
    assert ctl.update(10.0, 10) == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))  # error clipped at +0.2
    v = ctl.value
    assert ctl.update(0.5, 10) == pytest.approx(v * (1 - 0.2 * 10 / 100))  # e = -0.5, clipped to -0.2
    fixed = AdaptiveKLController(0.1, target=None, horizon=100)
    assert fixed.update(100.0, 10) == 0.1
    assert ctl.update(float("nan"), 10) == ctl.value
