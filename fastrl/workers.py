"""A pool of killable worker processes that run a callable under a per-call time limit.

This is the machinery under fastrl's reward pool (:mod:`fastrl.train.rewards.pool`) and the
agents' environment steps: untrusted or fragile user code runs in worker processes, each
task bounded by a wall-clock limit, and a worker that hangs, dies or is interrupted is
killed, reaped and replaced. The pool knows nothing about rewards; what a task means is
the ``handler``'s business.

**The contract.** ``WorkerPool(handler, state, num_workers=, timeout_s=)`` starts
``num_workers`` processes. :meth:`WorkerPool.run` takes a list of picklable arguments,
dispatches each to an idle worker, which calls ``handler(state, argument)``, and returns
one :class:`TaskResult` per argument, in order. ``status`` is one of :data:`STATUSES`:

- ``"ok"``: ``value`` is what the handler returned;
- ``"raised"``: the handler raised (``sys.exit`` included), or its return value could not
  be sent back (does not pickle); ``message`` has the error and the traceback's tail;
- ``"timeout"``: no result within ``timeout_s`` of the task's dispatch; the worker's whole
  process group was killed and the worker replaced;
- ``"crashed"``: the worker died (``os._exit``, a signal, the OOM killer) or no worker
  could be started; ``message`` says how;
- ``"unsendable"``: the argument could not be pickled (nothing was sent).

:meth:`WorkerPool.run` never raises because of what the handler does; an interrupt
(Ctrl-C) or any other exception in the caller kills the workers busy with that call
before it propagates, and the next call starts fresh ones.

**Containment.** Each worker calls ``setsid()`` when it starts, so it leads its own session
and process group, and everything it starts (``subprocess.run(["sleep", "3600"])``) is in
that group. Killing a worker (timeout, death, interrupt, :meth:`close`) sends SIGKILL to
the whole group, so no grandchild outlives its task. A grandchild that calls ``setsid()``
itself (a daemon) leaves the group and is beyond reach; containing those needs a cgroup.
The new session also keeps a terminal's Ctrl-C, which goes to the foreground group, away
from the workers and their children (the trainer handles it); workers ignore SIGINT too.

**Dying with the parent.** A worker must not outlive the process that started it, even
while it is busy with a task. Two mechanisms, either suffices:

1. on Linux, ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` (through ``ctypes``): the kernel sends
   the worker SIGTERM when its parent dies. Note that for the kernel the "parent" is the
   *thread* that started the worker: start and use a pool from one long-lived thread (a
   worker whose starting thread ends gets SIGTERM, is counted as crashed and replaced);
2. everywhere, a watch thread in the worker that checks ``os.getppid()`` every
   :data:`PARENT_CHECK_INTERVAL_S` seconds and acts when the parent has changed.

Either way the worker ends its process group with SIGKILL (itself and its children). For
``start_method="forkserver"`` the parent is the fork server, which exits with its owner.

**Start methods.** ``"fork"`` (the default where available) hands ``handler`` and
``state`` to the workers by inheritance: lambdas and closures work, and a worker starts in
milliseconds. ``"spawn"``/``"forkserver"`` ship them with ``cloudpickle`` (by value for
lambdas and closures). A task goes only to a worker that has started (loaded the handler
and answered), so start-up never counts against ``timeout_s``. If torch is loaded in a
worker, it is set to one thread: a forked child's inherited OpenMP pool hangs on its
first multi-threaded op, and ``num_workers`` processes should not compete for the
parent's cores anyway. Workers are daemonic: they cannot start ``multiprocessing``
children of their own (``subprocess`` works).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
import warnings
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

__all__ = [
    "CRASHED",
    "Closeable",
    "OK",
    "PARENT_CHECK_INTERVAL_S",
    "RAISED",
    "STATUSES",
    "TIMEOUT",
    "UNSENDABLE",
    "TaskResult",
    "WorkerPool",
    "WorkerStartError",
    "set_parent_death_signal",
]

logger = logging.getLogger(__name__)

OK, RAISED, TIMEOUT, CRASHED, UNSENDABLE = "ok", "raised", "timeout", "crashed", "unsendable"
STATUSES = (OK, RAISED, TIMEOUT, CRASHED, UNSENDABLE)

PARENT_CHECK_INTERVAL_S = 0.5
"""How often a worker's watch thread checks that its parent is alive (the fallback where
``PR_SET_PDEATHSIG`` is not available)."""

STARTUP_TIMEOUT_S = {"fork": 10.0, "spawn": 120.0, "forkserver": 120.0}
"""Longest wait for a new worker's first message: a forked one answers in milliseconds; a
spawned one imports the handler's modules first (slow on a loaded machine)."""

