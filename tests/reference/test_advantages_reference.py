"""fastrl.reference.advantages against hand-computed cases and literal Python loops."""

from __future__ import annotations

import math
import random
import statistics
from collections import defaultdict

import pytest
import torch

from fastrl.reference.advantages import GROUP_MODES, group_advantages_reference, step_advantages_reference


def loop_group_advantages(rewards: list[float], ids: list[int], mode: str, eps: float) -> list[float]:
    """The formulas written as a loop over samples with a dict of groups (verl's style)."""
    groups: dict[int, list[float]] = defaultdict(list)
    for r, g in zip(rewards, ids):
        groups[g].append(r)
    batch_std = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
    out = []
    for r, g in zip(rewards, ids):
        members = groups[g]
        n = len(members)
        if n == 1:
            out.append(0.0)
            continue
        mean = sum(members) / n
        std = statistics.stdev(members)
        if mode == "grpo":
            out.append((r - mean) / (std + eps))
        elif mode in ("dr_grpo", "reinforce_pp"):
            out.append(r - mean)
        elif mode == "batch_std":
            out.append((r - mean) / (batch_std + eps))
        elif mode == "group_mean_batch_std_floor":
            out.append((r - mean) / (max(std, 0.1 * batch_std) + eps))
        elif mode == "rloo":
            out.append(r - (sum(members) - r) / (n - 1))
    if mode == "reinforce_pp":
        m = sum(out) / len(out)
        s = statistics.stdev(out) if len(out) > 1 else 0.0
        out = [(a - m) / (s + eps) for a in out]
    return out


def loop_step_advantages(step_rewards, step_end, ids, mask, eps):
    """Process-reward advantages as nested loops over Python lists."""
    groups: dict[int, list[float]] = defaultdict(list)
    for b, g in enumerate(ids):
        for r, e in zip(step_rewards[b], step_end[b]):
            if e >= 0:
                groups[g].append(r)
    out = []
    for b, g in enumerate(ids):
        vals = groups[g]
        mean = sum(vals) / len(vals) if vals else 0.0
        std = statistics.stdev(vals) if len(vals) > 1 else 0.0
        row = []
        for t in range(len(mask[b])):
            a = sum((r - mean) / (std + eps) for r, e in zip(step_rewards[b], step_end[b]) if e >= t)
            row.append(a if mask[b][t] else 0.0)
        out.append(row)
    return out


# rewards [1, 0, 0, 0 | 5]: group 2 has mean 0.25 and unbiased std 0.5; group 9 is a singleton.
HAND_R = [1.0, 0.0, 0.0, 0.0, 5.0]
HAND_IDS = [2, 2, 2, 2, 9]
BATCH_STD = math.sqrt(4.7)  # mean 1.2, squared deviations sum to 18.8, / 4
HAND_EXPECTED = {
    "grpo": [1.5, -0.5, -0.5, -0.5, 0.0],
    "dr_grpo": [0.75, -0.25, -0.25, -0.25, 0.0],
    "batch_std": [x / BATCH_STD for x in (0.75, -0.25, -0.25, -0.25, 0.0)],
    "group_mean_batch_std_floor": [1.5, -0.5, -0.5, -0.5, 0.0],  # std_g 0.5 > 0.1 * 2.17
    "rloo": [1.0, -1 / 3, -1 / 3, -1 / 3, 0.0],
    "reinforce_pp": [x / math.sqrt(0.75 / 4) for x in (0.75, -0.25, -0.25, -0.25, 0.0)],
}


@pytest.mark.parametrize("mode", GROUP_MODES)
def test_group_hand_computed(mode):
    adv, stats = group_advantages_reference(torch.tensor(HAND_R, dtype=torch.float64), torch.tensor(HAND_IDS), mode=mode, eps=1e-12)
    torch.testing.assert_close(adv, torch.tensor(HAND_EXPECTED[mode], dtype=torch.float64), rtol=1e-9, atol=1e-9)
    assert stats["frac_all_equal_groups"].item() == 0.5  # the singleton counts as all-equal
    assert stats["effective_group_ratio"].item() == 0.5
    assert stats["reward_mean"].item() == pytest.approx(1.2)
    assert stats["reward_std"].item() == pytest.approx(BATCH_STD, rel=1e-6)


