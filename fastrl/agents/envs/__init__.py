"""Built-in offline environments (seeded, no downloads) and the ``--env`` resolver.

``BUILTIN_ENVS`` maps a name to a :class:`BuiltinEnv`: how to build the environment, its
seeded train / held-out rows and its oracle (for synthetic warm-up transcripts).
``resolve_environment(spec)`` accepts a built-in name or ``module:Class`` (a user class,
imported; any zero-argument callable returning an environment works) and returns a
zero-argument factory; a spec that names nothing importable is an ``InputError``.

``module`` is imported as ``python -m`` and ``uvicorn main:app`` would: the current working
directory comes first on the import path, so ``fastrl train --env my_env:MyEnv`` finds
``./my_env.py`` whichever way ``fastrl`` was started (the console script's path holds its own
directory, not the working one). A class in TRL's ``environment_factory`` shape -- ``reset(**row)``
returning the prompt's addition, public methods as tools, ``get_reward()``, and no ``step()`` --
is recognised and run as it is, through ``fastrl.agents.tool_env.TRLEnvironment``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from fastrl.agents.env import Message, validate_environment
from fastrl.agents.envs.calculator import CalculatorEnv, calculator_rows
from fastrl.agents.envs.frozenlake import FrozenLakeEnv, frozenlake_rows
from fastrl.agents.envs.sql import SqlEnv, sql_rows
from fastrl.agents.tool_env import TRLEnvironment
from fastrl.agents.tools import ToolCall, format_tool_call
from fastrl.errors import InputError

__all__ = ["BuiltinEnv", "BUILTIN_ENVS", "is_trl_environment", "resolve_environment", "synthetic_transcripts"]


@dataclass(frozen=True)
class BuiltinEnv:
    """One built-in environment."""

    make: Callable[..., Any]
    """The environment class (keyword options such as ``call_format`` go to it)."""
    rows: Callable[..., tuple[list[dict], list[dict]]]
    """``rows(num_train=, num_heldout=, seed=) -> (train, heldout)``."""
    uses_tools: bool
    """Whether actions are tool calls (else plain-text moves)."""


BUILTIN_ENVS: dict[str, BuiltinEnv] = {
    "calculator": BuiltinEnv(CalculatorEnv, calculator_rows, uses_tools=True),
    "sql": BuiltinEnv(SqlEnv, sql_rows, uses_tools=True),
    "frozenlake": BuiltinEnv(FrozenLakeEnv, frozenlake_rows, uses_tools=False),
}


def resolve_environment(spec: str | Callable[[], Any], **options: Any) -> Callable[[], Any]:
    """A zero-argument factory for ``spec`` (a built-in name, ``module:Class``, or a callable).

    ``options`` go to a built-in's class (e.g. ``call_format="hermes"``). The factory is
    called once here and the instance validated (``validate_environment``), so a class
    missing a method fails now, not in a worker."""
    if callable(spec):
        factory = spec
        label = getattr(spec, "__qualname__", repr(spec))
    elif isinstance(spec, str) and spec in BUILTIN_ENVS:
        make = BUILTIN_ENVS[spec].make
        if not BUILTIN_ENVS[spec].uses_tools:
            options = {k: v for k, v in options.items() if k not in ("call_format", "max_repeated_calls")}
        factory = _Factory(make, options)
        label = spec
    elif isinstance(spec, str) and spec.count(":") == 1 and all(spec.split(":")):
        module_name, attribute = spec.split(":")
        _working_directory_first()
        try:
            module = importlib.import_module(module_name)
        except Exception as error:
            raise InputError(f"--env {spec!r}: module {module_name!r} could not be imported ({type(error).__name__}: {error})") from None
        factory = getattr(module, attribute, None)
        if factory is None or not callable(factory):
            raise InputError(f"--env {spec!r}: module {module_name!r} has no class or callable {attribute!r}")
        if is_trl_environment(factory):
            factory = _Factory(TRLEnvironment, {"factory": factory})
        label = spec
    else:
        raise InputError(f"--env {spec!r} is neither a built-in environment ({', '.join(BUILTIN_ENVS)}) nor 'module:Class'")
    try:
        probe = factory()
    except InputError:
        raise
    except Exception as error:
        raise InputError(f"--env {label!r}: building the environment failed ({type(error).__name__}: {error})") from None
    validate_environment(probe, what=f"environment {label!r}")
    close = getattr(probe, "close", None)
    if callable(close):
        close()
    return factory


def _working_directory_first() -> None:
    """The current working directory at the front of ``sys.path``, as ``python -m`` puts it."""
    cwd = os.getcwd()
    if not sys.path or os.path.abspath(sys.path[0] or ".") != cwd:
        if cwd in sys.path:
            sys.path.remove(cwd)
        sys.path.insert(0, cwd)


def is_trl_environment(factory: Any) -> bool:
    """Whether ``factory`` is a class in TRL's ``environment_factory`` shape: a ``reset`` that
    takes the row's columns as keyword arguments (``reset(**row)``, or named ones), and no
    ``step`` (its public methods are the tools). An object with ``step`` is an environment of
    fastrl's own contract."""
    if not inspect.isclass(factory) or callable(getattr(factory, "step", None)):
        return False
    reset = getattr(factory, "reset", None)
    if not callable(reset):
        return False
    try:
        parameters = list(inspect.signature(reset).parameters.values())[1:]  # without self
    except (TypeError, ValueError):
        return False
    return all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) or p.default is not p.empty for p in parameters) or any(
        p.kind == p.VAR_KEYWORD for p in parameters)


class _Factory:
    """A picklable ``make(**options)`` (workers started with spawn receive it)."""

    def __init__(self, make: Callable[..., Any], options: dict) -> None:
        self.make, self.options = make, dict(options)

    def __call__(self) -> Any:
        return self.make(**self.options)


def synthetic_transcripts(name: str, rows: list[dict], *, call_format: str = "compact", seed: int = 0) -> list[tuple[list[Message], list[Message]]]:
    """Oracle demonstrations for a supervised warm-up: per row, ``(prompt messages, target
    transcript)`` where the transcript is the assistant turns and the environment's real
    observations in between (produced by running the environment on the oracle's actions,
    so they match what RL will see). The assistant turns are the training targets."""
    if name not in BUILTIN_ENVS:
        raise InputError(f"synthetic transcripts exist for the built-in environments {list(BUILTIN_ENVS)}, not {name!r}")
    entry = BUILTIN_ENVS[name]
    env = entry.make(call_format=call_format) if entry.uses_tools else entry.make()
    pairs = []
    try:
        for index, row in enumerate(rows):
            prompt = env.reset(row, seed + index)
            transcript: list[Message] = []
            for action in entry.make.solve(row):
                if "call" in action:
                    tool, arguments = action["call"]
                    text = format_tool_call(ToolCall(tool, arguments), call_format=call_format, schemas=env.schemas)
                else:
                    text = action.get("answer", action.get("move"))
                transcript.append({"role": "assistant", "content": text})
                result = env.step(text)
                transcript.extend(result.observation)
                if result.done:
                    if result.reward != 1.0:
                        raise AssertionError(f"the {name} oracle failed on row {index}: {row}")
                    break
            pairs.append((prompt, transcript))
    finally:
        env.close()
    return pairs
