"""Ctrl-C (SIGINT) and SIGTERM stop `fastrl train` as users expect: a checkpoint, one line
naming `--resume latest`, exit status 128 + signal, no traceback (fastrl/train/run/interrupt.py).

Real processes and real signals; each signal is sent once the run has shown it reached the
stage under test (a checkpoint file, or the warm-up's first progress line), never after a sleep.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastrl.train.run.interrupt import RunInterrupted, StopRequests, exit_status

REPO = Path(__file__).resolve().parents[2]
TINY = ["--eval_every", "0", "--task_digits", "1", "--task_train_size", "60", "--task_eval_size", "8", "--model_hidden_size", "32",
        "--model_layers", "1", "--prompts_per_step", "4", "--group_size", "4", "--max_new_tokens", "3", "--reward_workers", "0",
        "--tensorboard", "false"]
WAIT_SECONDS = 300  # a bound on a loaded CI machine, never reached by a working run


def _start(out: Path, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "fastrl.cli", "train", "--output_dir", str(out), *TINY, *extra]
    return subprocess.Popen(args, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for(proc: subprocess.Popen, ready) -> list[str]:
    """Read the run's output line by line until ``ready(line)``; the lines read."""
    lines: list[str] = []
    deadline = time.time() + WAIT_SECONDS
    for line in proc.stdout:
        lines.append(line)
        if ready(line) or time.time() > deadline:
            break
    assert proc.poll() is None, "".join(lines)[-3000:]
    return lines


def test_exit_status_is_the_shells_convention():
    assert exit_status(signal.SIGINT) == 130 and exit_status(signal.SIGTERM) == 143


def test_a_first_signal_is_deferred_in_the_loop_and_a_second_raises():
    before = signal.getsignal(signal.SIGINT)  # Python's default_int_handler, or SIG_IGN in a job a shell put in the background
    with StopRequests() as stop:
        with pytest.raises(RunInterrupted) as outside:  # not deferring (setup, warm-up): at once
            os.kill(os.getpid(), signal.SIGTERM)
        assert outside.value.signum == signal.SIGTERM and not stop.requested
        stop.deferring = True
        os.kill(os.getpid(), signal.SIGINT)  # the loop's first: only asks
        assert stop.signum == signal.SIGINT
        with pytest.raises(RunInterrupted) as second:
            os.kill(os.getpid(), signal.SIGTERM)
        assert second.value.signum == signal.SIGINT  # the run is stopping for the first signal
    assert signal.getsignal(signal.SIGINT) is before  # the handlers come back


def test_ctrl_c_during_rl_checkpoints_says_resume_latest_and_the_run_resumes(tmp_path):
    """SIGINT once the checkpoint after the warm-up exists (RL is starting): the step in
    progress ends, a checkpoint is written, one line, 130; `--resume latest` (in this process)
    finishes the run with one metrics record per step."""
    from fastrl.cli import main

    out = tmp_path / "run"
    proc = _start(out, "--steps", "400", "--sft_steps", "5", "--progress", "false")
    try:
        deadline = time.time() + WAIT_SECONDS
        while time.time() < deadline and proc.poll() is None and not list((out / "checkpoints").glob("step-*/manifest.json")):
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before the signal"
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=WAIT_SECONDS)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith("fastrl train: stopped by SIGINT; checkpoint ") and f"--output_dir {out} --resume latest" in last
    stopped = json.loads(sorted((out / "checkpoints").glob("step-*/trainer_state.json"))[-1].read_text())["step"]
    assert 1 <= stopped < 400 and not (out / "final").exists()
    assert main(["train", "--output_dir", str(out), *TINY, "--sft_steps", "5", "--steps", str(stopped + 2), "--resume", "latest",
                 "--progress", "false"]) == 0
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"event"' not in line]
    assert steps == list(range(1, stopped + 3))


def _stop_during_the_warm_up(out: Path, signum: int, *extra: str) -> tuple[str, Path]:
    """Start a run whose warm-up cannot end on its own (100000 steps), send ``signum`` once it has
    printed its first step; the run's output and the warm-up checkpoint it names."""
    proc = _start(out, "--steps", "1", "--sft_steps", "100000", "--progress", "true", *extra)
    try:
        _wait_for(proc, lambda line: line.startswith("warm-up (SFT): step 1/"))
        proc.send_signal(signum)
        output, _ = proc.communicate(timeout=WAIT_SECONDS)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == exit_status(signum), output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    last = output.strip().splitlines()[-1]
    name = signal.Signals(signum).name
    assert last.startswith(f"fastrl train: stopped by {name}; checkpoint {out / 'checkpoints' / 'warmup-'}"), last
    assert f"--output_dir {out} --resume latest" in last, last
    (saved,) = [p for p in (out / "checkpoints").iterdir()]  # the warm-up's, complete (no .tmp), and nothing else
    assert saved.name.startswith("warmup-") and f"checkpoint {saved}:" in last
    return output, saved