SHUTDOWN_GRACE_S = 1.0
"""How long :meth:`WorkerPool.close` lets idle workers exit on request before killing them."""

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_TRACEBACK_LINES = 3


class WorkerStartError(RuntimeError):
    """No worker could be started (``fork`` failed, or the handler could not be loaded)."""


@dataclass
class TaskResult:
    """What one task came to; ``status`` is one of :data:`STATUSES`."""

    status: str
    value: Any = None
    message: str = ""


# ---------------------------------------------------------------------------------------
# The worker side
# ---------------------------------------------------------------------------------------


def set_parent_death_signal(signum: int) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent (thread) dies.

    Linux only (``prctl(PR_SET_PDEATHSIG)`` through ``ctypes``); returns whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _end_own_group() -> None:
    """SIGKILL this worker's process group (itself and everything it started)."""
    try:
        if os.getpgid(0) == os.getpid():
            os.killpg(0, signal.SIGKILL)
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _watch_parent(parent_pid: int) -> None:
    # SIGTERM is for the main thread (its handler ends the group); a signal delivered to this
    # thread would leave the main thread blocked in a system call.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    while True:
        time.sleep(PARENT_CHECK_INTERVAL_S)
        if os.getppid() != parent_pid:
            _end_own_group()


def _on_sigterm(signum: int, frame: Any) -> None:
    _end_own_group()


def _describe_exception(error: BaseException) -> str:
    tail = "".join(traceback.format_exception(type(error), error, error.__traceback__)[-_TRACEBACK_LINES:])
    return f"{type(error).__name__}: {error}\n{tail}".strip()


def _worker_main(connection: Any, payload: Any, parent_pid: int | None, death_signal: bool) -> None:
    """Worker loop: say ``("ready", None)`` (or ``("failed", why)``), then receive
    ``(task_id, argument)`` and reply ``(task_id, status, value_or_message)``; ``None`` stops it.

    ``parent_pid`` is the process that started the worker (``None``: whatever its parent is
    now, for ``forkserver``, whose server is the parent); ``death_signal``: arm
    ``PR_SET_PDEATHSIG`` (else only the watch thread notices the parent's death)."""
    try:
        os.setsid()  # its own session and process group: the pool kills the group
    except OSError:
        pass  # already a group leader (cannot happen for a fresh child); the pool still kills the worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    signal.signal(signal.SIGTERM, _on_sigterm)  # the parent-death signal, and the interpreter's exit
    if death_signal:
        set_parent_death_signal(signal.SIGTERM)
    if parent_pid is None:
        parent_pid = os.getppid()
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        _end_own_group()
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="fastrl-parent-watch").start()
    try:
        if isinstance(payload, bytes):
            import cloudpickle

            handler, state = cloudpickle.loads(payload)
        else:
            handler, state = payload
    except Exception as error:
        connection.send(("failed", f"loading the worker's handler failed: {type(error).__name__}: {error}"))
        return
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
    connection.send(("ready", None))
    while True:
        try:
            message = connection.recv()
        except (EOFError, OSError):  # the parent is gone: nothing this worker started may stay
            _end_own_group()
            return
        if message is None:
            return
        task_id, argument = message
        try:
            reply = (task_id, OK, handler(state, argument))
        except (Exception, SystemExit) as error:  # sys.exit() in user code must not end the worker either
            reply = (task_id, RAISED, _describe_exception(error))
        try:
            connection.send(reply)
        except (EOFError, OSError):
            _end_own_group()
            return
        except Exception as error:  # the value does not pickle
            connection.send((task_id, RAISED, f"the result could not be sent back: {type(error).__name__}: {error}"))


