"""``advantages.estimate`` on agent trajectories (issue 19): the turn modes and PPO's GAE over
policy tokens, on Experiences built from real FrozenLake episodes (scripted moves), against
float64 loops over the trajectories' turns written from the formulas."""

import math

import pytest
import torch

from fastrl.agents.batch import AgentBatch
from fastrl.agents.driver import AgentConfig, run_episodes
from fastrl.agents.envs.frozenlake import FrozenLakeEnv, frozenlake_rows, shortest_path
from fastrl.agents.render import ChatRenderer
from fastrl.agents.runtime import InProcessRuntime
from fastrl.train.advantages import INITIAL_STATE, estimate, state_key_hash, turn_tables
from fastrl.train.config import TrainConfig
from fastrl.train.experience import Experience
from fastrl.train.ranks import Ranks
from fastrl.train.task import char_tokenizer
from scripted import ScriptedSampler

G = 4
EPS = 1e-6


def _episodes():
    """2 grids x 4 trajectories: the shortest path; an invalid move, then the path; the path's
    first move, an invalid move, the rest; a wander along the border (falls in a hole, or runs
    out of turns). Step groups with several members exist (same cell at turns 1 and 2)."""
    tokenizer = char_tokenizer()
    rows, _ = frozenlake_rows(num_train=2, num_heldout=0, seed=3)
    paths = [shortest_path(list(r["grid"]), tuple(r["start"])) for r in rows]

    def script(trajectory, turn):
        path, j = paths[trajectory // G], trajectory % G
        moves = [path, ["jump", *path], [path[0], "jump", *path[1:]], ["up", "up", "left", "left", "down", "right"]][j]
        return moves[turn] if turn < len(moves) else "jump"

    with InProcessRuntime(FrozenLakeEnv) as runtime:
        trajectories, _ = run_episodes(rows, group_size=G, runtime=runtime, renderer=ChatRenderer(tokenizer),
                                       sampler=ScriptedSampler(tokenizer, script),
                                       config=AgentConfig(max_turns=8, max_trajectory_tokens=2048), seeds=[0, 1])
    return trajectories, tokenizer


@pytest.fixture(scope="module")
def episodes():
    return _episodes()


def _experience(trajectories, tokenizer, excluded=()):
    for i in excluded:
        trajectories[i].excluded = True
    ab = AgentBatch.from_trajectories(trajectories, group_size=G, pad_token_id=tokenizer.pad_token_id)
    for i in excluded:
        trajectories[i].excluded = False
    return _experience_rows(ab)


def _experience_rows(ab):
    return Experience.from_agent_batch(ab, device=torch.device("cpu"))


def _cfg(mode, **kw):
    """A TrainConfig with every field the estimator reads set (what ``resolved()`` fills)."""
    return TrainConfig(advantage_mode=mode, kl_coef=0.0, **{"turn_gamma": 1.0, "turn_coef": 1.0, "outcome_coef": 0.0, **kw})


def _norm(values, eps=EPS):
    """(x - mean) / (std + eps) over a set, unbiased std; 0 for a set of one."""
    if len(values) < 2:
        return [0.0] * len(values)
    m = sum(values) / len(values)
    s = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))
    return [(v - m) / (s + eps) for v in values]


