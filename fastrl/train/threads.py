"""How many intra-op threads ``fastrl train`` gives torch on a CPU when ``--threads`` is not set.

The rule is a pure function of what it is told (``choose_threads``): the policy's parameter
count, the cores this process may run on (``os.sched_getaffinity``) and the load beside it
(the 1-minute load average); ``machine_threads`` reads those two from the machine.

Why: torch's default is one thread per core. A model as small as the built-in ones (0.28M
parameters for the embedded default and ``--env calculator``/``frozenlake``, 1.1M for ``sql``)
does too little per operation to share it, and every parallel region ends at a barrier where
the threads spin-wait for each other: on a loaded CPU a descheduled partner stalls every op.
``benchmarks/thread_rule.py`` (``benchmarks/results/thread_rule_cpu.json``) measured the
embedded default and ``--env calculator`` with 1 and 2 threads, idle and beside a busy-loop
process; one thread was never slower than the best beyond the noise, two collapsed when loaded.
A larger model gets the cores nobody else is using: the cores minus the load (rounded), at
least one. On CUDA the rule leaves torch's default (the CPU side only launches kernels).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ThreadChoice", "SMALL_MODEL_PARAMETERS", "choose_threads", "machine_threads", "available_cores",
           "load_average", "builtin_model_parameters"]

SMALL_MODEL_PARAMETERS = 2_000_000
"""Policies with fewer parameters run one intra-op thread on a CPU, whatever the machine: the
built-in models (0.28M and 1.1M parameters) and anything of their size. The measured cases are
the 0.28M models (``benchmarks/thread_rule.py``); above this bound the rule counts free cores."""


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
    beside a 1-minute load average of ``load``. ``parameters`` None: unknown (counted as
    large). Pure: the caller reads the machine (``machine_threads``)."""
    if device_type != "cpu":
        return ThreadChoice(None, f"on {device_type} the CPU threads only launch kernels")
    cores = max(1, int(cores))
    if parameters is not None and parameters < SMALL_MODEL_PARAMETERS:
        return ThreadChoice(1, f"a {parameters / 1e6:.2f}M-parameter model gains nothing from more, and loses "
                               "to spin-waits on a busy CPU")
    busy = min(cores, max(0, round(load)))
    free = max(1, cores - busy)
    return ThreadChoice(free, f"{cores} core(s), load {load:.1f}: the cores not in use")


def available_cores() -> int:
    """The cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> float:
    """The 1-minute load average (0.0 where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def machine_threads(*, parameters: int | None, device_type: str = "cpu") -> ThreadChoice:
    """``choose_threads`` with this machine's cores and load."""
    return choose_threads(parameters=parameters, cores=available_cores(), load=load_average(), device_type=device_type)


def builtin_model_parameters(model_hidden_size: int | None = None, model_layers: int | None = None) -> int:
    """The parameter count of the built-in tiny model (the embedded default's unless sizes are
    given), counted on the model itself (built from its config: a fraction of a second)."""
    from fastrl.train.task import DefaultTask, char_tokenizer, tiny_model

    default = DefaultTask()
    model = tiny_model(char_tokenizer(), hidden_size=model_hidden_size or default.hidden_size,
                       layers=model_layers or default.layers, heads=default.heads, arch=default.arch)
    return sum(p.numel() for p in model.parameters())
