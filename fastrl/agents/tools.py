"""Tools as typed Python functions: their JSON schemas, the tool-call formats the policy
writes, argument checking, execution, and the repeated-call detector.

**A tool** is a plain function (or bound method) with a type hint on every parameter and a
Google-style docstring (a description, and an ``Args:`` line per parameter). Its schema is
derived from the signature and docstring by ``transformers.utils.get_json_schema`` (the
format ``tokenizer.apply_chat_template(tools=...)`` takes; TRL does the same); accepted
types: ``int``, ``float``, ``str``, ``bool``, ``list[...]``, ``dict``, ``Literal[...]``,
``Optional[...]``. A tool without hints or docstring is an :class:`InputError` at validation.

**Results.** A tool returns a ``str`` (used as is) or any JSON-serialisable value (sent as
its ``json.dumps``). The return annotation, when given, is checked at validation (a
non-JSON type is an ``InputError``); at call time a result that cannot be serialised
becomes an error observation of kind ``bad_result`` -- never an exception in the trainer.

**Call formats** (``CALL_FORMATS``):

- ``"hermes"``: Hermes / Qwen / most open chat models:
  ``<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>``, several
  per turn allowed; results are ``{"role": "tool", "name": ..., "content": ...}`` messages.
  Needs a chat template that renders ``tools=`` (checked by :func:`check_template_supports_tools`).
- ``"compact"``: for fastrl's built-in character tokenizer (printable ASCII: every character
  below exists in its vocabulary, and short calls keep the tiny model's context small).
  The *last non-empty line* of the turn is a call when it starts with ``name(``; it must be
  ``name(ARGS)``, where ARGS is a JSON object of the arguments (``calc({"expression": "2+3"})``)
  or, for a tool whose only required parameter is ``p``, the raw value of ``p``
  (``calc(2+3)``; converted to ``p``'s type: ``int``/``float`` parsed, ``str`` as written).
  One call per turn; the result is a ``{"role": "tool", "name": ..., "content": ...}`` message.

**Reasoning.** A call written inside ``<think>...</think>`` (an unclosed ``<think>`` runs to
the end of the turn) is the model thinking about a call, not making one: it is not parsed,
not run, not counted (``parse_tool_calls(..., calls_in_reasoning=False)``, the default; the
environments' ``calls_in_reasoning`` option runs them too). A turn whose only calls are
inside its reasoning is a final answer.

**Non-ASCII results.** A JSON result is sent as ``json.dumps(result, ensure_ascii=False)``,
as TRL sends it: ``{"city": "東京"}`` reaches the model as those characters (7 tokens of
Qwen's BPE), not as ``\u6771\u4eac`` escapes (three times as many tokens and a spelling no
text in pre-training used).

A turn without a call is the final answer. A malformed call, an unknown tool, or wrong /
missing arguments are *error observations* (a tool message starting ``error:``), counted by
kind in ``FAILURE_KINDS``; a tool that raises returns ``error: <Type>: <message>`` (kind
``exception``). A tool that never returns is the runtime's business (its per-call time
limit kills the worker; kind ``timeout``).
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from fastrl.errors import InputError

__all__ = [
    "CALL_FORMATS",
    "FAILURE_KINDS",
    "ToolCall",
    "ToolFailure",
    "tool_schema",
    "tool_schemas",
    "check_template_supports_tools",
    "parse_tool_calls",
    "strip_reasoning",
    "format_tool_call",
    "check_arguments",
    "call_tool",
    "RepeatDetector",
]

CALL_FORMATS = ("hermes", "compact")
"""Tool-call formats the parser reads (see the module docstring)."""

FAILURE_KINDS = ("bad_format", "unknown_tool", "bad_arguments", "exception", "bad_result", "timeout")
"""Kinds of failed tool calls, counted per trajectory (``info["tool_failures"]``)."""

_JSON_RESULT_TYPES = (str, int, float, bool, list, dict, tuple, type(None))
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_REASONING = re.compile(r"<think>.*?(?:</think>|\Z)", re.DOTALL)
"""A reasoning block (an unclosed ``<think>`` runs to the end of the turn)."""
_COMPACT_CALL_START = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\(")
_COMPACT_CALL = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\((.*)\)\s*$", re.DOTALL)
ERROR_PREFIX = "error: "


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: the tool's name and its arguments (a dict)."""

    name: str
    arguments: dict

    def key(self) -> str:
        """Canonical text of the call (the repeated-call detector compares these)."""
        return self.name + json.dumps(self.arguments, sort_keys=True, default=str)


