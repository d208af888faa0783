"""Hugging Face causal LMs on packed shared-prefix rows: each prompt runs once per group.

``PackedGroups.from_groups([(prompt_ids, [completion_ids, ...]), ...])`` packs every group
into one document ``[prompt | c_1 | ... | c_G]`` of a single row. These functions run the
model's decoder over that row with the shared-prefix attention
(``fastrl.ops.shared_prefix_attention``, registered in transformers' ``AttentionInterface``
as ``"fastrl_shared_prefix_train"``; positions continue from ``P`` in every completion) and
score every completion token from the hidden state that predicts it, through the fused
LM-head ops (no ``[tokens, vocab]`` logits):

- ``packed_causal_lm_hidden_states`` -> ``[M, H]``, one row per completion token;
- ``packed_causal_lm_logprobs`` -> ``[M]`` log-probs (and entropies), equal to
  ``causal_lm_logprobs`` of the repeated-prefix ``[prompt + completion]`` rows at the
  completion tokens (``PackedGroups.to_batch_layout`` / ``to_completion_layout`` put them
  in the ``[B, T]`` / ``[B, L_max]`` layouts);
- ``packed_causal_lm_policy_loss`` -> ``fused_linear_policy_loss`` on the completion
  layout ``[B, L_max]`` (TRL's ``logits_to_keep`` layout).

Values and every parameter gradient equal those of the repeated-prefix batch (the prompt's
keys/values collect gradient from all G completions); the cost is ``P + G * L`` tokens per
group instead of ``G * (P + L)``. The model is used unchanged: ``config._attn_implementation``
is switched for the duration of the call -- with activation checkpointing, keep
``shared_prefix_attention_enabled(model)`` entered around the backward as well: checkpointed
layers re-run their forward there, and would otherwise recompute with the model's default
attention (wrong gradients with reentrant checkpointing, a saved-tensor count error without).
Supported: decoder-only models whose attention
layers call ``ALL_ATTENTION_FUNCTIONS`` with RoPE from ``position_ids`` and full attention
(Llama, Qwen2, Qwen3, Mistral, ...); no sliding windows, no attention dropout.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from fastrl._checks import check_choice, check_scalar
from fastrl.config import PolicyLossConfig
from fastrl.ops.hf import causal_lm_decoder, lm_head_params
from fastrl.ops.shared_prefix_attention import BACKENDS, PackedGroups, shared_prefix_attention

__all__ = [
    "ATTN_NAME",
    "check_shared_prefix_support",
    "shared_prefix_attention_enabled",
    "packed_causal_lm_hidden_states",
    "packed_causal_lm_logprobs",
    "packed_causal_lm_policy_loss",
]

ATTN_NAME = "fastrl_shared_prefix_train"
_LAYOUT_KWARG = "fastrl_shared_prefix_layout"
_BACKEND_KWARG = "fastrl_shared_prefix_backend"


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface entry point (registered as ``ATTN_NAME``).

    ``query [1, Hq, N, D]``, ``key/value [1, Hkv, N, D]`` -> ``([1, N, Hq, D], None)``.
    """
    layout = kwargs.get(_LAYOUT_KWARG)
    if layout is None:
        raise RuntimeError(
            f"attention implementation {ATTN_NAME!r} needs a SharedPrefixLayout or a TreeLayout: run the model "
            "through fastrl.ops.hf_packed (packed_causal_lm_logprobs / packed_causal_lm_hidden_states) or "
            "fastrl.ops.hf_tree"
        )
    if kwargs.get("sliding_window") is not None:
        raise ValueError("sliding-window attention layers are not supported by the shared-prefix training forward")
    if dropout:
        raise ValueError(f"attention dropout ({dropout}) is not supported by the shared-prefix training forward")
    if query.shape[0] != 1:
        raise ValueError(f"the shared-prefix forward runs one packed row, got a batch of {query.shape[0]}")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    from fastrl.ops.tree_attention import TreeLayout, tree_attention

    attend = tree_attention if isinstance(layout, TreeLayout) else shared_prefix_attention
    out = attend(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), layout,
        scale=float(scaling), backend=kwargs.get(_BACKEND_KWARG, "auto"),
    )
    return out[None], None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _attention)


