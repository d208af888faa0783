"""The trainer under faults and mistakes (issue 21): damaged checkpoints, resumes that never
duplicate a step, one run per directory, a full disk, overflowing rewards, divergence
messages. Real runs of the tiny built-in model, real files, real processes; nothing here
depends on timing."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fastrl.errors import InputError
from fastrl.train import TrainConfig
from fastrl.train.run.checkpoint import checkpoint_dir, list_checkpoints, save_checkpoint
from fastrl.train.run.faults import CheckpointDiskFullError, NonFiniteWeightsError
from fastrl.train.run.manifest import MANIFEST_FILE, verify_checkpoint
from fastrl.train.run.metrics import MetricsLogger
from fastrl.train.rewards import NON_FINITE_TOTAL_METRIC, RewardPool
from fastrl.train.rundir import lock_run_directory
from fastrl.train.task import char_tokenizer, tiny_model
from fastrl.train.trainer import Trainer, TrainingDivergedError

REPO = Path(__file__).resolve().parents[2]


def tiny(output_dir: Path, **changes) -> TrainConfig:
    base = dict(
        output_dir=str(output_dir), steps=3, prompts_per_step=4, group_size=4, max_new_tokens=3,
        task_digits=1, task_train_size=60, task_eval_size=8, model_hidden_size=32, model_layers=1, sft_steps=0,
        eval_every=0, reward_workers=0, progress=False, tensorboard=False, seed=0, lr=1e-3,
    )
    base.update(changes)
    return TrainConfig(**base)


def digit_share(prompts, completions, **kwargs):
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def steps_logged(output_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()
            if "event" not in json.loads(line)]


# ---------------------------------------------------------------------- damaged checkpoints (defect 2)
@pytest.fixture(scope="module")
def paused_run(tmp_path_factory) -> Path:
    """A run paused after step 2 with checkpoints at steps 1 and 2."""
    out = tmp_path_factory.mktemp("paused") / "run"
    with Trainer(tiny(out, save_every=1, keep_checkpoints=3), reward_functions=[digit_share]) as trainer:
        trainer.train(stop_after=2)
    assert [path.name for path in list_checkpoints(out)] == ["step-000001", "step-000002"]
    return out


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garble_start(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:40] = b"#" * 32  # the safetensors header / the JSON's first keys
    path.write_bytes(bytes(data))


def _finite_garbage_in_weights(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 0.5  # finite, same size: only the hash can tell
    save_file(tensors, path, metadata={"format": "pt"})


def _nan_in_weights(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, path, metadata={"format": "pt"})


DAMAGES = {
    "truncated_weights": ("policy/model.safetensors", _truncate),
    "garbled_weights_header": ("policy/model.safetensors", _garble_start),
    "finite_garbage_in_weights": ("policy/model.safetensors", _finite_garbage_in_weights),
    "nan_in_weights": ("policy/model.safetensors", _nan_in_weights),
    "truncated_optimizer": ("optim.pt", _truncate),
    "garbled_trainer_state": ("trainer_state.json", _garble_start),
    "missing_manifest": (MANIFEST_FILE, lambda path: path.unlink()),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_resume_latest_skips_a_damaged_newest_checkpoint_and_says_why(paused_run, tmp_path, damage, caplog):
    out = tmp_path / "run"
    shutil.copytree(paused_run, out)
    name, spoil = DAMAGES[damage]
    spoil(checkpoint_dir(out, 2) / name)
    problem = verify_checkpoint(checkpoint_dir(out, 2))
    assert problem is not None and "step-000002" in problem
    assert verify_checkpoint(checkpoint_dir(out, 1)) is None
    with caplog.at_level(logging.WARNING, logger="fastrl.train.run.checkpoint"):
        trainer = Trainer(tiny(out, save_every=1, keep_checkpoints=3, resume="latest"), reward_functions=[digit_share])
    try:
        assert trainer.resume_dir == checkpoint_dir(out, 1) and trainer.step == 1
        skipped = [record.getMessage() for record in caplog.records if "skipped" in record.getMessage()]
        assert len(skipped) == 1 and "step-000002" in skipped[0] and name.split("/")[-1] in skipped[0], skipped
        trainer.train()
    finally:
        trainer.close()
    assert steps_logged(out) == [1, 2, 3]  # step 2 redone from step 1, logged once


def test_an_explicitly_named_damaged_checkpoint_is_refused_naming_file_and_step(paused_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(paused_run, out)
    _truncate(checkpoint_dir(out, 2) / "optim.pt")
    with pytest.raises(InputError, match=r"step-000002 \(step 2\): optim.pt has \d+ bytes"):
        Trainer(tiny(out, resume=str(checkpoint_dir(out, 2))))


def test_no_checkpoint_that_verifies_is_an_input_error_listing_each(paused_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(paused_run, out)
    for step in (1, 2):
        _truncate(checkpoint_dir(out, step) / "policy" / "model.safetensors")
    with pytest.raises(InputError, match="no checkpoint verifies.*step-000002.*step-000001"):
        Trainer(tiny(out, resume="latest"))


def test_non_finite_weights_are_never_checkpointed(tmp_path):
    tokenizer = char_tokenizer()
    model = tiny_model(tokenizer, hidden_size=32, layers=1, heads=2, seed=0)
    directory = checkpoint_dir(tmp_path, 1)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("inf")
    with pytest.raises(NonFiniteWeightsError, match="step 1: the policy weights are not finite"):
        save_checkpoint(directory, models={"policy": model}, tokenizer=tokenizer, objects={}, state={"step": 1}, keep=2)
    assert not directory.exists() and not directory.with_name(directory.name + ".tmp").exists()


def test_non_finite_weights_are_never_checkpointed_by_the_distributed_writer(tmp_path):
    from fastrl.train.run.checkpoint import save_distributed_checkpoint

    tokenizer = char_tokenizer()
    model = tiny_model(tokenizer, hidden_size=32, layers=1, heads=2, seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    directory = checkpoint_dir(tmp_path / "run", 1)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(NonFiniteWeightsError, match="step 1: the policy weights are not finite"):
            save_distributed_checkpoint(
                directory, models={"policy": model}, optimizers={"policy": (model, optimizer)}, schedulers={},
                state={"step": 1}, hf_policy=model, tokenizer=tokenizer, rank=0, barrier=torch.distributed.barrier,
                keep=2)
    finally:
        torch.distributed.destroy_process_group()
    assert not directory.exists() and not directory.with_name(directory.name + ".tmp").exists()


# ---------------------------------------------------------------------- one record per step (defect 1)
def test_a_resumed_logger_leaves_tensorboard_one_value_per_step(tmp_path):
    """Steps 1..5 logged, the run resumed from step 3's checkpoint logs 4..5 again: TensorBoard's
    own reader (EventAccumulator, as the TensorBoard UI loads a run) shows each step once, the
    resumed run's values for 4 and 5."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fastrl.train.run.metrics import MetricsLogger

    first = MetricsLogger(tmp_path, total_steps=5, progress=False)
    for step in range(1, 6):
        first.log(step, {"reward/mean": float(step)})
    first.close()  # a killed run's events are on disk up to step 5
    resumed = MetricsLogger(tmp_path, total_steps=5, progress=False, start_step=3)
    for step in range(4, 6):
        resumed.log(step, {"reward/mean": 10.0 + step})
    resumed.close()
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2  # both runs' files are read
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0)]


