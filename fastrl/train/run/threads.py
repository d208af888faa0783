"""How many intra-op threads ``fastrl train`` gives torch on a CPU when ``--threads`` is not set.

The rule (``choose_threads``, pure): the cores this process may run on that no other process
is using. A run starts with it (``machine_threads``: the other processes running now, counted
a few times over a quarter of a second) and keeps it true while it runs: a ``ThreadGovernor``
on the policy's forward re-reads the machine every half second (``WINDOW_SECONDS``) and moves
torch's thread count to the free cores, down at once when a neighbour takes a core, up only
after ``RAISE_AFTER_WINDOWS`` windows agree. What it reads is the CPU time the kernel counts
on this process's cores (``/proc/stat``) less this process's own (``os.times``): the cores
the others used over the window, so neither this run's own threads nor their spin-waits count
as load, and the 1-minute load average's lag does not enter.

Why: every parallel region of torch's intra-op pool ends at a barrier where the threads
spin-wait for each other. Beside a CPU-bound neighbour a descheduled partner stalls every op,
and a small model's ops are too short to pay for that: ``benchmarks/thread_rule.py``
measured the embedded default and ``--env calculator`` (0.28M parameters) on two threads
beside a busy loop, and they never finished within the 90 s that one thread needed 15-30 s
for (``benchmarks/results/thread_rule_cpu.json``, ``thread_rule_idle_cpu.json``). On the
idle 2-core CPU the same runs were fastest on both cores (the default's warm-up 25 steps/s
against 16-17 on one), and sql's 1.1M model ran its runs in 552-598 s on two threads against
933-1156 s of CPU on one (``env_train_sql_width128_default_threads_cpu.json``). So no model
size earned a rule of its own here: the free cores, re-read as the machine changes (measured
against 1 and 2 threads, idle, beside a busy loop and with one arriving mid-run:
``thread_rule_governor_cpu.json``, rendered in docs/train.md). On CUDA
the rule leaves torch's default (the CPU side only launches kernels).

The price of following the machine: torch's CPU sums may round differently at another thread
count, so two runs of one seed can part ways when the load differs. ``--threads N`` (or
``OMP_NUM_THREADS=N``) pins the count, and the run with it: the way to reproduce a run bit for
bit, and what the tests and the measured studies do.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

__all__ = ["ThreadChoice", "ThreadGovernor", "THREADS_ENV", "threads_from_environment", "WINDOW_SECONDS", "RAISE_AFTER_WINDOWS", "choose_threads", "machine_threads",
           "available_cores", "core_ids", "other_runnable", "others_busy_reader", "builtin_model_parameters"]

RUNNABLE_SAMPLES = 5
"""Samples of the running-process count ``other_runnable`` takes at the start (50 ms apart; the median)."""
WINDOW_SECONDS = 0.5
"""How often a ``ThreadGovernor`` re-reads the machine: long enough for the kernel's CPU-time
counters (10 ms ticks) to resolve a core's share to 2%, short enough that a neighbour arriving
mid-run costs about a second of collapsed steps (it is seen within one to two windows). At 1 s
a neighbour arriving 5 s into the embedded default's short run cost it 2.3 s against one
thread throughout (``benchmarks/thread_rule.py``, the ``arrives`` rows)."""
RAISE_AFTER_WINDOWS = 2
"""Windows in a row that must find more free cores before the governor adds threads (it takes
them away after one): a neighbour that pauses for a moment does not make the run flap."""


@dataclass(frozen=True)
class ThreadChoice:
    """The rule's answer: a thread count (None: torch's default) and why, in words, with the
    machine it was chosen for (usable cores, other processes running)."""

    threads: int | None
    reason: str
    cores: int = 0
    load: float = 0.0

    def describe(self, *, given: int | None = None, source: str = "--threads") -> str:
        """One line for the start of a run and ``fastrl env``; ``given``: a count the user chose, by ``source``."""
        if given is not None:
            return f"threads: {given} ({source})"
        count = "torch's default" if self.threads is None else str(self.threads)
        return f"threads: {count} ({self.reason}; --threads N overrides)"


THREADS_ENV = "OMP_NUM_THREADS"
"""A thread count the user set for every OpenMP program: ``fastrl train`` takes it as it takes
``--threads`` (that count, no rule, no governor); torch read it at start-up too."""


def threads_from_environment(environ: dict[str, str] | None = None) -> int | None:
    """``OMP_NUM_THREADS`` when it is a whole number of at least one, else None (unset, empty, a list)."""
    value = (os.environ if environ is None else environ).get(THREADS_ENV, "").strip()
    return int(value) if value.isdigit() and int(value) >= 1 else None


def free_cores(cores: int, others: float) -> int:
    """The cores of ``cores`` that ``others`` (cores' worth of other processes' work) leave, at least one."""
    return max(1, int(cores) - min(int(cores), max(0, round(others))))


def choose_threads(*, parameters: int | None, cores: int, load: float, device_type: str = "cpu") -> ThreadChoice:
    """The intra-op thread count for a policy of ``parameters`` (for the words; None: unknown)
    on ``cores`` usable cores beside ``load`` other running processes. Pure: the caller reads
    the machine (``machine_threads``)."""
    if device_type != "cpu":
        return ThreadChoice(None, f"on {device_type} the CPU threads only launch kernels", cores, load)
    threads = free_cores(cores, load)
    size = "a model of unknown size" if parameters is None else f"a {parameters / 1e6:.2f}M-parameter model"
    return ThreadChoice(threads, f"{size} on {max(1, int(cores))} core(s) with {load:g} other process(es) running: "
                                 "the free cores, re-read every half second", cores, load)


def core_ids() -> list[int]:
    """The cores this process may run on (its affinity mask; all of ``os.cpu_count()`` where there is none)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def available_cores() -> int:
    """How many cores this process may run on (``core_ids``)."""
    return len(core_ids())


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
    """``choose_threads`` with this machine's cores and the processes running on it now."""
    load = other_runnable() if device_type == "cpu" else 0.0
    return choose_threads(parameters=parameters, cores=available_cores(), load=load, device_type=device_type)


