"""Hugging Face causal LMs -> per-token log-probs without materialising logits.

Replaces the usual

    logits = model(input_ids, attention_mask=mask).logits[:, :-1]
    logp = torch.log_softmax(logits.float() / temperature, -1).gather(-1, input_ids[:, 1:, None])[..., 0]

with one call, ``causal_lm_logprobs(model, input_ids, mask, temperature=...)``: the decoder
runs without its LM head and ``fastrl.ops.linear_logprobs`` computes log p(token t+1 |
tokens <= t) from the last hidden state at t and the LM head weight, tile by tile.

Linear logit scalings in the config are folded into the temperature (Cohere's
``logit_scale`` multiplies the logits, Granite's ``logits_scaling`` divides them).
Final-logit soft-capping (Gemma 2/3 ``final_logit_softcapping``) is not linear and is
rejected with a ValueError.
"""

from __future__ import annotations

from typing import Any

import torch

from fastrl._checks import check_int, check_mask, check_scalar
from fastrl.config import PolicyLossConfig

__all__ = ["lm_head_params", "causal_lm_decoder", "causal_lm_hidden_states", "causal_lm_logprobs", "causal_lm_policy_loss"]


def lm_head_params(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """``(weight [V, H], bias [V] | None, logit_multiplier)`` of a causal LM's output layer.

    ``logit_multiplier`` is the constant the model applies to ``hidden @ weight.T + bias``
    (1.0 for most models). Raises ValueError for models whose logits are not a linear
    function of the last hidden state (soft-capping) or whose head is not a Linear.
    """
    config = getattr(model, "config", None)
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        raise ValueError(
            f"{type(model).__name__} soft-caps its logits (final_logit_softcapping={cap}): "
            "logits = cap * tanh(z / cap) is not linear in the LM head, so the fused log-prob op "
            "cannot reproduce it; use the model's logits for this model"
        )
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"{type(model).__name__} has no nn.Linear output layer (get_output_embeddings() returned "
            f"{type(head).__name__}); fused log-probs need a linear LM head"
        )
    mult = 1.0
    scale = getattr(config, "logit_scale", None)  # Cohere: logits * logit_scale
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        mult *= float(scale)
    scaling = getattr(config, "logits_scaling", None)  # Granite: logits / logits_scaling
    if isinstance(scaling, (int, float)) and not isinstance(scaling, bool):
        mult /= float(scaling)
    if mult <= 0:
        raise ValueError(f"{type(model).__name__}: logit multiplier from the config must be > 0, got {mult}")
    return head.weight, head.bias, mult


def causal_lm_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder body of a Hugging Face causal LM (the model without its LM head)."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    if dec is None or dec is model:
        dec = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if not isinstance(dec, torch.nn.Module) or dec is model:
        raise ValueError(f"cannot find the decoder (body without LM head) of {type(model).__name__}")
    return dec


def causal_lm_hidden_states(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    logits_to_keep: int | None = None,
    **model_kwargs: Any,
) -> torch.Tensor:
    """Last hidden states that predict tokens 1..T-1 of ``input_ids``: [B, T-1, H].

    With ``logits_to_keep=k`` only the states predicting the last ``k`` tokens: [B, k, H].
    The decoder runs without its LM head and without a KV cache.
    """
    check_int("input_ids", input_ids, ndim=2)
    if input_ids.shape[1] < 2:
        raise ValueError(f"input_ids needs at least 2 positions to score a next token, got shape {tuple(input_ids.shape)}")
    if attention_mask is not None:
        check_mask("attention_mask", attention_mask, tuple(input_ids.shape))
    T = input_ids.shape[1]
    if logits_to_keep is not None:
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or not 1 <= logits_to_keep <= T - 1:
            raise ValueError(f"logits_to_keep must be an int in [1, {T - 1}], got {logits_to_keep!r}")
    out = causal_lm_decoder(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **model_kwargs)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    k = T - 1 if logits_to_keep is None else logits_to_keep
    return hidden[:, T - 1 - k : T - 1]


def _targets(input_ids, attention_mask, k, ignore_index=-100):
    targets = input_ids[:, -k:]
    if attention_mask is not None:
        targets = torch.where(attention_mask[:, -k:] != 0, targets, torch.full_like(targets, ignore_index))
    return targets


def causal_lm_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    entropy_rows: torch.Tensor | None = None,
    logits_to_keep: int | None = None,
    backend: str = "auto",
    **model_kwargs: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) for t = 0..T-2: [B, T-1] fp32.

    Equal to ``log_softmax(model(input_ids, attention_mask).logits[:, :-1] / temperature)``
    gathered at ``input_ids[:, 1:]``, without the [B, T, V] logits. With
    ``logits_to_keep=k`` only the last ``k`` tokens are scored ([B, k]; TRL's
    convention for completions). Tokens whose ``attention_mask`` is 0 get logp = 0 (and
    entropy 0) and no gradient. Gradients reach every parameter, including a tied
    embedding matrix, which receives gradient from both of its uses. ``entropy_rows``
    (bool, the shape of the scored tokens): the entropy of those tokens only, NaN at the
    others, no gradient (a metric's subsample; ``fastrl.ops.linear_logprobs``).
    """
    from fastrl.ops.logprobs import linear_logprobs

    check_scalar("temperature", temperature, low=0.0, low_inclusive=False)
    weight, bias, mult = lm_head_params(model)
    hidden = causal_lm_hidden_states(model, input_ids, attention_mask, logits_to_keep=logits_to_keep, **model_kwargs)
    targets = _targets(input_ids, attention_mask, hidden.shape[1])
    return linear_logprobs(
        hidden, weight, targets, bias=bias, temperature=temperature / mult, return_entropy=return_entropy,
        entropy_rows=entropy_rows, backend=backend,
    )


def causal_lm_policy_loss(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    completion_mask: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
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
    **model_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of the last ``k = completion_mask.shape[1]`` tokens of each row,
    from the model's hidden states (``fastrl.ops.fused_linear_policy_loss``).

    ``completion_mask``/``old_logp``/``ref_logp``/``rollout_logp`` are [B, k] aligned with
    ``input_ids[:, -k:]`` (TRL's ``logits_to_keep`` layout); ``advantages`` [B, k] or [B].
    """
    from fastrl.ops.fused_policy_loss import fused_linear_policy_loss

    check_int("input_ids", input_ids, ndim=2)
    if not isinstance(completion_mask, torch.Tensor) or completion_mask.dim() != 2 or completion_mask.shape[0] != input_ids.shape[0]:
        raise ValueError(
            f"completion_mask must be a [B, k] tensor with B = {input_ids.shape[0]}, got "
            f"{tuple(completion_mask.shape) if isinstance(completion_mask, torch.Tensor) else type(completion_mask).__name__}"
        )
    k = completion_mask.shape[1]
    weight, bias, mult = lm_head_params(model)
    hidden = causal_lm_hidden_states(model, input_ids, attention_mask, logits_to_keep=k, **model_kwargs)
    targets = input_ids[:, -k:]
    return fused_linear_policy_loss(
        hidden, weight, targets, old_logp, advantages, completion_mask,
        bias=bias, ref_logp=ref_logp, rollout_logp=rollout_logp, config=config, temperature=temperature / mult,
        entropy=entropy, global_token_count=global_token_count, global_seq_count=global_seq_count,
        global_counts=global_counts, backend=backend,
    )