def test_a_resumed_logger_drops_what_a_killed_run_logged_past_the_checkpoint(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=10, tensorboard=False, progress=False)
    for step in range(1, 9):
        logger.log(step, {"reward/mean": float(step)})
        logger.write_samples(step, ("p", f"best {step}", 1.0), ("p", f"worst {step}", 0.0))
        if step % 3 == 0:
            logger.log_eval(step, {"eval/accuracy": 0.5})
    logger.close()
    with open(tmp_path / "metrics.jsonl", "a") as torn:
        torn.write('{"step": 9, "rew')  # killed mid-line
    resumed = MetricsLogger(tmp_path, total_steps=10, tensorboard=False, progress=False, start_step=6)
    for step in range(7, 11):
        resumed.log(step, {"reward/mean": float(step)})
        resumed.write_samples(step, ("p", f"best {step}", 1.0), ("p", f"worst {step}", 0.0))
    resumed.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "event" not in r] == list(range(1, 11))
    assert [r["step"] for r in records if "event" in r] == [3, 6]
    headers = [line for line in (tmp_path / "samples.txt").read_text().splitlines() if line.startswith("=== step")]
    assert [int(line.split()[2]) for line in headers] == [step for step in range(1, 11) for _ in (0, 1)]


# ---------------------------------------------------------------------- one run per directory (defect 5)
_HOLDER = textwrap.dedent(
    """
    import sys
    from fastrl.train.rundir import lock_run_directory
    lock = lock_run_directory(sys.argv[1])
    print("locked", flush=True)
    sys.stdin.read()  # holds the lock until the test kills this process
    """
)


