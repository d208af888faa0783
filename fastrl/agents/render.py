"""Rendering environment turns as token deltas, so sampled tokens are never re-encoded.

A trajectory's token ids are: the prompt (the chat template's rendering of the first
observation, with the generation prompt), then per turn the policy's exact sampled ids
(ending with the stop token it sampled), then the environment's *delta*: the tokens the
chat template puts between the end of an assistant turn and the start of the next generation.

**The delta** is computed in text, the level at which a template is defined, against a fixed
base conversation ``BASE`` (a user message and an assistant message):
``render(BASE + env_messages, generation prompt)`` minus the prefix ``render(BASE)``
(checked to be a prefix, else :class:`DeltaError`), after the template's *turn separator*:
whatever ``render(BASE)`` puts after the assistant's stop token (ChatML's ``"\\n"`` after
``<|im_end|>``), which the policy stops before sampling and which a naive delta would drop
at every turn (a known bug of incremental agent loops elsewhere). The delta text is then
encoded. The policy's own tokens are never part of it: the delta depends only on the
environment's messages.

**The rule: sampled ids are the trajectory.** Whether the appended ids stand for the
template's rendering of the conversation is decided on the template's text, never by
encoding the policy's text again: the *context text* of a sample is its prompt's text,
each policy turn as its decoded content followed by the template's end of turn
(``end_text``: the stop token's text as the template writes it), and each delta's text.
:meth:`ChatRenderer.matches_template` compares that with the template's rendering of the
conversation (the assistant contents decoded from the sampled ids). So

- a turn the policy tokenised its own way (``[788, 13, 18, 788, 4913]`` where BPE would
  write ``[788, 13, 18, 22317]``) is kept as sampled and is not a mismatch: a byte-level
  BPE has many tokenisations of one text, and the policy was conditioned on the one it
  sampled;
- a turn ended by any of the stop tokens (``fastrl.rollout.stop_tokens``: the tokenizer's
  eos and the model's ``generation_config`` end tokens, the sampler's set) is stripped of
  it and rendered with the template's own end; its ids keep the sampled stop token;
- a template that rewrites history -- drops earlier reasoning (Qwen3), trims contents
  (Llama 3), reformats tool calls -- renders a different text: the turn is a mismatch,
  counted in ``tokenization/mismatch_rate``, and by default (``AgentConfig.split_on_mismatch``)
  the next policy turn starts a new training sample whose context is the template's
  rendering of the conversation (encoded text: what the model would see at inference).

**Control-token text in environment messages.** A tool result that contains the text of a
control token (``<|im_end|>``, ``<|eot_id|>``: the tokenizer's special tokens) would be
encoded as the real token, letting tool output close the tool turn and open a turn of its
own. :meth:`ChatRenderer.guard_messages` escapes it by default (a backslash after its first
character: ``<\\|im_end|>``, which encodes as plain text), or refuses it, or, for a trusted
environment that emits structure on purpose, allows it (``AgentConfig.control_text``).
"""

from __future__ import annotations

from typing import Any, Sequence

from fastrl.agents.env import Message

__all__ = ["ChatRenderer", "DeltaError", "ControlTextError", "BASE_CONVERSATION", "CONTROL_TEXT_MODES", "escape_control_text"]

BASE_CONVERSATION: tuple[Message, ...] = (
    {"role": "user", "content": "base"},
    {"role": "assistant", "content": "base"},
)
"""The fixed conversation environment deltas are rendered against."""

CONTROL_TEXT_MODES = ("escape", "refuse", "allow")
"""What to do with control-token text in an environment message (see the module docstring)."""
ESCAPE = "\\"
"""Inserted after the first character of a control token's text to make it plain text."""


class DeltaError(ValueError):
    """The chat template is not prefix-preserving for this environment turn."""


class ControlTextError(ValueError):
    """An environment message contains a control token's text (``control_text="refuse"``)."""


def escape_control_text(text: str, controls: Sequence[str]) -> str:
    """``text`` with every occurrence of each of ``controls`` broken by ``ESCAPE`` after its first character."""
    for control in sorted(controls, key=len, reverse=True):
        if len(control) > 1 and control in text:
            text = text.replace(control, control[0] + ESCAPE + control[1:])
    return text