def _loop_turn_advantages(trajectories, mode, *, gamma, omega=1.0, turn_coef=1.0, outcome_coef=0.0, excluded=(),
                          outcome=None, final_turn_coef=None):
    """A[i][k] of every trajectory i, turn k, in float64 Python: the formulas of
    fastrl.reference.turn_advantages, grouped by the trajectories' own keys (not hashes)."""
    kept = [i for i in range(len(trajectories)) if i not in excluded]
    A_E = {}
    for g in {trajectories[i].group for i in kept}:
        members = [i for i in kept if trajectories[i].group == g]
        R = [trajectories[i].outcome_reward if outcome is None else outcome[i] for i in members]
        for i, a in zip(members, _norm(R)):
            A_E[i] = a
    returns = {}
    for i in kept:
        t = trajectories[i]
        r = t.turn_rewards + [0.0] * (t.turns - len(t.turn_rewards))  # a turn stopped by a limit has no reward
        for k in range(t.turns):
            returns[i, k] = sum(gamma ** (j - k) * r[j] for j in range(k, t.turns))

    def key(i, k):
        t = trajectories[i]
        if mode == "gigpo":
            return (t.group, INITIAL_STATE if k == 0 else t.state_keys[k - 1])  # the state turn k acted in
        return (t.group, k)

    rel = {}
    for group_key in {key(i, k) for (i, k) in returns}:
        members = [(i, k) for (i, k) in returns if key(i, k) == group_key]
        for m, a in zip(members, _norm([returns[m] for m in members])):
            rel[m] = a
    if mode == "gigpo":
        return {(i, k): A_E[i] + omega * rel[i, k] for (i, k) in returns}, rel
    def coef(i, k):  # MT-GRPO (final_turn_coef 0): a trajectory's final turn gets the outcome term alone
        final = k == trajectories[i].turns - 1
        return final_turn_coef if final and final_turn_coef is not None else turn_coef

    return {(i, k): coef(i, k) * rel[i, k] + outcome_coef * A_E[i] for (i, k) in returns}, rel


def _expected_tokens(exp, per_turn, row_trajectory=None):
    """[B, T-1] float64: each policy span's columns [start - 1, end - 1) hold its trajectory's
    turn value (``row_trajectory[row]``: the trajectory of each row; default the row itself)."""
    want = torch.zeros(exp.loss_mask.shape, dtype=torch.float64)
    for (row, start, end), turn in zip(exp.segments.tolist(), exp.segment_turns.tolist()):
        i = row if row_trajectory is None else row_trajectory[row]
        want[row, start - 1:end - 1] = per_turn.get((i, turn), 0.0)
    return want


@pytest.mark.parametrize("mode, kw, excluded", [
    ("gigpo", dict(turn_gamma=0.9, step_coef=0.7), ()),
    ("gigpo", dict(turn_gamma=0.9, step_coef=1.0), (1,)),
    ("turn_discounted", dict(turn_gamma=0.0, turn_coef=0.5, outcome_coef=1.0, final_turn_coef=0.0), ()),  # MT-GRPO
    ("turn_discounted", dict(turn_gamma=0.0, turn_coef=0.5, outcome_coef=1.0), (2,)),  # the same weight on every turn
    ("turn_discounted", dict(turn_gamma=0.8, turn_coef=1.0, outcome_coef=0.0), (6,)),
])
def test_turn_modes_equal_a_float64_loop_over_the_turns(episodes, mode, kw, excluded):
    trajectories, tokenizer = episodes
    assert all(len(t.samples) == 1 for t in trajectories)  # one row per trajectory
    exp = _experience(trajectories, tokenizer, excluded)
    cfg = _cfg(mode, **kw)
    metrics = estimate(exp, cfg=cfg, ranks=Ranks(None, torch.device("cpu")), kl_coef=0.0)
    per_turn, rel = _loop_turn_advantages(trajectories, mode, gamma=kw["turn_gamma"], omega=kw.get("step_coef", 1.0),
                                          turn_coef=kw.get("turn_coef", 1.0), outcome_coef=kw.get("outcome_coef", 0.0),
                                          excluded=excluded, final_turn_coef=kw.get("final_turn_coef"))
    want = _expected_tokens(exp, per_turn)
    assert exp.advantages.shape == exp.loss_mask.shape and exp.advantages.dtype == torch.float32
    torch.testing.assert_close(exp.advantages.double(), want, atol=2e-6, rtol=1e-5)
    assert (exp.advantages[exp.loss_mask == 0] == 0).all()
    if kw.get("final_turn_coef") is not None:  # the case tells MT-GRPO's final turn from turn_coef on every turn
        every, _ = _loop_turn_advantages(trajectories, mode, gamma=kw["turn_gamma"], turn_coef=kw["turn_coef"],
                                         outcome_coef=kw["outcome_coef"], excluded=excluded)
        assert (exp.advantages.double() - _expected_tokens(exp, every)).abs().max() > 0.1
    for i in excluded:
        assert (exp.advantages[i] == 0).all() and exp.loss_mask[i].sum() == 0 and exp.segments[:, 0].eq(i).any()
    assert metrics["advantage/excluded"] == len(excluded)
    # the step groups exist: some turns share a group, and within a trajectory the credit differs per turn
    groups = {}
    for (i, k) in rel:
        t = trajectories[i]
        groups.setdefault((t.group, INITIAL_STATE if k == 0 else t.state_keys[k - 1]) if mode == "gigpo" else (t.group, k), []).append((i, k))
    assert metrics["advantage/turn_groups"] == len(groups)
    singletons = sum(len(m) == 1 for m in groups.values())
    assert metrics["advantage/frac_singleton_turn_groups"] == pytest.approx(singletons / len(groups))
    assert singletons < len(groups)  # some turns share a group
    rows_with_distinct_turns = [b for b in range(exp.num_samples) if exp.advantages[b][exp.loss_mask[b] > 0].unique().numel() > 1]
    assert rows_with_distinct_turns
    assert metrics["advantage/frac_rows_turn_varying"] == pytest.approx(len(rows_with_distinct_turns) / (exp.num_samples - len(excluded)))


