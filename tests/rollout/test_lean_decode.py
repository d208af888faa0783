"""The sampler's lean decode forward (fastrl.rollout.lean_decode) against the model's own
forward, and the sampler's choice of it (used on Llama/Qwen2, refused or dropped otherwise)."""

import pytest
import torch
import torch.nn.functional as F

from fastrl.rollout import HFGroupSampler, SamplingConfig
from fastrl.rollout.lean_decode import lean_decoder

from test_hf_multiturn import PROMPTS, hf_greedy, tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def causal_attend(module, q, k, v, scaling):
    """Plain causal attention in the attention-interface layout (the oracle's attention)."""
    r = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(r, 1), v.repeat_interleave(r, 1), is_causal=True, scale=scaling)
    return out.transpose(1, 2)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_lean_forward_equals_the_base_model(kind):
    model = tiny(kind)
    lean = lean_decoder(model)
    assert lean is not None
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 200, (3, 9), generator=g)
    pos = torch.arange(9)[None].expand(3, 9) + torch.tensor([[0], [5], [11]])  # rows at different offsets
    with torch.no_grad():
        want = model.base_model(input_ids=ids, position_ids=pos).last_hidden_state
        got = lean(ids, pos, causal_attend)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sampler_uses_it_and_keeps_its_guarantees():
    model = tiny("qwen2")
    sampler = HFGroupSampler(model)
    assert sampler._lean is not None and not sampler._lean_checked
    batch = sampler.generate(PROMPTS, group_size=2, sampling=SamplingConfig(greedy=True, max_new_tokens=8))
    assert sampler._lean is not None and sampler._lean_checked  # passed its check, kept
    for i, p in enumerate(PROMPTS):
        want = hf_greedy(model, p, 8)
        assert batch.completion_ids[2 * i] == want[: len(batch.completion_ids[2 * i])]


def test_refused_for_other_dtypes_and_hooked_layers():
    model = tiny("llama")
    assert lean_decoder(model.to(torch.bfloat16)) is None
    model = tiny("llama")
    handle = model.base_model.layers[0].mlp.register_forward_hook(lambda m, a, out: out * 0.5)
    assert lean_decoder(model) is None
    handle.remove()
    assert lean_decoder(model) is not None


def test_a_model_that_differs_keeps_its_own_forward():
    """A hook added after the sampler was built changes the model's outputs: the lean forward's
    check fails at its first use and the sampler runs the model's forward from then on."""
    model = tiny("llama")
    sampler = HFGroupSampler(model)
    model.base_model.layers[1].mlp.register_forward_hook(lambda m, a, out: out * 3.0)
    batch = sampler.generate(PROMPTS, group_size=1, sampling=SamplingConfig(greedy=True, max_new_tokens=6))
    assert sampler._lean is None
    for i, p in enumerate(PROMPTS):
        want = hf_greedy(model, p, 6)
        assert batch.completion_ids[i] == want[: len(batch.completion_ids[i])]