@dataclass(frozen=True)
class ToolFailure:
    """A call that could not be made: its kind (one of ``FAILURE_KINDS``) and the message the model sees."""

    kind: str
    message: str
    name: str | None = None


# ---------------------------------------------------------------------------------------
# Schemas
# ---------------------------------------------------------------------------------------


def _tool_name(function: Callable) -> str:
    return getattr(function, "__name__", type(function).__name__)


def tool_schema(function: Callable, *, owner: str = "") -> dict:
    """The JSON schema (``{"type": "function", "function": {...}}``) of one tool; InputError if
    it has no docstring, a parameter without a type hint or description, or a return type
    that is not a string or JSON value."""
    from transformers.utils import get_json_schema

    where = f"tool {_tool_name(function)!r}" + (f" of {owner}" if owner else "")
    if not callable(function):
        raise InputError(f"{where} is not callable (a tool is a typed Python function with a docstring)")
    if not inspect.getdoc(function):
        raise InputError(f"{where} has no docstring: a tool needs a description and an 'Args:' line per parameter")
    try:
        hints = typing.get_type_hints(function)
    except Exception as error:
        raise InputError(f"{where} has type hints that cannot be resolved: {error}") from None
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise InputError(f"{where} takes *{parameter.name}: a tool's parameters must be named and typed")
        if parameter.name not in hints:
            raise InputError(f"{where} has no type hint on parameter {parameter.name!r} (accepted: int, float, str, bool, list, dict, Literal, Optional)")
    returns = hints.get("return")
    if returns is not None:
        origin = typing.get_origin(returns) or returns
        if origin is typing.Union:
            origins = [typing.get_origin(a) or a for a in typing.get_args(returns)]
        else:
            origins = [origin]
        if not all(isinstance(o, type) and issubclass(o, _JSON_RESULT_TYPES) for o in origins):
            raise InputError(f"{where} returns {returns!r}: a tool must return a str or a JSON-serialisable value")
    try:
        schema = get_json_schema(function)
    except Exception as error:  # DocstringParsingException, TypeHintParsingException
        raise InputError(f"{where}: {error}") from None
    return schema


def tool_schemas(tools: Sequence[Callable], *, owner: str = "") -> list[dict]:
    """Schemas of several tools (names must be distinct)."""
    if not isinstance(tools, (list, tuple)):
        raise InputError(f"tools of {owner or 'the environment'} must be a list of functions, got {type(tools).__name__}")
    schemas = [tool_schema(tool, owner=owner) for tool in tools]
    names = [s["function"]["name"] for s in schemas]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise InputError(f"tools of {owner or 'the environment'} have duplicate names: {duplicates}")
    return schemas


