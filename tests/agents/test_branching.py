"""Branching agent rollouts (``fastrl.agents.branching``): the turn schedule's checks, forking
each built-in environment in the real worker pool (``fork()`` for frozenlake, checked replay for
calculator and sql; a non-deterministic environment is caught), and the driver growing trees
with the real HF sampler: ``G`` leaves per row, siblings sharing their partial trajectory, the
KV forked (log-probs equal a plain forward), every leaf's observations equal to a fresh
environment replaying its actions, the loss mask exactly the policy tokens, the equal-budget figures."""

from __future__ import annotations

import random

import pytest
import torch

from fastrl.agents import metric_names as names
from fastrl.agents.branching import ForkingTokenSampler, TurnSchedule, TurnTree
from fastrl.agents.driver import AgentConfig, run_episodes
from fastrl.agents.envs import BUILTIN_ENVS
from fastrl.agents.envs.frozenlake import FrozenLakeEnv, frozenlake_rows
from fastrl.agents.render import ChatRenderer
from fastrl.agents.runtime import FORK_NATIVE, FORK_REPLAY, EnvRuntime, InProcessRuntime
from fastrl.errors import InputError
from fastrl.rollout.base import SamplingConfig
from fastrl.rollout.hf import HFGroupSampler, HFTokenSampler
from fastrl.train.task import char_tokenizer, tiny_model
from fastrl.workers import OK, RAISED
from test_metric_names import unnamed

STOPS = tuple(range(7, 104, 3))  # as in test_driver: a random tiny model ends its turns early


@pytest.mark.parametrize("kwargs, check, message", [
    (dict(branches=(2, 0), turns=(0, 1)), None, "tree_branches must be one or more ints >= 1"),
    (dict(branches=(2, 2), turns=(0,)), None, "tree_turns must give one turn per entry of tree_branches"),
    (dict(branches=(2, 2), turns=(1, 1)), None, "strictly increasing"),
    (dict(branches=(2, 2), turns=(0, 1)), dict(group_size=8, max_turns=4), r"give 4 leaves per row; .* group_size \(8\)"),
    (dict(branches=(2, 2), turns=(0, 4)), dict(group_size=4, max_turns=4), r"below max_turns \(4"),
])
def test_turn_schedule_refuses_what_cannot_run(kwargs, check, message):
    with pytest.raises(InputError, match=message):
        TurnSchedule(**kwargs).check(**(check or dict(group_size=1, max_turns=1)))


def test_turn_schedule_default_and_spans():
    assert TurnSchedule.default(group_size=8, max_turns=3) == TurnSchedule(branches=(2, 4), turns=(0, 1))
    assert TurnSchedule.default(group_size=6, max_turns=1).branches == (6,)
    s = TurnSchedule(branches=(3, 2, 2), turns=(0, 2, 3))
    assert s.leaves == 12 and [s.span(level) for level in range(3)] == [4, 2, 1] and s.level(2) == 1 and s.level(1) is None


class CoinEnv:
    """Not deterministic: each observation is a fresh random draw (replay cannot reproduce it)."""

    def reset(self, row, seed):
        return [{"role": "user", "content": "go"}]

    def step(self, action):
        return [{"role": "user", "content": str(random.SystemRandom().random())}], 0.0, False, {}

    def close(self):
        pass


def _actions(name, row):
    if name == "frozenlake":
        return ["right", "down", "left"], "up"
    if name == "calculator":  # a repeated call: the repeat detector's state must be carried to the copy
        return ["calc(1+2)", "calc(1+2)"], "calc(1+2)"
    return [f"query({row['sql']})"], row["answer"]


@pytest.mark.parametrize("name", list(BUILTIN_ENVS))
def test_each_builtin_environment_forks_in_the_worker_pool(name):
    entry = BUILTIN_ENVS[name]
    row = entry.rows(num_train=1, num_heldout=0, seed=0)[0][0]
    if name == "frozenlake":
        row = {"prompt": "p", "grid": ["....", "....", "....", "...G"], "start": [0, 0], "answer": "6"}
    history, last = _actions(name, row)
    # what a fresh environment replaying the whole history answers (in this process first: the
    # forked workers inherit what the tools import on their first call)
    fresh = entry.make()
    fresh.reset(row, 3)
    expected = [fresh.step(action) for action in [*history, last]]
    fresh.close()
    with EnvRuntime(entry.make, num_workers=2, step_timeout_s=20) as runtime:
        assert runtime.reset([(0, row, 3)])[0].status == OK
        recorded = [runtime.step([(0, a)])[0].value for a in history]
        assert all(not r.done for r in recorded)
        assert [r.observation for r in recorded] == [r.observation for r in expected[:-1]]
        (fork,) = runtime.fork([(1, 0)])
        assert fork.status == OK, fork.message
        assert fork.value.how == (FORK_NATIVE if name == "frozenlake" else FORK_REPLAY)
        assert fork.value.calls == (0 if name == "frozenlake" else 1 + len(history))
        child, parent = runtime.step([(1, last), (0, last)])
        runtime.release([0, 1])
    # both answer the next action as the fresh environment did
    want = expected[-1]
    for got in (child, parent):
        assert got.status == OK and (got.value.observation, got.value.reward, got.value.done) == (
            want.observation, want.reward, want.done)
    if name == "calculator":
        assert want.done and want.info["stop_reason"] == "repeated_call"  # the third identical call


