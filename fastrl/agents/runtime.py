"""The environment runtime: every trajectory's environment lives in a worker process; the
environment steps of all active trajectories run concurrently, each bounded in time; an
environment that hangs or crashes ends its own trajectory only.

Built on ``fastrl.workers.WorkerPool`` (the reward pool's machinery: per-task time limit,
a worker that hangs or dies is killed with its whole process group and replaced, workers
die with the trainer). Environments are stateful, so a trajectory is pinned to one worker:
the runtime keeps ``num_workers`` single-worker pools ("slots") and sends trajectory
``tid`` to slot ``tid % num_workers``; the slots run in parallel (one thread each, which
waits on its pool), the requests of one slot one after another.

**Contract** (what the driver calls):

- ``reset(requests: [(tid, row, seed)]) -> [EnvReply]``: build a fresh environment for
  each trajectory in its worker, ``reset(row, seed)``; ``value`` = the first observation.
- ``step(requests: [(tid, action)]) -> [EnvReply]``: one ``step(action)`` per trajectory;
  ``value`` = the ``StepResult``; an environment that is done is closed in its worker.
- ``release(tids)``: close and forget those trajectories' environments (end of a batch).
- ``fork(requests: [(child, parent)]) -> [EnvReply]`` (branching rollouts,
  ``fastrl.agents.branching``): give trajectory ``child`` an environment in the state of
  ``parent``'s, and ``parent``'s record (row, seed, actions, environment seconds so far).
  An environment with a ``fork()`` method is copied by it in the parent's worker (the child
  then lives in that worker); any other is rebuilt in the child's own worker by replay:
  ``reset(row, seed)`` and the parent's actions, each observation, reward and ``done``
  compared with the parent's recorded ones (a difference is ``raised``, with the first
  differing call in ``message``: the environment is not deterministic given row, seed and
  actions). ``value`` = ``ForkInfo`` (how, and the environment calls the replay made).
- ``EnvReply.status``: ``fastrl.workers`` status: ``ok``, ``raised`` (the environment
  itself raised, or returned the wrong type: ``message`` says what), ``timeout`` (the call
  ran past ``min(step_timeout_s, what is left of trajectory_timeout_s)``; the worker was
  killed), ``crashed`` (the worker died: ``os._exit``, a signal).

**Lost environments.** A worker killed for one trajectory takes the other environments of
its slot with it. Those are rebuilt on the replacement worker by replay: ``reset(row,
seed)`` and the trajectory's earlier actions, in order (environments must be deterministic
given ``(row, seed)`` and the actions: see ``fastrl.agents.env``); ``EnvReply.replayed``
says so and the driver counts it (``env/replays``).

**Start method and parent death.** Workers are forked (the environment factory is
inherited: closures work). The replacement of a killed worker is started from the slot's
thread, and Linux's ``PR_SET_PDEATHSIG`` follows the starting *thread*, so the pools run
with ``parent_death_signal=False``; the workers' parent-watch thread still ends them
(and their process groups) when the trainer dies.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from fastrl.agents.env import check_messages, check_step_result
from fastrl.errors import InputError
from fastrl.workers import CRASHED, OK, RAISED, TIMEOUT, Closeable, WorkerPool

__all__ = ["EnvReply", "EnvRuntime", "ForkInfo", "InProcessRuntime", "ReplayDivergence", "probe_environment"]

FORK_NATIVE, FORK_REPLAY = "fork", "replay"
"""How ``fork`` copied an environment (``ForkInfo.how``): its own ``fork()``, or replay."""
_NO_FORK = "no_fork"


class ReplayDivergence(RuntimeError):
    """A replayed environment answered differently from the recorded trajectory."""


@dataclass
class ForkInfo:
    """What ``fork`` did for one child."""

    how: str
    """``FORK_NATIVE`` or ``FORK_REPLAY``."""
    calls: int
    """Environment calls the copy made: 0 for ``fork()``, ``1 + actions`` for a replay."""


@dataclass
class EnvReply:
    status: str
    """``ok``, ``raised``, ``timeout`` or ``crashed`` (``fastrl.workers`` statuses)."""
    value: Any = None
    """The first observation (reset) or the StepResult (step), when ``ok``."""
    message: str = ""
    """What went wrong, when not ``ok``."""
    seconds: float = 0.0
    """Wall-clock seconds of the call (dispatch to reply)."""
    replayed: bool = False
    """The environment had to be rebuilt by replay before this step."""


def _close_quietly(env: Any) -> None:
    try:
        env.close()
    except Exception:
        pass


def _rebuild(factory: Callable[[], Any], row: dict, seed: int, history: Sequence[str]) -> Any:
    env = factory()
    env.reset(row, seed)
    for action in history:
        env.step(action)
    return env


def _outcome(observation: Any, result: Any = None) -> tuple:
    """What replay compares: the reset's messages, or a step's (observation, reward, done)."""
    if result is None:
        return ("reset", observation)
    return ("step", result.observation, result.reward, result.done)


def _replay(factory: Callable[[], Any], row: dict, seed: int, history: Sequence[str], recorded: Sequence[tuple]) -> Any:
    """A fresh environment brought to the end of ``history`` by replay, each answer checked
    against ``recorded`` (``[reset outcome, step outcomes...]``); ``ReplayDivergence`` on a difference."""
    env = factory()
    try:
        got = [_outcome(check_messages(env.reset(row, seed), where=f"{type(env).__name__}.reset()"))]
        for action in history:
            result = check_step_result(env.step(action), where=f"{type(env).__name__}.step()")
            got.append(_outcome(None, result))
        for call, (g, want) in enumerate(zip(got, recorded)):
            if g != want:
                what = "reset" if call == 0 else f"step {call - 1} (action {history[call - 1]!r:.60})"
                raise ReplayDivergence(f"replaying the trajectory gave a different answer at {what}: {g!r:.120} instead of "
                                       f"{want!r:.120}; forking by replay needs an environment that is deterministic given "
                                       "row, seed and actions (or give it a fork() method)")
    except BaseException:
        _close_quietly(env)
        raise
    return env


def _handle(state: dict, request: tuple) -> Any:
    """Worker side. ``state = {"factory": ..., "envs": {tid: [env, steps]}}`` (one per worker)."""
    op, tid = request[0], request[1]
    envs = state["envs"]
    if op == "reset":
        _, _, row, seed = request
        if tid in envs:
            _close_quietly(envs.pop(tid)[0])
        env = state["factory"]()
        observation = check_messages(env.reset(row, seed), where=f"{type(env).__name__}.reset()")
        envs[tid] = [env, 0]
        return observation
    if op == "step":
        _, _, row, seed, history, action = request
        entry = envs.get(tid)
        replayed = entry is None or entry[1] != len(history)
        if replayed:
            if entry is not None:
                _close_quietly(entry[0])
            entry = envs[tid] = [_rebuild(state["factory"], row, seed, history), len(history)]
        env = entry[0]
        result = check_step_result(env.step(action), where=f"{type(env).__name__}.step()")
        entry[1] += 1
        if result.done:
            _close_quietly(envs.pop(tid)[0])
        return result, replayed
    if op == "fork":  # in the parent's worker: the environment's own fork(), if it has one
        _, child, parent = request
        entry = envs.get(parent)
        fork = getattr(entry[0], "fork", None) if entry is not None else None
        if not callable(fork):
            return _NO_FORK
        if child in envs:
            _close_quietly(envs.pop(child)[0])
        envs[child] = [fork(), entry[1]]
        return ForkInfo(FORK_NATIVE, 0)
    if op == "replay":  # in the child's worker: reset and the parent's actions, checked
        _, child, row, seed, history, recorded = request
        if child in envs:
            _close_quietly(envs.pop(child)[0])
        envs[child] = [_replay(state["factory"], row, seed, history, recorded), len(history)]
        return ForkInfo(FORK_REPLAY, 1 + len(history))
    if op == "release":
        for t in request[2]:
            if t in envs:
                _close_quietly(envs.pop(t)[0])
        return None
    raise ValueError(f"unknown request {op!r}")


class _Episodes:
    """Parent-side record of each trajectory: its row, seed, actions, environment seconds,
    the environment's answers (``_outcome``: what a fork's replay is checked against) and,
    for a child forked by ``fork()``, the worker slot it lives in."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[dict, int]] = {}
        self.history: dict[int, list[str]] = {}
        self.seconds: dict[int, float] = {}
        self.outcomes: dict[int, list[tuple]] = {}
        self.slots: dict[int, int] = {}

    def start(self, tid: int, row: dict, seed: int) -> None:
        self.rows[tid] = (row, seed)
        self.history[tid] = []
        self.seconds[tid] = 0.0
        self.outcomes[tid] = []
        self.slots.pop(tid, None)

    def copy(self, child: int, parent: int) -> None:
        self.rows[child] = self.rows[parent]
        self.history[child] = list(self.history[parent])
        self.seconds[child] = self.seconds.get(parent, 0.0)
        self.outcomes[child] = list(self.outcomes[parent])
        self.slots.pop(child, None)

    def record(self, tid: int, outcome: tuple) -> None:
        self.outcomes.setdefault(tid, []).append(outcome)

    def forget(self, tid: int) -> None:
        for table in (self.rows, self.history, self.seconds, self.outcomes, self.slots):
            table.pop(tid, None)


