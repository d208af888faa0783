"""``fastrl train --env``: real tiny-model runs through the real loop and the real worker pool
(the built-in environments and a user's ``module:Class``), exact resume of an env run, and the
mistakes of §6 of issue 18 as one-line errors (exit 2) before the first step."""

import json

import pytest
import torch

from fastrl.agents import metric_names as names
from fastrl.cli import main
from fastrl.train import TrainConfig
from fastrl.train.trainer import Trainer

# tiny and quick: a 1-layer model, 2 rows x 2 trajectories per step, short turns
TINY = dict(steps=2, prompts_per_step=2, group_size=2, task_train_size=16, task_eval_size=2, model_hidden_size=16,
            model_layers=1, sft_steps=2, sft_check_every=1000, env_workers=1, reward_workers=0, max_turns=2,
            max_turn_tokens=8, progress=False, tensorboard=False, seed=0, threads=1)


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run(tmp_path, name, stop_after=None, **changes):
    cfg = TrainConfig(**{**TINY, "env": "calculator", "output_dir": str(tmp_path / name), "eval_every": 2, **changes})
    with Trainer(cfg) as trainer:
        trainer.train(stop_after=stop_after)
        return {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}


def test_a_branching_env_run_resumes_exactly(tmp_path):
    # --rollout tree: forks by replay (calculator has no fork()), the KV forked per sibling, trie training
    tree = dict(rollout="tree", group_size=4, tree_turns=[0, 1], tree_branches=[2, 2], eval_every=0)
    straight = run(tmp_path, "a", **tree)
    run(tmp_path, "b", stop_after=1, **tree)
    resumed = run(tmp_path, "b", resume="latest", **tree)
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
    steps_a = [m for m in read_metrics(tmp_path / "a") if "event" not in m]
    steps_b = [m for m in read_metrics(tmp_path / "b") if "event" not in m]
    assert [m["step"] for m in steps_b] == [1, 2] and steps_a[-1][names.FORKS_REPLAYED] > 0
    for key in ("loss/total", "reward/mean", names.GENERATED_TOKENS, names.ENV_CALLS, names.FORKS_REPLAYED):
        assert steps_a[-1][key] == steps_b[-1][key], key


def test_an_env_run_resumes_exactly_and_logs_trajectories(tmp_path):
    straight = run(tmp_path, "a")
    run(tmp_path, "b", stop_after=1)
    resumed = run(tmp_path, "b", resume="latest")
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
    steps_a = [m for m in read_metrics(tmp_path / "a") if "event" not in m]
    steps_b = [m for m in read_metrics(tmp_path / "b") if "event" not in m]
    assert [m["step"] for m in steps_b] == [1, 2]
    for key in ("loss/total", "reward/mean", names.TURNS_MEAN, names.ENV_TOKEN_SHARE):
        assert steps_a[-1][key] == steps_b[-1][key], key
    last = steps_a[-1]
    assert last["rollout/samples"] == 4 and 1 <= last[names.TURNS_MEAN] <= 2
    assert last["rollout/logp_gap_max"] < 1e-3  # the HF sampler's log-probs are the trainer's (policy tokens only)
    assert last[names.ENV_SECONDS] > 0
    if last[names.TOKENIZATION_CHECKED_TURNS]:  # the rate is logged only when a turn was checked
        assert 0 <= last[names.TOKENIZATION_MISMATCH_RATE] <= 1
    else:
        assert names.TOKENIZATION_MISMATCH_RATE not in last
    evals = [m for m in read_metrics(tmp_path / "a") if m.get("event") == "eval" and "eval/accuracy" in m]
    assert [m["step"] for m in evals] == [0, 2] and all(0 <= m["eval/tool_call_rate"] <= 1 for m in evals)
    for m in evals:  # each held-out row's success, for the paired view of two evaluations
        assert len(m["row_success"]) == TINY["task_eval_size"] and set(m["row_success"]) <= {0, 1}
        assert sum(m["row_success"]) / len(m["row_success"]) == pytest.approx(m["eval/accuracy"])
    samples = (tmp_path / "a" / "samples.txt").read_text()
    assert "=== step 2 best" in samples and "[prompt] <bos><|user|>Compute " in samples and "[policy 0] " in samples


