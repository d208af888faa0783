"""Tools: schemas from signatures and docstrings, the two call formats, error observations by kind, repeats."""

import json
from typing import Literal, Optional

import pytest

from fastrl.agents.tool_env import ToolEnv
from fastrl.agents.tools import (
    RepeatDetector,
    ToolCall,
    ToolFailure,
    call_tool,
    check_template_supports_tools,
    format_tool_call,
    parse_tool_calls,
    tool_schema,
    tool_schemas,
)
from fastrl.errors import InputError
from fastrl.train.task import char_tokenizer


def lookup(city: str, days: int, unit: Literal["c", "f"] = "c", scale: Optional[float] = None, tags: list[str] = None) -> str:
    """Look up the weather.

    Args:
        city: the city
        days: how many days ahead
        unit: the unit
        scale: a factor
        tags: labels
    """
    return f"{city}:{days}{unit}"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first
        b: second
    """
    return a + b


def boom(x: str) -> str:
    """Raise.

    Args:
        x: anything
    """
    raise RuntimeError("it broke: " + x)


def not_json(x: str) -> dict:
    """Return something json cannot write.

    Args:
        x: anything
    """
    return {"value": object()}


def test_schema_types_from_signature_and_docstring():
    schema = tool_schema(lookup)["function"]
    props = schema["parameters"]["properties"]
    assert schema["name"] == "lookup" and schema["description"] == "Look up the weather."
    assert props["city"]["type"] == "string" and props["days"]["type"] == "integer"
    assert props["unit"]["enum"] == ["c", "f"]
    assert props["scale"]["type"] == "number" and props["scale"].get("nullable")
    assert props["tags"] == {"type": "array", "items": {"type": "string"}, "description": "labels"}
    assert schema["parameters"]["required"] == ["city", "days"]


def test_bad_tools_are_input_errors():
    def untyped(x):
        """Doc.

        Args:
            x: thing
        """

    def undocumented(x: int) -> str:
        return ""

    def no_arg_doc(x: int) -> str:
        """Only a description."""

    def returns_object(x: int) -> object:
        """Doc.

        Args:
            x: thing
        """

    for bad, words in ((untyped, "type hint"), (undocumented, "docstring"), (no_arg_doc, "x"), (returns_object, "JSON")):
        with pytest.raises(InputError, match=words):
            tool_schema(bad)
    with pytest.raises(InputError, match="duplicate"):
        tool_schemas([add, add])


def test_hermes_parsing():
    schemas = tool_schemas([add])
    calls = parse_tool_calls('ok <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', call_format="hermes", schemas=schemas)
    assert calls == [ToolCall("add", {"a": 1, "b": 2})]
    # arguments given as a JSON string are read too
    calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>', call_format="hermes")
    assert calls == [ToolCall("add", {"a": 1, "b": 2})]
    assert parse_tool_calls("the answer is 3", call_format="hermes") == []
    bad = parse_tool_calls("<tool_call>{name: add}</tool_call>", call_format="hermes")
    assert len(bad) == 1 and isinstance(bad[0], ToolFailure) and bad[0].kind == "bad_format"
    unclosed = parse_tool_calls('<tool_call>{"name": "add"', call_format="hermes")
    assert [c.kind for c in unclosed] == ["bad_format"]


def test_compact_parsing_and_round_trip():
    schemas = tool_schemas([lookup, add, boom])
    assert parse_tool_calls("boom(2*(3+4))", call_format="compact", schemas=schemas) == [ToolCall("boom", {"x": "2*(3+4)"})]
    assert parse_tool_calls('I will add\nadd({"a": 1, "b": 2})', call_format="compact", schemas=schemas) == [ToolCall("add", {"a": 1, "b": 2})]
    assert parse_tool_calls("42", call_format="compact", schemas=schemas) == []
    assert [c.kind for c in parse_tool_calls("boom(1", call_format="compact", schemas=schemas)] == ["bad_format"]
    assert [c.kind for c in parse_tool_calls("add(1)", call_format="compact", schemas=schemas)] == ["bad_format"]
    for call in (ToolCall("boom", {"x": "12*3"}), ToolCall("add", {"a": 5, "b": 7})):
        for call_format in ("compact", "hermes"):
            text = format_tool_call(call, call_format=call_format, schemas=schemas)
            assert parse_tool_calls(text, call_format=call_format, schemas=schemas) == [call]


def test_every_character_of_the_compact_format_is_in_the_builtin_vocabulary():
    tokenizer = char_tokenizer()
    text = format_tool_call(ToolCall("add", {"a": 5, "b": 7}), call_format="compact", schemas=tool_schemas([add]))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == text


def test_failures_are_observations_by_kind():
    tools = {"add": add, "boom": boom, "not_json": not_json}
    schemas = {s["function"]["name"]: s for s in tool_schemas(list(tools.values()))}
    assert call_tool(ToolCall("add", {"a": 1, "b": 2}), tools, schemas) == ("3", None)
    cases = [
        (ToolCall("nope", {}), "unknown_tool"),
        (ToolCall("add", {"a": 1}), "bad_arguments"),
        (ToolCall("add", {"a": 1, "b": "2"}), "bad_arguments"),
        (ToolCall("add", {"a": True, "b": 2}), "bad_arguments"),
        (ToolCall("add", {"a": 1, "b": 2, "c": 3}), "bad_arguments"),
        (ToolCall("boom", {"x": "y"}), "exception"),
        (ToolCall("not_json", {"x": "y"}), "bad_result"),
        (ToolFailure("bad_format", "broken"), "bad_format"),
    ]
    for call, kind in cases:
        text, got = call_tool(call, tools, schemas)
        assert got == kind and text.startswith("error: "), (call, text)
    assert "it broke: y" in call_tool(ToolCall("boom", {"x": "y"}), tools, schemas)[0]


class _Adder(ToolEnv):
    tools = [add]

    def reset(self, row, seed):
        self.begin_episode()
        return [{"role": "user", "content": "add"}]

    def score(self, answer):
        return float(answer.strip() == "3")


def test_tool_env_steps_counts_and_repeated_calls():
    env = _Adder(call_format="compact", max_repeated_calls=3)
    env.reset({}, 0)
    first = env.step('add({"a": 1, "b": 2})')
    assert not first.done and first.observation == [{"role": "tool", "name": "add", "content": "3"}]
    assert first.info == {"tool_calls": 1, "tool_failures": {}}
    wrong = env.step('add({"a": 1})')
    assert wrong.info["tool_failures"] == {"bad_arguments": 1} and wrong.observation[0]["content"].startswith("error:")
    env.step('add({"a": 1, "b": 2})')
    env.step('add({"a": 1, "b": 2})')
    third = env.step('add({"a": 1, "b": 2})')
    assert third.done and third.info["stop_reason"] == "repeated_call" and third.reward == 0.0
    env.reset({}, 0)  # the detector starts over with each episode
    assert not env.step('add({"a": 1, "b": 2})').done
    final = env.step("3")
    assert final.done and final.reward == 1.0 and final.info["stop_reason"] == "answer"
    assert RepeatDetector(None).observe(ToolCall("a", {})) is False
    with pytest.raises(InputError, match="max_repeated_calls"):
        RepeatDetector(1)


def test_template_without_tools_is_an_input_error_for_hermes():
    with pytest.raises(InputError, match="does not render tools"):
        check_template_supports_tools(char_tokenizer())
    tokenizer = char_tokenizer()
    tokenizer.chat_template = "{% if tools %}{{ tools | tojson }}{% endif %}" + tokenizer.chat_template
    check_template_supports_tools(tokenizer)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=tool_schemas([add]), tokenize=False)
    assert json.loads(text[: text.index("<bos>")])[0]["function"]["name"] == "add"