def check_template_supports_tools(tokenizer: Any, *, what: str = "the tokenizer") -> None:
    """InputError unless the tokenizer's chat template reads ``tools`` (for a ``hermes`` run)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str) or "tools" not in template:
        raise InputError(
            f"the chat template of {what} does not render tools (apply_chat_template(tools=...) would drop them); "
            "use a tokenizer whose template supports tools, or call_format='compact'"
        )


# ---------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------


def _as_call(payload: Any) -> ToolCall | ToolFailure:
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolFailure("bad_format", 'a tool call must be a JSON object {"name": ..., "arguments": {...}}')
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolFailure("bad_format", "the arguments of the tool call are not a JSON object", payload["name"])
    if not isinstance(arguments, dict):
        return ToolFailure("bad_format", "the arguments of the tool call are not a JSON object", payload["name"])
    return ToolCall(payload["name"], arguments)


def _parse_hermes(text: str) -> list[ToolCall | ToolFailure]:
    calls: list[ToolCall | ToolFailure] = []
    for body in _HERMES_CALL.findall(text):
        try:
            payload = json.loads(body.strip())
        except json.JSONDecodeError as error:
            calls.append(ToolFailure("bad_format", f"the tool call is not valid JSON ({error.msg})"))
            continue
        calls.append(_as_call(payload))
    if text.count("<tool_call>") != len(_HERMES_CALL.findall(text)):
        calls.append(ToolFailure("bad_format", "a <tool_call> tag is not closed by </tool_call>"))
    return calls


def _single_parameter(schema: dict | None) -> tuple[str, str] | None:
    """(name, JSON type) of a tool's only required parameter, if it has exactly one."""
    if schema is None:
        return None
    parameters = schema["function"].get("parameters", {})
    required = parameters.get("required", [])
    if len(required) != 1:
        return None
    name = required[0]
    return name, parameters["properties"][name].get("type", "string")


def _parse_compact(text: str, schemas: dict[str, dict]) -> list[ToolCall | ToolFailure]:
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or not _COMPACT_CALL_START.match(lines[-1]):
        return []
    match = _COMPACT_CALL.match(lines[-1])
    if match is None:
        return [ToolFailure("bad_format", "a call must be written name(ARGS) on the last line")]
    name, body = match.group(1), match.group(2).strip()
    if body.startswith("{"):
        try:
            arguments = json.loads(body)
        except json.JSONDecodeError as error:
            return [ToolFailure("bad_format", f"the arguments are not valid JSON ({error.msg})", name)]
        return [_as_call({"name": name, "arguments": arguments})]
    if name not in schemas:
        return [ToolCall(name, {})]  # reported as unknown_tool by the caller
    single = _single_parameter(schemas[name])
    if single is None:
        return [ToolFailure("bad_format", f"{name} takes several arguments: write {name}({{\"arg\": value, ...}})", name)]
    parameter, kind = single
    value: Any = body
    if kind in ("integer", "number", "boolean", "array", "object"):
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return [ToolFailure("bad_arguments", f"{parameter} must be a {kind}, got {body!r:.60}", name)]
    return [ToolCall(name, {parameter: value})]


def strip_reasoning(text: str) -> str:
    """``text`` without its ``<think>...</think>`` blocks (an unclosed one to the end)."""
    return _REASONING.sub("", text)


def parse_tool_calls(text: str, *, call_format: str, schemas: Sequence[dict] = (),
                     calls_in_reasoning: bool = False) -> list[ToolCall | ToolFailure]:
    """The calls in one policy turn, in order (empty: the turn is a final answer); calls
    inside reasoning blocks only with ``calls_in_reasoning`` (see the module docstring)."""
    if call_format not in CALL_FORMATS:
        raise InputError(f"call_format must be one of {CALL_FORMATS}, got {call_format!r}")
    if not calls_in_reasoning:
        text = strip_reasoning(text)
    if call_format == "hermes":
        return _parse_hermes(text)
    return _parse_compact(text, {s["function"]["name"]: s for s in schemas})


def format_tool_call(call: ToolCall, *, call_format: str, schemas: Sequence[dict] = ()) -> str:
    """The text a policy writes for ``call`` (synthetic transcripts; the inverse of the parser)."""
    if call_format == "hermes":
        return "<tool_call>\n" + json.dumps({"name": call.name, "arguments": call.arguments}) + "\n</tool_call>"
    if call_format != "compact":
        raise InputError(f"call_format must be one of {CALL_FORMATS}, got {call_format!r}")
    single = _single_parameter({s["function"]["name"]: s for s in schemas}.get(call.name))
    if single is not None and list(call.arguments) == [single[0]]:
        value = call.arguments[single[0]]
        return f"{call.name}({value if isinstance(value, str) else json.dumps(value)})"
    return f"{call.name}({json.dumps(call.arguments)})"