def test_a_second_run_on_a_locked_directory_is_refused_and_a_dead_holder_leaves_no_lock(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(InputError, match=rf"in use by another fastrl run \(pid {holder.pid}\)"):
            Trainer(tiny(out, steps=1))
        assert not (out / "metrics.jsonl").exists() and not (out / "reference").exists()
    finally:
        holder.kill()  # SIGKILL: no cleanup runs; the kernel drops the lock with the process
        holder.wait()
    with Trainer(tiny(out, steps=1), reward_functions=[digit_share]) as trainer:
        trainer.train()
    assert steps_logged(out) == [1]


def test_a_forked_child_does_not_keep_the_directory_locked(tmp_path):
    import multiprocessing

    lock = lock_run_directory(tmp_path)
    context = multiprocessing.get_context("fork")
    release_child = context.Event()
    child = context.Process(target=release_child.wait, daemon=True)
    child.start()
    try:
        lock.release()
        probe = subprocess.run([sys.executable, "-c", "import sys; from fastrl.train.rundir import lock_run_directory; "
                                "lock_run_directory(sys.argv[1]); print('ok')", str(tmp_path)],
                               capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert probe.stdout.strip() == "ok", probe.stderr
    finally:
        release_child.set()
        child.join()


def test_an_output_directory_that_cannot_be_written_is_an_input_error(tmp_path):
    target = tmp_path / "readonly"
    target.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(target)], capture_output=True)
    if mounted.returncode != 0:
        target.chmod(0o500)
        if os.access(target, os.W_OK):
            pytest.skip("cannot make a read-only directory here (root without mount)")
    try:
        with pytest.raises(InputError, match="cannot be written"):
            lock_run_directory(target / "run")
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", str(target)], check=True)
        target.chmod(0o700)


# ---------------------------------------------------------------------- a full disk (defect 11)
_FILL_THEN_SAVE = textwrap.dedent(
    """
    import resource, signal, sys
    from pathlib import Path
    import torch
    from fastrl.train.run.checkpoint import checkpoint_dir, save_checkpoint, save_distributed_checkpoint
    from fastrl.train.run.faults import CheckpointDiskFullError
    from fastrl.train.task import char_tokenizer, tiny_model

    out, mode, writer = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    tokenizer = char_tokenizer()
    model = tiny_model(tokenizer, hidden_size=32, layers=1, heads=2, seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()

    def save(step):
        if writer == "dcp":  # torchrun's sharded checkpoint, a gloo group of one process
            return save_distributed_checkpoint(
                checkpoint_dir(out, step), models={"policy": model}, optimizers={"policy": (model, optimizer)},
                schedulers={}, state={"step": step}, hf_policy=model, tokenizer=tokenizer, rank=0,
                barrier=torch.distributed.barrier, keep=2)
        return save_checkpoint(checkpoint_dir(out, step), models={"policy": model}, tokenizer=tokenizer,
                               objects={"optimizer": optimizer}, state={"step": step}, keep=2)

    if writer == "dcp":
        torch.distributed.init_process_group("gloo", init_method=f"file://{out.parent / 'store'}", rank=0, world_size=1)

    save(1)
    if mode == "rlimit_fsize":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    else:  # fill the file system
        with open(out / "filler", "wb", buffering=0) as filler:
            try:
                while True:
                    filler.write(b"x" * 4096)
            except OSError:
                pass
    try:
        save(2)
    except CheckpointDiskFullError as error:
        print("ERROR", error.errno, error)
    else:
        print("SAVED")
    """
)


