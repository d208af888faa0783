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

__all__ = ["eos_ids", "model_eos_ids", "stop_token_ids"]


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def eos_ids(*values: Any) -> tuple[int, ...]:
    """The end tokens that ``eos_token_id`` values name (each an id, a list of ids or None), in
    order, without repeats: what a model's configs say (vLLM reads them from the model's files)."""
    return tuple(dict.fromkeys(i for value in values for i in _ids(value)))


def model_eos_ids(model: Any) -> tuple[int, ...]:
    """The model's end tokens: its ``generation_config.eos_token_id`` (an id or a list), then its
    ``config.eos_token_id`` (``eos_ids``)."""
    sources = (getattr(model, "generation_config", None), getattr(model, "config", None))
    return eos_ids(*(getattr(source, "eos_token_id", None) for source in sources if source is not None))


def stop_token_ids(tokenizer: Any, model: Any = None, *, extra: Iterable[int] = ()) -> tuple[int, ...]:
    """The stop set of a policy turn: the tokenizer's eos first (what a demonstration ends its
    turns with), then the model's end tokens (``model_eos_ids``; none without a model), then
    ``extra``; without repeats."""
    ids = _ids(getattr(tokenizer, "eos_token_id", None))
    if model is not None:
        ids.extend(model_eos_ids(model))
    ids.extend(int(t) for t in extra)
    return tuple(dict.fromkeys(ids))