class ReplayedLake(FrozenLakeEnv):
    """frozenlake without its fork(): the runtime replays it."""

    fork = None


@pytest.mark.parametrize("env, how", [(FrozenLakeEnv, FORK_NATIVE), (ReplayedLake, FORK_REPLAY)])
def test_a_forked_environment_is_independent_of_its_parent_in_process(env, how):
    runtime = InProcessRuntime(env)
    row = {"prompt": "p", "grid": ["....", "....", "....", "...G"], "start": [0, 0], "answer": "6"}
    runtime.reset([(0, row, 0)])
    runtime.step([(0, "right")])
    assert runtime.fork([(1, 0)])[0].value.how == how
    a, b = runtime.step([(0, "down"), (1, "right")])
    assert a.value.info["state_key"].endswith(":1,1") and b.value.info["state_key"].endswith(":0,2")
    runtime.close()


def test_a_fork_attribute_that_is_not_a_method_is_an_input_error():
    from fastrl.agents.env import validate_environment

    class Odd(FrozenLakeEnv):
        fork = 3

    with pytest.raises(InputError, match=r"\.fork is not a method"):
        validate_environment(Odd())


def test_replay_of_a_non_deterministic_environment_is_an_error():
    with EnvRuntime(CoinEnv, num_workers=1) as runtime:
        runtime.reset([(0, {}, 0)])
        runtime.step([(0, "a")])
        (fork,) = runtime.fork([(1, 0)])
    assert fork.status == RAISED and "deterministic given row, seed and actions" in fork.message and "step 0" in fork.message


@pytest.fixture(scope="module")
def tiny():
    tokenizer = char_tokenizer()
    model = tiny_model(tokenizer, hidden_size=32, layers=2, heads=2, max_position_embeddings=512, seed=1).eval()
    return tokenizer, model


def _episodes(tiny, *, rows, seeds, schedule=None, group_size=None, env=FrozenLakeEnv, max_turns=4):
    """``run_episodes`` on the tiny model: trees grown by ``schedule`` (``ForkingTokenSampler``), or
    ``group_size`` independent trajectories per row without one (``HFTokenSampler``). Returns
    ``(trajectories, metrics, tree or None, sampler)``."""
    tokenizer, model = tiny
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=6, stop_token_ids=STOPS)
    if schedule is None:
        tree, sampler = None, HFTokenSampler(HFGroupSampler(model, backend="torch"), sampling)
    else:
        group_size = schedule.leaves
        tree = TurnTree(schedule, group_size=group_size)
        sampler = ForkingTokenSampler(HFGroupSampler(model, backend="torch"), sampling)
    renderer = ChatRenderer(tokenizer, stop_token_ids=(tokenizer.eos_token_id, *STOPS))
    config = AgentConfig(max_turns=max_turns, max_turn_tokens=6, max_trajectory_tokens=400, split_on_mismatch=False)
    with EnvRuntime(env, num_workers=2) as runtime:
        trajectories, metrics = run_episodes(rows, group_size=group_size, runtime=runtime, renderer=renderer,
                                             sampler=sampler, config=config, seeds=seeds, tree=tree)
    sampler.close()
    return trajectories, metrics, tree, sampler


def _observations(t):
    return [m for m in t.messages if m["role"] != "assistant"]


