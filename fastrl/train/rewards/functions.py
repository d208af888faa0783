"""The reward functions: TRL's signature, the built-ins, final-answer extraction and resolving a reward spec.

A reward function has TRL's signature::

    fn(prompts: list[str], completions: list[str], **kwargs) -> list[float | None]

so TRL reward functions work unchanged. The keyword arguments are the ones TRL's
``GRPOTrainer`` passes, as far as they make sense outside TRL:

- ``completion_ids``: ``list[list[int]]`` (or ``None`` when the caller has no token ids);
- every dataset column of the sample's prompt (``answer``, ...), one entry per sample
  (repeated over the group), except ``prompt``/``completion``/``completion_ids``, which
  TRL drops too;
- ``trainer_state``: whatever the trainer hands to :meth:`RewardPool.score` (TRL passes its
  ``TrainerState``; fastrl's trainer passes a small picklable object with ``global_step``);
- ``log_metric(name, value)``: a scalar the function wants logged; it comes back in the
  metrics as ``reward/<function>/user/<name>`` (mean over the chunks that logged it);
- ``log_extra(column, values)``: one value per sample of the call, for the completions
  table; it comes back in :attr:`RewardResult.extra_columns`.

``None`` in a function's output means "does not apply to this sample": it counts as 0 in
the weighted sum (TRL's ``nansum``) and is left out of that function's mean.

**Scoring** runs in :class:`fastrl.train.rewards.pool.RewardPool` (worker processes, hard time
limits, failures counted); ``fastrl.train.rewards`` hands on its names and these.

**Built-ins** (names usable from the command line): ``exact_match``, ``math`` and
``format`` (see their docstrings); ``format=<regex>`` is a format check with your own
pattern. Other functions come from ``module.sub:function`` or ``path/to/file.py:function``.
The built-ins read a conversational completion (a list of messages: chat prompts, agent
trajectories) as the content of its last ``assistant`` message (:func:`completion_text`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import threading
from fractions import Fraction
from typing import Any, Callable, Literal, Sequence

from fastrl.errors import InputError

__all__ = [
    "BUILTIN_REWARDS",
    "RegexFormatReward",
    "completion_text",
    "exact_match_reward",
    "extract_final_answer",
    "format_reward",
    "math_answers_equal",
    "math_reward",
    "resolve_reward",
]

RewardFunction = Callable[..., Sequence[Any]]

# ---------------------------------------------------------------------------------------
# Final-answer extraction and the built-in reward functions
# ---------------------------------------------------------------------------------------

_BOX_START = re.compile(r"\\(?:boxed|fbox)\{")
_BRACE = re.compile(r"[{}]")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces balanced.

    One pass over the text (a degenerate completion full of unclosed boxes stays linear)."""
    starts = [match.end() - 1 for match in _BOX_START.finditer(text)]
    if not starts:
        return None
    closing: dict[int, int] = {}  # brace matching from the first box on (earlier braces cannot close a box)
    open_positions: list[int] = []
    for brace in _BRACE.finditer(text, starts[0]):
        if brace.group() == "{":
            open_positions.append(brace.start())
        elif open_positions:
            closing[open_positions.pop()] = brace.start()
    starts.reverse()
    for open_brace in starts:  # the last box that closes; a truncated one is skipped
        if open_brace in closing:
            return text[open_brace + 1 : closing[open_brace]]
    return None


def _last_answer_tag(text: str) -> str | None:
    """Content of the last complete ``<answer>...</answer>`` (case-insensitive), in linear time."""
    lowered = text.lower()
    close = lowered.rfind("</answer>")
    if close < 0:
        return None
    open_tag = lowered.rfind("<answer>", 0, close)
    return None if open_tag < 0 else text[open_tag + len("<answer>") : close]


