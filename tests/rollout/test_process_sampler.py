"""``ProcessSampler``: the HF sampler in a forked worker samples exactly what the in-process
one samples on the weights put into its shared slot (not the weights the worker was forked
with), a held slot is never overwritten, weights of another shape are refused, and a
failure in the worker is a ``SamplerProcessError``; ``encode_batch``/``decode_batch`` give
back the batch they were given."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fastrl.rollout import HFGroupSampler, SamplingConfig
from fastrl.rollout.process import ProcessSampler, SamplerProcessError, decode_batch, encode_batch


# the worker runs torch at one thread; so does this process here: the same sums in the same order
# (bitwise equal log-probs)
pytestmark = pytest.mark.usefixtures("one_thread")


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
            got = sampler.generate(prompts, group_size=3, sampling=sampling, prompt_seeds=seeds, weights=model)
            want = HFGroupSampler(model, pad_token_id=0).generate(prompts, group_size=3, sampling=sampling, prompt_seeds=seeds)
            assert got.completion_ids == want.completion_ids
            assert torch.equal(got.sampler_logp, want.sampler_logp) and torch.equal(got.input_ids, want.input_ids)
        assert sampler.pid is not None
        # a slot held by a rollout not yet received is not overwritten: the second put takes
        # the other slot, a third finds none free; the held slot still samples `forked`
        held = sampler.put_weights(forked)
        spare = sampler.put_weights(other)
        assert spare != held
        with pytest.raises(RuntimeError, match="every one of the 2 weight slots is held"):
            sampler.put_weights(other)
        reply = sampler.sample(prompts, group_size=3, sampling=sampling, prompt_seeds=seeds, slot=held)
        want = HFGroupSampler(forked, pad_token_id=0).generate(prompts, group_size=3, sampling=sampling, prompt_seeds=seeds)
        assert decode_batch(reply.data).completion_ids == want.completion_ids
        assert reply.times.generate > 0 and reply.times.generate_cpu > 0
        sampler.release(held)
        sampler.release(spare)
        with pytest.raises(RuntimeError, match="released more often"):
            sampler.release(spare)
        # weights of another architecture: put_weights refuses them (nothing is written)
        wrong = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1))
        with pytest.raises(ValueError, match="has shape"):
            sampler.put_weights(wrong)
        # a failure in the worker: a prompt longer than the model's positions
        with pytest.raises(SamplerProcessError, match="raised"):
            sampler.generate([list(range(4, 60))], group_size=2, sampling=SamplingConfig(max_new_tokens=30, seed=0),
                             weights=forked)
    finally:
        sampler.close()


def test_encoded_batch_decodes_to_the_same_batch():
    model = tiny(2)
    batch = HFGroupSampler(model, pad_token_id=0).generate([[5, 6, 7], [8]], group_size=2,
                                                           sampling=SamplingConfig(max_new_tokens=4, seed=1))
    back = decode_batch(encode_batch(batch))
    for field in dataclasses.fields(batch):
        a, b = getattr(batch, field.name), getattr(back, field.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), field.name
        elif isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
            assert len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b)), field.name
        else:
            assert a == b, field.name
    back.sampler_logp.add_(1.0)  # decoded tensors are the receiver's own (writable, not the bytes')
    assert not torch.equal(back.sampler_logp, batch.sampler_logp)
