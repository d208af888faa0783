"""Runs across seeds (pure): per algorithm every metric's mean ± std, the verdict per axis
(winner, margin, whether the seeds tell the algorithms apart) and the terminal table."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from fastrl.commands.compare.analysis import (
    ECHO_TRAP_STD_FRACTION,
    ENTROPY_BLOWUP_FACTOR,
    KL_BLOWUP,
    SMOOTHING_STEPS,
    STAGES,
    as_float,
)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof 1; 0 for one value) of the finite values."""
    v = [float(x) for x in values if math.isfinite(float(x))]
    if not v:
        return float("nan"), float("nan")
    m = sum(v) / len(v)
    if len(v) == 1:
        return m, 0.0
    return m, math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))


@dataclass(frozen=True)
class Metric:
    """One row of the comparison: where it is in a run's metrics and which way is better."""

    axis: str
    key: str
    label: str
    higher_is_better: bool | None
    """None: reported, not ranked."""
    fmt: str = ".3f"


METRICS: tuple[Metric, ...] = (
    Metric("success", "initial_accuracy", "held-out accuracy, start", None),
    Metric("success", "final_accuracy", "held-out accuracy, end", True),
    Metric("success", "best_accuracy", "held-out accuracy, best", True),
    Metric("success", "final_pass@k", "pass@k, end", True),
    Metric("success", "final_reward", f"train reward, last {SMOOTHING_STEPS} steps", True),
    Metric("stability", "reward_drop", "worst reward drop", False),
    Metric("stability", "kl_max", "max KL to reference", False),
    Metric("stability", "kl_blowups", f"KL blow-up steps (> {KL_BLOWUP:g})", False, ".1f"),
    Metric("stability", "entropy_end_over_start", "entropy end / start", None),
    Metric("stability", "entropy_blowups", f"entropy blow-up steps (> {ENTROPY_BLOWUP_FACTOR:g}x)", False, ".1f"),
    Metric("stability", "non_finite_steps", "non-finite steps", False, ".1f"),
    Metric("stability", "reward_std_collapse_steps", "reward-std collapse steps (Echo Trap)", False, ".1f"),
    Metric("cost", "steps", "RL steps", None, ".1f"),
    Metric("cost", "train_seconds", "RL seconds (eval excluded)", False, ".1f"),
    Metric("cost", "wall_seconds", "process wall seconds", False, ".1f"),
    Metric("cost", "generated_tokens", "generated tokens", None, ".0f"),
    Metric("cost", "leaf_tokens", "tokens if sampled independently", None, ".0f"),
    Metric("cost", "trained_tokens", "trained tokens", None, ".0f"),
    Metric("cost", "peak_memory_gb", "peak memory (GB)", False, ".2f"),
    Metric("cost", "env_calls", "environment calls (resets + steps)", False, ".0f"),
    Metric("cost", "env_calls_per_prompt", "environment calls per prompt", False, ".1f"),
    Metric("cost", "leaf_env_calls", "environment calls if played independently", None, ".0f"),
    Metric("cost", "tool_calls", "tool calls", None, ".0f"),
)


