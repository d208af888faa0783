"""The environment contract of an agent trajectory, and its validation.

An environment is any object with three methods::

    reset(row: dict, seed: int) -> list[Message]      # the first observation: the prompt's messages
    step(action: str) -> StepResult                   # the policy's turn (decoded text) -> what follows
    close() -> None                                   # release resources (connections, files)

and, optionally, ``tools: list[callable]`` (typed Python functions, see ``fastrl.agents.tools``)
that the chat template shows the model (``apply_chat_template(tools=...)``).

A ``Message`` is a chat message dict: ``{"role": str, "content": str}`` (``"name"`` and
other keys a template reads may be present). ``step`` receives the text of the policy's turn
(its sampled tokens decoded, the stop token removed): the driver never re-encodes it, the
trajectory keeps the exact sampled ids. ``StepResult.observation`` holds the messages that
follow the turn (tool results, the next user message, the new grid); an empty list when
``done``.

``StepResult.info`` may carry:

- ``"state_key"`` (hashable, str or int preferred): identifies the state reached, so that
  per-turn credit (issue 19) can group steps that reach the same state. Default when absent:
  :func:`default_state_key` of the observation's tokens (a SHA-1 of the token ids), so two
  identical observations share a key.
- ``"tool_calls"`` (int), ``"tool_failures"`` (``{kind: count}``), ``"stop_reason"`` (str):
  counted by the driver (``fastrl.agents.tools.ToolEnv`` fills them).

Rewards: ``StepResult.reward`` is the per-turn reward (0.0 when the environment has none);
the outcome reward of a whole trajectory is the ``reward`` of its final step (``done=True``)
plus, separately, whatever reward functions the trainer applies to the whole transcript.
Both are kept per trajectory (``Trajectory.turn_rewards``, ``Trajectory.outcome_reward``).

Environments must be deterministic given ``(row, seed)`` and the actions: the runtime
relies on it to rebuild an environment whose worker was lost (see ``fastrl.agents.runtime``).

Optional ``fork() -> environment``: an independent copy in the same state (a new object
whose later steps do not touch this one's state). Branching rollouts (``--rollout tree``
with ``--env``, ``fastrl.agents.branching``) continue several trajectories from one
environment state; with ``fork()`` the copy is made in the worker, without it the runtime
replays: a fresh environment, ``reset(row, seed)`` and the recorded actions, each answer
(observation, reward, done) checked against the recorded one, so a non-deterministic
environment is an error there, not a silently different branch.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

from fastrl.errors import InputError

__all__ = [
    "Message",
    "StepResult",
    "Environment",
    "REQUIRED_METHODS",
    "OPTIONAL_METHODS",
    "validate_environment",
    "check_messages",
    "check_step_result",
    "default_state_key",
]

Message = dict
"""A chat message: ``{"role": str, "content": str, ...}``."""

REQUIRED_METHODS = ("reset", "step", "close")
"""The methods an environment must have (one list; validation and docs derive from it)."""
OPTIONAL_METHODS = ("fork",)
"""Methods an environment may have: ``fork()`` copies it for branching rollouts (else replay)."""


@dataclass
class StepResult:
    """What an environment returns for one policy turn."""

    observation: list[Message]
    """Messages appended after the policy's turn (empty when ``done``)."""
    reward: float = 0.0
    """Per-turn reward of this step (the final step's reward is the outcome reward)."""
    done: bool = False
    """The trajectory ends after this step."""
    info: dict[str, Any] = field(default_factory=dict)
    """Optional: ``state_key``, ``tool_calls``, ``tool_failures``, ``stop_reason`` (see the module docstring)."""


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: dict, seed: int) -> list[Message]: ...

    def step(self, action: str) -> StepResult: ...

    def close(self) -> None: ...


def _name(env: Any) -> str:
    return getattr(type(env), "__qualname__", type(env).__name__)


def validate_environment(env: Any, *, what: str | None = None) -> None:
    """Check an environment object's shape before any episode: each of ``REQUIRED_METHODS``
    exists, is callable and accepts the contract's arguments; ``tools`` (if present) are valid
    tools. Raises :class:`InputError` naming the class and the problem."""
    label = what or f"environment {_name(env)!r}"
    arities = {"reset": ("row", "seed"), "step": ("action",), "close": ()}
    for method in REQUIRED_METHODS:
        function = getattr(env, method, None)
        if function is None or not callable(function):
            raise InputError(
                f"{label} has no {method}() method; an environment needs {', '.join(m + '()' for m in REQUIRED_METHODS)}"
            )
        try:
            signature = inspect.signature(function)
        except (TypeError, ValueError):
            continue
        try:
            signature.bind(*arities[method])
        except TypeError:
            wanted = ", ".join(arities[method])
            raise InputError(f"{label}.{method}() cannot be called as {method}({wanted}): its signature is {signature}") from None
    for method in OPTIONAL_METHODS:
        if getattr(env, method, None) is not None and not callable(getattr(env, method)):
            raise InputError(f"{label}.{method} is not a method; {method}() is optional (branching rollouts copy the "
                             "environment with it, else replay its actions)")
    tools = getattr(env, "tools", None)
    if tools is not None:
        from fastrl.agents.tools import tool_schemas

        tool_schemas(tools, owner=label)


def check_messages(value: Any, *, where: str) -> list[Message]:
    """``value`` as a list of message dicts with str ``role`` and ``content``; InputError otherwise."""
    if not isinstance(value, (list, tuple)):
        raise InputError(f"{where} must return a list of messages ({{'role': ..., 'content': ...}} dicts), got {type(value).__name__}")
    for index, message in enumerate(value):
        if not isinstance(message, dict):
            raise InputError(f"{where} returned a list whose item {index} is a {type(message).__name__}, not a message dict")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise InputError(f"{where} returned message {index} without a str {key!r}: {message!r:.120}")
    return list(value)


def check_step_result(value: Any, *, where: str) -> StepResult:
    """``value`` as a StepResult (a 4-tuple ``(observation, reward, done, info)`` is accepted)."""
    if isinstance(value, tuple) and len(value) == 4:
        value = StepResult(*value)
    if not isinstance(value, StepResult):
        raise InputError(f"{where} must return a StepResult (or (observation, reward, done, info)), got {type(value).__name__}")
    value.observation = check_messages(value.observation, where=where)
    try:
        value.reward = float(value.reward)
    except (TypeError, ValueError):
        raise InputError(f"{where} returned a reward that is not a number: {value.reward!r:.80}") from None
    if not isinstance(value.info, dict):
        raise InputError(f"{where} returned info that is not a dict: {type(value.info).__name__}")
    value.done = bool(value.done)
    return value


def default_state_key(observation_ids: Sequence[int]) -> str:
    """The state key of a step whose environment gave none: SHA-1 of its observation's token ids."""
    digest = hashlib.sha1(",".join(str(int(t)) for t in observation_ids).encode()).hexdigest()
    return f"obs:{digest[:16]}"
