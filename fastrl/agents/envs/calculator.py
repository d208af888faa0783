"""``calculator``: arithmetic a tiny model cannot do unaided (3-digit x 2-digit plus a term),
one ``calc(expression)`` tool evaluated by a safe AST walker (never ``eval``); reward 1.0 for
the exact final answer.

Rows: ``{"prompt": "Compute 347*58+126.", "answer": "20252"}`` from :func:`calculator_rows`
(seeded, train and held-out disjoint). The oracle (:meth:`CalculatorEnv.solve`) calls
``calc`` once with the expression, then answers with its result.
"""

from __future__ import annotations

import ast
import math
import random
import re

from fastrl.agents.env import Message
from fastrl.agents.tool_env import ToolEnv

__all__ = ["CalculatorEnv", "calculator_rows", "safe_arithmetic", "MAX_EXPRESSION_CHARS", "MAX_RESULT_DIGITS"]

MAX_EXPRESSION_CHARS = 200
"""Longest expression ``calc`` accepts."""
MAX_RESULT_DIGITS = 100
"""Largest magnitude of any intermediate value, in decimal digits (bounds ``**`` and ``*``)."""
MAX_EXPONENT = 100
"""Largest ``|exponent|`` of ``**``."""

_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
    ast.Pow: lambda a, b: a**b,
}
_UNARY = {ast.UAdd: lambda a: +a, ast.USub: lambda a: -a}


def _digits(value: float) -> float:
    return math.log10(abs(value)) if value else 0.0


def _walk(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _walk(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_walk(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _walk(node.left), _walk(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
            if abs(left) > 1 and right > 0 and right * _digits(left) > MAX_RESULT_DIGITS:
                raise ValueError(f"the result would have more than {MAX_RESULT_DIGITS} digits")
        if isinstance(node.op, ast.Mult) and _digits(left) + _digits(right) > MAX_RESULT_DIGITS + 1:
            raise ValueError(f"the result would have more than {MAX_RESULT_DIGITS} digits")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ZeroDivisionError("division by zero")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex) or _digits(value) > MAX_RESULT_DIGITS:
            raise ValueError(f"the result is not a real number below 10**{MAX_RESULT_DIGITS}")
        return value
    raise ValueError(f"unsupported syntax: {type(node).__name__} (numbers, + - * / // % ** and parentheses only)")


def safe_arithmetic(expression: str) -> str:
    """Evaluate an arithmetic expression by walking its syntax tree (no ``eval``): integers,
    decimals, ``+ - * / // % **``, unary signs, parentheses; bounded size. The result as
    text (an integral float is written without ``.0``). Raises ValueError/ZeroDivisionError."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r:.60}") from None
    value = _walk(tree)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("the result is not finite")
        if value.is_integer():
            return str(int(value))
        return repr(round(value, 10))
    return str(value)


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. 347*58+126
    """
    return safe_arithmetic(expression)


def calculator_rows(*, num_train: int, num_heldout: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """``(train, heldout)`` problems ``a*b+c`` with ``a`` 3-digit, ``b`` 2-digit, ``c`` 1-3 digits; distinct prompts."""
    rng = random.Random(seed)
    seen: set[tuple[int, int, int]] = set()
    rows = []
    while len(rows) < num_train + num_heldout:
        key = (rng.randint(100, 999), rng.randint(10, 99), rng.randint(1, 999))
        if key in seen:
            continue
        seen.add(key)
        a, b, c = key
        rows.append({"prompt": f"Compute {a}*{b}+{c}.", "answer": str(a * b + c), "expression": f"{a}*{b}+{c}"})
    return rows[num_heldout:], rows[:num_heldout]


_ANSWER = re.compile(r"-?\d+(?:\.\d+)?")


class CalculatorEnv(ToolEnv):
    """One problem per episode; the policy may call ``calc``, then answers with the number."""

    tools = [calc]

    def __init__(self, *, call_format: str = "compact", max_repeated_calls: int | None = 3,
                 calls_in_reasoning: bool = False) -> None:
        super().__init__(call_format=call_format, max_repeated_calls=max_repeated_calls, calls_in_reasoning=calls_in_reasoning)
        self.row: dict = {}

    def reset(self, row: dict, seed: int) -> list[Message]:
        self.begin_episode()
        self.row = row
        return [{"role": "user", "content": row["prompt"]}]

    def score(self, answer: str) -> float:
        return 1.0 if answer.strip() == self.row["answer"] else 0.0

    @staticmethod
    def solve(row: dict) -> list[dict]:
        """The oracle's calls and answer: ``[{"call": ("calc", {...})}, {"answer": "..."}]``."""
        return [{"call": ("calc", {"expression": row["expression"]})}, {"answer": row["answer"]}]