def _run_value(run: dict[str, Any], metric: Metric) -> float:
    if metric.key == "wall_seconds":
        return as_float(run.get("wall_seconds"))
    section = run.get(metric.axis, {})
    if metric.key == "final_pass@k":
        found = [v for k, v in section.items() if k.startswith("final_pass@")]
        return as_float(found[0]) if found else float("nan")
    return as_float(section.get(metric.key))


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per algorithm: every metric's per-seed values, mean and std; seconds per stage (mean);
    counts of NaN-stopped and failed runs; the spread of the final accuracy across seeds."""
    out: dict[str, dict[str, Any]] = {}
    for algo in dict.fromkeys(r["algorithm"] for r in runs):
        mine = [r for r in runs if r["algorithm"] == algo]
        measured = [r for r in mine if r.get("success")]
        entry: dict[str, Any] = {"seeds": [r["seed"] for r in mine], "runs_measured": len(measured)}
        for metric in METRICS:
            values = [_run_value(r, metric) for r in measured]
            m, s = mean_std(values)
            entry[metric.key] = {"mean": m, "std": s, "values": values}
        stages: dict[str, list[float]] = {}
        for r in measured:
            for k, v in r["cost"]["stage_seconds"].items():
                stages.setdefault(k, []).append(v)
        entry["stage_seconds"] = {k: mean_std(v + [0.0] * (len(measured) - len(v)))[0] for k, v in stages.items()}
        finals = [v for v in entry["final_accuracy"]["values"] if math.isfinite(v)]
        entry["final_accuracy_range"] = (max(finals) - min(finals)) if finals else float("nan")
        entry["nan_stops"] = sum(1 for r in mine if r.get("status") == "diverged")
        entry["failed"] = sum(1 for r in mine if r.get("status") == "failed")
        out[algo] = entry
    return out


def format_value(value: float, fmt: str) -> str:
    """``value`` in ``fmt``; ``n/a`` for NaN or None (not measured), ``inf`` as itself."""
    if value is None or not math.isfinite(value):
        return "n/a" if value is None or math.isnan(value) else str(value)
    return format(value, fmt)


def _pm(mean: float, std: float, n: int, fmt: str) -> str:
    """``mean ± std`` (``mean`` alone for one value, ``n/a`` when not measured)."""
    if mean is None or math.isnan(mean):
        return "n/a"
    return f"{format_value(mean, fmt)} ± {format_value(std, fmt)}" if n > 1 else format_value(mean, fmt)


def axis_verdict(
    axis: str,
    label: str,
    values: dict[str, Sequence[float]],
    *,
    higher_is_better: bool,
    fmt: str = ".3f",
    note: str = "",
) -> dict[str, Any]:
    """Which algorithm wins on one metric, by how much, and whether the seeds separate it from
    the runner-up: the mean ± std (sample std over seeds) intervals of the two must not
    overlap; with one seed there is no spread and the verdict says so.

    ``values``: algorithm -> per-seed values (non-finite ones are ignored). Returns a dict with
    ``winner``, ``runner_up``, their mean/std, ``difference`` (winner - runner-up), ``ratio``,
    ``distinguishable`` (True/False, None when a side has fewer than 2 seeds), ``ranking`` and
    the ``text`` of the verdict line.
    """
    stats = {}
    for algo, vals in values.items():
        finite = [float(v) for v in vals if math.isfinite(float(v))]
        if finite:
            m, s = mean_std(finite)
            stats[algo] = (m, s, len(finite))
    head = f"{axis} ({label}, {'higher' if higher_is_better else 'lower'} is better): "
    result: dict[str, Any] = {"axis": axis, "metric": label, "higher_is_better": higher_is_better, "winner": None,
                              "runner_up": None, "distinguishable": None, "ranking": []}
    if not stats:
        result["text"] = head + "no run measured it" + (f"; {note}" if note else "")
        return result
    ranking = sorted(stats, key=lambda a: stats[a][0], reverse=higher_is_better)
    result["ranking"] = ranking
    best = ranking[0]
    bm, bs, bn = stats[best]
    result.update(winner=best, winner_mean=bm, winner_std=bs, winner_seeds=bn)

    def pm(a: str) -> str:
        m, s, n = stats[a]
        return f"{format_value(m, fmt)} ± {format_value(s, fmt)}" if n > 1 else f"{format_value(m, fmt)} (1 seed)"

    if len(ranking) == 1:
        result["text"] = head + f"only {best} measured it: {pm(best)}" + (f"; {note}" if note else "")
        return result
    second = ranking[1]
    sm, ss, sn = stats[second]
    diff = bm - sm
    ratio = bm / sm if sm != 0 else float("nan")
    result.update(runner_up=second, runner_up_mean=sm, runner_up_std=ss, runner_up_seeds=sn, difference=diff, ratio=ratio)
    if bm == sm:
        verdict = f"{best} and {second} tie at {pm(best)}"
        result["winner"] = None
        distinguishable = False if min(bn, sn) > 1 else None
    else:
        by = f"{'+' if diff > 0 else ''}{format_value(diff, fmt)}"
        if math.isfinite(ratio):
            by += f", {ratio:.2f}x"
        verdict = f"{best} wins, {pm(best)} vs {second} {pm(second)} ({by})"
        if min(bn, sn) < 2:
            distinguishable = None
        else:
            distinguishable = (bm - bs > sm + ss) if higher_is_better else (bm + bs < sm - ss)
    result["distinguishable"] = distinguishable
    if distinguishable is None:
        tail = "fewer than 2 seeds: no uncertainty estimate"
    elif distinguishable:
        tail = "distinguishable: the mean ± std intervals over seeds do not overlap"
    else:
        tail = "not distinguishable: the mean ± std intervals over seeds overlap"
    if len(ranking) > 2:
        tail += "; order " + (" > " if higher_is_better else " < ").join(ranking)
    result["text"] = head + verdict + "; " + tail + (f"; {note}" if note else "")
    return result


def verdicts(summary: dict[str, dict[str, Any]], *, budget_kind: str) -> list[dict[str, Any]]:
    """The verdict lines: success (final held-out accuracy), stability (worst reward drop, with
    the NaN stops and blow-ups named), cost (RL seconds; generated tokens for a time budget,
    where every run spends the same seconds), memory (peak)."""
    def vals(key: str) -> dict[str, list[float]]:
        return {a: e[key]["values"] for a, e in summary.items()}

    out = [axis_verdict("success", "held-out accuracy at the end", vals("final_accuracy"), higher_is_better=True)]
    trouble = []
    for a, e in summary.items():
        bits = []
        if e["nan_stops"]:
            bits.append(f"{e['nan_stops']} NaN stop(s)")
        if e["failed"]:
            bits.append(f"{e['failed']} failed run(s)")
        blowups = sum(v for v in e["kl_blowups"]["values"] if math.isfinite(v)) + sum(
            v for v in e["entropy_blowups"]["values"] if math.isfinite(v))
        if blowups:
            bits.append(f"{int(blowups)} KL/entropy blow-up step(s)")
        trapped = sum(1 for v in e["reward_std_collapse_steps"]["values"] if math.isfinite(v) and v > 0)
        if trapped:
            bits.append(f"Echo Trap warning (reward std collapsed below {ECHO_TRAP_STD_FRACTION:g}x its peak, unsolved) "
                        f"in {trapped} seed(s)")
        if bits:
            trouble.append(f"{a}: " + ", ".join(bits))
    spread = ", ".join(f"{a} {format_value(e['final_accuracy']['std'], '.3f')}" for a, e in summary.items())
    note = f"seed spread of the final accuracy (std): {spread}; " + ("; ".join(trouble) if trouble else "no NaN stops, blow-ups or reward-std collapse")
    out.append(axis_verdict("stability", "worst drop of the reward curve", vals("reward_drop"), higher_is_better=False, note=note))
    if budget_kind == "seconds":
        out.append(axis_verdict("cost", "generated tokens in the same RL seconds", vals("generated_tokens"),
                                higher_is_better=True, fmt=".0f"))
    else:
        out.append(axis_verdict("cost", "RL seconds for the budget", vals("train_seconds"), higher_is_better=False, fmt=".1f"))
    if any(math.isfinite(v) for e in summary.values() for v in e["env_calls"]["values"]):
        # agent runs: what the environment is asked for, the cost GRPO's G trajectories per prompt multiply
        per_prompt = ", ".join(f"{a} {format_value(e['env_calls_per_prompt']['mean'], '.1f')}" for a, e in summary.items())
        out.append(axis_verdict("cost", "environment calls for the budget", vals("env_calls"), higher_is_better=False,
                                fmt=".0f", note=f"environment calls per prompt: {per_prompt}"))
    out.append(axis_verdict("memory", "peak memory in GB", vals("peak_memory_gb"), higher_is_better=False, fmt=".2f"))
    return out


def format_table(summary: dict[str, dict[str, Any]], verdict_list: Sequence[dict[str, Any]], *, pass_k: int | None = None) -> str:
    """The terminal table: one column per algorithm (mean ± std over seeds), rows grouped by
    axis, then the seconds per stage and the verdict lines."""
    algos = list(summary)
    label_w = 34
    col_w = max(17, *(len(a) + 2 for a in algos))
    lines = [f"{'':<{label_w}}" + "".join(f"{a:>{col_w}}" for a in algos)]
    lines.append(f"{'seeds measured':<{label_w}}" + "".join(f"{summary[a]['runs_measured']:>{col_w}}" for a in algos))
    axis = None
    for metric in METRICS:
        if all(not any(math.isfinite(v) for v in summary[a][metric.key]["values"]) for a in algos):
            continue  # e.g. no KL to a reference in any run
        if metric.axis != axis:
            axis = metric.axis
            lines.append(f"-- {axis}")
        label = metric.label.replace("pass@k", f"pass@{pass_k}") if pass_k else metric.label
        cells = []
        for a in algos:
            entry = summary[a][metric.key]
            n = sum(1 for v in entry["values"] if math.isfinite(v))
            cells.append(_pm(entry["mean"], entry["std"], n, metric.fmt))
        lines.append(f"  {label:<{label_w - 2}}" + "".join(f"{c:>{col_w}}" for c in cells))
        if metric.key == "reward_drop":
            lines.append(f"  {'final accuracy spread (max-min)':<{label_w - 2}}"
                         + "".join(f"{format_value(summary[a]['final_accuracy_range'], '.3f'):>{col_w}}" for a in algos))
            lines.append(f"  {'NaN stops / failed runs':<{label_w - 2}}"
                         + "".join(f"{str(summary[a]['nan_stops']) + ' / ' + str(summary[a]['failed']):>{col_w}}" for a in algos))
    stages = [st for st in STAGES if any(st in summary[a]["stage_seconds"] for a in algos)]
    if stages:
        lines.append("-- seconds per stage (mean over seeds)")
        for st in stages:
            lines.append(f"  {st:<{label_w - 2}}" + "".join(f"{format_value(summary[a]['stage_seconds'].get(st, 0.0), '.1f'):>{col_w}}" for a in algos))
    lines.append("")
    lines.extend(v["text"] for v in verdict_list)
    return "\n".join(lines)
