"""``ProcessSampler``: the HF sampler in a forked worker samples exactly what the in-process
one samples on the weights sent with the call (not the weights the worker was forked with),
and a failure in the worker is a ``SamplerProcessError``."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fastrl.rollout import HFGroupSampler, SamplingConfig
from fastrl.rollout.process import ProcessSampler, SamplerProcessError, weights_bytes


@pytest.fixture(autouse=True)
def _one_thread():
    """The worker runs torch at one thread; so does this process here, so the two compute the
    same sums in the same order (bitwise equal log-probs)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                         eos_token_id=3, bos_token_id=1, pad_token_id=0))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)  # distributions that are not flat
    return model.eval()


def test_samples_equal_the_in_process_sampler_on_the_weights_sent():
    prompts, seeds = [[5, 6, 7], [8, 9]], [11, 12]
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, seed=0)
    forked, other = tiny(0), tiny(1)
    sampler = ProcessSampler(forked, pad_token_id=0, timeout_s=120.0)
    try:
        for model in (forked, other):  # the second call: weights the worker was not forked with
            got = sampler.generate(prompts, group_size=3, sampling=sampling, prompt_seeds=seeds, weights=weights_bytes(model))
            want = HFGroupSampler(model, pad_token_id=0).generate(prompts, group_size=3, sampling=sampling, prompt_seeds=seeds)
            assert got.completion_ids == want.completion_ids
            assert torch.equal(got.sampler_logp, want.sampler_logp) and torch.equal(got.input_ids, want.input_ids)
        assert sampler.pid is not None
        # weights of another architecture: the worker's update_weights refuses them
        wrong = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1))
        with pytest.raises(SamplerProcessError, match="raised.*has shape"):
            sampler.generate(prompts, group_size=2, sampling=sampling, prompt_seeds=seeds, weights=weights_bytes(wrong))
    finally:
        sampler.close()
