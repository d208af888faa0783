"""``async_steps``: a real tiny run whose rollouts are sampled by a process of its own
(``fastrl.train.async_collect``), against the synchronous loop and against itself paused and
resumed; and the options it refuses."""

from __future__ import annotations

import json
import os

import pytest
import torch

from fastrl.errors import InputError
from fastrl.rollout.process import SamplerTimes
from fastrl.train.async_collect import AsyncCollector, sampler_metrics
from fastrl.train.config import TrainConfig
from fastrl.train.trainer import Trainer


def tiny(out, **changes) -> TrainConfig:
    base = dict(
        output_dir=str(out), steps=3, prompts_per_step=4, group_size=4, max_new_tokens=3, task_digits=1,
        task_train_size=60, task_eval_size=8, model_hidden_size=32, model_layers=1, sft_steps=0, eval_every=0,
        reward_workers=0, progress=False, tensorboard=False, seed=0, lr=1e-2, threads=1,
        rollout_correction="decoupled",
    )
    base.update(changes)
    return TrainConfig(**base)


def digit_share(prompts, completions, **kwargs):
    """A dense reward: every group has signal before any learning."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def steps(out) -> list[dict]:
    return [m for m in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()) if "event" not in m]


def train(cfg, stop_after=None):
    with Trainer(cfg, reward_functions=[digit_share]) as trainer:
        pid = trainer.collector.sampler.pid if isinstance(trainer.collector, AsyncCollector) else None
        trainer.train(stop_after=stop_after)
        params = {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}
    return params, pid


def test_async_run_is_one_step_stale_and_resumes_exactly(tmp_path):
    sync_params, _ = train(tiny(tmp_path / "sync"))
    async_params, pid = train(tiny(tmp_path / "async", async_steps=1))
    # the sampler was a process of its own, and it is gone with the trainer
    assert pid is not None and pid != os.getpid()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)

    s, a = steps(tmp_path / "sync"), steps(tmp_path / "async")
    assert [m["async/staleness"] for m in a] == [0.0, 1.0, 1.0]
    assert "async/staleness" not in s[0]
    # what the asynchrony costs is logged every step: the trainer's side (weights into the
    # shared slot, the wait, decoding the reply) and the sampler process's; the last step
    # has no next rollout to send weights for
    assert ["time/weights" in m for m in a] == [True, True, False]
    for key in ("time/generate", "time/receive", *sampler_metrics(SamplerTimes())):
        assert all(key in m for m in a), key
    # step 1: both sample with the initial weights, same seeds: the same rollout and loss
    # (the worker's copy of the policy is the trainer's; decoupled with a fresh sampler is w = 1)
    for key in ("reward/mean", "response/length_mean", "loss/total", "grad_norm"):
        assert a[0][key] == pytest.approx(s[0][key], rel=1e-5, abs=1e-7), key
    assert a[0]["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    # later steps train on a rollout of the previous weights: the behaviour weight is no longer 1,
    # and the run differs from the synchronous one
    assert all(abs(m["rollout/is_weight_mean"] - 1.0) > 1e-4 for m in a[1:]), [m["rollout/is_weight_mean"] for m in a]
    assert any(not torch.equal(sync_params[k], async_params[k]) for k in sync_params)

    # paused after step 2 (the rollout of step 3, in flight, goes into the checkpoint) and
    # resumed: the same run as without the pause
    train(tiny(tmp_path / "paused", async_steps=1), stop_after=2)
    checkpoint = tmp_path / "paused" / "checkpoints" / "step-000002"
    assert (checkpoint / "in_flight-rank0.pt").exists()
    resumed_params, _ = train(tiny(tmp_path / "paused", async_steps=1, resume="latest"))
    for k in async_params:
        assert torch.equal(async_params[k], resumed_params[k]), k
    r = steps(tmp_path / "paused")
    assert [m["step"] for m in r] == [1, 2, 3]
    for key in ("reward/mean", "loss/total", "async/staleness", "rollout/is_weight_mean"):
        assert [m[key] for m in r] == [m[key] for m in a], key


@pytest.mark.parametrize("changes,words", [
    (dict(rollout_correction="none"), "rollout_correction must see the sampler's log-probs"),
    (dict(sampler="vllm"), "sampler must be hf"),
    (dict(device="cuda"), "device must be cpu"),
    (dict(async_steps=-1), "async_steps must be an int >= 0"),
])
def test_async_refuses_what_it_cannot_run(tmp_path, changes, words):
    with pytest.raises(InputError, match=words):
        tiny(tmp_path, **{"async_steps": 1, **changes}).resolved()


def test_decoupled_is_truncated_is_with_the_roles_named_on_a_synchronous_run(tmp_path):
    # two epochs: the proximal policy is the recomputed trainer policy, the behaviour one the
    # sampler's; the same loss as rollout_correction=is (old = trainer, rollout = sampler)
    decoupled, _ = train(tiny(tmp_path / "d", steps=2, ppo_epochs=2))
    weighted, _ = train(tiny(tmp_path / "i", steps=2, ppo_epochs=2, rollout_correction="is"))
    for k in decoupled:
        assert torch.equal(decoupled[k], weighted[k]), k
    d, i = steps(tmp_path / "d"), steps(tmp_path / "i")
    assert [m["loss/total"] for m in d] == [m["loss/total"] for m in i]
    assert "time/old_logp" in d[0]  # not on-policy: the proximal log-probs are the trainer's pass


def half_informative(prompts, completions, **kwargs):
    """``digit_share`` on about half of the prompts, 0 on the rest: those groups are all equal."""
    return [digit_share([p], [c])[0] if sum(map(ord, str(p))) % 2 else 0.0 for p, c in zip(prompts, completions)]


def test_async_dynamic_sampling_refills_as_the_synchronous_loop_and_resumes_exactly(tmp_path):
    def run(out, stop_after=None, **changes):
        cfg = tiny(out, dynamic_sampling=True, max_resample_rounds=2, **changes)
        with Trainer(cfg, reward_functions=[half_informative]) as trainer:
            decode = trainer.collector.sampler.decode if isinstance(trainer.collector, AsyncCollector) else None
            trainer.train(stop_after=stop_after)
            params = {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}
        return params, decode

    run(tmp_path / "sync")
    async_params, decode = run(tmp_path / "async", async_steps=1, sampler_decode="static")
    assert decode == "static"  # the sampler process runs the static-shape decode step
    s, a = steps(tmp_path / "sync"), steps(tmp_path / "async")
    # all-equal groups were dropped and refilled, in the async run too
    assert any(m["dynamic/dropped_groups"] > 0 and m["dynamic/rounds"] >= 1 for m in a), [m["dynamic/rounds"] for m in a]
    assert [m["async/staleness"] for m in a] == [0.0, 1.0, 1.0]
    # step 1: the same prompts (refill rounds included, drawn in the synchronous order), the same
    # weights and seeds: the same rollout and loss as the synchronous run
    for key in ("dynamic/rounds", "dynamic/dropped_groups", "groups/frac_all_equal", "reward/mean", "loss/total", "grad_norm"):
        assert a[0][key] == pytest.approx(s[0][key], rel=1e-5, abs=1e-7), key
    # paused after step 2 with step 3's rollout in flight, resumed: the uninterrupted run
    run(tmp_path / "paused", stop_after=2, async_steps=1, sampler_decode="static")
    resumed_params, _ = run(tmp_path / "paused", async_steps=1, sampler_decode="static", resume="latest")
    for k in async_params:
        assert torch.equal(async_params[k], resumed_params[k]), k
    r = steps(tmp_path / "paused")
    for key in ("dynamic/rounds", "reward/mean", "loss/total", "async/staleness"):
        assert [m[key] for m in r] == [m[key] for m in a], key
