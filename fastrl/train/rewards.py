"""The reward stage: TRL-style reward functions, scored in worker processes with hard time limits.

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

**Isolation.** :class:`RewardPool` runs reward code in the worker processes of a
:class:`fastrl.workers.WorkerPool` (see there for process groups and dying with the
trainer). Each call is split,
per function, into ``num_workers`` contiguous chunks of samples, one task each, dispatched
to idle workers. ``timeout_s`` bounds one task (one function on one chunk), measured from
its dispatch. A task whose function raises, hangs past the limit, kills its process
(``os._exit``, a segfault, the OOM killer) or returns something that is not one number or
``None`` per sample gives every sample of its chunk 0 for that function; a non-finite value
(NaN, inf) or one beyond float32's range gives that sample 0. The weighted sum over
functions is taken in float64; a sample whose total does not fit float32 (two functions
returning 3e38 each) scores 0 and is left out of ``scored``: it is treated as a failed
reward rather than stopping the run, and counted in ``reward/non_finite_total``. Each kind is counted, in samples, in the metrics
(``reward/<name>/raised``, ``/timeout``, ``/crashed``, ``/invalid``; ``/none`` counts
``None`` values). A hung or dead worker is killed, reaped and replaced before the next
task is dispatched; the call itself never raises because of reward code and returns within
about ``timeout_s`` per round of tasks (``len(functions)`` rounds at worst, when every task
of every function hangs).

**Start method.** Workers are forked where the platform allows (Linux, macOS with
``start_method="fork"``): they inherit the functions, so lambdas, closures and functions
defined in a user's script work without pickling, and a worker starts in milliseconds
(about 0.2 s for a trainer holding 2 GB). Forking a process that has threads (torch's, a
progress bar's) is safe for the Python code that runs in the worker; if a worker ever
deadlocks on a lock inherited from another thread, the time limit turns that into a counted
timeout and a fresh worker. Workers run torch with one thread: after a fork, torch's
multi-threaded CPU ops would hang (its OpenMP pool does not survive a fork), and several
workers should not compete for the trainer's cores anyway. A forked worker cannot use CUDA
once the trainer has initialised it; a reward that needs the GPU uses
``start_method="spawn"`` or ``num_workers=0``. With ``"spawn"``/``"forkserver"`` the
functions are shipped with ``cloudpickle`` (by value for lambdas, closures and functions
loaded from ``path/to/file.py``) and each worker imports torch once when it starts; a task
is only dispatched to a worker that has started, so start-up never counts against
``timeout_s``. Each worker leads its own process group, and a worker is killed with its
whole group: a reward that runs ``subprocess.run(["sleep", "3600"])`` and times out leaves
no ``sleep`` behind. Workers ignore SIGINT (a Ctrl-C is the trainer's to handle; the pool
kills the workers busy with the interrupted call, and :meth:`RewardPool.close` or the
interpreter's exit ends the rest) and die with the trainer, even in the middle of a call
(``PR_SET_PDEATHSIG`` on Linux, and a watch thread), taking their children with them. A
daemonic worker cannot start ``multiprocessing`` children of its own (``subprocess`` works).

**In-process mode** (``num_workers=0``) calls the functions in the training process, for
debugging with breakpoints. Exceptions (``sys.exit`` included) and invalid outputs are
still caught and counted, but there is no time limit, and a function that hangs, calls
``os._exit`` or crashes the interpreter takes the run with it.

**Built-ins** (names usable from the command line): ``exact_match``, ``math`` and
``format`` (see their docstrings); ``format=<regex>`` is a format check with your own
pattern. Other functions come from ``module.sub:function`` or ``path/to/file.py:function``.
The built-ins read a conversational completion (a list of messages: chat prompts, agent
trajectories) as the content of its last ``assistant`` message (:func:`completion_text`).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import logging
import math
import multiprocessing
import os
import pickle
import re
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Literal, Sequence

import torch

from fastrl import workers
from fastrl.errors import InputError

__all__ = [
    "BUILTIN_REWARDS",
    "RegexFormatReward",
    "completion_text",
    "RewardPool",
    "RewardResult",
    "exact_match_reward",
    "extract_final_answer",
    "format_reward",
    "math_answers_equal",
    "math_reward",
    "resolve_reward",
]

logger = logging.getLogger(__name__)

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


# ---------------------------------------------------------------------------------------
# Calling one function on one chunk (in a worker or in-process)
# ---------------------------------------------------------------------------------------

_OK, _RAISED, _INVALID, _TIMEOUT, _CRASHED = "ok", "raised", "invalid", "timeout", "crashed"
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
NON_FINITE_TOTAL_METRIC = "reward/non_finite_total"
"""Samples whose weighted reward sum does not fit float32 (scored 0, like a failed reward)."""
_FAILURE_KINDS = (_RAISED, _TIMEOUT, _CRASHED, _INVALID)
# The worker pool's statuses that are reward failures, by the name the metrics count them under.
_WORKER_STATUS = {workers.RAISED: _RAISED, workers.TIMEOUT: _TIMEOUT, workers.CRASHED: _CRASHED}
_RESERVED_KWARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")
_SHARED_KWARGS = ("trainer_state",)  # the same object for every chunk; everything else is per sample
_DROPPED_COLUMNS = ("prompt", "completion", "completion_ids")


@dataclass
class _Outcome:
    """What one function returned for one chunk."""

    status: str
    values: list[float | None] | None = None  # per sample; NaN marks a non-finite value
    message: str = ""
    user_metrics: dict[str, list[float]] = field(default_factory=dict)
    extra_columns: dict[str, list] = field(default_factory=dict)


def _coerce_rewards(output: Any, count: int) -> tuple[list[float | None] | None, str]:
    """The output as ``count`` floats/None (NaN for non-finite), or ``(None, why not)``."""
    if isinstance(output, (torch.Tensor,)) or type(output).__module__ == "numpy":
        if getattr(output, "ndim", 1) != 1:
            return None, f"returned an array of shape {tuple(output.shape)}; expected a list of {count} values"
        output = output.tolist()
    if isinstance(output, (str, bytes, dict)) or not hasattr(output, "__len__") or not hasattr(output, "__iter__"):
        return None, f"returned {type(output).__name__}; expected a list of {count} floats or None"
    if len(output) != count:
        return None, f"returned {len(output)} values for {count} completions"
    values: list[float | None] = []
    for index, value in enumerate(output):
        if value is None:
            values.append(None)
            continue
        if isinstance(value, (str, bytes)):
            return None, f"value {index} is a {type(value).__name__} ({value!r:.40}); expected a float or None"
        try:
            number = float(value)
        except (TypeError, ValueError):
            return None, f"value {index} is a {type(value).__name__}; expected a float or None"
        values.append(number if math.isfinite(number) and abs(number) <= _FLOAT32_MAX else math.nan)
    return values, ""


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _call_reward(function: RewardFunction, prompts: list[str], completions: list[str], kwargs: dict) -> _Outcome:
    """Call ``function`` on one chunk; every exception and bad output becomes an outcome."""
    user_metrics: dict[str, list[float]] = {}
    extra_columns: dict[str, list] = {}

    def log_metric(name: str, value: float) -> None:
        user_metrics.setdefault(str(name), []).append(float(value))

    def log_extra(column: str, values: list) -> None:
        extra_columns.setdefault(str(column), []).extend(values)

    try:
        output = function(
            prompts=prompts, completions=completions, log_metric=log_metric, log_extra=log_extra, **kwargs
        )
        if inspect.isawaitable(output):  # an ``async def`` reward (TRL accepts those too)
            output = asyncio.run(_awaited(output))
    except (Exception, SystemExit) as error:  # sys.exit() in reward code must not end the trainer either
        tail = "".join(traceback.format_exception(type(error), error, error.__traceback__)[-3:])
        return _Outcome(_RAISED, message=f"{type(error).__name__}: {error}\n{tail}".strip())
    try:
        values, problem = _coerce_rewards(output, len(completions))
    except Exception as error:  # an output object whose len/iter/float itself fails
        values, problem = None, f"the returned {type(output).__name__} could not be read: {type(error).__name__}: {error}"
    if values is None:
        return _Outcome(_INVALID, message=problem)
    extra_columns = {name: column for name, column in extra_columns.items() if len(column) == len(completions)}
    return _Outcome(_OK, values=values, user_metrics=user_metrics, extra_columns=extra_columns)


def _reward_task(functions: list[RewardFunction], message: tuple) -> _Outcome:
    """What a worker does with one task: ``(function_index, prompts, completions, kwargs)``."""
    function_index, prompts, completions, kwargs = message
    outcome = _call_reward(functions[function_index], prompts, completions, kwargs)
    try:
        pickle.dumps((outcome.user_metrics, outcome.extra_columns))
    except Exception as error:  # something the function logged does not pickle: keep the rewards
        logger.warning("reward logs dropped, they could not be sent back: %s", error)
        outcome.user_metrics, outcome.extra_columns = {}, {}
    return outcome



@dataclass
class RewardResult:
    """Rewards of one batch of N completions."""

    rewards: torch.Tensor
    """``[N]`` float32: the weighted sum over functions (taken in float64); failed or ``None``
    values count 0, and a total beyond float32's range is 0 (``reward/non_finite_total``)."""
    per_function: dict[str, torch.Tensor]
    """name -> ``[N]`` float32 raw values of that function (failed or ``None`` -> 0)."""
    scored: torch.Tensor
    """``[N]`` bool: at least one function gave a valid value (TRL treats rows where every
    function returned None as unscorable and leaves them out of the group baseline)."""
    metrics: dict[str, float]
    """``reward/<name>/mean`` and ``/std`` over that function's valid values (0 when none);
    sample counts ``/none``, ``/raised``, ``/timeout``, ``/crashed``, ``/invalid``;
    ``reward/<name>/user/<metric>`` from ``log_metric``; ``reward/seconds`` for the call."""
    errors: list[str]
    """One line per failed task: function, kind, samples, message."""
    extra_columns: dict[str, list] = field(default_factory=dict)
    """Columns logged with ``log_extra``: name -> N values (``None`` where not logged)."""


