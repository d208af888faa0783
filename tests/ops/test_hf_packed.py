"""fastrl.ops.hf_packed: the shared-prefix forward equals the repeated-prefix batch.

Tiny Llama / Qwen2 / Qwen3 (q/k norms) built from configs, in float64: every completion
token's hidden state, log-prob, entropy and policy loss, and every parameter's gradient,
equal those of the plain HF forward over right-padded ``[prompt + completion]`` rows.
"""

import types

import pytest
import torch

from fastrl.config import PolicyLossConfig
from fastrl.ops.hf import causal_lm_hidden_states, causal_lm_logprobs
from fastrl.ops.hf_packed import (
    ATTN_NAME,
    packed_causal_lm_hidden_states,
    packed_causal_lm_logprobs,
    packed_causal_lm_policy_loss,
    shared_prefix_attention_enabled,
)
from fastrl.ops.policy_loss import policy_loss
from fastrl.ops.shared_prefix_attention import PackedGroups
from fastrl.rollout.base import pack_batch

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed; CI installs it")

SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rope_theta=100.0)

# groups of different prompt and completion lengths, G = 1, completions of length 1
PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [42]]
COMPLETIONS = [[[11, 12, 13], [14], [15, 16, 17, 18]], [[19, 20, 21, 22, 23]], [[24], [25, 26]], [[27, 28]]]


def _rms_norm_fp64(self, x):
    # the same formula as the HF module, without its float32 round trip (which rounds
    # gradients summed over a group's completions differently from the repeated batch)
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _model(name, **over):
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[name]
    kw = dict(SMALL, **over)
    if name == "qwen3":
        kw["head_dim"] = 8
    model = model_cls(cfg_cls(**kw)).double().train()
    for module in model.modules():  # HF RMSNorms compute in fp32 even for fp64 models: keep fp64 end to end
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_norm_fp64, module)
    with torch.no_grad():  # non-trivial q/k norm weights and biases, so their gradients are checked too
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def _repeated(prompts=PROMPTS, completions=COMPLETIONS):
    """The repeated-prefix baseline batch (RolloutBatch's layout)."""
    flat_p = [p for p, cs in zip(prompts, completions) for _ in cs]
    flat_c = [c for cs in completions for c in cs]
    ids, attn, _, _, _ = pack_batch(flat_p, flat_c, [torch.zeros(len(c)) for c in flat_c], 1, 0)
    return ids, attn


def _grads(model):
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _assert_grads_close(got, want, rtol):
    assert got.keys() == want.keys() and len(want) > 0
    for name in want:
        scale = want[name].abs().max().clamp_min(1e-30)
        err = ((got[name] - want[name]).abs().max() / scale).item()
        assert err < rtol, f"{name}: relative error {err}"


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_hidden_states_and_all_grads_equal_repeated_prefix_float64(name):
    model = _model(name)
    packed = PackedGroups.from_groups(list(zip(PROMPTS, COMPLETIONS)))
    w = torch.randn(packed.target_ids.shape[0], SMALL["hidden_size"], dtype=torch.float64)

    h = packed_causal_lm_hidden_states(model, packed, attention_backend="torch")
    (h * w).sum().backward()
    got = _grads(model)

    ids, attn = _repeated()
    h_ref = packed.from_batch_layout(causal_lm_hidden_states(model, ids, attn), shift=1)
    (h_ref * w).sum().backward()
    want = _grads(model)

    assert model.config._attn_implementation != ATTN_NAME  # restored after the call
    torch.testing.assert_close(h, h_ref, atol=1e-12, rtol=0)
    _assert_grads_close(got, want, 1e-10)


def test_segment_backend_and_tied_embeddings_float64():
    model = _model("qwen2", tie_word_embeddings=True)
    packed = PackedGroups.from_groups(list(zip(PROMPTS, COMPLETIONS)))
    h = packed_causal_lm_hidden_states(model, packed, attention_backend="segments")
    h.pow(2).sum().backward()
    got = _grads(model)
    ids, attn = _repeated()
    packed.from_batch_layout(causal_lm_hidden_states(model, ids, attn), shift=1).pow(2).sum().backward()
    torch.testing.assert_close(h, packed.from_batch_layout(causal_lm_hidden_states(model, ids, attn), shift=1).detach(), atol=1e-12, rtol=0)
    _assert_grads_close(got, _grads(model), 1e-10)


def test_triton_kernel_in_the_model_float64(device):
    # the kernel under the interpreter on CPU (one layer keeps it quick), for real on a GPU
    model = _model("qwen3", num_hidden_layers=1).to(device)
    prompts, completions = PROMPTS[:2], COMPLETIONS[:2]
    packed = PackedGroups.from_groups(list(zip(prompts, completions)), device=device)
    w = torch.randn(packed.target_ids.shape[0], SMALL["hidden_size"], dtype=torch.float64, device=device)
    h = packed_causal_lm_hidden_states(model, packed, attention_backend="triton")
    (h * w).sum().backward()
    got = _grads(model)
    ids, attn = (t.to(device) for t in _repeated(prompts, completions))
    h_ref = packed.from_batch_layout(causal_lm_hidden_states(model, ids, attn), shift=1)
    (h_ref * w).sum().backward()
    torch.testing.assert_close(h, h_ref, atol=1e-12, rtol=0)
    _assert_grads_close(got, _grads(model), 1e-10)