def check_shared_prefix_support(model: torch.nn.Module) -> None:
    """ValueError unless the model's attention can run the shared-prefix forward: a
    decoder-only LM with full causal attention layers that take RoPE positions from
    ``position_ids`` (Llama, Qwen2/3, Mistral without a window, ...), no attention-logit
    soft-capping and no attention dropout."""
    config = model.config
    layer_types = getattr(config, "layer_types", None) or []
    problems = []
    # Qwen2-style configs carry a sliding_window that only applies with use_sliding_window;
    # Mistral-style configs apply it whenever it is set.
    window_on = getattr(config, "use_sliding_window", getattr(config, "sliding_window", None) is not None)
    if any(t != "full_attention" for t in layer_types) or (window_on and getattr(config, "sliding_window", None)):
        problems.append(f"sliding-window attention (layer_types={sorted(set(layer_types))}, "
                        f"sliding_window={getattr(config, 'sliding_window', None)})")
    if getattr(config, "attn_logit_softcapping", None):
        problems.append("attention-logit soft-capping")
    if getattr(config, "attention_dropout", 0.0):
        problems.append(f"attention dropout {config.attention_dropout}")
    if getattr(config, "is_encoder_decoder", False):
        problems.append("an encoder-decoder architecture")
    if problems:
        raise ValueError(f"{type(model).__name__} has {', '.join(problems)}, which the shared-prefix training forward does not support")


@contextlib.contextmanager
def shared_prefix_attention_enabled(model: torch.nn.Module) -> Iterator[None]:
    """Within the block the model's attention layers use the shared-prefix attention (they
    need the layout in the forward's keyword arguments, which the functions here pass)."""
    _register()
    check_shared_prefix_support(model)
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTN_NAME
    try:
        yield
    finally:
        config._attn_implementation = previous


def packed_causal_lm_hidden_states(
    model: torch.nn.Module,
    packed: PackedGroups,
    *,
    attention_backend: str = "auto",
    **model_kwargs: Any,
) -> torch.Tensor:
    """Last hidden states that predict the completion tokens: ``[M, H]`` (row m predicts
    ``packed.target_ids[m]``). The decoder runs once over the packed row, no KV cache."""
    if not isinstance(packed, PackedGroups):
        raise TypeError(f"packed must be a PackedGroups, got {type(packed).__name__}")
    check_choice("attention_backend", attention_backend, BACKENDS)
    hidden = packed_decoder_forward(model, packed.input_ids, packed.position_ids, packed.layout,
                                    attention_backend=attention_backend, model_kwargs=model_kwargs)
    return hidden.index_select(0, packed.predictor_index)


def packed_decoder_forward(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, layout: Any, *,
                           attention_backend: str, model_kwargs: dict[str, Any] | None = None) -> torch.Tensor:
    """The decoder's last hidden states ``[N, H]`` over one packed row ``input_ids [1, N]``
    with the attention of ``layout`` (a ``SharedPrefixLayout`` or a
    ``fastrl.ops.tree_attention.TreeLayout``); shared by this module and ``hf_tree``.
    ``model_kwargs`` go to the decoder (not the ones the packed forward sets)."""
    model_kwargs = model_kwargs or {}
    device = model.get_input_embeddings().weight.device
    if input_ids.device != device:
        raise ValueError(f"packed is on {input_ids.device}, the model on {device}: build it with device={device}")
    for name in ("attention_mask", "position_ids", "input_ids", "past_key_values"):
        if name in model_kwargs:
            raise ValueError(f"{name} is set by the packed forward; do not pass it")
    with shared_prefix_attention_enabled(model):
        out = causal_lm_decoder(model)(
            input_ids=input_ids, position_ids=position_ids, use_cache=False,
            **{_LAYOUT_KWARG: layout, _BACKEND_KWARG: attention_backend}, **model_kwargs,
        )
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return hidden[0]