# ---------------------------------------------------------------------------------------
# The parent side
# ---------------------------------------------------------------------------------------


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, context: Any, payload: Any, name: str, death_signal: bool) -> None:
        parent_end, child_end = context.Pipe(duplex=True)
        parent_pid = None if context.get_start_method() == "forkserver" else os.getpid()
        self.process = context.Process(
            target=_worker_main, args=(child_end, payload, parent_pid, death_signal), daemon=True, name=name
        )
        with warnings.catch_warnings():  # Python >= 3.12 warns about forking a threaded process
            warnings.simplefilter("ignore", DeprecationWarning)
            self.process.start()
        child_end.close()
        self.connection = parent_end
        self.grouped = False  # True once the worker said it is ready: it leads its own process group
        self.task: tuple[int, int, float] | None = None  # (task index, task id, deadline)

    def wait_ready(self, timeout_s: float) -> str | None:
        """``None`` once the worker has loaded the handler, else why it did not."""
        try:
            if not self.connection.poll(timeout_s):
                return f"the worker did not start within {timeout_s:g} s"
            status, message = self.connection.recv()
        except (EOFError, OSError):
            self.process.join(timeout=SHUTDOWN_GRACE_S)
            return self.death_message()
        self.grouped = True  # setsid() ran before the first message
        return None if status == "ready" else message

    def kill(self) -> None:
        """SIGKILL the worker's process group (the worker and whatever it started) and reap it."""
        if self.grouped:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass  # the group is empty already
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.connection.close()

    def death_message(self) -> str:
        code = self.process.exitcode
        if code is None:
            return "the worker closed its pipe without replying"
        if code < 0:
            try:
                return f"the worker process died (signal {signal.Signals(-code).name})"
            except ValueError:
                return f"the worker process died (signal {-code})"
        return f"the worker process died (exit code {code})"


