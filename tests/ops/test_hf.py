"""fastrl.ops.hf: tiny Llama / Qwen2 / Cohere / Gemma2 built from configs (no downloads)."""

import pytest
import torch

from fastrl.ops.hf import causal_lm_hidden_states, causal_lm_logprobs, lm_head_params

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed; CI installs it")

SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _llama(tied=False):
    cfg = transformers.LlamaConfig(**SMALL, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg).float().eval()


def _qwen2(tied=True):
    cfg = transformers.Qwen2Config(**SMALL, tie_word_embeddings=tied)
    return transformers.Qwen2ForCausalLM(cfg).float().eval()


def _batch(vocab=97, B=3, T=11):
    ids = torch.randint(0, vocab, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, -3:] = 0  # right padding
    mask[2, :2] = 0  # left padding
    return ids, mask


def _naive(model, ids, mask, temperature=1.0, k=None):
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].double() / temperature
    logp = torch.log_softmax(logits, -1)
    tok = logp.gather(-1, ids[:, 1:, None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    keep = mask[:, 1:] != 0
    tok, ent = tok * keep, ent * keep
    if k is not None:
        tok, ent = tok[:, -k:], ent[:, -k:]
    return tok, ent


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("build, backend", [(_llama, "torch"), (_qwen2, "torch"), (_qwen2, "triton")])
def test_matches_logits_path_values_and_all_parameter_grads(build, backend):
    # the Triton kernels run on the GPU when there is one, else in the interpreter
    dev = torch.device("cuda" if backend == "triton" and torch.cuda.is_available() else "cpu")
    model = build().to(dev)
    ids, mask = (t.to(dev) for t in _batch())
    gl, ge = torch.randn(3, 10, device=dev), torch.randn(3, 10, device=dev)

    logp, ent = causal_lm_logprobs(model, ids, mask, temperature=0.9, return_entropy=True, backend=backend)
    ((logp * gl).sum() + (ent * ge).sum()).backward()
    got = _grads(model)
    model.zero_grad(set_to_none=True)

    rlogp, rent = _naive(model, ids, mask, temperature=0.9)
    ((rlogp * gl.double()).sum() + (rent * ge.double()).sum()).backward()
    ref = _grads(model)

    torch.testing.assert_close(logp.double(), rlogp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), rent, atol=1e-5, rtol=0)
    assert got.keys() == ref.keys()
    for name in ref:
        scale = ref[name].abs().max().clamp_min(1e-12)
        assert ((got[name] - ref[name]).abs().max() / scale) < 1e-4, name


def test_tied_embedding_gets_gradient_from_both_uses():
    model = _qwen2(tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids, mask = _batch()
    causal_lm_logprobs(model, ids, mask, backend="torch").sum().backward()
    g_both = model.lm_head.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    # gradient through the LM-head use alone (hidden detached) differs from the total
    hidden = causal_lm_hidden_states(model, ids, mask).detach()
    from fastrl.ops import linear_logprobs

    y = torch.where(mask[:, 1:] != 0, ids[:, 1:], -100)
    linear_logprobs(hidden, model.lm_head.weight, y, backend="torch").sum().backward()
    g_head = model.lm_head.weight.grad.clone()
    assert (g_both - g_head).abs().max() > 1e-4 * g_head.abs().max()
    # ... and the total equals the logits path (checked in float64)
    model.zero_grad(set_to_none=True)
    _naive(model, ids, mask)[0].sum().backward()
    torch.testing.assert_close(g_both.double(), model.lm_head.weight.grad.double(), atol=1e-6, rtol=1e-4)


def test_logits_to_keep_scores_only_the_completion():
    model = _llama()
    ids, mask = _batch()
    logp = causal_lm_logprobs(model, ids, mask, logits_to_keep=4, backend="torch")
    assert logp.shape == (3, 4)
    torch.testing.assert_close(logp.double(), _naive(model, ids, mask, k=4)[0], atol=1e-5, rtol=0)


def test_linear_logit_scale_is_folded_into_temperature():
    cfg = transformers.CohereConfig(**SMALL, logit_scale=0.5)
    model = transformers.CohereForCausalLM(cfg).float().eval()
    assert lm_head_params(model)[2] == 0.5
    ids, mask = _batch()
    torch.testing.assert_close(
        causal_lm_logprobs(model, ids, mask, temperature=0.7, backend="torch").double(),
        _naive(model, ids, mask, temperature=0.7)[0], atol=1e-5, rtol=0,
    )


def test_softcapped_model_is_rejected():
    cfg = transformers.Gemma2Config(**{**SMALL, "head_dim": 8}, final_logit_softcapping=30.0)
    model = transformers.Gemma2ForCausalLM(cfg)
    with pytest.raises(ValueError, match="soft-caps"):
        causal_lm_logprobs(model, torch.randint(0, 97, (1, 5)))


def test_bad_inputs():
    model = _llama()
    with pytest.raises(ValueError, match="input_ids"):
        causal_lm_logprobs(model, torch.randint(0, 97, (2, 1)))
    with pytest.raises(TypeError, match="input_ids"):
        causal_lm_logprobs(model, torch.rand(2, 5))
    with pytest.raises(ValueError, match="logits_to_keep"):
        causal_lm_logprobs(model, torch.randint(0, 97, (2, 5)), logits_to_keep=5)
    with pytest.raises(ValueError, match="attention_mask"):
        causal_lm_logprobs(model, torch.randint(0, 97, (2, 5)), torch.ones(2, 4))


def test_causal_lm_policy_loss_matches_logits_path():
    from fastrl.config import PolicyLossConfig
    from fastrl.ops import policy_loss
    from fastrl.ops.hf import causal_lm_policy_loss

    model = _qwen2(tied=True)
    ids, mask = _batch()
    k = 5
    cmask = mask[:, -k:].clone().float()
    old = torch.randn(3, k) * 0.1 - 4.0
    adv = torch.randn(3)
    cfg = PolicyLossConfig.preset("dapo")
    loss, metrics = causal_lm_policy_loss(model, ids, mask, cmask, old, adv, config=cfg, temperature=0.8,
                                          entropy=True, backend="torch")
    loss.backward()
    got = _grads(model)
    model.zero_grad(set_to_none=True)
    rlogp, rent = _naive(model, ids, mask, temperature=0.8, k=k)
    rloss, rmetrics = policy_loss(rlogp, old, adv, cmask, entropy=rent, config=cfg, backend="torch")
    rloss.backward()
    torch.testing.assert_close(loss.double(), rloss.double(), atol=1e-5, rtol=1e-5)
    assert "entropy_mean" in metrics
    for key in rmetrics:
        torch.testing.assert_close(metrics[key].double(), rmetrics[key].double(), atol=1e-5, rtol=1e-5, msg=key)
    for name, g in _grads(model).items():
        assert ((got[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)) < 1e-4, name
    with pytest.raises(ValueError, match="completion_mask"):
        causal_lm_policy_loss(model, ids, mask, cmask[0], old, adv)
