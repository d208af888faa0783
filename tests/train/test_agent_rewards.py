"""``--rewards`` on agent runs (``fastrl/train/agent/score.py``): what the functions receive of
a whole trajectory, the combination with the environment's outcome, and a real tiny-model
``--env calculator`` loop whose rewards come from a user's module in the reward pool's worker
process, the combined reward checked per trajectory and in the logged metrics."""

import json

import pytest
import torch

from fastrl.agents import metric_names as names
from fastrl.agents.trajectory import Trajectory
from fastrl.errors import InputError
from fastrl.train import TrainConfig
from fastrl.train.agent.score import TrajectoryScorer, trajectory_completion, trajectory_prompt
from fastrl.train.cli import parse_train_args
from fastrl.train.rewards import RewardPool, completion_text, exact_match_reward, format_reward, math_reward
from fastrl.train.trainer import Trainer

FEW_SHOT = [{"role": "user", "content": "Compute 1+1."}, {"role": "assistant", "content": "2"},
            {"role": "user", "content": "Compute 2*3+1."}]


def trajectory(messages, *, turns, outcome, row=None, error=""):
    t = Trajectory(group=0, index=0, row=row or {"answer": "7"}, env_seed=0, messages=messages, turns=turns,
                   outcome_reward=outcome, turn_rewards=[0.0] * turns, stop_reason="env_error" if error else "answer",
                   error=error)
    t.current.append("prompt", -1, [1, 2])
    for k in range(turns):
        t.current.append("policy", k, [10 + k, 20 + k], [0.0, 0.0])
    return t


def seen(prompts, completions, completion_ids, env_reward, stop_reason, answer, log_extra, **kwargs):
    """Records what it was given (as extra columns) and scores the last answer's length."""
    log_extra("seen", [json.dumps([p, c, ids, e, s, a]) for p, c, ids, e, s, a
                       in zip(prompts, completions, completion_ids, env_reward, stop_reason, answer)])
    return [float(len(completion_text(c))) for c in completions]


def test_a_trajectory_is_split_into_its_prompt_and_its_turns_and_combined_with_the_outcome():
    two_turns = trajectory([*FEW_SHOT, {"role": "assistant", "content": "calc(2*3+1)"}, {"role": "tool", "content": "7"},
                            {"role": "assistant", "content": "7"}], turns=2, outcome=1.0)
    assert trajectory_prompt(two_turns) == FEW_SHOT  # a few-shot assistant message stays in the prompt
    assert [m["content"] for m in trajectory_completion(two_turns)] == ["calc(2*3+1)", "7", "7"]
    failed = trajectory([FEW_SHOT[0], {"role": "assistant", "content": "calc(1+"}], turns=1, outcome=0.0, error="hung")
    wrong = trajectory([FEW_SHOT[0], {"role": "assistant", "content": "12"}], turns=1, outcome=0.0)
    with RewardPool([seen, "exact_match"], weights=[0.5, 2.0], num_workers=0) as pool:
        scores = TrajectoryScorer(rewards=pool, env_weight=0.25).score([two_turns, failed, wrong])
    # 0.25 * outcome + 0.5 * len(last answer) + 2 * exact_match; the failed environment's trajectory: 0
    torch.testing.assert_close(scores.rewards, torch.tensor([0.25 + 0.5 + 2.0, 0.0, 0.5 * 2]), rtol=0, atol=0)
    assert scores.env_rewards.tolist() == [1.0, 0.0, 0.0]
    assert scores.per_function["seen"].tolist() == [1.0, 0.0, 2.0] and scores.per_function["exact_match"].tolist() == [1, 0, 0]
    assert scores.metrics["reward/env/mean"] == pytest.approx(1 / 3) and scores.metrics["reward/seen/mean"] == 1.5
    assert scores.metrics["reward/seen/raised"] == 0 and scores.metrics["reward/non_finite_total"] == 0
    alone = TrajectoryScorer(rewards=None, env_weight=1.0).score([two_turns, wrong])
    assert alone.rewards.tolist() == [1.0, 0.0] and not alone.per_function


