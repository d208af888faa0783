"""TrainConfig presets, validation and the generated command line."""

import dataclasses
from pathlib import Path

import torch

import pytest
import yaml

from fastrl.config import PolicyLossConfig
from fastrl.errors import InputError
from fastrl.train.cli import build_train_parser, parse_train_args
from fastrl.train.config import ALGORITHM_PRESETS, ALGORITHMS, TrainConfig


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_presets_map_onto_op_presets(algorithm):
    from fastrl.train.config import TURN_MODES

    preset = ALGORITHM_PRESETS[algorithm]
    agent = {"env": "frozenlake"} if preset.advantage in TURN_MODES else {}  # turn credit needs trajectories
    cfg = TrainConfig(algorithm=algorithm, **agent).resolved()
    loss = cfg.policy_loss_config()
    expected = PolicyLossConfig.preset(preset.loss_preset, norm_length=cfg.max_new_tokens) if algorithm == "dr_grpo" else PolicyLossConfig.preset(preset.loss_preset)
    for name in ("ratio_level", "clip_low", "clip_high", "loss_agg"):
        assert getattr(loss, name) == getattr(expected, name), name
    assert cfg.advantage_mode == preset.advantage
    assert cfg.uses_critic == (algorithm == "ppo")
    assert cfg.dynamic_sampling == (algorithm == "dapo")
    assert loss.kl_coef == preset.kl_coef


def test_dr_grpo_norm_length_is_the_longest_completion():
    loss = TrainConfig(algorithm="dr_grpo", max_new_tokens=37).resolved().policy_loss_config()
    assert loss.loss_agg == "seq-mean-token-sum-norm" and loss.norm_length == 37.0


def test_explicit_fields_override_the_preset():
    cfg = TrainConfig(algorithm="grpo", clip_high=0.28, kl_coef=0.0, advantage_mode="rloo").resolved()
    assert cfg.policy_loss_config().clip_high == 0.28
    assert cfg.policy_loss_config().kl_coef == 0.0 and not cfg.uses_reference
    assert cfg.advantage_mode == "rloo"


def test_kl_in_reward_moves_beta_out_of_the_loss():
    cfg = TrainConfig(algorithm="ppo", kl_coef=0.1, kl_in_reward=True).resolved()
    assert cfg.policy_loss_config().kl_coef == 0.0 and cfg.uses_reference


@pytest.mark.parametrize(
    "changes, needle",
    [
        (dict(group_size=1), "group_size"),
        (dict(lr=-1.0), "lr"),
        (dict(lr=float("nan")), "lr"),
        (dict(algorithm="sac"), "algorithm"),
        (dict(advantage_mode="mean"), "advantage_mode"),
        (dict(reward_weights=[1.0, 2.0]), "reward_weights"),
        (dict(rollout_correction="bypass", ppo_epochs=2), "bypass"),
        (dict(kl_target=1.0, kl_coef=0.0), "kl_target"),
        (dict(critic_init="/x"), "critic_init"),
        (dict(loss_agg="sum"), "loss_agg"),
        (dict(steps=0), "steps"),
        (dict(adam_betas=[0.9]), "adam_betas"),
    ],
)
def test_bad_options_fail_before_any_work(changes, needle):
    with pytest.raises(ValueError, match=needle):
        TrainConfig(**changes).resolved()


def test_help_lists_every_option_with_its_doc(capsys):
    with pytest.raises(SystemExit) as e:
        build_train_parser().parse_args(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(TrainConfig):
        assert f"--{f.name}" in text, f.name
    # attribute docstrings are the help text
    assert "Completions per prompt (G)." in text
    assert "Held-out evaluation every N steps" in text


def test_yaml_file_plus_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"algorithm": "dapo", "steps": 7, "lr": 1e-3, "rewards": ["exact_match", "format"],
                                    "reward_weights": [1.0, 0.1]}))
    cfg = parse_train_args(["--config", str(path), "--steps", "9"])
    assert (cfg.algorithm, cfg.steps, cfg.lr) == ("dapo", 9, 1e-3)
    assert cfg.rewards == ["exact_match", "format"] and cfg.reward_weights == [1.0, 0.1]
    assert cfg.dynamic_sampling is True  # resolved from the preset


