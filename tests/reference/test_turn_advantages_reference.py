"""fastrl.reference.turn_advantages against hand-computed cases and independent loops
(GiGPO's paper formulas, MT-GRPO's authors' assignment rule, verl's masked GAE loop)."""

from __future__ import annotations

import math

import pytest
import torch

from fastrl.reference.advantages import group_advantages_reference
from fastrl.reference.turn_advantages import (
    place_turn_rewards_reference,
    turn_advantages_reference,
    turn_gae_reference,
)

EPS = 1e-12  # hand-computed cases: the eps is negligible


def _layout(turn_lengths: list[list[int]], env: int = 2, T: int | None = None):
    """Rows of [turn 0 policy tokens][env tokens][turn 1 policy tokens][env tokens]... right-padded.
    Returns (turn_index [B, T] with -7 off the policy tokens, loss_mask [B, T], num_turns [B])."""
    rows = []
    for lengths in turn_lengths:
        idx, m = [], []
        for k, n in enumerate(lengths):
            idx += [k] * n + [-7] * env
            m += [1] * n + [0] * env
        rows.append((idx, m))
    T = T or max(len(i) for i, _ in rows) + 1
    ti = torch.full((len(rows), T), -7, dtype=torch.int64)
    lm = torch.zeros(len(rows), T, dtype=torch.int64)
    for b, (idx, m) in enumerate(rows):
        ti[b, : len(idx)] = torch.tensor(idx, dtype=torch.int64)
        lm[b, : len(m)] = torch.tensor(m)
    return ti, lm, torch.tensor([len(x) for x in turn_lengths])


def _per_turn(adv, turn_index, loss_mask, b, k):
    """The (single) advantage value of turn k of row b, checking every token of it agrees."""
    sel = (turn_index[b] == k) & (loss_mask[b] != 0)
    vals = adv[b][sel]
    assert vals.numel() > 0 and torch.all(vals == vals[0])
    return float(vals[0])


def test_gigpo_hand_case():
    # one group of 3 trajectories; states: t0 = [s1, s2], t1 = [s1, s3], t2 = [s1, s2, s4]
    ti, lm, n = _layout([[2, 1], [1, 2], [1, 1, 2]])
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 9.0], [0.0, 0.0, 1.0]], dtype=torch.float64)  # 9: absent
    keys = torch.tensor([[11, 22, 0], [11, 33, 0], [11, 22, 44]])
    outcome = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
    ids = torch.tensor([3, 3, 3])
    adv, stats = turn_advantages_reference(ti, lm, rewards, n, outcome, ids, mode="gigpo", state_keys=keys,
                                           gamma=0.5, step_coef=1.0, eps=EPS)
    # episode: mean 2/3, unbiased std sqrt(1/3)
    s = math.sqrt(1 / 3)
    ae = [(1 / 3) / s, (-2 / 3) / s, (1 / 3) / s]
    # returns: t0 = [0.5, 1], t1 = [0, 0], t2 = [0.25, 0.5, 1]
    # step group s1 = {0.5, 0, 0.25}: mean 0.25, std 0.25 -> [1, -1, 0]
    # step group s2 = {1, 0.5}: mean 0.75, std sqrt(0.125) -> [+-0.7071]; s3, s4 singletons -> 0
    r2 = 0.25 / math.sqrt(0.125)
    expect = {(0, 0): ae[0] + 1, (0, 1): ae[0] + r2, (1, 0): ae[1] - 1, (1, 1): ae[1] + 0,
              (2, 0): ae[2] + 0, (2, 1): ae[2] - r2, (2, 2): ae[2] + 0}
    for (b, k), v in expect.items():
        assert _per_turn(adv, ti, lm, b, k) == pytest.approx(v, abs=1e-9)
    assert torch.all(adv[lm == 0] == 0)
    assert float(stats["turn_groups"]) == 4 and float(stats["frac_singleton_turn_groups"]) == 0.5
    # omega scales only the step part; norm="none" drops both stds
    adv_w, _ = turn_advantages_reference(ti, lm, rewards, n, outcome, ids, mode="gigpo", state_keys=keys,
                                         gamma=0.5, step_coef=0.25, norm="none", eps=EPS)
    assert _per_turn(adv_w, ti, lm, 0, 0) == pytest.approx((1 - 2 / 3) + 0.25 * 0.25, abs=1e-9)
    assert _per_turn(adv_w, ti, lm, 2, 1) == pytest.approx((1 - 2 / 3) + 0.25 * (0.5 - 0.75), abs=1e-9)