@pytest.mark.parametrize("env, extra", [
    ("sql", ["--max_turn_tokens", "8"]),
    # an unreachable warm-up target, probed sooner near it: at step 2, then 1 or 2 steps on, to the last step
    ("frozenlake", ["--algorithm", "ppo", "--sft_steps", "4", "--sft_check_every", "2", "--sft_target_accuracy", "1.0",
                    "--sft_probe_sooner", "true"]),
    ("agent_user_envs:EchoEnv", []),
    ("agent_user_envs:HangingEnv", ["--failed_trajectories", "mask", "--env_step_timeout", "3"]),
])
def test_fastrl_train_env_runs_a_step(tmp_path, env, extra):
    out = tmp_path / "run"
    args = ["train", "--env", env, "--output_dir", str(out), "--steps", "1", "--eval_every", "1"]
    for name in ("prompts_per_step", "group_size", "task_train_size", "task_eval_size", "model_hidden_size", "model_layers",
                 "env_workers", "reward_workers", "max_turns", "progress", "tensorboard", "threads"):
        if f"--{name}" not in extra:
            args += [f"--{name}", str(TINY[name]).lower()]
    if ":" not in env and "--sft_steps" not in extra:
        args += ["--sft_steps", "1", "--sft_check_every", "1000"]
    assert main(args + extra) == 0
    step = [m for m in read_metrics(out) if "event" not in m][0]
    assert step["rollout/samples"] == 4 and step[names.TURNS_MEAN] > 0 and names.stop("max_turns") in step
    if ":" not in env:  # the warm-up ran; sql's and frozenlake's demonstrations share most of their tokens: a trie
        warm = [m for m in read_metrics(out) if "sft/steps" in m][0]
        steps = int(extra[extra.index("--sft_steps") + 1]) if "--sft_steps" in extra else 1
        assert warm["sft/steps"] == warm["sft/trie_steps"] == steps
        if "--sft_target_accuracy" in extra:  # a probe at 2, then 1 or 2 steps on (the accuracy is below 1)
            assert warm["sft/probes"] == len(warm["probes"]) >= 2 and warm["probes"][0][0] == 2
            assert [s for s, _ in warm["probes"]][-1] <= 4 and 0 <= warm["sft/probe_accuracy"] < 1
        else:
            assert "sft/probes" not in warm
    if "Hanging" in env:  # one of the step's two rows hangs at reset, in both of its trajectories
        assert step[names.stop("env_timeout")] == step[names.EXCLUDED] == 2
    assert (out / "final" / "config.json").exists()


@pytest.mark.parametrize("args, message", [
    (["--env", "agent_user_envs:NoStepEnv"], "has no step() method"),
    (["--env", "agent_user_envs:UndocumentedToolEnv"], "lookup"),
    (["--env", "agent_user_envs:TextResetEnv"], "reset()"),
    (["--env", "no_such_module:Env"], "could not be imported"),
    (["--env", "agent_user_envs:Missing"], "has no class or callable"),
    (["--env", "calculator", "--env_call_format", "hermes"], "does not render tools"),
    (["--max_turns", "3"], "needs --env"),
])
def test_bad_env_input_is_one_line_before_the_first_step(tmp_path, capsys, args, message):
    out = tmp_path / "run"
    assert main(["train", *args, "--output_dir", str(out), "--progress", "false", "--tensorboard", "false",
                 "--model_layers", "1", "--model_hidden_size", "16", "--env_workers", "1", "--reward_workers", "0"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("fastrl train: error: ") and message in lines[-1]
    assert not (out / "metrics.jsonl").exists()


def test_the_agent_options_are_agent_configs_fields_with_its_docs(capsys):
    import dataclasses

    from fastrl.agents.driver import AgentConfig
    from fastrl.train.cli import build_train_parser
    from fastrl.train.config import AGENT_FIELDS

    from fastrl.agents.envs import BUILTIN_ENVS
    from fastrl.train.env_task import ENV_TASKS

    assert AGENT_FIELDS == tuple(f.name for f in dataclasses.fields(AgentConfig)) and set(ENV_TASKS) == set(BUILTIN_ENVS)
    assert all(f.default is None for f in dataclasses.fields(TrainConfig) if f.name in AGENT_FIELDS)
    text = " ".join(build_train_parser().format_help().split())
    assert "--max_turns MAX_TURNS Policy turns per trajectory at most" in text
    cfg = TrainConfig(env="frozenlake", max_turns=5, failed_trajectories="mask").resolved()
    assert cfg.agent_config() == AgentConfig(**{**dataclasses.asdict(cfg.agent_config()), "max_turns": 5,
                                                 "failed_trajectories": "mask"})
    assert cfg.agent_config().max_turn_tokens == 8  # the built-in environment's default (ENV_TASKS)
    from fastrl.train.config import DEFAULT_RL_STEPS

    # RL steps: the default for every built-in environment; a given --steps wins
    assert TrainConfig(env="sql").resolved().steps == DEFAULT_RL_STEPS
    assert TrainConfig(env="sql", steps=3).resolved().steps == 3
    assert TrainConfig(env="calculator").resolved().steps == TrainConfig().resolved().steps == DEFAULT_RL_STEPS
