"""``ToolEnv``: the base of tool-using environments, and ``TRLEnvironment``, the adapter that
runs a class in TRL's ``environment_factory`` shape unchanged.

A ``ToolEnv`` subclass provides ``tools`` (typed functions, see ``fastrl.agents.tools``),
``reset(row, seed) -> messages`` and ``score(answer, row) -> float``. ``step(action)``:

- the action contains tool calls -> each is run (errors become ``error: ...`` tool messages,
  counted by kind); the observation is the tool messages; not done;
- the same call ``max_repeated_calls`` times in a row -> done, reward 0,
  ``info["stop_reason"] = "repeated_call"``;
- no call -> the action is the final answer: done, reward ``score(answer)``, where the answer
  is the turn without its ``<think>...</think>`` reasoning (``tools.strip_reasoning``).

``info`` of every step: ``tool_calls`` (calls attempted this turn), ``tool_failures``
(``{kind: count}``, kinds from ``FAILURE_KINDS``), ``stop_reason`` on the last step
(``"answer"`` or ``"repeated_call"``).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from fastrl.agents.env import Message, StepResult, check_messages
from fastrl.agents.tools import (
    CALL_FORMATS,
    RepeatDetector,
    ToolCall,
    call_tool,
    parse_tool_calls,
    strip_reasoning,
    tool_schemas,
)
from fastrl.errors import InputError

__all__ = ["ToolEnv", "TRLEnvironment", "STOP_ANSWER", "STOP_REPEATED_CALL"]

STOP_ANSWER = "answer"
STOP_REPEATED_CALL = "repeated_call"


class ToolEnv:
    """Base class of an environment whose actions are tool calls or a final answer.

    Args:
        call_format: how calls are written, one of ``CALL_FORMATS``.
        max_repeated_calls: identical consecutive calls that end the trajectory (None: no limit).
        calls_in_reasoning: run calls written inside ``<think>...</think>`` too (default: a
            call in the reasoning is not a call; see ``fastrl.agents.tools``).
    """

    tools: list[Callable] = []

    def __init__(self, *, call_format: str = "compact", max_repeated_calls: int | None = 3,
                 calls_in_reasoning: bool = False) -> None:
        if call_format not in CALL_FORMATS:
            raise InputError(f"call_format must be one of {CALL_FORMATS}, got {call_format!r}")
        self.call_format = call_format
        self.calls_in_reasoning = bool(calls_in_reasoning)
        self._repeats = RepeatDetector(max_repeated_calls)
        self._schemas_list: list[dict] | None = None
        self._label = f"environment {type(self).__name__!r}"

    # subclasses --------------------------------------------------------------------
    def reset(self, row: dict, seed: int) -> list[Message]:
        raise NotImplementedError

    def score(self, answer: str) -> float:
        """Reward of a final answer (the turn's text without a tool call, without its reasoning)."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    # the step ----------------------------------------------------------------------
    @property
    def schemas(self) -> list[dict]:
        if self._schemas_list is None:
            self._schemas_list = tool_schemas(list(self.tools), owner=self._label)
        return self._schemas_list

    def begin_episode(self) -> None:
        """Reset the per-episode bookkeeping (subclasses call it from ``reset``)."""
        self._repeats.reset()

    def step(self, action: str) -> StepResult:
        schemas = {s["function"]["name"]: s for s in self.schemas}
        tools = {s["function"]["name"]: tool for s, tool in zip(self.schemas, self.tools)}
        calls = parse_tool_calls(action, call_format=self.call_format, schemas=self.schemas,
                                 calls_in_reasoning=getattr(self, "calls_in_reasoning", False))
        if not calls:
            return StepResult([], reward=float(self.score(strip_reasoning(action))), done=True, info={"tool_calls": 0, "tool_failures": {}, "stop_reason": STOP_ANSWER})
        failures: dict[str, int] = {}
        observation: list[Message] = []
        repeated = False
        for call in calls:
            repeated = self._repeats.observe(call) or repeated
            text, kind = call_tool(call, tools, schemas)
            if kind is not None:
                failures[kind] = failures.get(kind, 0) + 1
            name = call.name if isinstance(call, ToolCall) else (call.name or "")
            observation.append({"role": "tool", "name": name, "content": text})
        info: dict[str, Any] = {"tool_calls": len(calls), "tool_failures": failures}
        if repeated:
            info["stop_reason"] = STOP_REPEATED_CALL
            return StepResult([], reward=0.0, done=True, info=info)
        return StepResult(observation, reward=0.0, done=False, info=info)


_TRL_RESERVED = ("reset", "get_reward", "close", "step")


class TRLEnvironment(ToolEnv):
    """Runs a TRL ``environment_factory`` class unchanged.

    TRL's shape: ``factory()`` builds an instance; ``instance.reset(**row)`` may return a
    string, appended to the prompt's last user message (or ``None``); every public method
    other than ``reset``/``get_reward`` is a tool; ``get_reward()`` (optional) is the outcome
    reward, read when the policy gives its final answer (0.0 without it: the trainer's reward
    functions then score the transcript). The row's ``prompt`` column (a string or a list of
    messages) is the prompt.

    Args:
        factory: the class (or any zero-argument callable returning an instance).
        call_format, max_repeated_calls: as for :class:`ToolEnv`.
    """

    def __init__(self, factory: Callable[[], Any], *, call_format: str = "hermes", max_repeated_calls: int | None = 3,
                 calls_in_reasoning: bool = False) -> None:
        super().__init__(call_format=call_format, max_repeated_calls=max_repeated_calls, calls_in_reasoning=calls_in_reasoning)
        if not callable(factory):
            raise InputError(f"environment_factory must be a class or a callable, got {type(factory).__name__}")
        self.factory = factory
        self.instance: Any = None
        label = getattr(factory, "__qualname__", repr(factory))
        self._label = f"TRL environment {label!r}"
        probe = factory()
        if not callable(getattr(probe, "reset", None)):
            raise InputError(f"TRL environment {label!r} has no reset() method")
        self._tool_names = [
            name for name, member in inspect.getmembers(type(probe), callable)
            if not name.startswith("_") and name not in _TRL_RESERVED
        ]
        if not self._tool_names:
            raise InputError(f"TRL environment {label!r} has no public methods to use as tools")
        self._bind(probe)
        self.schemas  # validate the tools now (InputError naming the method)

    def _bind(self, instance: Any) -> None:
        self.instance = instance
        self.tools = [getattr(instance, name) for name in self._tool_names]

    def reset(self, row: dict, seed: int) -> list[Message]:
        self.begin_episode()
        self._bind(self.factory())
        prompt = row.get("prompt")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in (prompt or [])]
        messages = check_messages(messages, where="the row's 'prompt' of a TRL environment")
        signature = inspect.signature(self.instance.reset)
        takes_all = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
        kwargs = row if takes_all else {k: v for k, v in row.items() if k in signature.parameters}
        extra = self.instance.reset(**kwargs)
        if extra is not None:
            if not isinstance(extra, str):
                raise InputError(f"reset() of TRL environment {type(self.instance).__name__!r} returned a {type(extra).__name__}; it must return a str or None")
            users = [i for i, m in enumerate(messages) if m["role"] == "user"]
            if users:
                messages[users[-1]]["content"] += extra
            else:
                messages.append({"role": "user", "content": extra})
        return messages

    def score(self, answer: str) -> float:
        get_reward = getattr(self.instance, "get_reward", None)
        return float(get_reward()) if callable(get_reward) else 0.0

    def close(self) -> None:
        close = getattr(self.instance, "close", None)
        if callable(close):
            close()