@pytest.mark.parametrize("argv", [["--lrr", "1"], ["--algorithm", "sac"], ["--group_size", "x"]])
def test_unknown_or_bad_options_exit_with_an_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse_train_args(argv)
    assert e.value.code != 0


def test_unknown_yaml_key_is_an_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("stepz: 3\n")
    with pytest.raises(SystemExit):
        parse_train_args(["--config", str(path)])


def _train_exit_code(argv: list[str]) -> int:
    """`fastrl train ARGV`'s exit status, in process (a parse error exits, an InputError returns 2)."""
    from fastrl.cli import main

    try:
        return main(["train", *argv])
    except SystemExit as e:
        return e.code


def test_semantic_errors_from_the_command_line_exit_cleanly(capsys):
    assert _train_exit_code(["--rollout_correction", "bypass", "--ppo_epochs", "2"]) == 2
    assert "bypass" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--algorithm", "gigpo"], ["--algorithm", "mt_grpo"],
                                  ["--advantage_mode", "turn_discounted"]])
def test_turn_modes_without_an_environment_are_one_line(argv, capsys, tmp_path):
    assert _train_exit_code(["--output_dir", str(tmp_path / "run"), *argv]) == 2
    message = capsys.readouterr().err.strip()
    assert len(message.splitlines()) == 1 and "--env" in message and "Traceback" not in message, message
    assert not (tmp_path / "run").exists()


def test_turn_presets_fill_the_turn_hyperparameters():
    from fastrl.train.config import TURN_MODES

    assert TURN_MODES == ("gigpo", "turn_discounted")
    gigpo, mt = ALGORITHM_PRESETS["gigpo"], ALGORITHM_PRESETS["mt_grpo"]
    assert (gigpo.advantage, gigpo.turn_gamma) == ("gigpo", 0.95)
    assert (mt.advantage, mt.turn_gamma, mt.turn_coef, mt.outcome_coef) == ("turn_discounted", 0.0, 1.0, 1.0)
    # a group preset with a turn mode chosen by hand: the plain turn-discount form
    plain = ALGORITHM_PRESETS["grpo"]
    assert (plain.turn_gamma, plain.turn_coef, plain.outcome_coef) == (1.0, 1.0, 0.0)
    cfg = TrainConfig(algorithm="mt_grpo", env="frozenlake", turn_coef=0.5).resolved()
    assert (cfg.advantage_mode, cfg.turn_gamma, cfg.turn_coef, cfg.outcome_coef) == ("turn_discounted", 0.0, 0.5, 1.0)
    assert TrainConfig(algorithm="gigpo", env="frozenlake").resolved().turn_gamma == 0.95


def test_each_vocabulary_has_one_list():
    """Algorithm names come from the presets; the loss options' choices are the op-level Literals."""
    import typing

    from fastrl.config import KL_ESTIMATORS, LOSS_AGGS, SURROGATES, KLEstimator, LossAgg, Surrogate
    from fastrl.reference.advantages import GROUP_MODES
    from fastrl.train.config import Algorithm

    assert typing.get_args(Algorithm) == ALGORITHMS == tuple(ALGORITHM_PRESETS)
    assert (LOSS_AGGS, SURROGATES, KL_ESTIMATORS) == tuple(typing.get_args(t) for t in (LossAgg, Surrogate, KLEstimator))
    hints = typing.get_type_hints(TrainConfig)
    assert hints["loss_agg"] == typing.Optional[LossAgg]
    assert hints["surrogate"] == typing.Optional[Surrogate]
    assert hints["kl_estimator"] == KLEstimator
    from fastrl.reference.turn_advantages import TURN_ADVANTAGE_MODES
    from fastrl.train.config import TURN_MODES

    assert typing.get_args(typing.get_args(hints["advantage_mode"])[0]) == (*GROUP_MODES, "gae", *TURN_MODES)
    assert set(TURN_MODES) == set(TURN_ADVANTAGE_MODES) - {"broadcast"}


