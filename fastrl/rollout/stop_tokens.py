"""The tokens that end a policy's turn: one set for the sampler and the chat renderer.

A chat model stops on more than its tokenizer's eos: Qwen's ``generation_config.json`` lists
``<|im_end|>`` and ``<|endoftext|>``, Llama 3's ``<|eot_id|>``, ``<|eom_id|>`` and
``<|end_of_text|>``. The samplers stop on the model's list (``model_eos_ids``); the agent
renderer strips whichever of them ended a turn before the text reaches the environment and
renders the turn's end as the template does (``fastrl.agents.render``). Both take their set
from here, so a turn the sampler ended is a turn the renderer recognises.
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["model_eos_ids", "stop_token_ids"]


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def model_eos_ids(model: Any) -> tuple[int, ...]:
    """The model's end tokens: its ``generation_config.eos_token_id`` (an id or a list), then its
    ``config.eos_token_id``, in that order, without repeats."""
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        ids.extend(_ids(getattr(source, "eos_token_id", None)) if source is not None else [])
    return tuple(dict.fromkeys(ids))


def stop_token_ids(tokenizer: Any, model: Any = None, *, extra: Iterable[int] = ()) -> tuple[int, ...]:
    """The stop set of a policy turn: the tokenizer's eos first (what a demonstration ends its
    turns with), then the model's end tokens (``model_eos_ids``; none without a model), then
    ``extra``; without repeats."""
    ids = _ids(getattr(tokenizer, "eos_token_id", None))
    if model is not None:
        ids.extend(model_eos_ids(model))
    ids.extend(int(t) for t in extra)
    return tuple(dict.fromkeys(ids))