def test_gigpo_differs_from_grpo_broadcast_only_by_the_step_term(episodes):
    """With omega = 0 GiGPO is GRPO's broadcast (advantage_mode grpo); with omega > 0 it differs
    exactly where a step group has members with different returns."""
    trajectories, tokenizer = episodes
    ranks = Ranks(None, torch.device("cpu"))
    grpo = _experience(trajectories, tokenizer)
    estimate(grpo, cfg=_cfg("grpo"), ranks=ranks, kl_coef=0.0)
    broadcast = grpo.advantages[:, None] * grpo.loss_mask
    flat = _experience(trajectories, tokenizer)
    estimate(flat, cfg=_cfg("gigpo", turn_gamma=0.9, step_coef=0.0), ranks=ranks,
             kl_coef=0.0)
    torch.testing.assert_close(flat.advantages, broadcast, atol=1e-6, rtol=0)
    step = _experience(trajectories, tokenizer)
    estimate(step, cfg=_cfg("gigpo", turn_gamma=0.9), ranks=ranks, kl_coef=0.0)
    assert (step.advantages - broadcast).abs().max() > 0.1


def test_anchor_keys_are_the_state_before_each_turn(episodes):
    trajectories, tokenizer = episodes
    exp = _experience(trajectories, tokenizer)
    lay = turn_tables(exp)
    for b, t in enumerate(trajectories):
        assert int(lay.num_turns[b]) == t.turns
        want = [state_key_hash(INITIAL_STATE)] + [state_key_hash(k) for k in t.state_keys[: t.turns - 1]]
        assert lay.anchor_keys[b, : t.turns].tolist() == want
        r = t.turn_rewards + [0.0] * (t.turns - len(t.turn_rewards))
        assert lay.turn_rewards[b, : t.turns].tolist() == r
    # deterministic across processes (not Python's salted hash): the documented BLAKE2b of type name and repr
    import hashlib

    digest = hashlib.blake2b(b"str:'g:1,2'", digest_size=8).digest()
    assert state_key_hash("g:1,2") == int.from_bytes(digest, "little", signed=True)
    assert state_key_hash(("g", 1)) != state_key_hash("('g', 1)") and state_key_hash(1) != state_key_hash("1")