def test_the_functions_get_the_trajectory_and_a_clashing_row_field_is_an_input_error():
    t = trajectory([FEW_SHOT[0], {"role": "assistant", "content": "7"}], turns=1, outcome=1.0, row={"answer": "7", "n": 3})
    with RewardPool([seen], num_workers=0) as pool:
        scorer = TrajectoryScorer(rewards=pool, env_weight=1.0)
        result = pool.score([trajectory_prompt(t)], [trajectory_completion(t)], completion_ids=[[10, 20]],
                            columns=scorer.columns([t.row], {"env_reward": [1.0], "turn_rewards": [[1.0]], "stop_reason": ["answer"]}))
        assert json.loads(result.extra_columns["seen"][0]) == [[FEW_SHOT[0]], [{"role": "assistant", "content": "7"}],
                                                               [10, 20], 1.0, "answer", "7"]
        # the built-ins read a conversational completion's last assistant message
        boxed = [{"role": "assistant", "content": "calc(1+1)"}, {"role": "tool", "content": "2"},
                 {"role": "assistant", "content": "\\boxed{2}"}]
        assert format_reward([None], [boxed]) == [1.0] and math_reward([None], [boxed], answer=["2"]) == [1.0]
        assert format_reward([None], [boxed[:2]]) == [0.0]
        with pytest.raises(InputError, match="field 'stop_reason'"):
            scorer.validate(prompt=[FEW_SHOT[0]], row={"answer": "7", "stop_reason": "x"})


def test_env_reward_weight_is_an_agent_option_and_rewards_default_to_the_environment_alone():
    cfg = parse_train_args(["--env", "calculator", "--rewards", "[exact_match, m:f]", "--reward_weights", "[1, 2]",
                            "--env_reward_weight", "0.5"])
    assert (cfg.rewards, cfg.reward_weights, cfg.env_reward_weight) == (["exact_match", "m:f"], [1.0, 2.0], 0.5)
    assert TrainConfig(env="calculator").resolved().rewards == [] and TrainConfig().resolved().rewards == ["exact_match"]
    with pytest.raises(InputError, match="env_reward_weight is an agent option"):
        TrainConfig(env_reward_weight=0.5).resolved()
    with pytest.raises(InputError, match="without a reward"):
        TrainConfig(env="calculator", env_reward_weight=0.0).resolved()


def read_steps(run_dir):
    return [m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "event" not in m]


def test_an_env_run_trains_on_its_outcome_plus_a_users_reward_functions_in_a_worker(tmp_path):
    cfg = TrainConfig(env="calculator", output_dir=str(tmp_path / "run"), steps=2, prompts_per_step=2, group_size=2,
                      task_train_size=16, task_eval_size=3, eval_every=2, model_hidden_size=16, model_layers=1, sft_steps=2,
                      sft_check_every=1000, env_workers=1, max_turns=2, max_turn_tokens=8, progress=False, tensorboard=False,
                      seed=0, threads=1, reward_workers=1, rewards=["agent_user_rewards:turns_tenth", "exact_match"],
                      reward_weights=[0.5, 2.0], env_reward_weight=0.25)
    with Trainer(cfg) as trainer:
        assert len(trainer.rewards.worker_pids) == 1  # the reward pool's own worker process
        trainer.train()
        # one more rollout: each trajectory's reward (every sample's) is the rule's, computed here by hand
        rollout, _ = trainer.collector.collect(sampler=trainer.sampler, step=trainer.step, timer=trainer.timer)
        exp = trainer.collector.experience(rollout, device=trainer.device)
    expected = []
    for t in rollout.trajectories:
        exact = exact_match_reward([None], [trajectory_completion(t)], answer=[t.row["answer"]])[0]
        expected.append(0.25 * t.outcome_reward + 0.5 * 0.1 * t.turns + 2.0 * exact)
    want = torch.tensor(expected, dtype=torch.float32)[rollout.batch.trajectory_ids]
    torch.testing.assert_close(exp.rewards.cpu(), want, rtol=0, atol=1e-6)
    assert any(t.turns for t in rollout.trajectories)
    for step in read_steps(tmp_path / "run"):
        assert step["reward/turns_tenth/raised"] == step["reward/turns_tenth/invalid"] == step["reward/turns_tenth/timeout"] == 0
        assert step["reward/turns_tenth/mean"] == pytest.approx(0.1 * step[names.TURNS_MEAN])
        assert step["reward/turns_tenth/user/policy_tokens"] == pytest.approx(step["response/length_mean"])
        assert step["reward/env/mean"] == pytest.approx(step[names.OUTCOME_REWARD_MEAN])
        combined = 0.25 * step["reward/env/mean"] + 0.5 * step["reward/turns_tenth/mean"] + 2.0 * step["reward/exact_match/mean"]
        assert step["reward/mean"] == pytest.approx(combined, abs=1e-6)
        assert step["time/reward"] >= 0
    # the held-out evaluation (before step 1 and after step 2) reports each function's mean over
    # its greedy trajectories; its success is still the environment's outcome
    evals = [m for m in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if m.get("event") == "eval" and "eval/accuracy" in m]
    assert [e["step"] for e in evals] == [0, 2]
    for e in evals:
        assert e["eval/reward/turns_tenth"] == pytest.approx(0.1 * e["eval/turns_mean"]) and e["eval/turns_mean"] > 0
        assert 0 <= e["eval/reward/exact_match"] <= 1 and e["eval/accuracy"] == e["eval/reward_mean"]