def _gigpo_paper(traj_rewards, traj_keys, outcomes, gamma, omega, eps):
    """GiGPO Eqs. 3-8 written over a list of trajectories of ONE group: A^E from the outcome,
    discounted step returns R_t = sum_k gamma^(k-t) r_k, anchor-state groups over all steps."""
    n = len(outcomes)
    m = sum(outcomes) / n
    sd = math.sqrt(sum((o - m) ** 2 for o in outcomes) / (n - 1))
    ae = [(o - m) / (sd + eps) for o in outcomes]
    returns = []
    for rs in traj_rewards:
        out, run = [], 0.0
        for r in reversed(rs):
            run = r + gamma * run
            out.append(run)
        returns.append(out[::-1])
    groups: dict[int, list[float]] = {}
    for ks, rets in zip(traj_keys, returns):
        for key, ret in zip(ks, rets):
            groups.setdefault(key, []).append(ret)
    adv = []
    for i, (ks, rets) in enumerate(zip(traj_keys, returns)):
        row = []
        for key, ret in zip(ks, rets):
            g = groups[key]
            if len(g) == 1:
                a_s = 0.0
            else:
                gm = sum(g) / len(g)
                gs = math.sqrt(sum((x - gm) ** 2 for x in g) / (len(g) - 1))
                a_s = (ret - gm) / (gs + eps)
            row.append(ae[i] + omega * a_s)
        adv.append(row)
    return adv


def test_gigpo_matches_paper_formulas_on_random_group():
    g = torch.Generator().manual_seed(3)
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    lengths = [[rand(1, 4) for _ in range(rand(1, 5))] for _ in range(5)]
    K = max(len(x) for x in lengths)
    ti, lm, n = _layout(lengths)
    rewards = torch.full((5, K), float("nan"), dtype=torch.float64)
    keys = torch.full((5, K), -1, dtype=torch.int64)
    traj_r, traj_k = [], []
    for b, ls in enumerate(lengths):
        rs = [float(torch.randint(0, 3, (1,), generator=g)) for _ in ls]
        ks = [int(torch.randint(0, 3, (1,), generator=g)) for _ in ls]
        rewards[b, : len(ls)] = torch.tensor(rs, dtype=torch.float64)
        keys[b, : len(ls)] = torch.tensor(ks)
        traj_r.append(rs)
        traj_k.append(ks)
    outcomes = [1.0, 0.0, 0.0, 1.0, 1.0]
    adv, _ = turn_advantages_reference(ti, lm, rewards, n, torch.tensor(outcomes, dtype=torch.float64),
                                       torch.zeros(5, dtype=torch.int64), mode="gigpo", state_keys=keys,
                                       gamma=0.9, step_coef=0.7, eps=1e-6)
    expect = _gigpo_paper(traj_r, traj_k, outcomes, 0.9, 0.7, 1e-6)
    for b, row in enumerate(expect):
        for k, v in enumerate(row):
            assert _per_turn(adv, ti, lm, b, k) == pytest.approx(v, abs=1e-12)


def test_gigpo_step_groups_do_not_cross_prompt_groups():
    ti, lm, n = _layout([[1], [1], [1], [1]])
    rewards = torch.tensor([[1.0], [0.0], [1.0], [0.0]], dtype=torch.float64)
    keys = torch.tensor([[5], [5], [5], [6]])  # rows 0,1 in group 1 share state 5; row 2 (group 2) too
    outcome = torch.zeros(4, dtype=torch.float64)
    ids = torch.tensor([1, 1, 2, 2])
    adv, _ = turn_advantages_reference(ti, lm, rewards, n, outcome, ids, mode="gigpo", state_keys=keys, eps=EPS)
    d = 0.5 / math.sqrt(0.5)
    assert _per_turn(adv, ti, lm, 0, 0) == pytest.approx(d)
    assert _per_turn(adv, ti, lm, 1, 0) == pytest.approx(-d)
    assert _per_turn(adv, ti, lm, 2, 0) == 0.0 and _per_turn(adv, ti, lm, 3, 0) == 0.0  # singletons


def test_turn_discounted_hand_case():
    ti, lm, n = _layout([[2, 1], [1, 3]])
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    outcome = torch.tensor([0.0, 1.0], dtype=torch.float64)
    ids = torch.tensor([4, 4])
    adv, _ = turn_advantages_reference(ti, lm, rewards, n, outcome, ids, mode="turn_discounted", gamma=0.5, eps=EPS)
    # returns [[1, 0], [0.5, 1]]; turn 0: {1, 0.5} -> +-0.7071; turn 1: {0, 1} -> -+0.7071
    h = math.sqrt(0.5)
    assert _per_turn(adv, ti, lm, 0, 0) == pytest.approx(h)
    assert _per_turn(adv, ti, lm, 1, 0) == pytest.approx(-h)
    assert _per_turn(adv, ti, lm, 0, 1) == pytest.approx(-h)
    assert _per_turn(adv, ti, lm, 1, 1) == pytest.approx(h)
    # the outcome mix adds outcome_coef * A^E (A^E = -+0.7071)
    mix, _ = turn_advantages_reference(ti, lm, rewards, n, outcome, ids, mode="turn_discounted", gamma=0.5,
                                       turn_coef=2.0, outcome_coef=0.5, eps=EPS)
    assert _per_turn(mix, ti, lm, 0, 1) == pytest.approx(2 * -h + 0.5 * -h)


