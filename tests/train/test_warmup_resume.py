"""A warm-up stopped at a step boundary and resumed is the warm-up never stopped: bitwise the same
weights after it (the step-0 checkpoint) and after RL, the same losses and probes
(fastrl/train/sft.py's ``WarmupState``, fastrl/train/run/warmup_checkpoint.py). The model has attention
dropout, so the warm-up draws the global RNG, and the stops fall before and after an epoch's
reshuffle: leaving out any part of the state (weights, AdamW's moments, the shuffler's order,
position or generator, the process's RNG) fails it.

The stop is a ``StopRequests`` whose signal has arrived (its handler's only effect while the
warm-up defers): the warm-up pauses after the step in progress. The real-signal, real-process
version is ``tests/train/test_interrupt.py``.
"""

from __future__ import annotations

import signal

import pytest
import torch
from safetensors.torch import load_file

from fastrl.train.config import TrainConfig
from fastrl.train.run.interrupt import RunInterrupted, StopRequests
from fastrl.train.sft import WarmupState
from fastrl.train.trainer import Trainer


def _dropout_model():
    """The built-in tiny model with attention dropout: its warm-up steps draw the global torch RNG,
    so continuing it exactly needs the process's RNG state back too (RL's packed forwards refuse
    dropout, hence ``shared_prefix=False`` and ``prefix_tree=False`` below)."""
    from fastrl.train.task import char_tokenizer, tiny_model

    tokenizer = char_tokenizer()
    model = tiny_model(tokenizer, hidden_size=32, layers=1, max_position_embeddings=64)
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = ATTENTION_DROPOUT
    return dict(model=model, tokenizer=tokenizer)


ATTENTION_DROPOUT = 0.5


def _cfg(out, **changes):
    # 60 rows in batches of 40: the second shuffled epoch starts during step 2, the third during step 3, so the
    # stop after step 2 is mid-epoch with the shuffler advanced (both its position and its generator must
    # come back); a probe every 2 steps, short of 1.0 here
    base = dict(output_dir=str(out), steps=1, sft_steps=6, sft_batch_size=40, sft_target_accuracy=1.0, sft_check_every=2,
                sft_probe_rows=4, eval_every=0, model_hidden_size=32, model_layers=1, task_digits=1, task_train_size=60,
                task_eval_size=8, prompts_per_step=4, group_size=4, max_new_tokens=3, reward_workers=0, progress=False,
                tensorboard=False, lr=1e-3, threads=1, sft_layout="padded", shared_prefix=False, prefix_tree=False)
    return TrainConfig(**{**base, **changes})


def _requested() -> StopRequests:
    stop = StopRequests()  # not entered: no handler installed; the signal's arrival is what its handler records
    stop.signum = signal.SIGINT
    return stop


def _step0_policy(out):
    return load_file(str(out / "checkpoints" / "step-000000" / "policy" / "model.safetensors"))


def test_a_warm_up_stopped_twice_and_resumed_is_bitwise_the_uninterrupted_one(tmp_path):
    with Trainer(_cfg(tmp_path / "a"), **_dropout_model()) as trainer:
        trainer.train()
        straight, straight_warmup = {k: v.clone() for k, v in trainer.policy.state_dict().items()}, trainer.warmup

    out = tmp_path / "b"
    for steps_done in (1, 2):  # stopped after the first step, then after the second (a resumed warm-up stops too)
        with pytest.raises(RunInterrupted) as stopped:
            Trainer(_cfg(out, resume="latest" if steps_done > 1 else None), stop=_requested(), **_dropout_model())
        assert stopped.value.signum == signal.SIGINT
        assert stopped.value.checkpoint == out / "checkpoints" / f"warmup-{steps_done:06d}"
        assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"warmup-{steps_done:06d}"]
    assert not (out / "metrics.jsonl").exists()  # nothing of RL yet

    with Trainer(_cfg(out, resume="latest"), **_dropout_model()) as trainer:
        trainer.train()
        for k, v in trainer.policy.state_dict().items():
            assert torch.equal(v, straight[k]), k
        resumed_warmup = trainer.warmup
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000000", "step-000001"]
    a, b = _step0_policy(tmp_path / "a"), _step0_policy(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed_warmup.probes == straight_warmup.probes and [s for s, _ in resumed_warmup.probes] == [2, 4, 6]
    for key in ("sft/steps", "sft/first_loss", "sft/final_loss", "sft/trie_steps", "sft/probes", "sft/probe_accuracy"):
        assert resumed_warmup.metrics[key] == straight_warmup.metrics[key], key


def test_a_warm_up_resumed_under_other_settings_or_another_model_is_refused_and_sft_steps_0_ends_it(tmp_path):
    from fastrl.errors import InputError

    out = tmp_path / "run"
    with pytest.raises(RunInterrupted) as stopped:
        Trainer(_cfg(out, sft_lr=1e-3), stop=_requested())
    with pytest.raises(InputError, match=r"other settings: lr=0\.001 \(now 0\.002\)"):
        Trainer(_cfg(out, resume="latest", sft_lr=2e-3))
    with pytest.raises(InputError, match=r"warmup-000001's weights do not fit this run's model"):
        Trainer(_cfg(out, resume="latest", sft_lr=1e-3, model_hidden_size=16))
    # sft_steps=0: the warm-up ends where it stopped (its weights, its one step), then RL
    saved = torch.load(stopped.value.checkpoint / "warmup.pt", weights_only=False)["model"]
    with Trainer(_cfg(out, resume="latest", sft_lr=1e-3, sft_steps=0, sft_target_accuracy=None)) as trainer:
        assert trainer.warmup.metrics["sft/steps"] == 1
        assert all(torch.equal(v, saved[k]) for k, v in trainer.policy.state_dict().items())


def test_a_warm_up_state_round_trips_through_its_checkpoint(tmp_path):
    from fastrl.train.run.warmup_checkpoint import (list_warmup_checkpoints, load_warmup_checkpoint,
                                                    save_warmup_checkpoint)

    state = WarmupState(steps_done=3, model={"w": torch.arange(4.0)}, optimizer={"state": {}}, order=[2, 0, 1], position=2,
                        generator={"bit_generator": "PCG64"}, losses=[1.5, 1.0, 0.5], tokens=9, forward_tokens=12,
                        padded_tokens=15, trie_steps=1, seconds=0.25, settings={"lr": 1e-4}, probes=[(2, 0.5)], next_probe_at=4)
    first = save_warmup_checkpoint(tmp_path, state)
    state.steps_done = 5
    second = save_warmup_checkpoint(tmp_path, state)
    assert list_warmup_checkpoints(tmp_path) == [second] and not first.exists()  # the newer one replaces the older
    loaded = load_warmup_checkpoint(second)
    assert loaded.steps_done == 5 and loaded.order == [2, 0, 1] and loaded.probes == [(2, 0.5)] and loaded.next_probe_at == 4
    assert torch.equal(loaded.model["w"], torch.arange(4.0))