def _loop_gae(exp, values, gamma, lam, excluded=()):
    """GAE over policy tokens only, float64, by turns: turn k's reward on its last policy token,
    the recursion from one policy token to the next policy token (environment tokens skipped)."""
    B, C = exp.loss_mask.shape
    adv = torch.zeros(B, C, dtype=torch.float64)
    ret = torch.zeros(B, C, dtype=torch.float64)
    V = values.double()
    for b in range(B):
        if b in excluded:
            continue
        spans = [(s - 1, e - 1, k) for (row, s, e), k in zip(exp.segments.tolist(), exp.segment_turns.tolist()) if row == b]
        reward = {}
        for s, e, k in spans:
            reward[e - 1] = float(exp.turn_rewards[b, s:e].double().sum())
        cols = [c for s, e, _ in spans for c in range(s, e)]
        a_next, v_next = 0.0, 0.0
        for c in reversed(cols):
            delta = reward.get(c, 0.0) + gamma * v_next - float(V[b, c])
            a_next = delta + gamma * lam * a_next
            v_next = float(V[b, c])
            adv[b, c] = a_next
            ret[b, c] = a_next + float(V[b, c])
    return adv, ret


@pytest.mark.parametrize("excluded", [(), (2,)])
def test_ppo_on_agents_is_gae_over_policy_tokens_with_per_turn_rewards(episodes, excluded):
    trajectories, tokenizer = episodes
    exp = _experience(trajectories, tokenizer, excluded)
    values = torch.randn(exp.loss_mask.shape, generator=torch.Generator().manual_seed(1))
    cfg = _cfg("gae", gamma=0.97, lam=0.9, whiten_advantages=False)
    estimate(exp, cfg=cfg, ranks=Ranks(None, torch.device("cpu")), kl_coef=0.0, critic_values=lambda e: values)
    want_adv, want_ret = _loop_gae(exp, values, 0.97, 0.9, excluded)
    torch.testing.assert_close(exp.advantages.double(), want_adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(exp.returns.double(), want_ret, atol=1e-5, rtol=1e-5)
    # rewards sit on each turn's last policy token: the environment tokens between turns carry none
    assert exp.token_rewards[exp.loss_mask == 0].abs().sum() == 0
    assert exp.token_rewards.sum() == sum(sum(t.turn_rewards) for i, t in enumerate(trajectories) if i not in excluded)


def test_turn_modes_refuse_single_turn_experience_and_config_needs_env():
    from fastrl.errors import InputError

    with pytest.raises(InputError, match="--env"):
        TrainConfig(algorithm="gigpo").resolved()
    with pytest.raises(InputError, match="--env"):
        TrainConfig(algorithm="grpo", advantage_mode="turn_discounted").resolved()


def _split(trajectory, turn):
    """A copy of ``trajectory`` whose sample is split after the environment answer to ``turn``,
    as the driver does where the chat template is not prefix-preserving: the later sample's
    prompt is the context so far, then the remaining segments with their turn indices."""
    import copy

    from fastrl.agents.trajectory import TrajectorySample

    t = copy.deepcopy(trajectory)
    whole = t.samples[0]
    cut = next(s.end for s in whole.segments if s.role == "env" and s.turn == turn)
    first, second = TrajectorySample(), TrajectorySample()
    second.append("prompt", -1, whole.token_ids[:cut])
    for s in whole.segments:
        target = first if s.end <= cut else second
        ids = whole.token_ids[s.start:s.end]
        target.append(s.role, s.turn, ids, whole.sampler_logp[s.start:s.end] if s.role == "policy" else None)
    first.check()
    second.check()
    t.samples = [first, second]
    return t


@pytest.mark.parametrize("mode", ["gigpo", "turn_discounted", "grpo"])
def test_a_split_trajectory_gets_the_advantages_of_the_whole_one(episodes, mode):
    """A trajectory split over two rows counts once in its group and keeps its per-turn credit."""
    trajectories, tokenizer = episodes
    split = [_split(t, 1) if i in (1, 6) else t for i, t in enumerate(trajectories)]
    ab = AgentBatch.from_trajectories(split, group_size=G, pad_token_id=tokenizer.pad_token_id)
    row_trajectory = ab.trajectory_ids.tolist()
    assert len(row_trajectory) == len(trajectories) + 2
    exp = _experience_rows(ab)
    cfg = _cfg(mode, turn_gamma=0.9, step_coef=0.5)
    estimate(exp, cfg=cfg, ranks=Ranks(None, torch.device("cpu")), kl_coef=0.0)
    if mode == "grpo":
        outcome = {g: [t.outcome_reward for t in trajectories if t.group == g] for g in (0, 1)}
        per_trajectory = {}
        for g, values in outcome.items():
            members = [i for i, t in enumerate(trajectories) if t.group == g]
            per_trajectory.update(zip(members, _norm(values)))
        want = torch.tensor([per_trajectory[i] for i in row_trajectory], dtype=torch.float64)
        torch.testing.assert_close(exp.advantages.double(), want, atol=1e-6, rtol=1e-6)
        return
    per_turn, _ = _loop_turn_advantages(trajectories, mode, gamma=0.9, omega=0.5)
    torch.testing.assert_close(exp.advantages.double(), _expected_tokens(exp, per_turn, row_trajectory), atol=2e-6,
                               rtol=1e-5)


def test_fastrl_train_with_gigpo_gives_turns_their_own_advantages(tmp_path):
    """The real loop (``fastrl train --env``, built-in tiny model, a user environment whose
    random-policy trajectories revisit states with different returns): the advantages the
    update used are per token -- some trajectories' turns get different values, which
    GRPO's broadcast never gives -- and the step groups are logged."""
    import json

    from fastrl.cli import main

    out = tmp_path / "run"
    argv = ["train", "--env", "corridor:CorridorEnv", "--algorithm", "gigpo", "--steps", "2", "--prompts_per_step", "2",
            "--group_size", "8", "--eval_every", "0", "--output_dir", str(out), "--progress", "false",
            "--env_workers", "1", "--reward_workers", "0", "--max_turns", "4", "--max_turn_tokens", "5",
            "--kl_coef", "0"]
    assert main(argv) == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "event" not in s]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["advantage/turn_groups"] > 0 and s["advantage/excluded"] == 0
        assert math.isfinite(s["advantage/mean"]) and math.isfinite(s["loss"] if "loss" in s else 0.0)
    assert any(s["advantage/frac_singleton_turn_groups"] < 1 for s in steps)  # step groups with several members
    assert any(s["advantage/frac_rows_turn_varying"] > 0 for s in steps)  # per-token credit, unlike broadcast


