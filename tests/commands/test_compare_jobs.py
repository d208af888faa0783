"""`fastrl compare --jobs`: the default per setting, and stopping a comparison with real
processes: every live run's process group is killed (the run and what it started), and a
run that starts after its comparison ended exits at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from fastrl.commands.compare import (
    DEFAULT_JOBS,
    PARENT_PID_ENV,
    RUN_MODULE,
    CompareError,
    RunProcesses,
    RunsStopped,
    available_cores,
    default_jobs,
    plan_compare,
    run_all,
    stop_signals_exit,
)

# a run that starts a grandchild in its own process group, says so, and waits for it;
# both hold the write end of the test's pipe (their stdout) until they die
RUN_WITH_GRANDCHILD = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
                       "print('ready', flush=True); p.wait()")


def test_the_default_jobs_fill_the_cores_with_single_threaded_runs():
    assert default_jobs(threads=1, cores=2) == 2 and default_jobs(threads=2, cores=8) == 4
    assert default_jobs(threads=4, cores=2) == 1  # never below one
    assert default_jobs(threads=None, cores=16) == DEFAULT_JOBS == 1  # torch's default threads: every core already
    algos = ["--algorithms", "grpo", "ppo"]
    assert plan_compare(["--env", "sql", *algos]).jobs == default_jobs(threads=1, cores=available_cores())
    assert plan_compare(["--env", "sql", *algos, "--threads", "2"]).jobs == default_jobs(threads=2, cores=available_cores())
    # single-turn on the built-in model: fastrl train's thread rule gives each run one thread, so they fill the cores
    single = plan_compare(algos)
    assert single.user_fields["threads"] == 1 and single.jobs == default_jobs(threads=1, cores=available_cores())
    assert plan_compare([*algos, "--jobs", "3"]).jobs == 3
    with pytest.raises(CompareError, match="--jobs must be >= 1"):
        plan_compare([*algos, "--jobs", "0"])


def test_results_come_in_task_order_with_jobs():
    gate = threading.Event()
    done = []

    def finished(i, result):
        done.append(i)
        gate.set()  # task 0 ends only after task 1 was reported: possible only with two at once

    tasks = [lambda: (gate.wait(), "first")[1], lambda: "second", lambda: "third"]
    assert run_all(tasks, jobs=2, processes=RunProcesses(), on_done=finished) == ["first", "second", "third"]
    assert done[0] == 1 and sorted(done) == [0, 1, 2]


def test_a_stop_signal_kills_every_live_run_and_its_children():
    """A real run (with a grandchild) is live when the comparison gets SIGTERM: run_all raises
    SystemExit(143) after SIGKILLing the run's group, so the pipe both held reaches EOF; the
    run's record shows the kill, and no run starts afterwards."""
    processes = RunProcesses()
    read_end, write_end = os.pipe()
    reader, writer = os.fdopen(read_end, "r"), os.fdopen(write_end, "w")
    codes = []

    def run():
        codes.append(processes.run([sys.executable, "-c", RUN_WITH_GRANDCHILD], log=writer))

    def stop():
        assert reader.readline() == "ready\n"  # the run and its grandchild are up
        writer.close()  # now only they hold the write end
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)

    with pytest.raises(SystemExit) as stopped, stop_signals_exit():
        run_all([run, stop], jobs=2, processes=processes)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert reader.read() == ""  # EOF: the run and its grandchild are both dead
    assert codes == [-signal.SIGKILL]
    with pytest.raises(RunsStopped):
        processes.run([sys.executable, "-c", "pass"], log=None)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is restored


def test_a_run_whose_comparison_is_gone_exits_at_once():
    env = {**os.environ, PARENT_PID_ENV: str(os.getpid() + 10**6)}  # not this run's parent
    proc = subprocess.run([sys.executable, "-m", RUN_MODULE, "train", "--help"], env=env, capture_output=True, text=True)
    assert proc.returncode == 128 + signal.SIGTERM and "usage" not in proc.stdout