def packed_causal_lm_logprobs(
    model: torch.nn.Module,
    packed: PackedGroups,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    entropy_rows: torch.Tensor | None = None,
    backend: str = "auto",
    attention_backend: str = "auto",
    **model_kwargs: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(completion token | prompt, earlier completion tokens) for every completion
    token: ``[M]`` fp32 (``(logp, entropy)`` with ``return_entropy``; ``entropy_rows``, bool
    ``[M]``: the entropy of those tokens only, see ``fastrl.ops.linear_logprobs``).

    Equal to ``log_softmax(model(prompt + completion).logits / temperature)`` at the
    completion tokens, with each prompt run once per group. ``packed.to_batch_layout(logp)``
    gives the ``[B, T]`` layout of ``RolloutBatch`` (value at the token's own column),
    ``packed.to_completion_layout(logp)`` the ``[B, L_max]`` one. ``backend`` picks the
    log-prob kernel, ``attention_backend`` the attention (see ``shared_prefix_attention``).
    """
    from fastrl.ops.logprobs import linear_logprobs

    check_scalar("temperature", temperature, low=0.0, low_inclusive=False)
    weight, bias, mult = lm_head_params(model)
    hidden = packed_causal_lm_hidden_states(model, packed, attention_backend=attention_backend, **model_kwargs)
    return linear_logprobs(
        hidden, weight, packed.target_ids, bias=bias, temperature=temperature / mult, return_entropy=return_entropy,
        entropy_rows=entropy_rows, backend=backend,
    )


def packed_causal_lm_policy_loss(
    model: torch.nn.Module,
    packed: PackedGroups,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor | None = None,
    *,
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    config: PolicyLossConfig = PolicyLossConfig(),
    temperature: float = 1.0,
    entropy: bool = False,
    global_token_count: Any = None,
    global_seq_count: Any = None,
    global_counts: Any = None,
    backend: str = "auto",
    attention_backend: str = "auto",
    **model_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of every completion token (``fastrl.ops.fused_linear_policy_loss``)
    with each prompt run once per group.

    ``old_logp``, ``ref_logp``, ``rollout_logp`` and ``completion_mask`` are in the
    completion layout ``[B, L_max]`` (``B = packed.num_samples``, ``L_max =
    packed.max_completion_len``; column t = completion token t); ``advantages`` is
    ``[B, L_max]`` or ``[B]``. ``completion_mask`` defaults to the real tokens; a given one
    is combined with them (positions past a completion's end never count).
    """
    from fastrl.ops.fused_policy_loss import fused_linear_policy_loss

    if not isinstance(packed, PackedGroups):
        raise TypeError(f"packed must be a PackedGroups, got {type(packed).__name__}")
    B, L = packed.num_samples, packed.max_completion_len
    device = packed.input_ids.device
    real = packed.to_completion_layout(torch.ones(packed.target_ids.shape[0], dtype=torch.bool, device=device), fill=False)
    if completion_mask is None:
        mask = real
    else:
        if not isinstance(completion_mask, torch.Tensor) or tuple(completion_mask.shape) != (B, L):
            shape = tuple(completion_mask.shape) if isinstance(completion_mask, torch.Tensor) else type(completion_mask).__name__
            raise ValueError(f"completion_mask must have shape ({B}, {L}) (samples, longest completion), got {shape}")
        mask = real & (completion_mask != 0)
    weight, bias, mult = lm_head_params(model)
    hidden = packed_causal_lm_hidden_states(model, packed, attention_backend=attention_backend, **model_kwargs)
    hidden_bl = packed.to_completion_layout(hidden)  # [B, L_max, H], zeros past each completion's end
    targets = packed.to_completion_layout(packed.target_ids)
    return fused_linear_policy_loss(
        hidden_bl, weight, targets, old_logp, advantages, mask,
        bias=bias, ref_logp=ref_logp, rollout_logp=rollout_logp, config=config, temperature=temperature / mult,
        entropy=entropy, global_token_count=global_token_count, global_seq_count=global_seq_count,
        global_counts=global_counts, backend=backend,
    )
