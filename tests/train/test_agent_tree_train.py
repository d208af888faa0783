"""``fastrl train --env NAME --rollout tree``: real tiny-model runs through the real loop and the
real worker pool. frozenlake (its ``fork()``): the steps' metrics (finite loss, the trie layout
and its saving, the tree's step groups, the equal-budget figures), then one more rollout of the
trained run checked leaf by leaf (observations equal a fresh environment replaying the leaf's
actions, the loss mask exactly the policy tokens, siblings on one node until they branch) and
its experience's gradient on the trie equal to the padded rows' (each leaf its own full
trajectory) in float64. calculator (replayed forks) through the CLI. The refusals are one-line
``InputError``s."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from fastrl.agents import metric_names as names
from fastrl.agents.envs.frozenlake import FrozenLakeEnv
from fastrl.cli import main
from fastrl.errors import InputError
from fastrl.ops import group_advantages
from fastrl.reference.tree_advantages import tree_step_advantages_reference
from fastrl.train import TrainConfig
from fastrl.train.advantages import estimate
from fastrl.train.batching import PaddedBatching, TreePackedBatching
from fastrl.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_tree_rollout import _assert_same, _grads  # noqa: E402

TINY = dict(prompts_per_step=2, group_size=4, task_train_size=16, task_eval_size=2, model_hidden_size=32, model_layers=1,
            sft_steps=30, sft_check_every=1000, env_workers=2, reward_workers=0, max_turns=3, max_turn_tokens=8,
            progress=False, tensorboard=False, seed=0, threads=1, eval_every=0, rollout="tree")


def _steps(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"event"' not in line]


def test_frozenlake_tree_run_forks_replays_exactly_and_trains_on_the_trie(tmp_path):
    cfg = TrainConfig(**TINY, env="frozenlake", steps=2, tree_turns=[0, 1], tree_branches=[2, 2], max_observation_tokens=256,
                      output_dir=str(tmp_path / "run"))  # observations uncut: a fresh replay compares as is
    with Trainer(cfg) as trainer:
        trainer.train()
        for r in _steps(tmp_path / "run"):
            assert math.isfinite(r["loss/total"]) and r["rollout/samples"] == 8
            assert r["layout/tree"] == 1.0 and r["layout/trie_saving"] >= 0.1  # the shared partial trajectories run once
            assert 0 < r[names.GENERATED_TOKENS] < r[names.TREE_LEAF_TOKENS]
            assert r[names.ENV_CALLS] < r[names.TREE_LEAF_ENV_CALLS] and r[names.FORK_FAILURES] == 0
            assert r[names.FORKS_NATIVE] >= 2 and r[names.FORKS_REPLAYED] == 0  # frozenlake forks itself
            assert r["advantage/tree_branch_points"] >= 2
        # one more rollout of the trained run, checked leaf by leaf
        rollout, _ = trainer.collector.collect(sampler=trainer.sampler, step=trainer.step, timer=trainer.timer)
        exp = trainer.collector.experience(rollout, device=trainer.device)
        exp.old_logp = exp.sampler_logp.clone()
        # outcomes that differ between siblings (the tiny policy rarely succeeds): the step credit has work to do
        exp.rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
        credit = estimate(exp, cfg=trainer.cfg, ranks=trainer.ranks, kl_coef=0.0)
        policy = trainer.policy
    assert credit["advantage/tree_branch_points"] >= 2 and exp.advantages.shape == exp.loss_mask.shape
    # the advantages are GRPO's over each row's G leaves plus step_coef x the reference step advantage
    on = exp.loss_mask > 0
    episode = group_advantages(exp.rewards, exp.group_ids, mode="grpo")[0]
    step = tree_step_advantages_reference(exp.rewards, torch.where(on, exp.tree_nodes, -1), exp.tree_parents)[0]
    assert step[on].abs().max() > 0.1  # turn 0's two nodes per row: leaf means 0.5 against 1.0 (row 0), 0.5 against 0 (row 1)
    torch.testing.assert_close(exp.advantages[on], (episode[:, None] + trainer.cfg.step_coef * step)[on], atol=1e-5, rtol=1e-5)
    assert rollout.metrics[names.KV_FORKS] >= 1  # the HF sampler's siblings continue forked keys/values
    batch, G = rollout.batch, 4
    assert batch.input_ids.shape[0] == len(rollout.trajectories) == 2 * G
    for r, t in enumerate(rollout.trajectories):
        sample = t.samples[0]
        sample.check()
        assert batch.loss_mask[r].nonzero().flatten().tolist() == [i for s in sample.segments if s.role == "policy"
                                                                   for i in range(s.start, s.end)]
        env = FrozenLakeEnv()
        seen = env.reset(t.row, t.env_seed)
        for action in [m["content"] for m in t.messages if m["role"] == "assistant"][:len(t.turn_rewards)]:
            result = env.step(action)
            seen = seen + ([] if result.done else result.observation)
        observations = [m for m in t.messages if m["role"] != "assistant"]
        assert seen[:len(observations)] == observations and len(seen) - len(observations) == (t.stop_reason == "max_turns")
    # turn 0's node is shared by the two leaves below each turn-1 branch point, their turn-1 nodes are siblings
    nodes, parents = exp.tree_nodes, exp.tree_parents.tolist()
    for g in range(2):
        for a in (g * G, g * G + 2):
            ta, tb = rollout.trajectories[a], rollout.trajectories[a + 1]
            turn0 = [int(nodes[r][(exp.loss_mask[r] > 0) & (nodes[r] >= 0)][0]) for r in (a, a + 1)]
            assert turn0[0] == turn0[1] and parents[turn0[0]] == g
            if ta.turns >= 2 and tb.turns >= 2:
                last = [int(nodes[r][exp.loss_mask[r] > 0][-1]) for r in (a, a + 1)]
                assert last[0] != last[1] and parents[last[0]] == parents[last[1]] == turn0[0]
    # the trie's gradient is the padded rows' (every leaf its own full trajectory), float64, with
    # per-token advantages that differ between rows on their shared tokens
    policy = policy.double()
    torch.manual_seed(0)
    exp.old_logp, exp.advantages = exp.old_logp.double(), torch.randn(exp.loss_mask.shape, dtype=torch.float64)
    common = dict(token_budget=100_000, device=torch.device("cpu"), temperature=1.0)
    _assert_same(_grads(TreePackedBatching(**common), policy, exp), _grads(PaddedBatching(**common), policy, exp))


def test_calculator_ppo_tree_run_through_the_cli_replays_its_forks(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--env", "calculator", "--output_dir", str(out), "--steps", "1", "--rollout", "tree",
            "--tree_turns", "[0]", "--tree_branches", "[4]", "--sft_steps", "1", "--algorithm", "ppo"]
    for name in ("prompts_per_step", "group_size", "task_train_size", "task_eval_size", "model_hidden_size", "model_layers",
                 "env_workers", "reward_workers", "max_turns", "max_turn_tokens", "progress", "tensorboard", "threads",
                 "eval_every", "sft_check_every"):
        args += [f"--{name}", str(TINY[name]).lower()]
    assert main(args) == 0
    (r,) = _steps(out)
    assert math.isfinite(r["loss/total"]) and r["rollout/samples"] == 8 and r[names.FORK_FAILURES] == 0
    assert r[names.FORKS_REPLAYED] == 2 * 3 and r[names.FORKS_NATIVE] == 0  # each row's 3 siblings: reset, checked
    assert "advantage/tree_branch_points" not in r and math.isfinite(r["critic/loss"])  # ppo: its critic's GAE, no tree term


@pytest.mark.parametrize("changes, message", [
    (dict(env="frozenlake", tree_turns=[0, 3], tree_branches=[2, 2]), r"below max_turns \(3"),
    (dict(env="frozenlake", tree_turns=[0, 1], tree_branches=[2, 4]), r"give 8 leaves per row; .* group_size \(4\)"),
    (dict(env="frozenlake", tree_depths=[0, 3], tree_branches=[2, 2]), "with --env the tree branches at policy turns"),
    (dict(env="frozenlake", algorithm="gigpo"), "credit the turns twice"),
    (dict(env=None, max_turns=None, max_turn_tokens=None, env_workers=2, tree_turns=[0, 1], tree_branches=[2, 2]),
     "tree_turns are the policy turns of agent trajectories"),
    (dict(env="frozenlake", rollout="independent", tree_turns=[0, 1]), "tree_turns shapes a tree rollout"),
])
def test_agent_tree_options_that_cannot_run_are_input_errors(tmp_path, changes, message):
    with pytest.raises(InputError, match=message):
        TrainConfig(**{**TINY, **changes, "output_dir": str(tmp_path / "x")}).resolved().validate()