def extract_final_answer(text: str, *, fallback: Literal["text", "last_number", "none"] = "text") -> str | None:
    """The final answer stated in ``text``, by the first rule that applies:

    1. the content of the last ``\\boxed{...}`` (nested braces balanced; ``\\fbox`` too);
    2. the rest of the line after the last ``####`` (GSM8K's answer marker);
    3. the content of the last ``<answer>...</answer>`` tag;
    4. ``fallback``: ``"text"`` -- the whole text; ``"last_number"`` -- the last number in
       the text (``-12``, ``1,000``, ``0.5``, ``3/4``); ``"none"`` -- no answer (``None``).

    The result is stripped of surrounding whitespace; it is ``None`` when nothing is found.
    """
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    marker = text.rfind("####")
    if marker >= 0:
        return text[marker + 4 :].split("\n", 1)[0].strip()
    tag = _last_answer_tag(text)
    if tag is not None:
        return tag.strip()
    if fallback == "text":
        return text.strip()
    if fallback == "last_number":
        numbers = _NUMBER.findall(text)
        return numbers[-1] if numbers else None
    return None


def completion_text(completion: Any) -> str:
    """The text a built-in reward reads from one completion: a string as it is; a
    conversational completion (TRL's form: a list of ``{"role", "content"}`` messages, as chat
    prompts and agent trajectories pass) the content of its last ``assistant`` message ("" when
    it has none)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)):
        for message in reversed(completion):
            if isinstance(message, dict) and message.get("role") == "assistant":
                content = message.get("content")
                return content if isinstance(content, str) else ""
        return ""
    return str(completion)


_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_DECIMAL = re.compile(r"^-?(?:\d+(?:\.\d*)?|\.\d+)$")
_SLASH_FRACTION = re.compile(r"^(-?\d+)/(-?\d+)$")
_LATEX_FRACTION = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$")
_LATEX_NOISE = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\:|\\ ")
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def _normalise_answer(answer: str) -> str:
    """Canonical spelling of an extracted answer, for string and numeric comparison.

    Strips whitespace, surrounding ``$``, a trailing period, spacing commands and
    ``\\left``/``\\right``; unwraps ``\\text{..}``; spells ``\\dfrac``/``\\tfrac`` as ``\\frac``;
    drops thousands separators and a trailing ``%``; casefolds; and writes a plain number
    in lowest terms (``72.0`` -> ``72``, ``-.5`` -> ``-1/2``, ``\\frac{2}{4}`` -> ``1/2``).
    """
    text = answer.strip().strip("$").strip()
    text = _TEXT_WRAPPER.sub(r"\1", text)
    text = _LATEX_NOISE.sub("", text).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = text.replace("\\%", "").rstrip("%").rstrip(".").strip()
    text = " ".join(text.split()).casefold()
    number = _as_fraction(text)
    if number is not None:
        return str(number)
    return text


def _as_fraction(text: str) -> Fraction | None:
    """``text`` as an exact rational number when it spells one (decimal, a/b, \\frac{a}{b})."""
    compact = text.replace(" ", "")
    if _THOUSANDS.match(compact):
        compact = compact.replace(",", "")
    if _DECIMAL.match(compact):
        return Fraction(compact)
    match = _SLASH_FRACTION.match(compact)
    if match and int(match.group(2)) != 0:
        return Fraction(int(match.group(1)), int(match.group(2)))
    match = _LATEX_FRACTION.match(compact)
    if match and int(match.group(3)) != 0:
        value = Fraction(int(match.group(2)), int(match.group(3)))
        return -value if match.group(1) else value
    return None


_math_verify_module: Any = None
_math_verify_checked = False


def _load_math_verify() -> Any:
    """The ``math_verify`` module, or ``None`` when it is not installed (imported once)."""
    global _math_verify_module, _math_verify_checked
    if not _math_verify_checked:
        _math_verify_checked = True
        try:
            import math_verify
        except ImportError:
            math_verify = None
        _math_verify_module = math_verify
    return _math_verify_module


def math_answers_equal(reference: str, prediction: str, *, use_math_verify: bool | None = None) -> bool:
    """Whether two extracted answers are mathematically equal.

    With ``math-verify`` (``use_math_verify=None`` uses it when installed; ``True`` requires
    it), both are parsed as LaTeX and compared symbolically (``1/2 == 0.5 == \\frac12``,
    sets in any order, ...). When it is not used, or cannot parse one of the two, the
    fallback compares :func:`_normalise_answer` spellings: equal rationals (``-0.75`` and
    ``\\frac{-3}{4}``, ``1,000`` and ``1000``) or equal normalised strings.
    """
    module = _load_math_verify() if use_math_verify in (None, True) else None
    if use_math_verify and module is None:
        raise ImportError("use_math_verify=True needs the math-verify package: pip install math-verify")
    if module is not None:
        verdict = _math_verify_equal(module, _as_latex(reference), _as_latex(prediction))
        if verdict is not None:
            return verdict
    return _normalise_answer(reference) == _normalise_answer(prediction)


def _as_latex(answer: str) -> str:
    return f"${answer.strip().strip('$')}$"


def _math_verify_equal(module: Any, reference: str, prediction: str) -> bool | None:
    """math-verify's verdict, or ``None`` when it cannot parse one side."""
    # math-verify's own time limits use SIGALRM, which only the main thread may set.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = module.parse(reference, parsing_timeout=limit)
    pred = module.parse(prediction, parsing_timeout=limit)
    if not gold or not pred:
        return None
    return bool(module.verify(gold, pred, timeout_seconds=limit))


