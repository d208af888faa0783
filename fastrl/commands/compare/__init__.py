"""``fastrl compare``: RL algorithms side by side on one model, task and budget.

    fastrl compare --algorithms ppo grpo dr_grpo --seeds 3 --budget 200-steps [train options]

1. start    One starting point shared by every run, built once in this process: the
            training and held-out rows (written as jsonl, so every run sees the same split
            and the same held-out prompts) and, when the configuration has a supervised
            warm-up (the built-in model has one), the warmed-up model. Every run then starts
            from that model with no warm-up of its own: the comparison measures the RL
            algorithms alone, and the warm-up is paid once, not once per run.
2. runs     Every algorithm x seed is ``fastrl train`` (``python -m fastrl.commands.compare train``) in a fresh process with
            the same options and budget: ``N-steps``, wall time of the RL steps (``10m``,
            ``90s``; held-out evaluation is not counted) or generated completion tokens
            (``50k-tokens``). ``grpo_then_ppo`` is two processes: GRPO for ``--hybrid_split``
            of the budget, then PPO from GRPO's final policy with the critic's body
            initialised from the same checkpoint (the PPO phase runs with seed + 1000, so
            its prompts come in a fresh order rather than repeating GRPO's).
3. report   Each run's ``metrics.jsonl`` gives success (held-out accuracy: start, end, best,
            curves over RL seconds and generated tokens), stability (worst drop of the reward
            curve, KL and entropy blow-ups, the reward-std collapse or "Echo Trap", NaN stops)
            and cost (seconds, tokens, peak memory, seconds per stage; with ``--env`` also
            environment calls, tool calls and environment calls per prompt, which
            ``--ppo_group_size`` lowers for PPO). Per algorithm: mean ± std over seeds; per axis a
            verdict naming the winner, by how much, and whether the seeds can tell the
            algorithms apart (mean ± std intervals that overlap: "not distinguishable").
            Output: a table on the terminal, ``compare.json``, ``compare.png``.

The functions that turn metrics into summaries and verdicts are pure (lists of numbers
in, dicts out), so they are tested on synthetic numbers.

Modules, one job each: ``defaults`` (the algorithms, the defaults, ``CompareError``),
``budget`` (``--budget`` parsed and checked), ``options`` (the command line and its checked
``ComparePlan``), ``start`` (the shared start), ``processes`` (the live runs, ``--jobs``, stop
signals, CPU seconds), ``runs`` (one algorithm x seed), ``analysis`` (one run's metrics and
stability detectors), ``summary`` (across seeds: summaries, verdicts, the table), ``plot``,
``report`` and ``command`` (``run_compare``); ``__main__`` is what a run's process executes.
This package exports every public name of them (``fastrl.train.compare`` is its old name).
"""

from __future__ import annotations

from fastrl.commands.compare.analysis import (
    ECHO_TRAP_SOLVED,
    ECHO_TRAP_STD_FRACTION,
    ENTROPY_BLOWUP_FACTOR,
    KL_BLOWUP,
    SAMPLES_METRIC,
    SMOOTHING_STEPS,
    STAGES,
    as_float,
    chain_phases,
    cumulative,
    moving_average,
    reward_drop,
    reward_std_collapse,
    run_metrics,
)
from fastrl.commands.compare.budget import (
    MIN_SECONDS,
    STEP_CAP,
    Budget,
    check_budget_fits,
    parse_budget,
    tokens_per_step,
)
from fastrl.commands.compare.command import run_compare
from fastrl.commands.compare.defaults import (
    COMPARE_ALGORITHMS,
    DEFAULT_ALGORITHMS,
    DEFAULT_BUDGET,
    DEFAULT_EVALUATIONS,
    DEFAULT_JOBS,
    DEFAULT_SEEDS,
    ENV_COMPARE_DEFAULTS,
    HYBRID,
    CompareError,
    EnvCompareDefaults,
)
from fastrl.commands.compare.options import (
    FORBIDDEN_TRAIN_OPTIONS,
    ComparePlan,
    available_cores,
    build_compare_parser,
    default_jobs,
    plan_compare,
    ppo_fields,
)
from fastrl.commands.compare.plot import plot_runs
from fastrl.commands.compare.processes import (
    INTERRUPTED_STATUS,
    STOP_SIGNALS,
    RunProcesses,
    RunsStopped,
    cpu_seconds_used,
    run_all,
    self_cpu_seconds,
    stop_signals_exit,
)
from fastrl.commands.compare.report import build_report, describe_run, strict_json
from fastrl.commands.compare.runs import PARENT_PID_ENV, RUN_MODULE, read_metrics_jsonl, run_fields_for, run_one
from fastrl.commands.compare.start import prepare_start
from fastrl.commands.compare.summary import (
    METRICS,
    Metric,
    axis_verdict,
    format_table,
    format_value,
    mean_std,
    summarize,
    verdicts,
)

__all__ = [
    # defaults
    "COMPARE_ALGORITHMS",
    "DEFAULT_ALGORITHMS",
    "DEFAULT_BUDGET",
    "DEFAULT_EVALUATIONS",
    "DEFAULT_JOBS",
    "DEFAULT_SEEDS",
    "ENV_COMPARE_DEFAULTS",
    "HYBRID",
    "CompareError",
    "EnvCompareDefaults",
    # budget
    "MIN_SECONDS",
    "STEP_CAP",
    "Budget",
    "check_budget_fits",
    "parse_budget",
    "tokens_per_step",
    # analysis
    "ECHO_TRAP_SOLVED",
    "ECHO_TRAP_STD_FRACTION",
    "ENTROPY_BLOWUP_FACTOR",
    "KL_BLOWUP",
    "SAMPLES_METRIC",
    "SMOOTHING_STEPS",
    "STAGES",
    "as_float",
    "chain_phases",
    "cumulative",
    "moving_average",
    "reward_drop",
    "reward_std_collapse",
    "run_metrics",
    # summary
    "METRICS",
    "Metric",
    "axis_verdict",
    "format_table",
    "format_value",
    "mean_std",
    "summarize",
    "verdicts",
    # plot
    "plot_runs",
    # options
    "FORBIDDEN_TRAIN_OPTIONS",
    "ComparePlan",
    "available_cores",
    "build_compare_parser",
    "default_jobs",
    "plan_compare",
    "ppo_fields",
    # start
    "prepare_start",
    # processes
    "INTERRUPTED_STATUS",
    "STOP_SIGNALS",
    "RunProcesses",
    "RunsStopped",
    "cpu_seconds_used",
    "run_all",
    "self_cpu_seconds",
    "stop_signals_exit",
    # runs
    "PARENT_PID_ENV",
    "RUN_MODULE",
    "read_metrics_jsonl",
    "run_fields_for",
    "run_one",
    # report
    "build_report",
    "describe_run",
    "strict_json",
    # command
    "run_compare",
]
