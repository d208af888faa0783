"""Hugging Face causal LMs on a packed prefix tree: every shared prefix runs once, at any depth.

``PackedTree.from_sequences(sequences, score_start=...)`` packs token sequences as a trie
in one row (``fastrl.ops.tree_attention``). These functions run the model's decoder over
that row with the tree attention (through the same transformers attention entry as the
shared-prefix forward, ``fastrl.ops.hf_packed``: the layout's type picks the attention)
and score the tokens from the hidden states that predict them, through the fused LM-head
ops (no ``[tokens, vocab]`` logits):

- ``tree_causal_lm_hidden_states`` -> ``[U, H]``, one row per *distinct* scored token
  (``tree.unique_of`` maps the ``M`` scored tokens onto them);
- ``tree_causal_lm_logprobs`` -> ``[M]`` log-probs (and entropies) in sequence order, equal
  to ``causal_lm_logprobs`` of the unpacked batch (each sequence its own row);
  ``tree.to_batch_layout(logp, shift=1)`` puts them on the ``[B, T-1]`` grid.

Values and every parameter gradient equal those of the unpacked batch (a shared segment's
keys/values collect the gradient of every sequence through it; a scored token two
sequences share is computed once and its gradient is the sum of both). The supported
models and the activation-checkpointing rule are those of ``fastrl.ops.hf_packed``: keep
``shared_prefix_attention_enabled(model)`` entered around the backward.
"""

from __future__ import annotations

from typing import Any

import torch

from fastrl._checks import check_choice, check_scalar
from fastrl.ops.hf import lm_head_params
from fastrl.ops.hf_packed import packed_decoder_forward
from fastrl.ops.tree_attention import BACKENDS, PackedTree

__all__ = ["tree_causal_lm_hidden_states", "tree_causal_lm_logprobs"]


def tree_causal_lm_hidden_states(
    model: torch.nn.Module,
    tree: PackedTree,
    *,
    attention_backend: str = "auto",
    **model_kwargs: Any,
) -> torch.Tensor:
    """Last hidden states that predict the distinct scored tokens: ``[U, H]`` (row u
    predicts ``tree.target_ids[u]``). The decoder runs once over the packed row."""
    if not isinstance(tree, PackedTree):
        raise TypeError(f"tree must be a PackedTree, got {type(tree).__name__}")
    check_choice("attention_backend", attention_backend, BACKENDS)
    hidden = packed_decoder_forward(model, tree.input_ids, tree.position_ids, tree.layout,
                                    attention_backend=attention_backend, model_kwargs=model_kwargs)
    return hidden.index_select(0, tree.predictor_index)


def tree_causal_lm_logprobs(
    model: torch.nn.Module,
    tree: PackedTree,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
    attention_backend: str = "auto",
    **model_kwargs: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(token | the sequence before it) of every scored token: ``[M]`` fp32 in sequence
    order (``(logp, entropy)`` with ``return_entropy``); ``backend`` picks the log-prob
    kernel, ``attention_backend`` the attention (see ``tree_attention``)."""
    from fastrl.ops.logprobs import linear_logprobs

    check_scalar("temperature", temperature, low=0.0, low_inclusive=False)
    weight, bias, mult = lm_head_params(model)
    hidden = tree_causal_lm_hidden_states(model, tree, attention_backend=attention_backend, **model_kwargs)
    out = linear_logprobs(
        hidden, weight, tree.target_ids, bias=bias, temperature=temperature / mult, return_entropy=return_entropy, backend=backend
    )
    if return_entropy:
        return out[0][tree.unique_of], out[1][tree.unique_of]
    return out[tree.unique_of]