# ---------------------------------------------------------------------------------------
# Arguments and execution
# ---------------------------------------------------------------------------------------

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def _type_ok(value: Any, spec: dict) -> bool:
    if value is None and spec.get("nullable"):
        return True
    if "enum" in spec and value not in spec["enum"]:
        return False
    kinds = spec.get("type")
    if kinds is None:
        return True
    kinds = kinds if isinstance(kinds, list) else [kinds]
    for kind in kinds:
        accepted = _JSON_TYPES.get(kind, (object,))
        if isinstance(value, bool) and kind in ("integer", "number"):
            continue  # True is not a number here
        if isinstance(value, accepted):
            if kind == "array" and "items" in spec:
                return all(_type_ok(item, spec["items"]) for item in value)
            return True
    return False


def check_arguments(call: ToolCall, schema: dict) -> str | None:
    """None when ``call.arguments`` fit the schema, else what is wrong (one line)."""
    parameters = schema["function"].get("parameters", {})
    properties = parameters.get("properties", {})
    missing = [name for name in parameters.get("required", []) if name not in call.arguments]
    if missing:
        return f"{call.name} is missing the argument(s) {missing}"
    unknown = [name for name in call.arguments if name not in properties]
    if unknown:
        return f"{call.name} has no argument(s) {unknown}; it takes {sorted(properties)}"
    for name, value in call.arguments.items():
        if not _type_ok(value, properties[name]):
            wanted = properties[name].get("enum") or properties[name].get("type")
            return f"argument {name!r} of {call.name} must be {wanted}, got {value!r:.60}"
    return None


def call_tool(call: ToolCall | ToolFailure, tools: dict[str, Callable], schemas: dict[str, dict]) -> tuple[str, str | None]:
    """Run one parsed call: ``(observation text, failure kind or None)``. Never raises
    (except ``KeyboardInterrupt``/``SystemExit``)."""
    if isinstance(call, ToolFailure):
        return ERROR_PREFIX + call.message, call.kind
    if call.name not in tools:
        return ERROR_PREFIX + f"unknown tool {call.name!r}; the tools are {sorted(tools)}", "unknown_tool"
    problem = check_arguments(call, schemas[call.name])
    if problem is not None:
        return ERROR_PREFIX + problem, "bad_arguments"
    try:
        result = tools[call.name](**call.arguments)
    except Exception as error:
        return ERROR_PREFIX + f"{type(error).__name__}: {error}", "exception"
    if isinstance(result, str):
        return result, None
    try:
        return json.dumps(result, ensure_ascii=False), None
    except (TypeError, ValueError) as error:
        return ERROR_PREFIX + f"the tool returned a {type(result).__name__}, which is not a string or JSON ({error})", "bad_result"


@dataclass
class RepeatDetector:
    """Ends a trajectory when the same call (tool + arguments) comes ``limit`` times in a row.

    ``limit=None`` disables it. ``observe(call)`` returns True when the limit is reached."""

    limit: int | None = 3
    """Identical consecutive calls that end the trajectory (>= 2), or None for no limit."""
    _last: str | None = field(default=None, repr=False)
    _run: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 2):
            raise InputError(f"max_repeated_calls must be an int >= 2 or None, got {self.limit!r}")

    def reset(self) -> None:
        self._last, self._run = None, 0

    def observe(self, call: ToolCall | ToolFailure) -> bool:
        key = call.key() if isinstance(call, ToolCall) else "failure:" + call.kind + call.message
        self._run = self._run + 1 if key == self._last else 1
        self._last = key
        return self.limit is not None and self._run >= self.limit
