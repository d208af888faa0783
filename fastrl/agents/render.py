"""Rendering environment turns as token deltas, so sampled tokens are never re-encoded.

A trajectory's token ids are: the prompt (the chat template's rendering of the first
observation, with the generation prompt), then per turn the policy's exact sampled ids
(ending with its stop token), then the environment's *delta*: the tokens the chat template
puts between the end of an assistant turn and the start of the next generation.

**The delta** is computed against a fixed base conversation ``BASE`` (a user message and an
assistant message): ``render(BASE + env_messages, generation prompt)`` minus the prefix
``render(BASE)``, checked to be a prefix (else :class:`DeltaError`), plus the template's
*turn separator*: whatever ``render(BASE)`` puts after the assistant's stop token (ChatML's
``"\\n"`` after ``<|im_end|>``), which the policy stops before sampling and which a naive
delta would drop at every turn (a known bug of incremental agent loops elsewhere). The
policy's own tokens are never part of the rendering: the delta depends only on the
environment's messages.

**The check** (:meth:`ChatRenderer.matches_template`) compares a trajectory's ids with the
template's rendering of the same conversation as messages (assistant contents decoded
from the sampled ids). Templates that rewrite earlier turns (drop reasoning, reformat tool
calls) or BPE merges across a turn boundary make them differ; the driver then counts the
turn in ``tokenization/mismatch_rate`` and, by default, starts a new training sample whose
context is the template's rendering (``AgentConfig.split_on_mismatch``).
"""

from __future__ import annotations

from typing import Any, Sequence

from fastrl.agents.env import Message

__all__ = ["ChatRenderer", "DeltaError", "BASE_CONVERSATION"]

BASE_CONVERSATION: tuple[Message, ...] = (
    {"role": "user", "content": "base"},
    {"role": "assistant", "content": "base"},
)
"""The fixed conversation environment deltas are rendered against."""


class DeltaError(ValueError):
    """The chat template is not prefix-preserving for this environment turn."""


class ChatRenderer:
    """Renders prompts, environment deltas and whole conversations with a tokenizer's chat template.

    Args:
        tokenizer: a ``transformers`` tokenizer with a chat template.
        tools: JSON schemas passed as ``apply_chat_template(tools=...)`` (None: no tools); a
            template that does not read ``tools`` is an ``InputError`` here.
        stop_token_ids: tokens a policy turn ends with (the sampler stops on them); default
            the tokenizer's eos.
        template_kwargs: extra keyword arguments for ``apply_chat_template`` (e.g.
            ``{"enable_thinking": False}``).
    """

    def __init__(self, tokenizer: Any, *, tools: Sequence[dict] | None = None, stop_token_ids: Sequence[int] | None = None,
                 template_kwargs: dict | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        if self.tools:
            from fastrl.agents.tools import check_template_supports_tools

            check_template_supports_tools(tokenizer)
        self.template_kwargs = dict(template_kwargs or {})
        if stop_token_ids is None:
            stop_token_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self._base_ids = self.render(list(BASE_CONVERSATION), add_generation_prompt=False)
        self.separator_ids = self._separator()

    # -------------------------------------------------------------------- rendering
    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> list[int]:
        """Token ids of ``messages`` as the template renders them (template text, encoded once)."""
        text = self.tokenizer.apply_chat_template(
            list(messages), tools=self.tools, add_generation_prompt=add_generation_prompt, tokenize=False, **self.template_kwargs
        )
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The first observation as a prompt (with the generation prompt)."""
        return self.render(messages, add_generation_prompt=True)

    def _separator(self) -> list[int]:
        """What the template renders after the assistant's stop token (the policy never samples it)."""
        user_only = self.render(list(BASE_CONVERSATION[:1]), add_generation_prompt=True)
        assistant_part = self._base_ids[len(user_only):] if self._base_ids[: len(user_only)] == user_only else self._base_ids
        stops = [i for i, t in enumerate(assistant_part) if t in self.stop_token_ids]
        return list(assistant_part[stops[-1] + 1:]) if stops else []

    def delta_ids(self, messages: Sequence[Message]) -> list[int]:
        """Tokens appended after a policy turn (ended by a stop token) for the environment's
        ``messages``, up to and including the next generation prompt. DeltaError when the
        template does not render ``BASE + messages`` as an extension of ``BASE``."""
        full = self.render(list(BASE_CONVERSATION) + list(messages), add_generation_prompt=True)
        base = self._base_ids
        if full[: len(base)] != base:
            raise DeltaError("the chat template renders the base conversation differently once environment messages follow it")
        return self.separator_ids + full[len(base):]

    # -------------------------------------------------------------------- the check
    def decode_turn(self, ids: Sequence[int]) -> str:
        """The text of a policy turn (its trailing stop token removed), for the environment and the check."""
        ids = list(ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def matches_template(self, token_ids: Sequence[int], messages: Sequence[Message]) -> bool:
        """Whether ``token_ids`` (a trajectory waiting for its next turn) equal the template's
        rendering of ``messages`` with the generation prompt."""
        return list(token_ids) == self.render(messages, add_generation_prompt=True)


def demonstration_sample(renderer: ChatRenderer, prompt: Sequence[Message], transcript: Sequence[Message]):
    """A supervised warm-up example in the exact layout RL produces: the prompt, then each
    assistant message as its encoded content + the first stop token (loss mask 1), each run
    of environment messages as its delta (mask 0). Returns a ``TrajectorySample`` (its
    ``sampler_logp`` is 0: there was no sampler). Demonstrations are text, so encoding them
    here is right; RL never re-encodes what it sampled."""
    from fastrl.agents.trajectory import TrajectorySample

    if not renderer.stop_token_ids:
        raise ValueError("the renderer has no stop token: a demonstrated turn could not end")
    sample = TrajectorySample()
    sample.append("prompt", -1, renderer.prompt_ids(prompt))
    turn, pending = -1, []
    for message in list(transcript) + [None]:
        if message is None or message["role"] == "assistant":
            if pending:
                sample.append("env", turn, renderer.delta_ids(pending))
                pending = []
            if message is None:
                break
            turn += 1
            ids = [int(t) for t in renderer.tokenizer(message["content"], add_special_tokens=False)["input_ids"]]
            ids.append(renderer.stop_token_ids[0])
            sample.append("policy", turn, ids, [0.0] * len(ids))
        else:
            pending.append(message)
    return sample
