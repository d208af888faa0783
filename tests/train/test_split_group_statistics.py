"""``advantages.estimate`` on hand-built agent trajectories: a trajectory split into several
samples (one per turn, as the driver splits where a chat template is not prefix-preserving)
counts once in its group's statistics, in every group mode and in the turn modes; MT-GRPO's
preset gives the final turn the outcome advantage alone."""

from __future__ import annotations

import math

import pytest
import torch

from fastrl.agents.batch import AgentBatch
from fastrl.agents.trajectory import Trajectory, TrajectorySample
from fastrl.reference.advantages import group_advantages_reference
from fastrl.train.advantages import estimate, turn_tables
from fastrl.train.config import TrainConfig
from fastrl.train.experience import Experience
from fastrl.train.ranks import Ranks

G = 3
PAD = 0


def _trajectory(group, index, turns, rewards, outcome, *, split=False):
    """``turns`` policy turns of 2 tokens, each answered by 1 environment token, after a 2-token
    prompt. ``split``: one sample per turn, sample k's prompt being the tokens so far."""
    t = Trajectory(group=group, index=index, row={}, env_seed=0, samples=[])
    history = [5 + group, 6 + group]  # the group's shared prompt
    sample = TrajectorySample()
    sample.append("prompt", -1, history)
    for k in range(turns):
        if split and k > 0:
            sample = TrajectorySample()
            sample.append("prompt", -1, list(history))
        if not t.samples or t.samples[-1] is not sample:
            t.samples.append(sample)
        policy, env = [10 + k, 20 + index], [30 + k]
        sample.append("policy", k, policy, [-0.5, -0.25])
        sample.append("env", k, env)
        history += policy + env
    t.turn_rewards, t.outcome_reward, t.turns = list(rewards), float(outcome), turns
    t.state_keys = [f"s{group}-{index}-{k}" for k in range(turns)]
    t.stop_reason = "done"
    return t


def _batch(split):
    """Group 0: A (3 turns, outcome 1), B (3 turns, 0), C (1 turn, 0); group 1: D (2 turns, 1),
    E (2 turns, 1), F (1 turn, 0). ``split``: A and D are one sample per turn."""
    spec = [  # group, index, turns, turn rewards (the final one is the outcome), outcome, split
        (0, 0, 3, [1.0, 0.0, 1.0], 1.0, True), (0, 1, 3, [0.0, 0.0, 0.0], 0.0, False), (0, 2, 1, [0.0], 0.0, False),
        (1, 0, 2, [0.0, 1.0], 1.0, True), (1, 1, 2, [1.0, 1.0], 1.0, False), (1, 2, 1, [0.0], 0.0, False),
    ]
    trajectories = [_trajectory(g, i, n, r, o, split=s and split) for g, i, n, r, o, s in spec]
    ab = AgentBatch.from_trajectories(trajectories, group_size=G, pad_token_id=PAD)
    return trajectories, ab, Experience.from_agent_batch(ab, device=torch.device("cpu"))


def _cfg(mode, **kw):
    return TrainConfig(advantage_mode=mode, kl_coef=0.0, **{"turn_gamma": 1.0, "turn_coef": 1.0, "outcome_coef": 0.0,
                                                           "final_turn_coef": None, **kw})


def _per_row(exp):
    """Each row's advantage (a group mode: one value per row)."""
    adv = exp.advantages
    return adv.tolist() if adv.dim() == 1 else [float(r[m > 0][0]) for r, m in zip(adv, exp.loss_mask)]


def test_the_split_case_is_what_the_driver_builds():
    trajectories, ab, exp = _batch(split=True)
    assert ab.trajectory_ids.tolist() == [0, 0, 0, 1, 2, 3, 3, 4, 5]  # A: 3 rows, D: 2 rows
    assert not exp.packable and exp.num_samples == 9
    lay = turn_tables(exp)
    assert lay.trajectory.tolist() == [0, 0, 0, 1, 2, 3, 3, 4, 5]  # rows continuing a trajectory are found
    assert lay.first_row.tolist() == [0, 3, 4, 5, 7, 8] and lay.num_turns.tolist() == [3, 3, 1, 2, 2, 1]
    assert lay.turn_rewards[0].tolist() == [1.0, 0.0, 1.0] and lay.turn_rewards[3, :2].tolist() == [0.0, 1.0]
    # the samples of one trajectory repeat its outcome and its group: counted per row, A would weigh 3
    assert exp.rewards.tolist() == [1, 1, 1, 0, 0, 1, 1, 1, 0] and exp.group_ids.tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo", "reinforce_pp"])