class RewardPool:
    """Scores completions with several weighted TRL-style reward functions in worker processes.

    Args:
        functions: callables or specs for :func:`resolve_reward`.
        weights: one weight per function (default 1 each); the reward is the weighted sum.
        names: names in the metrics (default: from :func:`resolve_reward`, made unique).
        timeout_s: wall-clock limit of one function on one chunk of samples.
        num_workers: worker processes (each call splits its batch into this many chunks per
            function); 0 runs in-process without a time limit (debugging).
        start_method: ``"fork"`` (default where available), ``"spawn"`` or ``"forkserver"``.

    Use as a context manager or call :meth:`close`; a pool that is garbage collected or
    alive at interpreter exit is closed too. Typical use::

        with RewardPool(["math", "format"], weights=[1.0, 0.1], timeout_s=5.0) as pool:
            pool.validate(prompts[:4], answers[:4], {"answer": answers[:4]})  # before step 1
            result = pool.score(prompts, completions, completion_ids=ids, columns={"answer": answers})
            result.rewards  # [N] float32
    """

    def __init__(
        self,
        functions: Sequence[Callable | str],
        *,
        weights: Sequence[float] | None = None,
        names: Sequence[str] | None = None,
        timeout_s: float = 10.0,
        num_workers: int = 2,
        start_method: str | None = None,
    ) -> None:
        if isinstance(functions, (str, bytes)) or callable(functions):
            functions = [functions]
        if len(functions) == 0:
            raise InputError("RewardPool needs at least one reward function")
        resolved = [resolve_reward(spec) for spec in functions]
        self.functions: list[RewardFunction] = [function for _, function in resolved]
        self.names = self._unique_names([name for name, _ in resolved] if names is None else list(names))
        if weights is None:
            weights = [1.0] * len(self.functions)
        if len(weights) != len(self.functions):
            raise InputError(f"weights has {len(weights)} entries for {len(self.functions)} reward functions {self.names}")
        self.weights = [float(weight) for weight in weights]
        if not all(math.isfinite(weight) for weight in self.weights):
            raise InputError(f"weights must be finite, got {list(weights)}")
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise InputError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise InputError(f"num_workers must be an int >= 0, got {num_workers!r}")
        self.timeout_s = float(timeout_s)
        self.num_workers = num_workers
        methods = multiprocessing.get_all_start_methods()
        if start_method is None:
            start_method = "fork" if "fork" in methods else "spawn"
        if start_method not in methods:
            raise InputError(f"start_method must be one of {methods}, got {start_method!r}")
        self.start_method = start_method
        self._closed = False
        self._warned: set[tuple[str, ...]] = set()
        self._pool: workers.WorkerPool | None = None
        if num_workers > 0:
            if start_method != "fork":
                self._register_file_modules_by_value()
            try:
                self._pool = workers.WorkerPool(
                    _reward_task,
                    self.functions,
                    num_workers=num_workers,
                    timeout_s=self.timeout_s,
                    start_method=start_method,
                    name="fastrl-reward-worker",
                )
            except workers.WorkerStartError as error:
                raise ValueError(f"reward worker for {self.names} could not start: {error}") from error
            except ValueError as error:  # the functions could not be shipped to spawned workers
                raise InputError(f"reward functions {self.names}: {error}") from error

    # ------------------------------------------------------------------ setup helpers
    def _unique_names(self, names: list[str]) -> list[str]:
        if len(names) != len(self.functions):
            raise InputError(f"names has {len(names)} entries for {len(self.functions)} reward functions")
        if any(not isinstance(name, str) or not name for name in names):
            raise InputError(f"reward names must be non-empty strings, got {names}")
        unique: list[str] = []
        for name in names:
            candidate, suffix = name, 2
            while candidate in unique:
                candidate, suffix = f"{name}_{suffix}", suffix + 1
            unique.append(candidate)
        return unique

    def _register_file_modules_by_value(self) -> None:
        """Functions loaded from a ``path/to/file.py`` go to spawned workers by value: they cannot import them."""
        try:
            import cloudpickle
        except ImportError:
            return  # the worker pool says that cloudpickle is needed
        for function in self.functions:
            module = sys.modules.get(getattr(function, "__module__", "") or "")
            if module is not None and module.__name__.startswith("fastrl_reward_"):
                cloudpickle.register_pickle_by_value(module)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (for monitoring and tests)."""
        return [] if self._pool is None else self._pool.worker_pids

    # ------------------------------------------------------------------ public API
    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers (asked first, killed after 1 s) and reap them. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.close()

    def validate(
        self,
        prompts: list[str],
        completions: list[str],
        columns: dict[str, list] | None = None,
        *,
        completion_ids: list[list[int]] | None = None,
        trainer_state: Any = None,
    ) -> None:
        """Check every function before the first step; raise ``ValueError`` naming it.

        Checks that each function's signature accepts ``(prompts, completions, **kwargs)``
        with the keyword arguments a step passes (``completion_ids``, ``trainer_state``,
        ``log_metric``, ``log_extra`` and the dataset ``columns``), then probes it on the given
        rows (real dataset rows with stand-in completions): raising, timing out, killing its
        worker or returning the wrong number of values is an error here, not a zero later.
        """
        count = len(completions)
        if count == 0:
            raise InputError("validate needs at least one row to probe the reward functions with")
        kwargs = self._call_kwargs(prompts, completions, completion_ids, columns, trainer_state)
        probe_arguments = dict(prompts=prompts, completions=completions, log_metric=None, log_extra=None, **kwargs)
        for name, function in zip(self.names, self.functions):
            try:
                signature = inspect.signature(function)
            except (TypeError, ValueError):
                continue  # no introspectable signature (a builtin): the probe call decides
            try:
                signature.bind(**probe_arguments)
            except TypeError as error:
                raise InputError(
                    f"reward function {name!r} cannot be called as {name}(prompts, completions, **kwargs) with the "
                    f"keyword arguments {sorted(probe_arguments)}: {error}. Reward functions use TRL's signature "
                    "fn(prompts, completions, **kwargs) -> list[float | None]."
                ) from None
        outcomes = self._run(prompts, completions, kwargs, whole=True)  # the function sees every probe row
        for name, chunk_outcomes in zip(self.names, outcomes):
            for _, outcome in chunk_outcomes:
                if outcome.status != _OK:
                    slow = outcome.status == _TIMEOUT
                    hint = f" (raise timeout_s above {self.timeout_s:g} s if it is just slow)" if slow else ""
                    raise InputError(
                        f"reward function {name!r} failed on a probe call with {count} dataset rows "
                        f"({outcome.status}){hint}: {outcome.message}"
                    )

    def score(
        self,
        prompts: list[str],
        completions: list[str],
        *,
        completion_ids: list[list[int]] | None = None,
        columns: dict[str, list] | None = None,
        trainer_state: Any = None,
    ) -> RewardResult:
        """Rewards of N completions; ``columns`` holds each dataset column repeated per sample.

        Never raises because of reward code (see the module docstring); raises ``ValueError``
        for inconsistent inputs (lengths, a column named like a reserved keyword argument).
        """
        started = time.perf_counter()
        count = len(completions)
        kwargs = self._call_kwargs(prompts, completions, completion_ids, columns, trainer_state)
        outcomes = self._run(prompts, completions, kwargs) if count else [[] for _ in self.functions]
        result = self._assemble(count, outcomes)
        result.metrics["reward/seconds"] = time.perf_counter() - started
        return result

    # ------------------------------------------------------------------ internals
    def _call_kwargs(
        self,
        prompts: list[str],
        completions: list[str],
        completion_ids: list[list[int]] | None,
        columns: dict[str, list] | None,
        trainer_state: Any,
    ) -> dict[str, Any]:
        if self._closed:
            raise ValueError("this RewardPool is closed")
        count = len(completions)
        if len(prompts) != count:
            raise ValueError(f"prompts has {len(prompts)} entries for {count} completions")
        if completion_ids is not None and len(completion_ids) != count:
            raise ValueError(f"completion_ids has {len(completion_ids)} entries for {count} completions")
        kwargs: dict[str, Any] = {
            "completion_ids": None if completion_ids is None else list(completion_ids),
            "trainer_state": trainer_state,
        }
        for name, values in (columns or {}).items():
            if name in _DROPPED_COLUMNS:
                continue
            if name in _RESERVED_KWARGS:
                raise InputError(f"dataset column {name!r} clashes with the reward keyword argument of that name")
            if not hasattr(values, "__len__") or len(values) != count:
                raise ValueError(
                    f"dataset column {name!r} must hold one value per completion ({count}), "
                    f"got {len(values) if hasattr(values, '__len__') else type(values).__name__}"
                )
            kwargs[name] = list(values)
        return kwargs

    def _chunks(self, count: int) -> list[tuple[int, int]]:
        pieces = max(1, min(self.num_workers, count))
        bounds = [round(index * count / pieces) for index in range(pieces + 1)]
        return [(bounds[index], bounds[index + 1]) for index in range(pieces) if bounds[index + 1] > bounds[index]]

    def _run(
        self, prompts: list[str], completions: list[str], kwargs: dict[str, Any], *, whole: bool = False
    ) -> list[list[tuple[tuple[int, int], _Outcome]]]:
        """Per function: ``[(chunk bounds, outcome), ...]``; ``whole``: one chunk per function."""
        chunks = [(0, len(completions))] if whole else self._chunks(len(completions))

        def chunk_kwargs(start: int, stop: int) -> dict[str, Any]:
            return {
                key: (value[start:stop] if key not in _SHARED_KWARGS and value is not None else value)
                for key, value in kwargs.items()
            }

        tasks = [
            (function_index, (start, stop))
            for function_index in range(len(self.functions))
            for start, stop in chunks
        ]
        if self.num_workers == 0:
            outcomes = [
                _call_reward(self.functions[index], prompts[start:stop], completions[start:stop], chunk_kwargs(start, stop))
                for index, (start, stop) in tasks
            ]
        else:
            messages = [
                (index, prompts[start:stop], completions[start:stop], chunk_kwargs(start, stop))
                for index, (start, stop) in tasks
            ]
            outcomes = self._dispatch(messages)
        grouped: list[list[tuple[tuple[int, int], _Outcome]]] = [[] for _ in self.functions]
        for (index, bounds), outcome in zip(tasks, outcomes):
            grouped[index].append((bounds, outcome))
        return grouped

    def _dispatch(self, messages: list[tuple]) -> list[_Outcome]:
        """Run the tasks on the worker pool; its statuses become reward outcomes."""
        outcomes = []
        for result in self._pool.run(messages):
            if result.status == workers.OK:
                outcomes.append(result.value)
            elif result.status == workers.UNSENDABLE:  # a column value that does not pickle
                outcomes.append(_Outcome(_INVALID, message=result.message))
            else:
                outcomes.append(_Outcome(_WORKER_STATUS[result.status], message=result.message))
        return outcomes

    def _assemble(self, count: int, outcomes: list[list[tuple[tuple[int, int], _Outcome]]]) -> RewardResult:
        rewards = torch.zeros(count, dtype=torch.float64)
        scored = torch.zeros(count, dtype=torch.bool)
        per_function: dict[str, torch.Tensor] = {}
        metrics: dict[str, float] = {}
        errors: list[str] = []
        extra_columns: dict[str, list] = {}
        for name, weight, chunk_outcomes in zip(self.names, self.weights, outcomes):
            values = torch.zeros(count, dtype=torch.float64)
            valid = torch.zeros(count, dtype=torch.bool)
            counts = dict.fromkeys((*_FAILURE_KINDS, "none"), 0)
            user_metrics: dict[str, list[float]] = {}
            for (start, stop), outcome in chunk_outcomes:
                if outcome.status != _OK:
                    counts[outcome.status] += stop - start
                    first_line = outcome.message.splitlines()[0] if outcome.message else ""
                    errors.append(f"{name}: {outcome.status} on samples {start}:{stop}: {first_line}")
                    continue
                for offset, value in enumerate(outcome.values):
                    if value is None:
                        counts["none"] += 1
                    elif math.isnan(value):
                        counts[_INVALID] += 1
                    else:
                        values[start + offset] = value
                        valid[start + offset] = True
                for metric, logged in outcome.user_metrics.items():
                    user_metrics.setdefault(metric, []).extend(logged)
                for column, column_values in outcome.extra_columns.items():
                    extra_columns.setdefault(column, [None] * count)[start:stop] = column_values
            good = values[valid]
            metrics[f"reward/{name}/mean"] = float(good.mean()) if good.numel() else 0.0
            metrics[f"reward/{name}/std"] = float(good.std(unbiased=False)) if good.numel() else 0.0
            for kind, number in counts.items():
                metrics[f"reward/{name}/{kind}"] = float(number)
            for metric, logged in user_metrics.items():
                metrics[f"reward/{name}/user/{metric}"] = sum(logged) / len(logged)
            per_function[name] = values.to(torch.float32)
            rewards += weight * values
            scored |= valid
        # The weighted sum is taken in float64; a total that float32 cannot hold (two rewards of
        # 3e38 each) is a failed reward: 0, left out of ``scored``, counted.
        overflow = ~(torch.isfinite(rewards) & (rewards.abs() <= _FLOAT32_MAX))
        rewards[overflow] = 0.0
        scored &= ~overflow
        metrics[NON_FINITE_TOTAL_METRIC] = float(overflow.sum())
        for index in overflow.nonzero().flatten().tolist()[:1]:
            errors.append(f"total: invalid on samples {index}:{index + 1}: the weighted sum of the rewards overflows float32")
        for line in errors:  # the first failure of each function and kind is a warning, repeats are debug
            key = tuple(line.split(" ", 2)[:2])
            logger.log(logging.DEBUG if key in self._warned else logging.WARNING, "reward %s", line)
            self._warned.add(key)
        return RewardResult(
            rewards=rewards.to(torch.float32),
            per_function=per_function,
            scored=scored,
            metrics=metrics,
            errors=errors,
            extra_columns=extra_columns,
        )