@pytest.mark.parametrize("writer", ["single", "dcp"])
@pytest.mark.parametrize("mode", ["tmpfs", "rlimit_fsize"])
def test_a_full_disk_is_named_and_the_last_complete_checkpoint_is_kept(tmp_path, mode, writer):
    out = tmp_path / "run"
    out.mkdir()
    mounted = False
    if mode == "tmpfs":
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(out)], capture_output=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here ({result.stderr.decode().strip()}); rlimit_fsize covers EFBIG")
        mounted = True
    try:
        run = subprocess.run([sys.executable, "-c", _FILL_THEN_SAVE, str(out), mode, writer], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        assert run.returncode == 0, run.stderr[-3000:]
        line = run.stdout.strip().splitlines()[-1]
        expected_errno, words = (errno.ENOSPC, "the disk is full") if mode == "tmpfs" else (errno.EFBIG, "size limit")
        assert line.startswith(f"ERROR {expected_errno} "), line
        assert words in line and str(checkpoint_dir(out, 2)) in line and str(checkpoint_dir(out, 1)) in line
        assert [path.name for path in list_checkpoints(out)] == ["step-000001"]
        assert verify_checkpoint(checkpoint_dir(out, 1)) is None
        assert not list((out / "checkpoints").glob("*.tmp"))
    finally:
        if mounted:
            subprocess.run(["umount", str(out)], check=True)


def test_disk_full_error_is_an_input_error():
    assert issubclass(CheckpointDiskFullError, InputError)


# ---------------------------------------------------------------------- rewards that overflow (defect 9)
def huge(prompts, completions, **kwargs):
    return [3e38] * len(completions)


def test_a_reward_total_beyond_float32_scores_zero_and_is_counted():
    with RewardPool([huge, huge, digit_share], num_workers=0) as pool:
        result = pool.score(["p"] * 3, ["1a", "22", "b"])
    assert result.rewards.tolist() == [0.0, 0.0, 0.0]
    assert result.metrics[NON_FINITE_TOTAL_METRIC] == 3.0
    assert not result.scored.any()
    with RewardPool([huge, digit_share], num_workers=0) as pool:  # one huge value alone fits float32
        result = pool.score(["p"] * 2, ["1a", "22"])
    assert result.metrics[NON_FINITE_TOTAL_METRIC] == 0.0 and torch.isfinite(result.rewards).all()


def test_a_run_whose_rewards_overflow_float32_goes_on(tmp_path):
    with Trainer(tiny(tmp_path / "run", steps=1), reward_functions=[huge, huge]) as trainer:
        trainer.train()
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record[NON_FINITE_TOTAL_METRIC] == 16.0  # 4 prompts x 4 samples


# ---------------------------------------------------------------------- divergence messages (defect 10)
def test_divergence_names_the_metrics_step_and_the_last_checkpoint(tmp_path):
    trainer = Trainer(tiny(tmp_path / "run", steps=3, save_every=1), reward_functions=[digit_share])

    def poison_after_the_first_step(module, args, output):
        return output * float("nan") if torch.is_grad_enabled() and trainer.step >= 1 else output

    trainer.policy.model.norm.register_forward_hook(poison_after_the_first_step)
    try:
        with pytest.raises(TrainingDivergedError, match=r"^step 2: non-finite .*last good checkpoint: .*step-000001"):
            trainer.train()
    finally:
        trainer.close()
    assert steps_logged(tmp_path / "run") == [1]
    assert (tmp_path / "run" / "diverged-step-000002.pt").exists()


def test_divergence_before_any_checkpoint_says_the_real_save_every(tmp_path):
    trainer = Trainer(tiny(tmp_path / "run", steps=3, save_every=2), reward_functions=[digit_share])
    trainer.policy.model.norm.register_forward_hook(
        lambda module, args, output: output * float("nan") if torch.is_grad_enabled() else output
    )
    try:
        with pytest.raises(TrainingDivergedError, match=r"^step 1: .*none yet \(save_every=2"):
            trainer.train()
    finally:
        trainer.close()


# ---------------------------------------------------------------------- a missing model directory (defect 7)
def test_a_missing_model_directory_says_it_does_not_exist(tmp_path, capsys):
    from fastrl.cli import main

    assert main(["train", "--model", str(tmp_path / "no-such-model"), "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastrl train: error:") and len(err.strip().splitlines()) == 1, err
    assert "no-such-model" in err and "does not exist" in err and "Repo id" not in err
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_still_being_written_is_never_a_resume_candidate(paused_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(paused_run, out)
    partial = checkpoint_dir(out, 3).with_name("step-000003.tmp")
    shutil.copytree(checkpoint_dir(out, 2), partial)  # killed after its state file, before the rename
    assert [path.name for path in list_checkpoints(out)] == ["step-000001", "step-000002"]
    with Trainer(tiny(out, resume="latest"), reward_functions=[digit_share]) as trainer:
        assert trainer.resume_dir == checkpoint_dir(out, 2)