def test_group_modes_count_a_split_trajectory_once(mode):
    ranks = Ranks(None, torch.device("cpu"))
    _, ab, split = _batch(split=True)
    _, _, whole = _batch(split=False)
    m_split = estimate(split, cfg=_cfg(mode), ranks=ranks, kl_coef=0.0)
    m_whole = estimate(whole, cfg=_cfg(mode), ranks=ranks, kl_coef=0.0)
    per_trajectory = _per_row(whole)  # one row per trajectory
    rows = ab.trajectory_ids.tolist()
    torch.testing.assert_close(torch.tensor(_per_row(split)), torch.tensor([per_trajectory[i] for i in rows]))
    assert m_split["groups/frac_all_equal"] == m_whole["groups/frac_all_equal"]
    # the specification on one value per trajectory, and the row-weighted statistics differ from it
    outcome = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    want, _ = group_advantages_reference(outcome, ids, mode=mode)
    torch.testing.assert_close(torch.tensor(per_trajectory, dtype=torch.float64), want, atol=1e-6, rtol=1e-6)
    row_weighted, _ = group_advantages_reference(outcome[rows], ids[rows], mode=mode)
    assert (row_weighted - want[rows]).abs().max() > 0.05


def test_grpo_and_rloo_hand_values_on_the_split_case():
    ranks = Ranks(None, torch.device("cpu"))
    _, ab, exp = _batch(split=True)
    rows = ab.trajectory_ids.tolist()
    estimate(exp, cfg=_cfg("grpo"), ranks=ranks, kl_coef=0.0)
    # group 0 outcomes {1, 0, 0}: mean 1/3, std sqrt(1/3) -> +1.1547, -0.5774; group 1 {1, 1, 0}: +0.5774, -1.1547
    s = math.sqrt(1 / 3)
    hand = [(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, (1 / 3) / s, (1 / 3) / s, (-2 / 3) / s]
    assert _per_row(exp) == pytest.approx([hand[i] for i in rows], abs=1e-5)
    exp = _batch(split=True)[2]
    estimate(exp, cfg=_cfg("rloo"), ranks=ranks, kl_coef=0.0)
    # leave-one-out: r_i - mean(others)
    hand = [1.0, -0.5, -0.5, 0.5, 0.5, -1.0]
    assert _per_row(exp) == pytest.approx([hand[i] for i in rows], abs=1e-6)


def test_mt_grpo_on_the_split_case_by_hand():
    """The mt_grpo preset (gamma 0, lambda 1, outcome 1, final turn 0) on per-turn statistics that
    count each trajectory once: every policy token of turn k gets A^O + A^T_k, the final turn A^O."""
    cfg = TrainConfig(algorithm="mt_grpo", env="frozenlake").resolved()
    assert (cfg.advantage_mode, cfg.turn_gamma, cfg.turn_coef, cfg.outcome_coef, cfg.final_turn_coef) == (
        "turn_discounted", 0.0, 1.0, 1.0, 0.0)
    assert TrainConfig(algorithm="mt_grpo", env="frozenlake", turn_coef=0.5).resolved().final_turn_coef == 0.0
    assert TrainConfig(algorithm="grpo", env="frozenlake", advantage_mode="turn_discounted",
                       turn_coef=0.5).resolved().final_turn_coef == 0.5  # the plain form: every turn alike
    _, ab, exp = _batch(split=True)
    estimate(exp, cfg=cfg, ranks=Ranks(None, torch.device("cpu")), kl_coef=0.0)
    eps = 1e-6
    s = math.sqrt(1 / 3)
    ao = {0: (2 / 3) / s, 1: (-1 / 3) / s, 2: (-1 / 3) / s, 3: (1 / 3) / s, 4: (1 / 3) / s, 5: (-2 / 3) / s}
    # turn 0 of group 0: rewards {A 1, B 0, C 0} -> A +1.1547, B -0.5774 (C's turn 0 is final: A^O only);
    # turn 1 of group 0: {A 0, B 0} -> 0 (B's turn 1 is not final); group 1 turn 0: {D 0, E 1, F 0} ->
    # D -0.5774, E +1.1547; turn 1 is final for D and E: A^O only
    want = {(0, 0): ao[0] + (2 / 3) / s, (0, 1): ao[0], (0, 2): ao[0],
            (1, 0): ao[1] - (1 / 3) / s, (1, 1): ao[1], (1, 2): ao[1],
            (2, 0): ao[2],
            (3, 0): ao[3] - (1 / 3) / s, (3, 1): ao[3],
            (4, 0): ao[4] + (2 / 3) / s, (4, 1): ao[4],
            (5, 0): ao[5]}
    got = {}
    for (row, start, end), turn in zip(exp.segments.tolist(), exp.segment_turns.tolist()):
        values = exp.advantages[row, start - 1:end - 1]
        assert torch.all(values == values[0])
        got[ab.trajectory_ids[row].item(), turn] = float(values[0])
    assert got == pytest.approx(want, abs=1e-5 + 2 * eps)
    assert (exp.advantages[exp.loss_mask == 0] == 0).all()