def test_kl_coef_default_is_the_loss_presets():
    # GRPO's 0.04 is written once, in PolicyLossConfig.preset("grpo")
    from fastrl.train.config import TURN_MODES

    for name, preset in ALGORITHM_PRESETS.items():
        want = PolicyLossConfig.preset_settings(preset.loss_preset).get("kl_coef", PolicyLossConfig().kl_coef)
        agent = {"env": "frozenlake"} if preset.advantage in TURN_MODES else {}
        assert TrainConfig(algorithm=name, **agent).resolved().kl_coef == want, name
    assert TrainConfig(algorithm="grpo").resolved().kl_coef == PolicyLossConfig.preset("grpo").kl_coef > 0


# ---------------------------------------------------------------- every option checked before any work (issue 21, defect 6)
BAD_OPTIONS = [
    ("top_p", "0"), ("top_p", "1.5"), ("top_k", "-1"), ("seed", "-1"), ("seed", str(2**40)), ("kl_coef", "1e300"),
    ("kl_coef", "-1"), ("weight_decay", "-5"), ("entropy_coef", "1e300"), ("entropy_coef", "nan"), ("temperature", "0"),
    ("lr", "inf"), ("critic_lr", "-1"), ("grad_clip", "-1"), ("clip_low", "-0.1"), ("dual_clip", "0.5"),
    ("value_clip", "0"), ("is_cap", "0"), ("sync_probe_tolerance", "0"), ("threads", "0"), ("max_prompt_length", "0"),
    ("prompt_token_budget", "0"), ("reward_timeout", "1e400"), ("sampler_timeout", "0"), ("eval_fraction", "1"),
    ("device", "tpu"), ("reward_weights", "[1e300]"), ("adam_betas", "[0.9, 1.0]"), ("min_lr_ratio", "2"),
]


@pytest.mark.parametrize(("option", "value"), BAD_OPTIONS, ids=[f"{o}={v}" for o, v in BAD_OPTIONS])
def test_a_bad_option_is_refused_naming_it_before_the_output_directory_exists(option, value, tmp_path, capsys):
    out = tmp_path / "run"
    assert _train_exit_code(["--output_dir", str(out), f"--{option}", value]) == 2
    message = capsys.readouterr().err
    assert option in message, message
    assert message.startswith("fastrl train: error:") or message.startswith("usage:"), message
    assert "Traceback" not in message
    assert not out.exists()


@pytest.mark.parametrize(("option", "value"), [("top_p", 0.0), ("dtype", "fp8"), ("kl_estimator", "k9"), ("steps", 2.5),
                                               ("tensorboard", "yes"), ("rewards", [3]), ("seed", -1)])
def test_fields_set_from_python_are_type_checked_too(option, value):
    from fastrl.errors import InputError

    with pytest.raises(InputError, match=option):
        TrainConfig(**{option: value}).resolved()


def test_the_warm_up_answer_weight_is_the_environments_and_an_agent_option():
    assert TrainConfig(env="sql").resolved().sft_answer_weight == 1.0
    assert TrainConfig(env="frozenlake", model="some/model").resolved(model_given=True).sft_answer_weight == 1.0
    assert TrainConfig(env="sql", sft_answer_weight=3.0).resolved().sft_answer_weight == 3.0
    with pytest.raises(InputError, match="sft_answer_weight"):
        TrainConfig(sft_answer_weight=2.0).resolved().validate()
    with pytest.raises(InputError, match="sft_answer_weight"):
        TrainConfig(env="sql", sft_answer_weight=0.0).resolved().validate()