def _mt_grpo_authors(turn_r, outcome_r, lam, eps):
    """MT-GRPO as its authors' trainer assigns it (2 turns; SiliangZeng/Multi-Turn-RL-Agent,
    ``_assign_advantages``): tokens before the tool result get A^O + lam * A^T, later ones
    A^O, with A = (r - mean) / (std + eps) over the group (unbiased std)."""
    def norm(x):
        m = sum(x) / len(x)
        s = math.sqrt(sum((v - m) ** 2 for v in x) / (len(x) - 1))
        return [(v - m) / (s + eps) for v in x]
    ao, at = norm(outcome_r), norm(turn_r)
    return [(o + lam * t, o) for o, t in zip(ao, at)]


def test_mt_grpo_is_turn_discounted_with_gamma_0_and_final_turn_coef_0():
    ti, lm, n = _layout([[2, 2], [1, 1], [3, 1], [1, 2]])
    turn_r = [1.0, 0.0, 1.0, 1.0]  # the first turn's (tool execution) reward
    outcome_r = [1.0, 0.0, 0.0, 1.0]
    # as fastrl's environments give them: the final turn's reward is the outcome
    rewards = torch.tensor([[r, o] for r, o in zip(turn_r, outcome_r)], dtype=torch.float64)
    args = (ti, lm, rewards, n, torch.tensor(outcome_r, dtype=torch.float64), torch.zeros(4, dtype=torch.int64))
    adv, _ = turn_advantages_reference(*args, mode="turn_discounted", gamma=0.0, turn_coef=0.5, outcome_coef=1.0,
                                       final_turn_coef=0.0, eps=1e-4)
    for b, (first, final) in enumerate(_mt_grpo_authors(turn_r, outcome_r, 0.5, 1e-4)):
        assert _per_turn(adv, ti, lm, b, 0) == pytest.approx(first, abs=1e-12)
        assert _per_turn(adv, ti, lm, b, 1) == pytest.approx(final, abs=1e-12)
    # hand values: A^O = (o - 0.5) / (std 0.5774 + 1e-4) = +-0.86588; A^T of turn 0 over {1, 0, 1, 1}
    # (mean 0.75, std 0.5) = 0.49990 / -1.49970; the final turn (index 1) gets A^O alone
    ao = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    at1, at0 = 0.25 / (0.5 + 1e-4), -0.75 / (0.5 + 1e-4)
    assert _per_turn(adv, ti, lm, 0, 0) == pytest.approx(ao + 0.5 * at1, abs=1e-12)
    assert _per_turn(adv, ti, lm, 1, 0) == pytest.approx(-ao + 0.5 * at0, abs=1e-12)
    assert _per_turn(adv, ti, lm, 0, 1) == pytest.approx(ao, abs=1e-12)
    assert _per_turn(adv, ti, lm, 2, 1) == pytest.approx(-ao, abs=1e-12)
    # without final_turn_coef the final turn also gets lambda x its own turn advantage: the outcome twice
    both, _ = turn_advantages_reference(*args, mode="turn_discounted", gamma=0.0, turn_coef=0.5, outcome_coef=1.0,
                                        eps=1e-4)
    assert _per_turn(both, ti, lm, 0, 1) == pytest.approx(ao + 0.5 * ao, abs=1e-12)
    assert _per_turn(both, ti, lm, 0, 0) == _per_turn(adv, ti, lm, 0, 0)


def test_mt_grpo_final_turn_is_each_trajectorys_own_last_turn():
    """Trajectories of different lengths: turn 1 is final for row 0 (outcome only) and not for row 1
    (outcome + lambda x A^T of turn index 1, whose statistics include row 0's final turn)."""
    ti, lm, n = _layout([[1, 2], [2, 1, 1]])
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    outcome = torch.tensor([1.0, 0.0], dtype=torch.float64)
    adv, _ = turn_advantages_reference(ti, lm, rewards, n, outcome, torch.tensor([3, 3]), mode="turn_discounted",
                                       gamma=0.0, turn_coef=1.0, outcome_coef=1.0, final_turn_coef=0.0, eps=EPS)
    h = math.sqrt(0.5)  # norm over two values {1, 0}: +-0.7071
    assert _per_turn(adv, ti, lm, 0, 0) == pytest.approx(h)  # A^O + A^T (turn 0: {0, 0} -> 0)
    assert _per_turn(adv, ti, lm, 0, 1) == pytest.approx(h)  # final: A^O only
    assert _per_turn(adv, ti, lm, 1, 1) == pytest.approx(-h - h)  # A^O + A^T_1 ({1, 0} -> -0.7071)
    assert _per_turn(adv, ti, lm, 1, 2) == pytest.approx(-h)  # final: A^O only (turn 2 is a singleton)