def test_tree_episodes_share_their_prefix_and_replay_exactly(tiny):
    tokenizer, model = tiny
    rows, _ = frozenlake_rows(num_train=2, num_heldout=0, seed=0, size=5, hole_rate=0.0)  # no holes: long episodes
    schedule = TurnSchedule(branches=(2, 2), turns=(0, 2))
    trajectories, metrics, tree, sampler = _episodes(tiny, rows=rows, seeds=[5, 6], schedule=schedule)
    G = schedule.leaves
    assert [(t.group, t.index) for t in trajectories] == [(g, j) for g in range(2) for j in range(G)]
    assert metrics[names.FORKS_NATIVE] >= 2 and metrics[names.FORKS_REPLAYED] == 0 and sampler.forked >= 1
    for g in range(2):
        leaves = trajectories[g * G:(g + 1) * G]
        for a, b in ((leaves[0], leaves[1]), (leaves[2], leaves[3])):  # siblings below the turn-2 branch point
            if a.turns >= 2 and b.turns >= 2:
                pa, pb = a.samples[0], b.samples[0]
                cut = next(s.start for s in pa.segments if s.role == "policy" and s.turn == 2)
                assert pa.token_ids[:cut] == pb.token_ids[:cut] and a.messages[:5] == b.messages[:5]
        assert leaves[0].samples[0].prompt_length == leaves[2].samples[0].prompt_length
    for t in trajectories:
        sample = t.samples[0]
        sample.check()
        policy = [i for s in sample.segments if s.role == "policy" for i in range(s.start, s.end)]
        assert [i for i, m in enumerate(sample.loss_mask) if m] == policy
        # the observations are a fresh environment's answers to the leaf's own actions
        env = FrozenLakeEnv()
        fresh = env.reset(t.row, t.env_seed)
        for m in [m for m in t.messages if m["role"] == "assistant"][:len(t.turn_rewards)]:  # the turns stepped
            result = env.step(m["content"])
            if not result.done:
                fresh = fresh + result.observation
        seen = _observations(t)  # the last turn's observation is not appended when max_turns ends it
        assert fresh[:len(seen)] == seen and len(fresh) - len(seen) == (t.stop_reason == "max_turns")
        # the forked keys/values give the log-probs a plain forward over the leaf gives
        ids = torch.tensor(sample.token_ids)
        with torch.no_grad():
            logp = torch.log_softmax(model(ids[None]).logits[0, :-1].float(), -1).gather(1, ids[1:, None])[:, 0]
        at = torch.tensor(policy)
        torch.testing.assert_close(torch.tensor(sample.sampler_logp)[at], logp[at - 1], atol=2e-5, rtol=1e-5)
    # equal budget: shared turns are generated and stepped once
    leaf_tokens = sum(t.count("policy") for t in trajectories)
    assert metrics[names.TREE_LEAF_TOKENS] == leaf_tokens
    assert 0 < metrics[names.GENERATED_TOKENS] < leaf_tokens
    assert metrics[names.ENV_CALLS] < metrics[names.TREE_LEAF_ENV_CALLS]
    assert unnamed(metrics) == []  # every figure the tree run logs is a declared name
    # the node grid: siblings' turn-2 nodes share a parent, their shared turns share a node
    assert tree.branch_points >= 2 + 2 and len(tree.parents) > 2


def test_a_branch_after_the_first_turn_and_leaves_that_stopped_early_are_copies(tiny):
    rows, _ = frozenlake_rows(num_train=2, num_heldout=0, seed=3, size=3, hole_rate=0.3)
    schedule = TurnSchedule(branches=(3,), turns=(1,))
    trajectories, metrics, tree, _ = _episodes(tiny, rows=rows, seeds=[1, 2], schedule=schedule, max_turns=3)
    assert len(trajectories) == 2 * 3 and [t.index for t in trajectories] == [0, 1, 2] * 2
    for g in range(2):
        leaves = trajectories[g * 3:(g + 1) * 3]
        first = [t.samples[0].token_ids[:next(s.end for s in t.samples[0].segments if s.role == "policy")] for t in leaves]
        assert first[0] == first[1] == first[2]  # turn 0 is one trunk, sampled once
    # a trunk that ended at turn 0 never branched: its 3 leaves are it and 2 copies
    ended = [g for g in range(2) if trajectories[g * 3].turns == 1]
    assert metrics[names.TREE_COPIES] == 2 * len(ended)
    for g in ended:
        assert all(t.samples[0].token_ids == trajectories[g * 3].samples[0].token_ids for t in trajectories[g * 3:g * 3 + 3])
    assert metrics[names.GENERATED_TOKENS] < metrics[names.TREE_LEAF_TOKENS]


def test_one_branch_point_at_turn_0_is_the_independent_rollout(tiny):
    """``--tree_turns [0] --tree_branches [G]``: the same seeds, the same trajectories as ``G``
    independent ones (one reset per row and G-1 forks instead of G resets)."""
    rows, _ = frozenlake_rows(num_train=2, num_heldout=0, seed=1, size=4, hole_rate=0.1)
    trees, metrics, _, _ = _episodes(tiny, rows=rows, seeds=[7, 8], schedule=TurnSchedule(branches=(3,), turns=(0,)))
    plain, plain_metrics, _, _ = _episodes(tiny, rows=rows, seeds=[7, 8], group_size=3)
    assert [t.samples[0].token_ids for t in trees] == [t.samples[0].token_ids for t in plain]
    assert [t.messages for t in trees] == [t.messages for t in plain]
    assert metrics[names.FORKS_NATIVE] == 2 * 2 and metrics[names.TREE_COPIES] == 0
    assert metrics[names.ENV_CALLS] == plain_metrics[names.ENV_CALLS] - 2 * 2  # two forks per row instead of resets
    assert metrics[names.GENERATED_TOKENS] == metrics[names.TREE_LEAF_TOKENS] == sum(t.count("policy") for t in plain)