def test_group_floor_binds():
    # group 0 has a tiny spread; the batch std floor (0.1 * std_B) replaces its std.
    r = [0.0, 0.001, 10.0, 0.0]
    ids = [0, 0, 1, 1]
    adv, _ = group_advantages_reference(torch.tensor(r, dtype=torch.float64), torch.tensor(ids), mode="group_mean_batch_std_floor", eps=1e-6)
    floor = 0.1 * statistics.stdev(r)
    assert adv[0].item() == pytest.approx(-0.0005 / (floor + 1e-6), rel=1e-9)
    expected = loop_group_advantages(r, ids, "group_mean_batch_std_floor", 1e-6)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize("mode", GROUP_MODES)
def test_group_matches_python_loop(mode):
    rng = random.Random(1)
    ids = [rng.choice([-7, 3, 10**15, 42, 5]) for _ in range(40)] + [999]  # a singleton too
    rewards = [rng.choice([0.0, 1.0]) + rng.random() * 0.1 for _ in ids]
    rng.shuffle(ids)
    adv, _ = group_advantages_reference(torch.tensor(rewards, dtype=torch.float64), torch.tensor(ids), mode=mode, eps=1e-6)
    expected = loop_group_advantages(rewards, ids, mode, 1e-6)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=1e-10, atol=1e-10)


def test_group_all_equal():
    adv, stats = group_advantages_reference(torch.ones(6, dtype=torch.float64), torch.tensor([0, 0, 0, 1, 1, 1]), mode="grpo")
    assert torch.equal(adv, torch.zeros(6, dtype=torch.float64))
    assert stats["frac_all_equal_groups"].item() == 1.0


def test_step_hand_computed():
    # one group of two rows; present step rewards [1, 0, 1]: mean 2/3, unbiased std sqrt(1/3)
    step_rewards = torch.tensor([[1.0, 0.0], [1.0, 99.0]], dtype=torch.float64)
    step_end = torch.tensor([[1, 3], [4, -1]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    adv = step_advantages_reference(step_rewards, step_end, torch.tensor([5, 5]), mask, eps=0.0)
    hi, lo = (1 / 3) / math.sqrt(1 / 3), (-2 / 3) / math.sqrt(1 / 3)
    expected = torch.tensor([[hi + lo, hi + lo, lo, lo, 0.0], [hi, hi, hi, hi, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected)


def test_step_matches_python_loop():
    rng = random.Random(2)
    B, S, T = 7, 4, 9
    ids = [rng.choice([1, -3, 8]) for _ in range(B)]
    step_end = [[rng.choice([-1] + list(range(T))) for _ in range(S)] for _ in range(B)]
    step_rewards = [[rng.random() for _ in range(S)] for _ in range(B)]
    mask = [[int(rng.random() > 0.2) for _ in range(T)] for _ in range(B)]
    adv = step_advantages_reference(
        torch.tensor(step_rewards, dtype=torch.float64), torch.tensor(step_end), torch.tensor(ids), torch.tensor(mask), eps=1e-6
    )
    expected = loop_step_advantages(step_rewards, step_end, ids, mask, 1e-6)
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=1e-10, atol=1e-10)


def test_step_single_step_group_and_stepless_row():
    adv = step_advantages_reference(
        torch.tensor([[3.0, 0.0], [1.0, 2.0]]), torch.tensor([[2, -1], [-1, -1]]), torch.tensor([0, 1]), torch.ones(2, 3)
    )
    assert torch.equal(adv, torch.zeros(2, 3))