def _resume_finishes(out: Path, saved: Path, capsys, *extra: str) -> None:
    """``--resume latest`` continues the warm-up from ``saved`` one step further (its settings are
    checked, its step count may change: its bar counts on from the steps done) and runs RL; the
    step-0 checkpoint then replaces the warm-up's."""
    from fastrl.cli import main

    done = json.loads((saved / "warmup_state.json").read_text())["steps_done"]
    assert done >= 1
    capsys.readouterr()
    assert main(["train", "--output_dir", str(out), *TINY, "--steps", "1", "--sft_steps", str(done + 1), "--progress", "true",
                 "--resume", "latest", *extra]) == 0
    err = capsys.readouterr().err
    assert f"warm-up (SFT): step {done + 1}/{done + 1}" in err and "warm-up (SFT): step 1/" not in err, err[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000000", "step-000001"]
    assert (out / "final").is_dir()
    warmup = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"sft/steps"' in line]
    assert [m["sft/steps"] for m in warmup] == [done + 1]  # the steps before the stop count


def test_sigterm_during_the_warm_up_saves_it_and_resume_latest_continues_it(tmp_path, capsys):
    """SIGTERM once the warm-up has printed its first step: the warm-up's state is saved at its
    next step boundary, one line names it and `--resume latest`, exit 143; resuming finishes."""
    out = tmp_path / "run"
    _, saved = _stop_during_the_warm_up(out, signal.SIGTERM)
    _resume_finishes(out, saved, capsys)


def test_ctrl_c_during_an_env_warm_up_saves_it_and_resume_latest_continues_it(tmp_path, capsys):
    """The same for the agent warm-up of `--env calculator` (SIGINT: exit 130)."""
    env = ["--env", "calculator", "--max_turns", "2", "--max_turn_tokens", "8", "--env_workers", "1", "--task_train_size", "16"]
    out = tmp_path / "run"
    _, saved = _stop_during_the_warm_up(out, signal.SIGINT, *env)
    _resume_finishes(out, saved, capsys, *env)


def test_a_damaged_or_partial_warm_up_checkpoint_is_refused_in_one_line(tmp_path, capsys):
    """Adversarial: a truncated file of the warm-up checkpoint, then one never completely
    written (only its ``.tmp``): `--resume latest` refuses each in one line, naming the problem."""
    from fastrl.cli import main
    from fastrl.train.cli import parse_train_args
    from fastrl.train.trainer import Trainer

    out = tmp_path / "run"
    stop = StopRequests()  # not entered: what its handler records when a signal arrives during the warm-up
    stop.signum = signal.SIGTERM
    with pytest.raises(RunInterrupted) as stopped:
        Trainer(parse_train_args(["--output_dir", str(out), *TINY, "--sft_steps", "5", "--progress", "false"]), stop=stop)
    saved = stopped.value.checkpoint
    assert saved == out / "checkpoints" / "warmup-000001" and saved.is_dir()
    weights = saved / "warmup.pt"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    args = ["train", "--output_dir", str(out), *TINY, "--steps", "1", "--sft_steps", "1", "--progress", "false",
            "--resume", "latest"]
    capsys.readouterr()
    assert main(args) == 2
    plan, *refusal = capsys.readouterr().err.strip().splitlines()  # the run's plan line, then the refusal alone
    assert plan.startswith("fastrl train: resuming from latest") and len(refusal) == 1, refusal
    assert "no checkpoint verifies" in refusal[0] and "warmup.pt" in refusal[0] and "truncated" in refusal[0], refusal
    saved.rename(saved.with_name(saved.name + ".tmp"))
    assert main(args) == 2
    plan, *refusal = capsys.readouterr().err.strip().splitlines()
    assert len(refusal) == 1 and "no complete checkpoint" in refusal[0], refusal
    assert not (out / "final").exists()


def test_the_checkpoint_after_the_warm_up_resumes_the_run_exactly(tmp_path):
    """What a stop before step 1 leaves (the step-0 checkpoint written once the warm-up ends)
    continues to bitwise the parameters of the uninterrupted run."""
    import torch

    from fastrl.train.config import TrainConfig
    from fastrl.train.trainer import Trainer

    def cfg(out, **changes):
        return TrainConfig(output_dir=str(out), steps=2, sft_steps=3, eval_every=0, model_hidden_size=32, model_layers=1,
                           task_digits=1, task_train_size=60, task_eval_size=8, prompts_per_step=4, group_size=4,
                           max_new_tokens=3, reward_workers=0, progress=False, tensorboard=False, lr=1e-3, **changes)

    def digits(prompts, completions, **kwargs):
        return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]

    with Trainer(cfg(tmp_path / "a"), reward_functions=[digits]) as trainer:
        trainer.train()
        straight = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    with Trainer(cfg(tmp_path / "b"), reward_functions=[digits]) as trainer:
        trainer.train(stop_after=0)
    assert [p.name for p in sorted((tmp_path / "b" / "checkpoints").iterdir())] == ["step-000000"]
    with Trainer(cfg(tmp_path / "b", resume="latest"), reward_functions=[digits]) as trainer:
        trainer.train()
        for k, v in trainer.policy.state_dict().items():
            assert torch.equal(v, straight[k]), k