def test_broadcast_is_grpo_on_every_policy_token():
    ti, lm, n = _layout([[2, 1], [1], [3, 1, 1]])
    outcome = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    ids = torch.tensor([9, 9, 9])
    adv, _ = turn_advantages_reference(ti, lm, torch.zeros(3, 3, dtype=torch.float64), n, outcome, ids)
    ref, _ = group_advantages_reference(outcome, ids, mode="grpo")
    torch.testing.assert_close(adv, ref[:, None] * (lm != 0).double(), rtol=0, atol=0)


def test_place_turn_rewards_hand_case():
    # row 0: [P0 P0 E E P1 E P2 .]; row 1: turn 1 has no policy token -> its reward joins turn 0's last
    ti = torch.tensor([[0, 0, -1, -1, 1, -1, 2, -1], [0, 0, -1, -1, 2, 2, -1, -1]])
    lm = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 0], [1, 1, 0, 0, 1, 1, 0, 0]])
    rewards = torch.tensor([[1.0, 2.0, 4.0], [1.0, 2.0, 4.0]], dtype=torch.float64)
    n = torch.tensor([3, 3])
    outcome = torch.tensor([10.0, 20.0], dtype=torch.float64)
    r = place_turn_rewards_reference(ti, lm, rewards, n, outcome_rewards=outcome)
    expect = torch.zeros(2, 8, dtype=torch.float64)
    expect[0, 1], expect[0, 4], expect[0, 6] = 1.0, 2.0, 4.0 + 10.0
    expect[1, 1], expect[1, 5] = 1.0 + 2.0, 4.0 + 20.0
    torch.testing.assert_close(r, expect, rtol=0, atol=0)


def _gae_verl_style(r, v, m, gamma, lam):
    """verl's masked GAE (every token visited; on an observation token the running value and
    advantage are carried unchanged), written independently; outputs read at policy tokens."""
    B, T = r.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    next_v = torch.zeros(B, dtype=torch.float64)
    last = torch.zeros(B, dtype=torch.float64)
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_v - v[:, t]
        cand = delta + gamma * lam * last
        mt = m[:, t].double()
        next_v = v[:, t] * mt + (1 - mt) * next_v
        last = cand * mt + (1 - mt) * last
        adv[:, t] = last
    return adv, adv + v


def _gae_loop_over_turns(ti, lm, rewards_tok, v, n, gamma, lam):
    """GAE as a loop over turns (last to first), then over each turn's policy tokens."""
    B, T = lm.shape
    adv = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        nv, na = 0.0, 0.0
        for k in reversed(range(int(n[b]))):
            for t in reversed([t for t in range(T) if lm[b, t] and int(ti[b, t]) == k]):
                a = float(rewards_tok[b, t]) + gamma * nv - float(v[b, t]) + gamma * lam * na
                adv[b, t] = a
                nv, na = float(v[b, t]), a
    return adv


def test_turn_gae_equals_verl_loop_and_turn_loop():
    g = torch.Generator().manual_seed(5)
    ti, lm, n = _layout([[2, 1, 3], [1], [2, 2], [3]], env=3)
    B, T = lm.shape
    rewards = torch.randn(B, 3, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, generator=g, dtype=torch.float64)
    out = torch.randn(B, generator=g, dtype=torch.float64)
    adv, ret = turn_gae_reference(ti, lm, rewards, n, v, gamma=0.9, lam=0.8, outcome_rewards=out)
    r_tok = place_turn_rewards_reference(ti, lm, rewards, n, outcome_rewards=out)
    va, vr = _gae_verl_style(r_tok, v, lm, 0.9, 0.8)
    on = lm != 0
    torch.testing.assert_close(adv[on], va[on], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret[on], vr[on], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(adv, _gae_loop_over_turns(ti, lm, r_tok, v, n, 0.9, 0.8), rtol=1e-12, atol=1e-12)
    assert torch.all(adv[~on] == 0) and torch.all(ret[~on] == 0)


def test_turn_gae_hand_case_gamma_lam_1_zero_values():
    ti, lm, n = _layout([[2, 1]], env=2)  # [P0 P0 E E P1 E E .]
    adv, _ = turn_gae_reference(ti, lm, torch.tensor([[1.0, 2.0]], dtype=torch.float64), n,
                                torch.zeros(lm.shape, dtype=torch.float64), gamma=1.0, lam=1.0)
    assert adv[0].tolist() == [3.0, 3.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0]
