"""The reward pool: scores completions with weighted reward functions in worker processes, under hard time limits.

The functions are TRL-style (:mod:`fastrl.train.rewards`: their signature and keyword arguments,
the built-ins, resolving a spec); this module calls them, in workers or in-process, turns every
failure into a counted zero and sums the weighted rewards (:class:`RewardResult`).

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
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import multiprocessing
import pickle
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from fastrl import workers
from fastrl.errors import InputError
from fastrl.train.rewards.functions import RewardFunction, resolve_reward

__all__ = ["NON_FINITE_TOTAL_METRIC", "RewardPool", "RewardResult"]

logger = logging.getLogger(__name__)

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


class RewardPool(workers.Closeable):
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

    # ------------------------------------------------------------------ public API (close and ``with``: workers.Closeable)
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
    def _release(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def _call_kwargs(
        self,
        prompts: list[str],
        completions: list[str],
        completion_ids: list[list[int]] | None,
        columns: dict[str, list] | None,
        trainer_state: Any,
    ) -> dict[str, Any]:
        self._check_open()
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
