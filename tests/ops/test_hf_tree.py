"""fastrl.ops.hf_tree: the prefix-tree forward equals the unpacked batch.

Tiny Llama / Qwen2 / Qwen3 (q/k norms) built from configs, in float64: the hidden state of
every scored token of every root-to-node sequence, and every parameter's gradient, equal
those of the plain HF forward over the right-padded sequences (each its own row). The
sequences are step-wise samples of agent trajectories (sample k = turns 0..k; one
re-renders an earlier turn, as a template that is not prefix-preserving does), a branch,
a duplicate and a second prompt: a trie of depth 4 with shared scored tokens.
"""

import pytest
import torch

from fastrl.ops.hf import causal_lm_hidden_states, causal_lm_logprobs
from fastrl.ops.hf_packed import ATTN_NAME
from fastrl.ops.hf_tree import tree_causal_lm_hidden_states, tree_causal_lm_logprobs
from fastrl.ops.tree_attention import PackedTree

from test_hf_packed import SMALL, _assert_grads_close, _grads, _model

PROMPT = [1, 2, 3, 4]
T0, O0, T1, O1, T2 = [11, 12, 13], [50, 51], [14, 15], [52], [16, 17, 18]
SEQUENCES = [
    PROMPT + T0,  # step 0
    PROMPT + T0 + O0 + T1,  # step 1
    PROMPT + T0 + O0 + T1 + O1 + T2,  # step 2
    PROMPT + [11, 12] + O0 + T1 + O1 + [19],  # turn 0 re-rendered, then another last turn
    PROMPT + T0 + O0 + [20, 21],  # a branch after turn 0
    PROMPT + T0 + O0 + T1 + O1 + [23, 24],  # a branch after turn 1
    PROMPT + T0,  # a duplicate
    [7, 8, 9, 10, 22],  # another prompt
]
SCORE_START = [4, 4, 4, 4, 4, 4, 4, 3]


def _unpacked(sequences=SEQUENCES):
    T = max(map(len, sequences))
    ids = torch.zeros(len(sequences), T, dtype=torch.long)
    attn = torch.zeros(len(sequences), T, dtype=torch.long)
    for b, s in enumerate(sequences):
        ids[b, : len(s)] = torch.tensor(s)
        attn[b, : len(s)] = 1
    return ids, attn


def test_the_trie_shares_what_the_sequences_share():
    tree = PackedTree.from_sequences(SEQUENCES, score_start=SCORE_START)
    assert tree.layout.num_tokens < sum(map(len, SEQUENCES)) // 2
    assert max(len(tree.layout.ancestors(s)) for s in range(tree.layout.num_segments)) >= 3
    assert tree.target_index.shape[0] < tree.sample_index.shape[0]  # shared scored tokens run once


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_hidden_states_and_all_grads_equal_unpacked_float64(name):
    model = _model(name)
    tree = PackedTree.from_sequences(SEQUENCES, score_start=SCORE_START)
    M = tree.sample_index.shape[0]
    w = torch.randn(M, SMALL["hidden_size"], dtype=torch.float64)

    h = tree_causal_lm_hidden_states(model, tree, attention_backend="torch")[tree.unique_of]
    (h * w).sum().backward()
    got = _grads(model)

    ids, attn = _unpacked()
    h_ref = tree.from_batch_layout(causal_lm_hidden_states(model, ids, attn), shift=1)
    (h_ref * w).sum().backward()
    want = _grads(model)

    assert model.config._attn_implementation != ATTN_NAME
    torch.testing.assert_close(h, h_ref, atol=1e-12, rtol=0)
    _assert_grads_close(got, want, 1e-10)


@pytest.mark.parametrize("backend", ["segments", "triton"])
def test_segment_and_triton_backends_in_the_model_float64(backend, device):
    # the kernel under the interpreter on CPU (one layer keeps it quick), for real on a GPU
    model = _model("qwen3", num_hidden_layers=1).to(device)
    tree = PackedTree.from_sequences(SEQUENCES, score_start=SCORE_START, device=device)
    h = tree_causal_lm_hidden_states(model, tree, attention_backend=backend)[tree.unique_of]
    w = torch.randn_like(h)
    (h * w).sum().backward()
    got = _grads(model)
    ids, attn = (t.to(device) for t in _unpacked())
    h_ref = tree.from_batch_layout(causal_lm_hidden_states(model, ids, attn), shift=1)
    (h_ref * w).sum().backward()
    torch.testing.assert_close(h, h_ref, atol=1e-12, rtol=0)
    _assert_grads_close(got, _grads(model), 1e-10)


def test_logprobs_and_entropy_equal_causal_lm_logprobs():
    model = _model("llama", tie_word_embeddings=True)
    tree = PackedTree.from_sequences(SEQUENCES, score_start=SCORE_START)
    M = tree.sample_index.shape[0]
    gl, ge = torch.randn(M), torch.randn(M)
    logp, ent = tree_causal_lm_logprobs(model, tree, temperature=0.7, return_entropy=True)
    ((logp * gl).sum() + (ent * ge).sum()).backward()
    got = _grads(model)
    ids, attn = _unpacked()
    rlogp, rent = causal_lm_logprobs(model, ids, attn, temperature=0.7, return_entropy=True)
    rlogp, rent = tree.from_batch_layout(rlogp, shift=1), tree.from_batch_layout(rent, shift=1)
    ((rlogp * gl).sum() + (rent * ge).sum()).backward()
    assert logp.dtype == torch.float32 and logp.shape == (M,)
    torch.testing.assert_close(logp, rlogp, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, rent, atol=1e-6, rtol=0)
    _assert_grads_close(got, _grads(model), 1e-5)  # the log-prob op returns fp32
    assert torch.equal(tree_causal_lm_logprobs(model, tree, temperature=0.7).detach(), logp.detach())


def test_wrong_positions_or_attention_would_be_caught():
    # negative controls: plain causal attention over the packed row, or packed-order
    # positions, differ from the unpacked batch, so the equality tests above have teeth
    model = _model("llama")
    tree = PackedTree.from_sequences(SEQUENCES, score_start=SCORE_START)
    ids, attn = _unpacked()
    with torch.no_grad():
        h_ref = tree.from_batch_layout(causal_lm_hidden_states(model, ids, attn), shift=1)
        pred = tree.predictor_index[tree.unique_of]
        causal = model.model(input_ids=tree.input_ids, position_ids=tree.position_ids, use_cache=False)
        assert (causal.last_hidden_state[0, pred] - h_ref).abs().max() > 1e-3
        from fastrl.ops.hf_packed import packed_decoder_forward

        flat = torch.arange(tree.layout.num_tokens)[None]
        h_flat = packed_decoder_forward(model, tree.input_ids, flat, tree.layout, attention_backend="torch")
        assert (h_flat[pred] - h_ref).abs().max() > 1e-3


def test_inputs_are_checked():
    model = _model("llama")
    tree = PackedTree.from_sequences([[1, 2, 3]], score_start=[1])
    with pytest.raises(TypeError, match="PackedTree"):
        tree_causal_lm_hidden_states(model, object())
    with pytest.raises(ValueError, match="position_ids"):
        tree_causal_lm_hidden_states(model, tree, position_ids=tree.position_ids)
    with pytest.raises(ValueError, match="attention_backend"):
        tree_causal_lm_hidden_states(model, tree, attention_backend="flash_attn")
