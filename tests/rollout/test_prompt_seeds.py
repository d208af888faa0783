"""HFGroupSampler with one seed per prompt: a prompt's completions depend on its seed alone,
not on the other prompts in the batch (what data-parallel ranks sampling slices of a batch
rely on), and the draw follows the processed distribution."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fastrl.rollout import HFGroupSampler, SamplingConfig
from fastrl.rollout.sampling import _inverse_cdf_sample

PROMPTS = [[5, 6, 7, 8, 9], [12, 13, 14], [20, 21, 22, 23, 24, 25, 26], [30, 31]]


@pytest.fixture(scope="module")
def sampler():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         max_position_embeddings=64, eos_token_id=3, bos_token_id=1, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)  # distributions that are not flat
    return HFGroupSampler(model)


def test_a_prompts_samples_do_not_depend_on_its_batch(sampler):
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=5)
    seeds = [101, 102, 103, 104]
    whole = sampler.generate(PROMPTS, group_size=3, sampling=cfg, prompt_seeds=seeds)
    halves = [sampler.generate(PROMPTS[:2], group_size=3, sampling=cfg, prompt_seeds=seeds[:2]),
              sampler.generate(PROMPTS[2:], group_size=3, sampling=cfg, prompt_seeds=seeds[2:])]
    assert whole.completion_ids == halves[0].completion_ids + halves[1].completion_ids
    for part, rows in zip(halves, (slice(0, 6), slice(6, 12))):
        for a, b in zip(whole.completion_logp[rows], part.completion_logp):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # other batch shapes: other rounding
    # the samples of a group differ, and another seed gives other samples
    assert len({tuple(c) for c in whole.completion_ids[:3]}) > 1
    other = sampler.generate(PROMPTS, group_size=3, sampling=cfg, prompt_seeds=[7, 8, 9, 10])
    assert other.completion_ids != whole.completion_ids


def test_prompt_seeds_respect_top_k(sampler):
    # top_k=1: the only token with probability left is the greedy one
    greedy = sampler.generate(PROMPTS, group_size=2, sampling=SamplingConfig(greedy=True, max_new_tokens=6))
    top1 = sampler.generate(PROMPTS, group_size=2, sampling=SamplingConfig(top_k=1, max_new_tokens=6), prompt_seeds=[1, 2, 3, 4])
    assert top1.completion_ids == greedy.completion_ids


def test_inverse_cdf_sampling_follows_the_distribution_and_skips_zero_probability():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]]).expand(20000, 6)
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    u[:3] = torch.tensor([0.0, 1.0 - 1e-16, 0.5])  # the edges of [0, 1)
    tokens = _inverse_cdf_sample(probs, u)
    counts = torch.bincount(tokens, minlength=6).double() / len(tokens)
    assert counts[[0, 2, 5]].sum() == 0
    torch.testing.assert_close(counts, probs[0].double(), rtol=0, atol=0.015)


def test_prompt_seeds_must_match_the_prompts(sampler):
    with pytest.raises(ValueError, match="one seed per prompt"):
        sampler.generate(PROMPTS, group_size=2, sampling=SamplingConfig(max_new_tokens=4), prompt_seeds=[1, 2])
