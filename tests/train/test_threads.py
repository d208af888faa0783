"""fastrl train's thread rule (fastrl/train/threads.py) on hand-made inputs, and its use."""

from __future__ import annotations

import torch

from fastrl.train.threads import SMALL_MODEL_PARAMETERS, builtin_model_parameters, choose_threads


def test_a_small_model_gets_one_thread_whatever_the_machine():
    for cores, load in ((2, 0.0), (64, 0.0), (2, 12.0)):
        choice = choose_threads(parameters=276_032, cores=cores, load=load)
        assert choice.threads == 1 and "0.28M-parameter" in choice.reason
    assert choose_threads(parameters=SMALL_MODEL_PARAMETERS - 1, cores=8, load=0.0).threads == 1


def test_a_larger_model_gets_the_cores_no_other_process_runs_on():
    big = SMALL_MODEL_PARAMETERS
    assert choose_threads(parameters=big, cores=8, load=0.0).threads == 8
    assert choose_threads(parameters=big, cores=8, load=3.0).threads == 5
    assert choose_threads(parameters=big, cores=2, load=9.0).threads == 1  # never below one
    assert choose_threads(parameters=None, cores=4, load=1.0).threads == 3  # unknown size: counted as large


def test_other_runnable_counts_running_processes_not_this_one():
    from fastrl.train.threads import other_runnable

    count = other_runnable(samples=3, interval=0.0)
    assert count >= 0.0 and count == int(count)


def test_cuda_keeps_torchs_default_and_the_line_says_who_chose():
    choice = choose_threads(parameters=10, cores=2, load=0.0, device_type="cuda")
    assert choice.threads is None and choice.describe().startswith("threads: torch's default (on cuda")
    assert choose_threads(parameters=10, cores=2, load=0.0).describe(given=3) == "threads: 3 (--threads)"


def test_the_bound_splits_the_built_in_models_as_measured():
    """The 0.28M model (default, calculator, frozenlake) is below it; sql's 1.1M model, which
    ran 1.8x faster on two idle cores, is above."""
    assert builtin_model_parameters() == 276_032 < SMALL_MODEL_PARAMETERS
    assert builtin_model_parameters(model_hidden_size=128) > SMALL_MODEL_PARAMETERS  # sql's width


def test_a_run_sets_and_states_the_rule(tmp_path, capsys):
    from fastrl.train.config import TrainConfig
    from fastrl.train.trainer import Trainer

    before = torch.get_num_threads()
    try:
        cfg = TrainConfig(output_dir=str(tmp_path / "run"), steps=1, sft_steps=0, eval_every=0, model_hidden_size=32, model_layers=1,
                          task_train_size=20, task_eval_size=4, prompts_per_step=2, group_size=2, max_new_tokens=2,
                          reward_workers=0, progress=False, tensorboard=False)
        with Trainer(cfg):
            assert torch.get_num_threads() == 1
        assert "fastrl train: threads: 1 (a 0.02M-parameter model" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)
