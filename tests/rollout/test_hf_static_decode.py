"""HFGroupSampler's static-shape decode step (``decode="static"``: the step a CUDA graph
captures, run eagerly) against the normal eager step, and the sampler's own output
projection (rows still sampling only; a transposed weight on CPU) against models that scale
their logits. Tiny models built from configs."""

import pytest
import torch
from transformers import CohereConfig, CohereForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from fastrl.errors import InputError
from fastrl.rollout import HFGroupSampler, SamplingConfig
from fastrl.rollout.hf import TRANSPOSED_HEAD_MIN_STEPS

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]]
L = TRANSPOSED_HEAD_MIN_STEPS + 4  # long enough for the transposed output projection


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(cls, config_cls, **extra):
    torch.manual_seed(0)
    config = config_cls(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=1, max_position_embeddings=256, eos_token_id=None, bos_token_id=1, pad_token_id=0, **extra)
    model = cls(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    return model.eval()


def hf_greedy(model, prompt, n, eos):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, pad_token_id=0, eos_token_id=eos)
    return out[0, len(prompt):].tolist()


def test_static_step_equals_the_eager_step_in_generate_and_across_turns():
    model = tiny(Qwen2ForCausalLM, Qwen2Config)  # attention biases, GQA 4:1
    eos = hf_greedy(model, PROMPTS[0], L, None)[5]  # prompt 0's samples end early, the others run on
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    eager, static = HFGroupSampler(model), HFGroupSampler(model, decode="static")
    greedy = SamplingConfig(greedy=True, max_new_tokens=L)
    a = eager.generate(PROMPTS, group_size=2, sampling=greedy)
    b = static.generate(PROMPTS, group_size=2, sampling=greedy)
    assert a.completion_ids == b.completion_ids
    assert "stop" in a.finish_reasons and "length" in a.finish_reasons
    for i, p in enumerate(PROMPTS):  # and both equal HF generate
        assert a.completion_ids[2 * i] == hf_greedy(model, p, L, eos)
    torch.testing.assert_close(a.sampler_logp, b.sampler_logp, rtol=0, atol=1e-5)
    cfg = SamplingConfig(temperature=0.9, top_k=40, max_new_tokens=L)
    a = eager.generate(PROMPTS, group_size=3, sampling=cfg, prompt_seeds=[1, 2, 3])
    b = static.generate(PROMPTS, group_size=3, sampling=cfg, prompt_seeds=[1, 2, 3])
    assert a.completion_ids == b.completion_ids
    assert len({tuple(c) for c in a.completion_ids[:3]}) > 1
    torch.testing.assert_close(a.sampler_logp, b.sampler_logp, rtol=0, atol=1e-5)
    # multi-turn: per-row suffix lengths differ, trajectories drop out
    outs = {}
    for name, sampler in (("eager", eager), ("static", static)):
        state = sampler.start(PROMPTS[:2], group_size=2, sampling=SamplingConfig(temperature=1.0), prompt_seeds=[4, 5])
        got = [(o.token_ids, o.logprobs) for o in sampler.continue_(state, [[]] * 4, max_new_tokens=[3, 5, 4, 6])]
        got += [(o.token_ids, o.logprobs) for o in sampler.continue_(state, [[40, 41, 42], [43]], trajectories=[1, 2], max_new_tokens=L)]
        outs[name] = got
        sampler.close(state)
    for (ta, la), (tb, lb) in zip(outs["eager"], outs["static"]):
        assert ta == tb
        torch.testing.assert_close(torch.tensor(la), torch.tensor(lb), rtol=0, atol=1e-5)