def test_kl_in_reward_shapes_each_trajectorys_outcome_by_the_kl_of_all_its_rows(episodes):
    """gigpo with ``kl_in_reward``: the episode reward is outcome - beta * sum of KL_t over the
    policy tokens of every row of the trajectory (a split trajectory's two rows together)."""
    trajectories, tokenizer = episodes
    split = [_split(t, 1) if i == 1 else t for i, t in enumerate(trajectories)]
    ab = AgentBatch.from_trajectories(split, group_size=G, pad_token_id=tokenizer.pad_token_id)
    exp = _experience_rows(ab)
    g = torch.Generator().manual_seed(3)
    exp.ref_logp = exp.sampler_logp + 0.3 * torch.randn(exp.loss_mask.shape, generator=g)
    beta = 0.2
    cfg = _cfg("gigpo", turn_gamma=0.9, kl_in_reward=True, kl_estimator="k3")
    estimate(exp, cfg=cfg, ranks=Ranks(None, torch.device("cpu")), kl_coef=beta)
    d = (exp.ref_logp - exp.sampler_logp).double()
    k3 = (torch.exp(d) - d - 1) * exp.loss_mask.double()
    row_trajectory = ab.trajectory_ids.tolist()
    kl = [0.0] * len(trajectories)
    for row, i in enumerate(row_trajectory):
        kl[i] += float(k3[row].sum())
    assert sum(1 for i in row_trajectory if i == 1) == 2
    shaped = [t.outcome_reward - beta * kl[i] for i, t in enumerate(trajectories)]
    per_turn, _ = _loop_turn_advantages(trajectories, "gigpo", gamma=0.9, outcome=shaped)
    torch.testing.assert_close(exp.advantages.double(), _expected_tokens(exp, per_turn, row_trajectory), atol=1e-5,
                               rtol=1e-4)
