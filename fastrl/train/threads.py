"""How many intra-op threads ``fastrl train`` gives torch on a CPU when ``--threads`` is not set.

The rule is a pure function of what it is told (``choose_threads``): the policy's parameter
count, the cores this process may run on (``os.sched_getaffinity``) and how many other
processes are running beside it; ``machine_threads`` reads those two from the machine (the
runnable processes counted a few times over a quarter of a second, ``other_runnable``: the
1-minute load average lags by a minute, so a run started right after another would see the
finished run's load).

Why: torch's default is one thread per core. A model as small as the embedded default's and
the calculator's and frozenlake's (0.28M parameters) does too little per operation to share
it, and every parallel region ends at a barrier where the threads spin-wait for each other:
on a loaded CPU a descheduled partner stalls every op. ``benchmarks/thread_rule.py``
(``benchmarks/results/thread_rule_cpu.json``) measured the embedded default and ``--env
calculator`` with 1 and 2 threads, alone and beside a busy-loop process: two threads
collapsed whenever the CPU was busy. sql's 1.1M-parameter model is big enough to gain: on the
idle 2-core CPU its runs took 552-598 s wall with two threads against 933-1156 s of CPU on
one (``benchmarks/results/env_train_sql_width128_default_threads_cpu.json``,
``env_train_sql_width128_3seeds_cpu.json``). So a model below ``SMALL_MODEL_PARAMETERS`` gets
one thread; a larger one the cores nobody else is running on, at least one. On CUDA the rule
leaves torch's default (the CPU side only launches kernels).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

__all__ = ["ThreadChoice", "SMALL_MODEL_PARAMETERS", "choose_threads", "machine_threads", "available_cores",
           "other_runnable", "builtin_model_parameters"]

SMALL_MODEL_PARAMETERS = 500_000
"""Policies with fewer parameters run one intra-op thread on a CPU, whatever the machine: the
0.28M-parameter built-in model's runs never finished within their limit on two threads beside a
busy neighbour or another session's work (``thread_rule_cpu.json``, ``thread_rule_idle_cpu.json``).
The price, measured on the truly idle 2-core CPU (load 0.8, ``thread_rule_idle_cpu.json``): the
embedded default's warm-up ran 25 steps/s on two threads against 16-17 on one, its short run
10.0 s against 12.8-13.8 s (the rule 1.38x the best there; calculator 1.05x). One thread trades
that for never collapsing when load arrives after the run started (the rule reads the machine
once). sql's 1.1M model gains from a second core (module docstring). Between the two the bound
is a choice, not a measurement."""
RUNNABLE_SAMPLES = 5
"""Samples of the running-process count ``other_runnable`` takes (50 ms apart; the median)."""


@dataclass(frozen=True)
class ThreadChoice:
    """The rule's answer: a thread count (None: torch's default) and why, in words."""

    threads: int | None
    reason: str

    def describe(self, *, given: int | None = None) -> str:
        """One line for the start of a run and ``fastrl env``."""
        if given is not None:
            return f"threads: {given} (--threads)"
        count = "torch's default" if self.threads is None else str(self.threads)
        return f"threads: {count} ({self.reason}; --threads N overrides)"


def choose_threads(*, parameters: int | None, cores: int, load: float, device_type: str = "cpu") -> ThreadChoice:
    """The intra-op thread count for a policy of ``parameters`` on ``cores`` usable cores
    beside ``load`` other running processes. ``parameters`` None: unknown (counted as large).
    Pure: the caller reads the machine (``machine_threads``)."""
    if device_type != "cpu":
        return ThreadChoice(None, f"on {device_type} the CPU threads only launch kernels")
    cores = max(1, int(cores))
    if parameters is not None and parameters < SMALL_MODEL_PARAMETERS:
        return ThreadChoice(1, f"a {parameters / 1e6:.2f}M-parameter model gains nothing from more, and loses "
                               "to spin-waits on a busy CPU")
    busy = min(cores, max(0, round(load)))
    free = max(1, cores - busy)
    size = "a model of unknown size" if parameters is None else f"a {parameters / 1e6:.1f}M-parameter model"
    return ThreadChoice(free, f"{size} on {cores} core(s) with {load:g} other process(es) running: the free cores")


def available_cores() -> int:
    """The cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def other_runnable(*, samples: int = RUNNABLE_SAMPLES, interval: float = 0.05) -> float:
    """How many other processes are running now: the kernel's count of runnable tasks
    (``/proc/loadavg``'s fourth field) less this one, the median of ``samples`` reads
    ``interval`` seconds apart. Where there is no ``/proc``, the 1-minute load average."""
    counts = []
    for i in range(samples):
        try:
            with open("/proc/loadavg") as handle:
                counts.append(max(0, int(handle.read().split()[3].split("/")[0]) - 1))
        except (OSError, IndexError, ValueError):
            try:
                return os.getloadavg()[0]
            except (AttributeError, OSError):
                return 0.0
        if i + 1 < samples:
            time.sleep(interval)
    return float(statistics.median(counts))


def machine_threads(*, parameters: int | None, device_type: str = "cpu") -> ThreadChoice:
    """``choose_threads`` with this machine's cores and load."""
    if device_type != "cpu" or (parameters is not None and parameters < SMALL_MODEL_PARAMETERS):
        return choose_threads(parameters=parameters, cores=available_cores(), load=0.0, device_type=device_type)
    return choose_threads(parameters=parameters, cores=available_cores(), load=other_runnable(), device_type=device_type)


def builtin_model_parameters(model_hidden_size: int | None = None, model_layers: int | None = None) -> int:
    """The parameter count of the built-in tiny model (the embedded default's unless sizes are
    given), counted on the model itself (built from its config: a fraction of a second)."""
    from fastrl.train.task import DefaultTask, char_tokenizer, tiny_model

    default = DefaultTask()
    model = tiny_model(char_tokenizer(), hidden_size=model_hidden_size or default.hidden_size,
                       layers=model_layers or default.layers, heads=default.heads, arch=default.arch)
    return sum(p.numel() for p in model.parameters())