# /proc/stat's per-core fields, in its order: user nice system idle iowait irq softirq steal (guest time is inside user)
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def others_busy_reader(cores: Sequence[int], *, stat_path: str = "/proc/stat",
                       own_times: Callable[[], os.times_result] = os.times) -> Callable[[], float] | None:
    """A function returning the CPU seconds other processes have used on ``cores`` so far
    (``/proc/stat``'s busy time of those cores less this process's ``os.times``): its
    difference over a window, divided by the window, is the cores' worth of the others' work.
    None where there is no ``/proc/stat`` (the governor then keeps the start's choice).
    ``stat_path`` and ``own_times`` are the test seams."""
    names = {f"cpu{c}" for c in cores}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def read() -> float:
        busy = 0
        with open(stat_path) as handle:
            for line in handle:
                if not line.startswith("cpu"):
                    break
                parts = line.split()
                if parts[0] in names:
                    values = parts[1:]
                    busy += sum(int(values[i]) for i in _BUSY_FIELDS if i < len(values))
        own = own_times()
        return busy / tick - (own.user + own.system)

    try:
        read()
    except (OSError, ValueError, IndexError):
        return None
    return read


@dataclass
class ThreadGovernor:
    """Keeps torch's intra-op threads at the free cores while a run goes on.

    ``tick()`` is cheap (a clock read) and acts once a ``window`` has passed: the others' CPU
    seconds over the window (``read_others``) give the cores they used, ``free_cores`` the
    threads. ``attach(module)`` calls ``tick`` before every forward of ``module`` (the CPU work
    of a run -- warm-up, sampling, scoring, update -- is forwards and their backwards), on the
    thread that runs them, where torch's thread count applies; in a process forked from the run
    (``--async_steps``' sampler, which sets its own count) the copied hook does nothing, and a
    counter that cannot be read leaves the count as it is. ``close()`` detaches it. The
    clock, the reader and the setter are parameters: the tests drive it with made-up counters.
    """

    cores: int
    threads: int
    read_others: Callable[[], float]
    set_threads: Callable[[int], None] = torch.set_num_threads
    clock: Callable[[], float] = time.monotonic
    window: float = WINDOW_SECONDS
    raise_after: int = RAISE_AFTER_WINDOWS
    changes: list[tuple[float, int, float]] = field(default_factory=list)
    """(time, new thread count, the others' cores that decided it), for a run's log and the tests."""

    def __post_init__(self) -> None:
        self._pid = os.getpid()  # a forked process (the async sampler's) keeps its own thread count
        self._start = self._last_time = self.clock()
        self._last_others = self.read_others()
        self._higher = 0
        self._handles: list = []
        self.closed = False

    def tick(self) -> None:
        """Re-read the machine if a window has passed; move the thread count if it must."""
        now = self.clock()
        if self.closed or now - self._last_time < self.window or os.getpid() != self._pid:
            return
        try:
            others_seconds = self.read_others()
        except (OSError, ValueError, IndexError):  # the counters went away mid-run: keep the count there is
            self._last_time = now
            return
        others = max(0.0, (others_seconds - self._last_others) / (now - self._last_time))
        self._last_time, self._last_others = now, others_seconds
        want = free_cores(self.cores, others)
        if want < self.threads:
            self._higher = 0
            self._move(want, now, others)
        elif want > self.threads:
            self._higher += 1
            if self._higher >= self.raise_after:
                self._higher = 0
                self._move(want, now, others)
        else:
            self._higher = 0

    def _move(self, threads: int, now: float, others: float) -> None:
        self.threads = threads
        self.set_threads(threads)
        self.changes.append((round(now - self._start, 3), threads, round(others, 2)))

    def attach(self, module: torch.nn.Module) -> None:
        """``tick`` before every forward of ``module``'s input embeddings (a ``transformers``
        model's ``get_input_embeddings()``; ``module`` itself when it has none): every path
        through the model starts there -- the whole model, its base alone (the warm-up's and the
        fused losses' hidden states), the HF sampler's lean decode, which runs the layers'
        weights without their modules but looks its tokens up through that one module -- where
        a hook on the top module would miss all but the first."""
        embeddings = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
        target = embeddings if isinstance(embeddings, torch.nn.Module) else module
        self._handles.append(target.register_forward_pre_hook(lambda _module, _args: self.tick()))

    def close(self) -> None:
        """Stop governing: hooks removed (a copy of the module made meanwhile keeps a hook that does nothing)."""
        self.closed = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def builtin_model_parameters(model_hidden_size: int | None = None, model_layers: int | None = None) -> int:
    """The parameter count of the built-in tiny model (the embedded default's unless sizes are
    given), counted on the model itself (built from its config: a fraction of a second)."""
    from fastrl.train.task import DefaultTask, char_tokenizer, tiny_model

    default = DefaultTask()
    model = tiny_model(char_tokenizer(), hidden_size=model_hidden_size or default.hidden_size,
                       layers=model_layers or default.layers, heads=default.heads, arch=default.arch)
    return sum(p.numel() for p in model.parameters())