def test_logprobs_and_entropy_equal_causal_lm_logprobs():
    model = _model("qwen3")
    packed = PackedGroups.from_groups(list(zip(PROMPTS, COMPLETIONS)))
    M = packed.target_ids.shape[0]
    gl, ge = torch.randn(M), torch.randn(M)

    logp, ent = packed_causal_lm_logprobs(model, packed, temperature=0.7, return_entropy=True)
    ((logp * gl).sum() + (ent * ge).sum()).backward()
    got = _grads(model)

    ids, attn = _repeated()
    rlogp, rent = causal_lm_logprobs(model, ids, attn, temperature=0.7, return_entropy=True)
    rlogp, rent = packed.from_batch_layout(rlogp, shift=1), packed.from_batch_layout(rent, shift=1)
    ((rlogp * gl).sum() + (rent * ge).sum()).backward()
    want = _grads(model)

    assert logp.dtype == torch.float32 and logp.shape == (M,)
    torch.testing.assert_close(logp, rlogp, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, rent, atol=1e-6, rtol=0)
    _assert_grads_close(got, want, 1e-5)  # the log-prob op returns fp32
    # in the RolloutBatch layout, the log-prob of input_ids[b, c] sits at column c
    logp_bt = packed.to_batch_layout(logp.detach())
    assert logp_bt.shape == ids.shape
    torch.testing.assert_close(logp_bt[:, 1:], torch.zeros_like(logp_bt[:, 1:]).index_put(
        (packed.sample_index, packed.batch_pos - 1), rlogp.detach()))


@pytest.mark.parametrize("loss_agg, ratio_level", [("token-mean", "token"), ("seq-mean-token-mean", "sequence")])
def test_policy_loss_equals_repeated_prefix(loss_agg, ratio_level):
    model = _model("llama")
    packed = PackedGroups.from_groups(list(zip(PROMPTS, COMPLETIONS)))
    B, L = packed.num_samples, packed.max_completion_len
    old = -torch.rand(B, L) * 3
    adv = torch.randn(B)
    cmask = torch.ones(B, L)
    cmask[0, 1] = 0  # a token masked out by the trainer
    old[packed.to_completion_layout(torch.ones(packed.target_ids.shape[0])) == 0] = float("nan")  # garbage past the ends
    cfg = PolicyLossConfig(loss_agg=loss_agg, ratio_level=ratio_level, clip_low=0.1, clip_high=0.1, entropy_coef=0.01)

    loss, metrics = packed_causal_lm_policy_loss(model, packed, old, adv, cmask, config=cfg, temperature=0.9)
    loss.backward()
    got = _grads(model)

    ids, attn = _repeated()
    rlogp, rent = causal_lm_logprobs(model, ids, attn, temperature=0.9, return_entropy=True)
    to_cl = lambda x: packed.to_completion_layout(packed.from_batch_layout(x, shift=1))
    real = packed.to_completion_layout(torch.ones(packed.target_ids.shape[0])) * cmask
    ref, ref_metrics = policy_loss(to_cl(rlogp), old.nan_to_num(0.0), adv, real, entropy=to_cl(rent), config=cfg)
    ref.backward()
    want = _grads(model)

    assert torch.isfinite(loss)
    torch.testing.assert_close(loss.double(), ref.double(), atol=1e-6, rtol=0)
    for key in ref_metrics:
        torch.testing.assert_close(metrics[key].double(), ref_metrics[key].double(), atol=1e-6, rtol=0, msg=key)
    _assert_grads_close(got, want, 1e-5)


def test_wrong_attention_would_be_caught():
    # negative control: plain causal attention over the packed row (completions seeing each
    # other's tokens) differs from the baseline, so the equality tests above have teeth
    model = _model("llama")
    packed = PackedGroups.from_groups(list(zip(PROMPTS, COMPLETIONS)))
    ids, attn = _repeated()
    with torch.no_grad():
        h_ref = packed.from_batch_layout(causal_lm_hidden_states(model, ids, attn), shift=1)
        out = model.model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
        h_causal = out.last_hidden_state[0, packed.predictor_index]
    assert (h_causal - h_ref).abs().max() > 1e-3


def test_attention_outside_the_packed_forward_raises():
    model = _model("llama")
    with shared_prefix_attention_enabled(model), pytest.raises(RuntimeError, match="SharedPrefixLayout"):
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert model.config._attn_implementation != ATTN_NAME
    packed = PackedGroups.from_groups([([1, 2], [[3]])])
    with pytest.raises(ValueError, match="position_ids"):
        packed_causal_lm_hidden_states(model, packed, position_ids=packed.position_ids)
    with pytest.raises(ValueError, match="completion_mask"):
        packed_causal_lm_policy_loss(model, packed, torch.zeros(1, 1), torch.zeros(1), torch.ones(2, 2))
