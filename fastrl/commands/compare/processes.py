"""The processes of a comparison: the live runs (each its own process group, killed together
when the comparison stops), running tasks ``--jobs`` at once, the stop signals, and the CPU
seconds the comparison and its runs used."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any, Callable, Sequence, TypeVar

INTERRUPTED_STATUS = 128 + signal.SIGINT
"""Exit status of a comparison stopped by Ctrl-C (the shell's convention for SIGINT)."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals that stop a comparison like Ctrl-C (SIGINT): every live run's process group is killed."""


class RunsStopped(RuntimeError):
    """A run was not started because the comparison is stopping (Ctrl-C, a signal, a failure)."""


class RunProcesses:
    """The live ``fastrl train`` processes of a comparison, started from any thread.

    Each run leads a new session and process group (so a terminal's Ctrl-C reaches only the
    comparison, which then stops every run itself) and is told by the kernel to end with its
    parent (the parent-death signal of ``runs.RUN_MODULE``, Linux): a comparison killed with SIGKILL
    leaves no run behind either. :meth:`kill_all` SIGKILLs every live run's group and refuses
    new runs from then on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[subprocess.Popen] = set()
        self.stopped = False

    def run(self, cmd: Sequence[str], *, log: Any, env: dict[str, str] | None = None) -> int:
        """Run ``cmd`` to its end (output to the open file ``log``); its return code
        (negative: the signal that killed it). RunsStopped once :meth:`kill_all` ran."""
        with self._lock:
            if self.stopped:
                raise RunsStopped("the comparison is stopping: run not started")
            proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
            self._live.add(proc)
        try:
            return proc.wait()
        finally:
            with self._lock:
                self._live.discard(proc)

    def kill_all(self) -> None:
        """SIGKILL the process group of every live run; start no new one."""
        with self._lock:
            self.stopped = True
            for proc in self._live:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass  # already gone


T = TypeVar("T")


def run_all(tasks: Sequence[Callable[[], T]], *, jobs: int, processes: RunProcesses,
            on_start: Callable[[int], None] | None = None, on_done: Callable[[int, T], None] | None = None) -> list[T]:
    """Every task, up to ``jobs`` at once in threads, started in order; their results in the
    order of ``tasks`` (not of completion). ``on_start(i)`` and ``on_done(i, result)`` run in
    the task's thread as it starts and ends (so with one job the lines of one run come before
    the next run's). Anything that stops this call
    (Ctrl-C, a stop signal, a task's exception) kills every live run of ``processes`` first,
    waits for the tasks' threads, and propagates."""
    results: list[Any] = [None] * len(tasks)

    def started(i: int) -> T:
        if on_start is not None:
            on_start(i)
        result = tasks[i]()
        if on_done is not None:
            on_done(i, result)
        return result

    pool = ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="fastrl-compare-run")
    futures: dict[Any, int] = {}
    try:
        futures = {pool.submit(started, i): i for i in range(len(tasks))}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in sorted(done, key=futures.__getitem__):
                results[futures[future]] = future.result()
    except BaseException:
        processes.kill_all()
        for future in futures:
            future.cancel()
        raise
    finally:
        pool.shutdown(wait=True)
    return results


@contextlib.contextmanager
def stop_signals_exit() -> Any:
    """While in this block, ``STOP_SIGNALS`` raise ``SystemExit(128 + signal)`` in the main
    thread instead of ending the process at once, so ``run_all`` can kill the runs first
    (a no-op outside the main thread, where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def self_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process alone (the shared start runs in it)."""
    import resource

    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def cpu_seconds_used() -> float:
    """CPU seconds (user + system) of this process and of its finished child processes (the runs)."""
    import resource

    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))