class EnvRuntime(Closeable):
    """Environments in worker processes (see the module docstring).

    Args:
        factory: zero-argument callable returning a fresh environment (``resolve_environment``).
        num_workers: worker processes (slots), >= 1.
        step_timeout_s: limit of one ``reset`` or ``step`` call.
        trajectory_timeout_s: limit of all environment calls of one trajectory together.

    Use as a context manager or call ``close`` (``fastrl.workers.Closeable``: once, and on the
    way out of ``with`` even on an error).
    """

    def __init__(self, factory: Callable[[], Any], *, num_workers: int = 2, step_timeout_s: float = 10.0,
                 trajectory_timeout_s: float = 60.0) -> None:
        for name, value in (("step_timeout_s", step_timeout_s), ("trajectory_timeout_s", trajectory_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise InputError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise InputError(f"env num_workers must be an int >= 1, got {num_workers!r}")
        self.step_timeout_s = float(step_timeout_s)
        self.trajectory_timeout_s = float(trajectory_timeout_s)
        self.num_workers = num_workers
        self._episodes = _Episodes()
        self._pools: list[WorkerPool] = []
        try:
            for slot in range(num_workers):
                self._pools.append(WorkerPool(
                    _handle, {"factory": factory, "envs": {}}, num_workers=1, timeout_s=self.step_timeout_s,
                    start_method="fork", name=f"fastrl-env-{slot}", parent_death_signal=False,
                ))
        except BaseException:
            self.close()
            raise
        self._threads = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="fastrl-env-slot")

    def _release(self) -> None:
        """Stop every worker (killing their process groups); ``close`` calls it once."""
        for pool in self._pools:
            pool.close()
        threads = getattr(self, "_threads", None)  # absent when a worker failed to start
        if threads is not None:
            threads.shutdown(wait=True)

    # ------------------------------------------------------------------ public API
    @property
    def worker_pids(self) -> list[int]:
        return [pid for pool in self._pools for pid in pool.worker_pids]

    def reset(self, requests: Sequence[tuple[int, dict, int]]) -> list[EnvReply]:
        for tid, row, seed in requests:
            self._episodes.start(tid, row, seed)
        replies = self._run([(tid, ("reset", tid, row, seed)) for tid, row, seed in requests])
        for (tid, _, _), reply in zip(requests, replies):
            if reply.status == OK:
                self._episodes.record(tid, _outcome(reply.value))
        return replies

    def step(self, requests: Sequence[tuple[int, str]]) -> list[EnvReply]:
        tasks = []
        for tid, action in requests:
            row, seed = self._episodes.rows[tid]
            tasks.append((tid, ("step", tid, row, seed, list(self._episodes.history[tid]), action)))
        replies = self._run(tasks)
        for (tid, action), reply in zip(requests, replies):
            self._episodes.history[tid].append(action)
            if reply.status == OK:
                reply.value, reply.replayed = reply.value
                self._episodes.record(tid, _outcome(None, reply.value))
        return replies

    def fork(self, requests: Sequence[tuple[int, int]]) -> list[EnvReply]:
        """Each ``child`` gets a copy of ``parent``'s environment (see the module docstring)."""
        for child, parent in requests:
            self._episodes.copy(child, parent)
        # the environment's own fork(), in the parent's worker (the child then lives there)
        replies = self._run([(parent, ("fork", child, parent)) for child, parent in requests])
        todo = []
        for index, ((child, parent), reply) in enumerate(zip(requests, replies)):
            if reply.status == OK and reply.value != _NO_FORK:
                self._episodes.slots[child] = self._slot(parent)
            elif reply.status == OK:
                todo.append(index)
        if todo:  # no fork(): replay in the child's own worker
            tasks = []
            for index in todo:
                child, _ = requests[index]
                row, seed = self._episodes.rows[child]
                tasks.append((child, ("replay", child, row, seed, list(self._episodes.history[child]),
                                      list(self._episodes.outcomes[child]))))
            calls = [1 + len(self._episodes.history[requests[index][0]]) for index in todo]
            for index, reply in zip(todo, self._run(tasks, calls=calls)):
                reply.seconds += replies[index].seconds
                replies[index] = reply
        return replies

    def release(self, tids: Sequence[int]) -> None:
        by_slot: dict[int, list[int]] = {}
        for tid in tids:
            by_slot.setdefault(self._slot(tid), []).append(tid)
            self._episodes.forget(tid)
        for slot, group in by_slot.items():
            pool = self._pools[slot]
            if not pool.closed:
                pool.run([("release", -1, group)], timeout_s=self.step_timeout_s)

    # ------------------------------------------------------------------ internals
    def _slot(self, tid: int) -> int:
        """The worker slot of a trajectory: ``tid % num_workers``, or its parent's for a child
        forked by the environment's ``fork()``."""
        return self._episodes.slots.get(tid, tid % self.num_workers)

    def _run(self, tasks: list[tuple[int, tuple]], *, calls: Sequence[int] | None = None) -> list[EnvReply]:
        """Run each ``(tid, request)`` in its trajectory's slot; ``calls[i]``: the environment calls
        request ``i`` makes (a replay's), each allowed ``step_timeout_s`` (default 1)."""
        replies: list[EnvReply | None] = [None] * len(tasks)
        by_slot: dict[int, list[int]] = {}
        for index, (tid, _) in enumerate(tasks):
            by_slot.setdefault(self._slot(tid), []).append(index)

        def run_slot(slot: int, indices: list[int]) -> None:
            pool = self._pools[slot]
            for index in indices:
                tid, request = tasks[index]
                left = self.trajectory_timeout_s - self._episodes.seconds.get(tid, 0.0)
                if left <= 0:
                    replies[index] = EnvReply(TIMEOUT, message=f"the trajectory used its {self.trajectory_timeout_s:g} s of environment time (trajectory_timeout_s)")
                    continue
                limit = self.step_timeout_s * (1 if calls is None else calls[index])
                started = time.perf_counter()
                result = pool.run([request], timeout_s=min(limit, left))[0]
                seconds = time.perf_counter() - started
                self._episodes.seconds[tid] = self._episodes.seconds.get(tid, 0.0) + seconds
                message = result.message
                if result.status == TIMEOUT and left < limit:
                    message = f"the trajectory used its {self.trajectory_timeout_s:g} s of environment time (trajectory_timeout_s); worker killed"
                replies[index] = EnvReply(result.status, result.value, message, seconds)

        futures = [self._threads.submit(run_slot, slot, indices) for slot, indices in by_slot.items()]
        for future in futures:
            future.result()
        return [r if r is not None else EnvReply(CRASHED, message="lost request") for r in replies]


class InProcessRuntime(Closeable):
    """The same contract with the environments in this process: no time limits, no
    isolation (debugging, and environments known to be safe). Exceptions become ``raised``.
    ``close`` (once; ``with`` closes) closes the environments still open."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self._state = {"factory": factory, "envs": {}}
        self._episodes = _Episodes()

    def _release(self) -> None:
        _handle(self._state, ("release", -1, list(self._state["envs"])))

    def _call(self, request: tuple) -> EnvReply:
        started = time.perf_counter()
        try:
            value = _handle(self._state, request)
        except Exception as error:
            return EnvReply(RAISED, message=f"{type(error).__name__}: {error}", seconds=time.perf_counter() - started)
        return EnvReply(OK, value, seconds=time.perf_counter() - started)

    def reset(self, requests: Sequence[tuple[int, dict, int]]) -> list[EnvReply]:
        replies = []
        for tid, row, seed in requests:
            self._episodes.start(tid, row, seed)
            reply = self._call(("reset", tid, row, seed))
            if reply.status == OK:
                self._episodes.record(tid, _outcome(reply.value))
            replies.append(reply)
        return replies

    def step(self, requests: Sequence[tuple[int, str]]) -> list[EnvReply]:
        replies = []
        for tid, action in requests:
            row, seed = self._episodes.rows[tid]
            reply = self._call(("step", tid, row, seed, list(self._episodes.history[tid]), action))
            self._episodes.history[tid].append(action)
            if reply.status == OK:
                reply.value, reply.replayed = reply.value
                self._episodes.record(tid, _outcome(None, reply.value))
            replies.append(reply)
        return replies

    def fork(self, requests: Sequence[tuple[int, int]]) -> list[EnvReply]:
        """As ``EnvRuntime.fork``, in this process."""
        replies = []
        for child, parent in requests:
            self._episodes.copy(child, parent)
            reply = self._call(("fork", child, parent))
            if reply.status == OK and reply.value == _NO_FORK:
                row, seed = self._episodes.rows[child]
                reply = self._call(("replay", child, row, seed, list(self._episodes.history[child]),
                                    list(self._episodes.outcomes[child])))
            replies.append(reply)
        return replies

    def release(self, tids: Sequence[int]) -> None:
        _handle(self._state, ("release", -1, list(tids)))
        for tid in tids:
            self._episodes.forget(tid)


def probe_environment(runtime: EnvRuntime | InProcessRuntime, row: dict, *, seed: int = 0, tid: int = -1) -> None:
    """Reset one environment on a real row before any episode; InputError (one line) if
    ``reset`` fails, hangs or returns the wrong type."""
    reply = runtime.reset([(tid, row, seed)])[0]
    runtime.release([tid])
    if reply.status != OK:
        first = (reply.message or "").strip().splitlines()[0] if reply.message else ""
        raise InputError(f"the environment's reset() failed on the first dataset row ({reply.status}): {first}")
