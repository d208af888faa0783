"""fastrl.workers: killable worker processes, real processes throughout.

No assertion here depends on timing: a task that must time out sleeps for an hour against
a sub-second limit, and "the process is gone" is waited for in a bounded loop (generous, so
a loaded machine only makes it slower, never wrong)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from fastrl.workers import TaskResult, WorkerPool

GONE_WAIT_S = 120.0  # upper bound on waiting for the kernel/init to remove a killed process
HOUR_S = 3600
GENEROUS_S = 120.0  # a limit no task that ends by itself reaches, however loaded the machine


def _gone(pid: int) -> bool:
    """True once ``pid`` is neither running nor stopped (a zombie awaiting its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _wait_gone(pids: list[int]) -> list[int]:
    """The pids still alive after waiting up to GONE_WAIT_S (empty when all went)."""
    deadline = time.monotonic() + GONE_WAIT_S
    alive = [pid for pid in pids if not _gone(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [pid for pid in alive if not _gone(pid)]
    return alive


def _wait_for_file(path: Path, process: subprocess.Popen | None = None) -> str:
    deadline = time.monotonic() + GONE_WAIT_S
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().endswith("\n"):
            return path.read_text()
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the script exited with {process.returncode}: {process.stderr.read()}")
        time.sleep(0.05)
    raise AssertionError(f"{path} was not written")


pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="checks processes through /proc")


# ----------------------------------------------------------------- handlers (module level: picklable)
def echo(state, argument):
    return (state, argument)


def behave(state, argument):
    kind, value = argument
    if kind == "raise":
        raise ValueError(f"asked to raise {value}")
    if kind == "exit":
        sys.exit(3)
    if kind == "die":
        os._exit(7)
    if kind == "hang":
        time.sleep(HOUR_S)
    if kind == "unpicklable":
        return lambda: None
    return value * 2


def start_sleeper(state, argument):
    """Start `sleep 3600`, write its pid (and this worker's) to ``argument['file']``, then do ``argument['then']``."""
    child = subprocess.Popen(["sleep", str(HOUR_S)])
    Path(argument["file"]).write_text(f"{os.getpid()} {child.pid}\n")
    then = argument["then"]
    if then == "wait":
        child.wait()
    elif then == "die":
        os._exit(1)
    return child.pid  # "return": the sleeper is left running in the background


# ----------------------------------------------------------------- statuses
def test_statuses_of_every_kind_and_the_pool_recovers():
    arguments = [("ok", 1), ("raise", 2), ("exit", 0), ("die", 0), ("hang", 0), ("unpicklable", 0), ("ok", 5)]
    # the hanging task alone gets a short limit: on a loaded machine a worker may not even be
    # scheduled within it, so a task that dies or answers is given time to (the limit is per call)
    with WorkerPool(behave, num_workers=2, timeout_s=GENEROUS_S) as pool:
        hang = arguments.index(("hang", 0))
        results = pool.run(arguments[:hang]) + pool.run([arguments[hang]], timeout_s=0.5) + pool.run(arguments[hang + 1:])
        assert [result.status for result in results] == ["ok", "raised", "raised", "crashed", "timeout", "raised", "ok"]
        assert results[0].value == 2 and results[6].value == 10
        assert "asked to raise 2" in results[1].message
        assert "SystemExit" in results[2].message
        assert "exit code 7" in results[3].message
        assert "could not be sent back" in results[5].message
        assert len(pool.worker_pids) == 2
        assert pool.run([("ok", 4)]) == [TaskResult("ok", value=8)]


def test_unpicklable_argument_is_not_sent_and_state_reaches_the_handler():
    with WorkerPool(echo, "the state", num_workers=1, timeout_s=30) as pool:
        results = pool.run([1, lambda: None, 3])
        assert [result.status for result in results] == ["ok", "unsendable", "ok"]
        assert results[0].value == ("the state", 1) and results[2].value == ("the state", 3)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="num_workers"):
        WorkerPool(echo, num_workers=0, timeout_s=1)
    with pytest.raises(ValueError, match="timeout_s"):
        WorkerPool(echo, num_workers=1, timeout_s=float("inf"))
    with pytest.raises(ValueError, match="callable"):
        WorkerPool("echo", num_workers=1, timeout_s=1)
    with WorkerPool(echo, num_workers=1, timeout_s=1) as pool:
        pass
    with pytest.raises(ValueError, match="closed"):
        pool.run([1])


def test_each_worker_leads_its_own_process_group():
    with WorkerPool(echo, num_workers=2, timeout_s=30) as pool:
        for pid in pool.worker_pids:
            assert os.getpgid(pid) == pid and os.getsid(pid) == pid
        assert os.getpgid(0) not in pool.worker_pids


# ----------------------------------------------------------------- nothing a task starts outlives it
@pytest.mark.parametrize("then", ["wait", "die"])
def test_a_timed_out_or_dead_workers_children_are_killed(tmp_path, then):
    pid_file = tmp_path / "pids"
    with WorkerPool(start_sleeper, num_workers=1, timeout_s=1.0) as pool:
        (result,) = pool.run([{"file": str(pid_file), "then": then}])
        assert result.status == ("timeout" if then == "wait" else "crashed")
        worker_pid, sleeper_pid = map(int, pid_file.read_text().split())
        assert _wait_gone([worker_pid, sleeper_pid]) == []
        assert len(pool.worker_pids) == 1  # replaced


def test_close_kills_what_an_idle_worker_left_running(tmp_path):
    pid_file = tmp_path / "pids"
    pool = WorkerPool(start_sleeper, num_workers=1, timeout_s=30)
    (result,) = pool.run([{"file": str(pid_file), "then": "return"}])
    assert result.status == "ok"
    worker_pid, sleeper_pid = map(int, pid_file.read_text().split())
    assert not _gone(sleeper_pid)
    pool.close()
    assert _wait_gone([worker_pid, sleeper_pid]) == []


def test_interrupt_kills_the_busy_workers_group(tmp_path):
    pid_file = tmp_path / "pids"
    main_thread = threading.get_ident()

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    def interrupt_once_the_task_runs():
        _wait_for_file(pid_file)
        signal.pthread_kill(main_thread, signal.SIGALRM)  # to the main thread itself, which waits in select()

    with WorkerPool(start_sleeper, num_workers=1, timeout_s=HOUR_S) as pool:
        previous = signal.signal(signal.SIGALRM, interrupt)
        sender = threading.Thread(target=interrupt_once_the_task_runs, daemon=True)
        sender.start()
        try:
            with pytest.raises(KeyboardInterrupt):  # the call would wait an hour: the interrupt ends it
                pool.run([{"file": str(pid_file), "then": "wait"}])
        finally:
            sender.join()
            signal.signal(signal.SIGALRM, previous)
        worker_pid, sleeper_pid = map(int, pid_file.read_text().split())
        assert _wait_gone([worker_pid, sleeper_pid]) == []
        assert pool.run([{"file": str(tmp_path / "again"), "then": "return"}])[0].status == "ok"


# ----------------------------------------------------------------- workers die with their parent
_OWNER_SCRIPT = textwrap.dedent(
    """
    import subprocess, sys
    from pathlib import Path
    from fastrl.workers import WorkerPool
    sys.path.insert(0, {tests!r})
    from test_workers import start_sleeper

    pool = WorkerPool(start_sleeper, num_workers=2, timeout_s=3600, parent_death_signal={death_signal})
    Path({pool_file!r}).write_text(" ".join(map(str, pool.worker_pids)) + "\\n")
    pool.run([{{"file": {pid_file!r}, "then": "wait"}}])  # hangs for an hour: the test kills this process
    """
)


@pytest.mark.parametrize("death_signal", [True, False], ids=["pdeathsig", "watch_thread"])
def test_workers_and_their_children_die_with_a_killed_parent_even_mid_call(tmp_path, death_signal):
    pid_file, pool_file = tmp_path / "pids", tmp_path / "pool"
    script = _OWNER_SCRIPT.format(
        tests=str(Path(__file__).parent), death_signal=death_signal, pid_file=str(pid_file), pool_file=str(pool_file)
    )
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    owner = subprocess.Popen([sys.executable, "-c", script], env=environment, stderr=subprocess.PIPE, text=True)
    try:
        pool_pids = list(map(int, _wait_for_file(pool_file, owner).split()))
        busy_worker, sleeper = map(int, _wait_for_file(pid_file, owner).split())
        assert busy_worker in pool_pids and not _gone(sleeper)
        owner.kill()  # SIGKILL: no cleanup code of the owner runs
        owner.wait()
        assert _wait_gone([*pool_pids, sleeper]) == []
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_parent_death_signal_is_available_on_linux():
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux-only; the watch thread covers other platforms")
    script = "from fastrl.workers import set_parent_death_signal; import signal; print(set_parent_death_signal(signal.SIGTERM))"
    output = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert output.strip() == "True"