def test_the_built_in_models_heads_are_an_option_that_must_divide_its_width():
    from fastrl.train.env_task import ENV_TASKS
    from fastrl.train.policy import load_model
    from fastrl.commands.plan import builtin_train_model_shape

    assert TrainConfig().resolved().model_heads == 4
    assert TrainConfig(env="sql").resolved().model_heads == ENV_TASKS["sql"].heads
    cfg = TrainConfig(env="calculator", model_heads=2).resolved()
    assert builtin_train_model_shape(cfg).heads == 2
    _, policy = load_model(cfg, model=None, tokenizer=None, resume_dir=None, device=torch.device("cpu"))
    assert policy.config.num_attention_heads == 2 and policy.config.hidden_size // 2 == 32
    with pytest.raises(InputError, match="model_heads"):
        TrainConfig(model_heads=3).resolved().validate()
    with pytest.raises(InputError, match="model_heads"):
        TrainConfig(model_heads=0).resolved().validate()


def test_default_output_folders_are_one_per_task_and_never_collide(tmp_path):
    from fastrl.train.rundir import LOCK_FILE, default_output_dir, default_run_name

    assert default_run_name(env=None, dataset=None) == "default"
    assert default_run_name(env="calculator", dataset=None) == "calculator"
    assert default_run_name(env="my_envs.shop:ShopEnv", dataset=None) == "shopenv"
    assert default_run_name(env=None, dataset="data/train.jsonl") == "train"
    assert default_run_name(env=None, dataset="org/gsm8k") == "gsm8k"
    assert default_run_name(env=None, dataset=None, model="Qwen/Qwen2.5-0.5B") == "qwen2-5-0-5b"
    assert default_run_name(env=None, dataset=None, model="./my-model/") == "my-model"
    root = tmp_path / "runs"

    def new(name="default"):
        return default_output_dir(name, resume=None, overwrite=False, root=root)

    assert new() == str(root / "default")
    (root / "default").mkdir(parents=True)
    (root / "default" / LOCK_FILE).write_text("")  # what a run interrupted before writing anything leaves
    assert new() == str(root / "default")
    (root / "default" / "checkpoints").mkdir()
    assert new() == str(root / "default-2") and new("calculator") == str(root / "calculator")
    (root / "default-2").mkdir()
    (root / "default-2" / "metrics.jsonl").write_text("")  # a run without checkpoints yet
    assert new() == str(root / "default-3")
    # resume latest: the newest folder of the task that holds checkpoints
    assert default_output_dir("default", resume="latest", overwrite=False, root=root) == str(root / "default")
    (root / "default-2" / "checkpoints").mkdir()
    assert default_output_dir("default", resume="latest", overwrite=False, root=root) == str(root / "default-2")
    step = root / "default" / "checkpoints" / "step-000003"
    assert default_output_dir("default", resume=str(step), overwrite=False, root=root) == str(root / "default")
    assert default_output_dir("default", resume=None, overwrite=True, root=root) == str(root / "default")
    assert default_output_dir("default", resume=None, overwrite=False, numbered=False, root=root) == str(root / "default")


def test_a_given_output_dir_is_kept_and_none_resolves_per_task(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert TrainConfig(output_dir="somewhere").resolved().output_dir == "somewhere"
    assert TrainConfig().resolved().output_dir == str(Path("runs") / "default")
    assert TrainConfig(env="calculator").resolved().output_dir == str(Path("runs") / "calculator")


def test_the_agent_fields_are_agent_configs_fields_written_out_in_its_order():
    """TrainConfig's agent block, written out as fields, is AgentConfig's field list: same names in the
    same order right after ``env_reward_weight``, each ``Optional`` of AgentConfig's type, default None
    (the environment's default). A field added to AgentConfig without its TrainConfig option fails here."""
    import typing
    from typing import Optional

    from fastrl.agents.driver import AgentConfig
    from fastrl.train.config import AGENT_FIELDS

    agent = [f.name for f in dataclasses.fields(AgentConfig)]
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    start = names.index("env_reward_weight") + 1
    assert tuple(names[start:start + len(agent)]) == tuple(agent) == AGENT_FIELDS
    assert names[start + len(agent)] == "eval_every"  # the block's place in --help and config.yaml
    theirs, ours = typing.get_type_hints(AgentConfig), typing.get_type_hints(TrainConfig)
    by_name = {f.name: f for f in dataclasses.fields(TrainConfig)}
    for name in agent:
        assert ours[name] == Optional[theirs[name]], name
        assert by_name[name].default is None, name