def _reference_answers(name: str, answer: Sequence[Any] | None, count: int) -> Sequence[Any]:
    if answer is None:
        raise ValueError(f"the {name} reward needs an 'answer' dataset column (the reference answer of each prompt)")
    if len(answer) != count:
        raise ValueError(f"the {name} reward got {len(answer)} answers for {count} completions")
    return answer


def exact_match_reward(
    prompts: list[str], completions: list[str], *, answer: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 when the completion's final answer equals the ``answer`` column, else 0.0.

    Both sides go through :func:`extract_final_answer` (``fallback="text"``: a completion or
    reference without an answer marker is taken whole) and :func:`_normalise_answer`, so
    ``"... #### 1,000."`` matches ``1000`` and a GSM8K reference ``"...#### 72"`` matches
    ``72.0``. A reference that is ``None`` gives ``None`` (does not apply).
    """
    references = _reference_answers("exact_match", answer, len(completions))
    rewards: list[float | None] = []
    for completion, reference in zip(map(completion_text, completions), references):
        if reference is None:
            rewards.append(None)
            continue
        expected = _normalise_answer(extract_final_answer(str(reference), fallback="text") or "")
        stated = _normalise_answer(extract_final_answer(completion, fallback="text") or "")
        rewards.append(1.0 if stated == expected else 0.0)
    return rewards


def math_reward(
    prompts: list[str], completions: list[str], *, answer: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 when the completion's answer is mathematically equal to the ``answer`` column.

    The reference is extracted with :func:`extract_final_answer` (``fallback="text"``), so
    GSM8K's ``"... #### 72"`` and MATH's ``\\boxed{...}`` solutions work as references. The
    completion's answer is its last ``\\boxed{}``, ``####`` line or ``<answer>`` tag; without
    any of these, math-verify extracts from the whole completion when it is installed, and
    the fallback takes the last number. Comparison: :func:`math_answers_equal`. A
    completion without an answer scores 0.0; a ``None`` reference gives ``None``.
    """
    references = _reference_answers("math", answer, len(completions))
    module = _load_math_verify()
    rewards: list[float | None] = []
    for completion, reference in zip(map(completion_text, completions), references):
        if reference is None:
            rewards.append(None)
            continue
        expected = extract_final_answer(str(reference), fallback="text") or ""
        stated = extract_final_answer(completion, fallback="none")
        if stated is None and module is not None:  # no marker: math-verify reads the whole completion
            verdict = _math_verify_equal(module, _as_latex(expected), completion)
            if verdict is not None:
                rewards.append(float(verdict))
                continue
        if stated is None:
            stated = extract_final_answer(completion, fallback="last_number")
        if stated is None or not stated.strip():
            rewards.append(0.0)
            continue
        rewards.append(1.0 if math_answers_equal(expected, stated) else 0.0)
    return rewards


class RegexFormatReward:
    """1.0 when ``re.search(pattern, completion)`` matches, else 0.0 (``format=<regex>``).

    ``re.DOTALL`` is on by default (``.`` matches newlines); anchor the pattern with
    ``^...$`` for a whole-completion format such as ``^<think>.*</think>\\s*<answer>.*</answer>$``.
    """

    def __init__(self, pattern: str, *, flags: int = re.DOTALL) -> None:
        try:
            self.regex = re.compile(pattern, flags)
        except re.error as error:
            raise InputError(f"format reward: invalid regular expression {pattern!r}: {error}") from None
        self.__name__ = "format"

    def __call__(self, prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        return [1.0 if self.regex.search(completion_text(completion)) else 0.0 for completion in completions]

    def __repr__(self) -> str:
        return f"RegexFormatReward({self.regex.pattern!r})"


def format_reward(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the completion states a final answer in a form the other built-ins read -- a
    complete ``\\boxed{...}``, a ``####`` line or an ``<answer>...</answer>`` tag -- that is not
    empty, else 0.0 (:func:`extract_final_answer` with ``fallback="none"``)."""
    return [1.0 if (extract_final_answer(completion_text(c), fallback="none") or "") else 0.0 for c in completions]


BUILTIN_REWARDS: dict[str, RewardFunction] = {
    "exact_match": exact_match_reward,
    "math": math_reward,
    "format": format_reward,
}


# ---------------------------------------------------------------------------------------
# Resolving reward specs
# ---------------------------------------------------------------------------------------

_SPEC_FORMS = (
    "a built-in name ({names}), 'format=<regex>', 'module.sub:function' or 'path/to/file.py:function'"
)


def _callable_name(function: Callable) -> str:
    name = getattr(function, "__name__", None) or type(function).__name__
    return "lambda" if name == "<lambda>" else name


def _load_file_module(path: str, spec: str) -> Any:
    if not os.path.isfile(path):
        raise InputError(f"reward {spec!r}: file {path!r} does not exist")
    module_name = "fastrl_reward_" + re.sub(r"\W", "_", os.path.abspath(path))
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[module_name]
        raise InputError(f"reward {spec!r}: importing {path!r} failed: {type(error).__name__}: {error}") from error
    return module


def resolve_reward(spec: str | Callable) -> tuple[str, RewardFunction]:
    """``(name, function)`` for a reward given as a callable or a string.

    Strings: a built-in name (``exact_match``, ``math``, ``format``), ``format=<regex>``,
    ``module.sub:function`` (imported) or ``path/to/file.py:function`` (loaded from the
    file; relative to the working directory). The attribute may be dotted
    (``module:Class.method``). A callable keeps its ``__name__`` (``lambda`` for lambdas).
    Raises ``ValueError`` naming the spec and the valid forms.
    """
    if callable(spec):
        return _callable_name(spec), spec
    if not isinstance(spec, str):
        raise InputError(f"a reward must be a callable or a string, got {type(spec).__name__}")
    forms = _SPEC_FORMS.format(names=", ".join(BUILTIN_REWARDS))
    if spec in BUILTIN_REWARDS:
        if spec == "math":
            _load_math_verify()  # imported once here, so forked workers inherit it
        return spec, BUILTIN_REWARDS[spec]
    if spec.startswith("format="):
        return "format", RegexFormatReward(spec[len("format=") :])
    location, colon, attribute = spec.rpartition(":")
    if not colon or not location or not attribute:
        raise InputError(f"unknown reward {spec!r}: expected {forms}")
    if location.endswith(".py"):
        module = _load_file_module(location, spec)
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as error:
            raise InputError(f"reward {spec!r}: cannot import module {location!r}: {error}") from error
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise InputError(f"reward {spec!r}: {location!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise InputError(f"reward {spec!r}: {attribute!r} is a {type(target).__name__}, not a function")
    return attribute.rsplit(".", 1)[-1], target