class ChatRenderer:
    """Renders prompts, environment deltas and whole conversations with a tokenizer's chat template.

    Args:
        tokenizer: a ``transformers`` tokenizer with a chat template.
        tools: JSON schemas passed as ``apply_chat_template(tools=...)`` (None: no tools); a
            template that does not read ``tools`` is an ``InputError`` here.
        stop_token_ids: tokens a policy turn ends with (the sampler stops on them); default
            the tokenizer's eos (``fastrl.rollout.stop_tokens.stop_token_ids`` adds the
            model's end tokens; :meth:`with_stop_tokens` the sampler's).
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
            from fastrl.rollout.stop_tokens import stop_token_ids as default_stops

            stop_token_ids = default_stops(tokenizer)
        self.stop_token_ids = tuple(dict.fromkeys(int(t) for t in stop_token_ids))
        self.control_texts = self._control_texts()
        self._base_text = self.render_text(list(BASE_CONVERSATION), add_generation_prompt=False)
        self._base_ids = self.encode(self._base_text)
        self.end_text, self.separator_text = self._turn_end()
        self.separator_ids = self.encode(self.separator_text)
        self._derived: dict[tuple[int, ...], ChatRenderer] = {}

    # -------------------------------------------------------------------- rendering
    def render_text(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
        """The template's text of ``messages``."""
        return self.tokenizer.apply_chat_template(
            list(messages), tools=self.tools, add_generation_prompt=add_generation_prompt, tokenize=False, **self.template_kwargs
        )

    def encode(self, text: str) -> list[int]:
        """Template text as token ids (its control tokens' text becomes the control tokens)."""
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids as text, exactly (control tokens as their text, no clean-up of spaces)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> list[int]:
        """Token ids of ``messages`` as the template renders them (template text, encoded once)."""
        return self.encode(self.render_text(messages, add_generation_prompt=add_generation_prompt))

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The first observation as a prompt (with the generation prompt)."""
        return self.render(messages, add_generation_prompt=True)

    def _turn_end(self) -> tuple[str, str]:
        """``(end_text, separator_text)``: the text of the stop token that ends the base
        assistant turn, and what the template renders after it (the policy never samples it)."""
        user_only = self.render_text(list(BASE_CONVERSATION[:1]), add_generation_prompt=True)
        base = self._base_text
        assistant = base[len(user_only):] if base.startswith(user_only) else base
        texts = {self.decode([t]) for t in self.stop_token_ids}
        best = max(((assistant.rfind(text), text) for text in texts if text), default=(-1, ""))
        if best[0] < 0:
            return "", ""
        return best[1], assistant[best[0] + len(best[1]):]

    def with_stop_tokens(self, ids: Sequence[int]) -> "ChatRenderer":
        """This renderer if it knows every one of ``ids`` as a stop token, else one that does
        (the sampler's stop set added: ``GroupSampler.eos_token_ids``)."""
        extra = tuple(int(t) for t in ids if int(t) not in self.stop_token_ids)
        if not extra:
            return self
        if extra not in self._derived:
            self._derived[extra] = ChatRenderer(self.tokenizer, tools=self.tools, stop_token_ids=self.stop_token_ids + extra,
                                                template_kwargs=self.template_kwargs)
        return self._derived[extra]

    def delta_text(self, messages: Sequence[Message]) -> str:
        """The text appended after a policy turn (ended by a stop token) for the environment's
        ``messages``, up to and including the next generation prompt. DeltaError when the
        template does not render ``BASE + messages`` as an extension of ``BASE``."""
        full = self.render_text(list(BASE_CONVERSATION) + list(messages), add_generation_prompt=True)
        if not full.startswith(self._base_text):
            raise DeltaError("the chat template renders the base conversation differently once environment messages follow it")
        return self.separator_text + full[len(self._base_text):]

    def delta_ids(self, messages: Sequence[Message]) -> list[int]:
        """``delta_text(messages)``, encoded."""
        return self.encode(self.delta_text(messages))

    # -------------------------------------------------------------------- control text
    def _control_texts(self) -> tuple[str, ...]:
        """The text of every special (control) token of the tokenizer."""
        texts = set(getattr(self.tokenizer, "all_special_tokens", []) or [])
        for token in (getattr(self.tokenizer, "added_tokens_decoder", None) or {}).values():
            if getattr(token, "special", False):
                texts.add(str(token.content))
        return tuple(sorted(t for t in texts if t))

    def guard_messages(self, messages: Sequence[Message], mode: str = "escape") -> list[Message]:
        """Environment ``messages`` with control-token text in their contents escaped
        (``escape``), refused (``refuse``: ControlTextError naming the token) or kept
        (``allow``)."""
        if mode not in CONTROL_TEXT_MODES:
            raise ValueError(f"control_text must be one of {CONTROL_TEXT_MODES}, got {mode!r}")
        if mode == "allow":
            return [dict(m) for m in messages]
        out = []
        for m in messages:
            content = m["content"]
            found = [c for c in self.control_texts if c in content]
            if found and mode == "refuse":
                raise ControlTextError(f"a {m.get('role', '?')} message contains the control token {found[0]!r} as text")
            out.append({**m, "content": escape_control_text(content, found)} if found else dict(m))
        return out

    # -------------------------------------------------------------------- the check
    def decode_turn(self, ids: Sequence[int], *, stopped: bool | None = None) -> str:
        """The text of a policy turn, its final stop token removed (``stopped``: the sampler
        says the last token ended the turn; None: when it is one of ``stop_token_ids``)."""
        ids = list(ids)
        if stopped is None:
            stopped = bool(ids) and ids[-1] in self.stop_token_ids
        if stopped and ids:
            ids = ids[:-1]
        return self.decode(ids)

    def turn_text(self, ids: Sequence[int], *, stopped: bool) -> str:
        """What a policy turn stands for in the template's text: its content, then the
        template's end of turn when a stop token ended it."""
        return self.decode_turn(ids, stopped=stopped) + (self.end_text if stopped else "")

    def matches_template(self, context_text: str, messages: Sequence[Message]) -> bool:
        """Whether a sample's context text (prompt, turns as ``turn_text``, deltas as
        ``delta_text``) is the template's rendering of ``messages`` with the generation prompt."""
        return context_text == self.render_text(messages, add_generation_prompt=True)


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