def _shutdown(workers: list[_Worker | None], grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Ask idle workers to exit, give them ``grace_s`` together, then kill (group) and reap all."""
    live = [worker for worker in workers if worker is not None]
    workers[:] = [None] * len(workers)
    for worker in live:
        if worker.task is None:
            try:
                worker.connection.send(None)
            except (OSError, ValueError):
                pass
    deadline = time.monotonic() + grace_s
    for worker in live:
        if worker.task is None:
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
        worker.kill()


def _ship(handler: Callable, state: Any, start_method: str) -> Any:
    """The payload a worker loads: the objects themselves for ``fork``, cloudpickle bytes otherwise."""
    if start_method == "fork":
        return handler, state
    try:
        import cloudpickle
    except ImportError as error:
        raise ValueError(
            f"start_method={start_method!r} ships the worker's handler with cloudpickle: pip install cloudpickle "
            "(or use start_method='fork')"
        ) from error
    try:
        return cloudpickle.dumps((handler, state))
    except Exception as error:
        raise ValueError(f"the worker's handler could not be pickled for {start_method!r} workers: {error}") from error


_Self = TypeVar("_Self", bound="Closeable")


class Closeable:
    """The closing of an object that holds worker processes, written once: :meth:`close` releases
    them the first time only (a subclass's :meth:`_release`), ``with`` closes on the way out (an
    error included), and a closed object refuses work (:meth:`_check_open`). What closes it at the
    interpreter's exit or on garbage collection is the holder's: :class:`WorkerPool` registers a
    ``weakref.finalize``; a holder of a pool (the reward pool) inherits that from its pool."""

    _closed = False

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the workers (asked first, killed after :data:`SHUTDOWN_GRACE_S`) and reap them. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._release()

    def _release(self) -> None:
        """Stop and reap the workers (called once, by :meth:`close`)."""
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"this {type(self).__name__} is closed")


class WorkerPool(Closeable):
    """``num_workers`` killable processes running ``handler(state, argument)`` per task.

    Args:
        handler: called in a worker as ``handler(state, argument)`` for each task.
        state: handed to every call (inherited with ``fork``, pickled once otherwise).
        num_workers: worker processes (>= 1).
        timeout_s: default wall-clock limit of one task, from its dispatch.
        start_method: ``"fork"`` (default where available), ``"spawn"`` or ``"forkserver"``.
        name: the workers' process name (shown by ``ps``).
        parent_death_signal: arm ``PR_SET_PDEATHSIG`` in the workers (Linux); ``False``
            leaves only the watch thread (a test seam, and a way out where prctl misbehaves).

    Raises ``ValueError`` for bad arguments and :class:`WorkerStartError` when a worker
    cannot start. Use as a context manager or call :meth:`close`; a pool that is garbage
    collected or alive at interpreter exit is closed too.
    """

    def __init__(
        self,
        handler: Callable[[Any, Any], Any],
        state: Any = None,
        *,
        num_workers: int,
        timeout_s: float,
        start_method: str | None = None,
        name: str = "fastrl-worker",
        parent_death_signal: bool = True,
    ) -> None:
        if not callable(handler):
            raise ValueError(f"handler must be callable, got {type(handler).__name__}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        self.timeout_s = _checked_timeout(timeout_s)
        methods = multiprocessing.get_all_start_methods()
        if start_method is None:
            start_method = "fork" if "fork" in methods else "spawn"
        if start_method not in methods:
            raise ValueError(f"start_method must be one of {methods}, got {start_method!r}")
        self.start_method = start_method
        self.num_workers = num_workers
        self.name = name
        self.parent_death_signal = bool(parent_death_signal)
        self._payload = _ship(handler, state, start_method)
        self._context = multiprocessing.get_context(start_method)
        self._workers: list[_Worker | None] = [None] * num_workers
        self._next_task_id = 0
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)
        try:
            self._start_missing_workers(raise_errors=True)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ public API
    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (for monitoring and tests)."""
        return [worker.process.pid for worker in self._workers if worker is not None and worker.process.is_alive()]


    def run(self, arguments: Sequence[Any], *, timeout_s: float | None = None) -> list[TaskResult]:
        """One :class:`TaskResult` per argument, in order; each task bounded by ``timeout_s``
        (default: the pool's) from its dispatch. Never raises because of the handler."""
        self._check_open()
        limit = self.timeout_s if timeout_s is None else _checked_timeout(timeout_s)
        results: list[TaskResult | None] = [None] * len(arguments)
        pending = deque(range(len(arguments)))
        send_failures = [0] * len(arguments)
        try:
            while pending or self._busy():
                if pending:
                    self._start_missing_workers()
                    if all(worker is None for worker in self._workers):
                        for index in pending:
                            results[index] = TaskResult(CRASHED, message="no worker could be started")
                        pending.clear()
                for worker in self._workers:
                    if not pending:
                        break
                    if worker is None or worker.task is not None:
                        continue
                    index = pending.popleft()
                    task_id = self._next_task_id
                    self._next_task_id += 1
                    try:
                        worker.connection.send((task_id, arguments[index]))
                    except OSError as error:  # the worker died while idle: retry once on a fresh one
                        send_failures[index] += 1
                        if send_failures[index] >= 2:
                            results[index] = TaskResult(CRASHED, message=f"could not send the task to a worker: {error}")
                        else:
                            pending.appendleft(index)
                        self._replace(worker)
                        continue
                    except Exception as error:  # an argument that does not pickle (nothing was written)
                        results[index] = TaskResult(UNSENDABLE, message=f"could not send the task to a worker: {error}")
                        continue
                    worker.task = (index, task_id, time.monotonic() + limit)
                busy = self._busy()
                if not busy:
                    continue
                wait_s = max(0.0, min(worker.task[2] for worker in busy) - time.monotonic())
                handles = [worker.connection for worker in busy] + [worker.process.sentinel for worker in busy]
                multiprocessing.connection.wait(handles, timeout=wait_s)
                for worker in busy:
                    self._collect(worker, results, limit)
        except BaseException:
            # Interrupted (Ctrl-C) or a bug here: no worker may keep a task of this call.
            for worker in self._workers:
                if worker is not None and worker.task is not None:
                    self._replace(worker, restart=False)
            raise
        return [result if result is not None else TaskResult(CRASHED, message="lost task") for result in results]

    # ------------------------------------------------------------------ internals
    def _release(self) -> None:
        self._finalizer()  # the same shutdown a garbage-collected pool, or one alive at exit, gets

    def _busy(self) -> list[_Worker]:
        return [worker for worker in self._workers if worker is not None and worker.task is not None]

    def _collect(self, worker: _Worker, results: list[TaskResult | None], limit: float) -> None:
        index, task_id, deadline = worker.task
        if worker.connection.poll():
            try:
                reply_id, status, payload = worker.connection.recv()
            except (EOFError, OSError):  # the pipe closed: the process died (its exit code says how)
                worker.process.join(timeout=SHUTDOWN_GRACE_S)
                results[index] = TaskResult(CRASHED, message=worker.death_message())
                self._replace(worker)
                return
            if reply_id != task_id:  # cannot happen unless a worker was reused wrongly: be safe
                results[index] = TaskResult(CRASHED, message=f"worker replied to task {reply_id}, expected {task_id}")
                self._replace(worker)
                return
            results[index] = TaskResult(OK, value=payload) if status == OK else TaskResult(status, message=payload)
            worker.task = None
        elif not worker.process.is_alive():
            results[index] = TaskResult(CRASHED, message=worker.death_message())
            self._replace(worker)
        elif time.monotonic() >= deadline:
            results[index] = TaskResult(TIMEOUT, message=f"no result within {limit:g} s; worker killed")
            self._replace(worker)

    def _replace(self, worker: _Worker, *, restart: bool = True) -> None:
        slot = self._workers.index(worker)
        worker.task = None
        worker.kill()
        self._workers[slot] = None
        if restart:
            self._start_missing_workers()

    def _start_missing_workers(self, *, raise_errors: bool = False) -> None:
        """Fill empty slots and replace idle workers that died (busy ones are handled by _collect).

        A worker counts once it has loaded the handler, so a slow start never eats into a
        task's time limit. One that cannot start leaves its slot empty (retried on the next
        call) or, with ``raise_errors``, raises :class:`WorkerStartError`."""
        started: list[tuple[int, _Worker]] = []
        for slot, worker in enumerate(self._workers):
            if worker is not None and (worker.task is not None or worker.process.is_alive()):
                continue
            if worker is not None:
                worker.kill()
                self._workers[slot] = None
            try:
                started.append((slot, _Worker(self._context, self._payload, self.name, self.parent_death_signal)))
            except OSError as error:  # fork failed (out of memory, process limit)
                problem = f"could not start a worker: {error}"
                if raise_errors:
                    raise WorkerStartError(problem) from error
                logger.warning(problem)
        try:
            while started:
                slot, worker = started[0]
                problem = worker.wait_ready(STARTUP_TIMEOUT_S.get(self.start_method, max(STARTUP_TIMEOUT_S.values())))
                started.pop(0)
                if problem is None:
                    self._workers[slot] = worker
                    continue
                worker.kill()
                if raise_errors:
                    raise WorkerStartError(f"a {self.name} worker could not start: {problem}")
                logger.warning("a %s worker could not start: %s", self.name, problem)
        finally:  # interrupted while waiting: no started worker may be left outside the pool
            for _, worker in started:
                worker.kill()


def _checked_timeout(timeout_s: Any) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (0 < timeout_s < float("inf")):
        raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
    return float(timeout_s)