def test_static_step_runs_the_eager_steps_triton_kernels_through_one_plan(monkeypatch):
    # backend "triton" (the interpreter on CPU): the static step's attention is the eager step's
    # cascade kernels with the lengths read from the device, so both modes pick the same tokens
    # (the first H200 run's static mode ran the torch attention over the whole capacity beside
    # eager's Triton kernels: in bf16 their rounding differed and greedy paths split). One plan
    # is prepared per rollout layout and reused by every layer and step.
    from csrc_triton import decode_attention as kernels

    made = []
    original = kernels.CascadePlan.__init__
    monkeypatch.setattr(kernels.CascadePlan, "__init__", lambda self, **kw: (made.append(kw["batch"]), original(self, **kw))[1])
    model = tiny(Qwen2ForCausalLM, Qwen2Config)
    eager, static = HFGroupSampler(model, backend="triton"), HFGroupSampler(model, decode="static", backend="triton")
    n = 6
    for cfg, seeds in ((SamplingConfig(greedy=True, max_new_tokens=n), None), (SamplingConfig(temperature=1.0, max_new_tokens=n), [1, 2, 3])):
        made.clear()
        a = eager.generate(PROMPTS, group_size=2, sampling=cfg, prompt_seeds=seeds)
        assert made == [6]  # one plan for 2 layers x 5 one-token steps
        made.clear()
        b = static.generate(PROMPTS, group_size=2, sampling=cfg, prompt_seeds=seeds)
        assert made == [6]
        assert a.completion_ids == b.completion_ids
        torch.testing.assert_close(a.sampler_logp, b.sampler_logp, rtol=0, atol=1e-6)
        torch_ids = HFGroupSampler(model, backend="torch").generate(PROMPTS, group_size=2, sampling=cfg, prompt_seeds=seeds)
        assert torch_ids.completion_ids == a.completion_ids  # fp32: the two attention paths agree


def test_cuda_graph_decode_needs_a_cuda_model():
    with pytest.raises(InputError, match="cuda_graph"):
        HFGroupSampler(tiny(LlamaForCausalLM, LlamaConfig), decode="cuda_graph")
    with pytest.raises(ValueError, match="decode"):
        HFGroupSampler(tiny(LlamaForCausalLM, LlamaConfig), decode="graph")


def test_a_model_that_scales_its_logits_keeps_its_own_forward():
    # Cohere multiplies its logits by logit_scale: lm_head(base_model(x)) is not its output
    scaled = tiny(CohereForCausalLM, CohereConfig, logit_scale=0.5)
    plain = tiny(LlamaForCausalLM, LlamaConfig)
    cfg = SamplingConfig(greedy=True, max_new_tokens=L)
    for model, split in ((scaled, False), (plain, True)):
        sampler = HFGroupSampler(model)
        batch = sampler.generate(PROMPTS[:2], group_size=2, sampling=cfg)
        assert sampler._split is split
        for i, p in enumerate(PROMPTS[:2]):
            assert batch.completion_ids[2 * i] == hf_greedy(model, p, L, None)
        with torch.no_grad():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
        want = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
        mask = batch.response_mask[:, 1:].bool()
        torch.testing.assert_close(batch.sampler_logp[:, 1:][mask], want[mask], rtol=0, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (benchmarks/gpu/run.sh runs this file)")
def test_cuda_graph_decode_equals_the_eager_step_on_cuda():
    model = tiny(Qwen2ForCausalLM, Qwen2Config).cuda()
    eager, graph = HFGroupSampler(model), HFGroupSampler(model, decode="cuda_graph")
    for cfg, seeds in ((SamplingConfig(greedy=True, max_new_tokens=L), None), (SamplingConfig(temperature=1.0, max_new_tokens=L), [1, 2, 3])):
        a = eager.generate(PROMPTS, group_size=2, sampling=cfg, prompt_seeds=seeds)
        b = graph.generate(PROMPTS, group_size=2, sampling=cfg, prompt_seeds=seeds)
        assert a.completion_ids == b.completion_ids
        torch.testing.assert_close(a.sampler_logp, b.sampler_logp, rtol=0, atol=1e-4)
    outs = {}
    for name, sampler in (("eager", eager), ("graph", graph)):
        state = sampler.start(PROMPTS[:2], group_size=2, sampling=SamplingConfig(greedy=True))
        got = [o.token_ids for o in sampler.continue_(state, [[]] * 4, max_new_tokens=[3, 5, 4, 6])]
        got += [o.token_ids for o in sampler.continue_(state, [[40, 41, 42], [43]], trajectories=[1, 2], max_new_tokens=L)]
        outs[name] = got
        sampler.close(state)
    assert outs["eager"] == outs["graph"]
