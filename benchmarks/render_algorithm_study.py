"""The algorithm-choice study's cells (``benchmarks/results/algorithm_study/*.json``) -> the page
``docs/choosing.md`` ("Choosing an algorithm") and its plot ``docs/choosing.png``.

    python benchmarks/render_algorithm_study.py            # after (part of) benchmarks/algorithm_study.py

Per factor, level and task: every arm's seeds (finished of planned), held-out success at the
end and at the best evaluation, stability and cost; a verdict between the best arm and the
runner-up: "distinguishable" when the 95% interval of the difference of their mean final
success over seeds (Welch, t quantiles) excludes 0, else "not distinguishable", with the
effect size (the difference), the pooled paired McNemar test on the held-out rows (seed k of
one arm against seed k of the other, the same rows: a sharper view that ignores run-to-run
variance, so it is reported, not used for the verdict) and the cost ratio (the cells' CPU
seconds, the shared warm-up excluded, plus ``cost_weight`` x environment calls for
``rollout_cost``'s levels, whose arms are compared at equal charged cost: ``equal_cost``).
Every sentence of advice
names the cells it rests on. A level with fewer than 2 finished seeds on an arm is pending,
never a result.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.algorithm_study import (  # noqa: E402
    ALPHA, DETECT, MAX_SEEDS, MIN_SEEDS, POWER, RESULTS, power_table, seeds_by_task, seeds_needed, spread_from_compare,
    spread_fresh_warmup, spread_from_study)
from benchmarks.study_factors import FACTORS, Factor, Level  # noqa: E402
from fastrl.commands.paired import _mcnemar_exact  # noqa: E402

PAGE = ROOT / "docs" / "choosing.md"
PLOT = ROOT / "docs" / "choosing.png"
HINT_P = 0.01
"""A pooled McNemar p-value below this on a level the seeds do not separate marks it as needing more seeds."""
MIN_SEEDS_FOR_VERDICT = 2
"""Seeds per arm below which a level is pending (no spread, no verdict)."""
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
"""Student's t 0.975 quantiles for 1..30 degrees of freedom (a standard table); above 30, 1.96."""


def t975(df: float) -> float:
    """The 0.975 quantile of Student's t at ``floor(df)`` degrees of freedom (conservative; a
    ``df`` a rounding error below an integer counts as that integer)."""
    k = max(1, int(math.floor(df + 1e-9)))
    return T975[k - 1] if k <= len(T975) else 1.96


# ============================================================================ reading the cells
def load_cells(results: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted(results.glob("*.json")):
        record = json.loads(path.read_text())
        out[record["cell"]["id"]] = record
    return out


def cell_cpu_seconds(record: dict[str, Any]) -> float:
    """CPU seconds of a cell's process tree without the shared warm-up, when the cell built it
    (the first cell of a start pays for it; the start's cost is the task's, not the arm's)."""
    cpu = _f(record["process"]["cpu_seconds"])
    start = record.get("start") or {}
    return cpu - _f(start.get("warmup_cpu_seconds")) if start.get("built_by_this_cell") else cpu


def _f(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


@dataclass
class Arm:
    """One algorithm at one level of one task: its planned cells and the finished ones."""

    algorithm: str
    planned: list[str]
    records: list[dict[str, Any]]

    @property
    def stem(self) -> str:
        """The arm's cell ids without the seed (``calculator.grpo.base``): a finished cell's, else a planned one's."""
        return (self.records[0]["cell"]["id"] if self.records else self.planned[0]).rsplit(".s", 1)[0]

    def values(self, section: str, key: str) -> list[float]:
        return [_f(r[section].get(key)) for r in self.records]

    def mean(self, section: str, key: str) -> float:
        v = [x for x in self.values(section, key) if math.isfinite(x)]
        return statistics.mean(v) if v else float("nan")

    def sd(self, section: str, key: str) -> float:
        v = [x for x in self.values(section, key) if math.isfinite(x)]
        return statistics.stdev(v) if len(v) > 1 else float("nan")

    def charged(self, weight: float) -> list[float]:
        """Per seed: the cell's CPU seconds (warm-up excluded: on a shared CPU they move less
        with the load than wall seconds) plus ``weight`` seconds per environment call."""
        out = []
        for r in self.records:
            calls = _f(r["cost"].get("env_calls"))
            out.append(cell_cpu_seconds(r) + (weight * calls if weight and math.isfinite(calls) else 0.0))
        return out


def arms_of(factor: Factor, level: Level, task: str, seeds: int, cells: dict[str, dict[str, Any]]) -> list[Arm]:
    arms = []
    for algo in level.algorithms:
        stem = f"{task}.{algo}.{level.arm(algo)}"
        extra = {r["cell"]["seed"] for i, r in cells.items() if i.rsplit(".s", 1)[0] == stem}  # seeds run beyond the plan
        ids = [f"{stem}.s{s}" for s in sorted(set(range(seeds)) | extra)]
        arms.append(Arm(algo, ids, [cells[i] for i in ids if i in cells]))
    return arms


# ============================================================================ the verdict (pure)
def welch_interval(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """Difference of means ``mean(a) - mean(b)`` and its 95% Welch interval (t at the
    Welch-Satterthwaite degrees of freedom, rounded down)."""
    ma, mb = statistics.mean(a), statistics.mean(b)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return ma - mb, ma - mb, ma - mb
    df = (va + vb) ** 2 / ((va**2 / (len(a) - 1) if va else 0.0) + (vb**2 / (len(b) - 1) if vb else 0.0))
    half = t975(df) * se
    return ma - mb, ma - mb - half, ma - mb + half


def pooled_mcnemar(a: Arm, b: Arm) -> dict[str, Any] | None:
    """Rows gained and lost from arm ``b`` to arm ``a`` over the seeds both finished (seed k
    against seed k, the same held-out rows), with the exact McNemar p-value."""
    by_seed_b = {r["cell"]["seed"]: r for r in b.records}
    gained = lost = rows = 0
    for r in a.records:
        other = by_seed_b.get(r["cell"]["seed"])
        if other is None or not r.get("row_success_final") or not other.get("row_success_final"):
            continue
        x, y = r["row_success_final"], other["row_success_final"]
        if len(x) != len(y):
            continue
        gained += sum(1 for p, q in zip(x, y) if p == "1" and q == "0")
        lost += sum(1 for p, q in zip(x, y) if p == "0" and q == "1")
        rows += len(x)
    if not rows:
        return None
    return {"gained": gained, "lost": lost, "rows": rows, "p_value": _mcnemar_exact(gained, lost)}


@dataclass
class EqualCost:
    """``rollout_cost``'s reading: every arm's held-out success when it has spent what the cheaper
    arm spent in its whole run (``equal_cost``)."""

    budget: float
    """Charged seconds: the cheaper arm's mean over seeds (CPU seconds + weight x environment calls)."""
    per_step: dict[str, float]
    """Each arm's mean charged seconds per RL step."""
    affordable: dict[str, float]
    """RL steps each arm affords within ``budget``."""
    success: dict[str, list[float]]
    """Per arm and seed: the held-out success at its affordable steps (``interpolate``)."""


def equal_cost(arms: Sequence[Arm], weight: float) -> EqualCost | None:
    """Held-out success at equal charged cost: the budget is the cheaper arm's mean charged cost
    (``Arm.charged``); an arm affords ``budget / its mean charged cost per step`` RL steps, and
    each of its seeds is read there, between the two held-out evaluations around it
    (``interpolate``). None when a cell lacks its steps or evaluations."""
    per_step, totals = {}, {}
    for a in arms:
        charged = a.charged(weight)
        steps = [_f(r["cost"].get("steps")) for r in a.records]
        if not a.records or not all(math.isfinite(c) and math.isfinite(n) and n > 0 for c, n in zip(charged, steps)):
            return None
        totals[a.algorithm] = statistics.mean(charged)
        per_step[a.algorithm] = statistics.mean(c / n for c, n in zip(charged, steps))
    budget = min(totals.values())
    affordable, success = {}, {}
    for a in arms:
        affordable[a.algorithm] = budget / per_step[a.algorithm]
        success[a.algorithm] = [interpolate(r.get("evals") or [], affordable[a.algorithm]) for r in a.records]
        if not all(math.isfinite(v) for v in success[a.algorithm]):
            return None
    return EqualCost(budget, per_step, affordable, success)


def interpolate(evals: Sequence[dict[str, Any]], step: float) -> float:
    """Held-out success at ``step`` (fractional): linear between the two evaluations around it,
    the last evaluation's beyond it (NaN without evaluations). The evaluations are a few steps
    apart, so reading at the earlier one would charge an arm a few steps for a cost a fraction of a
    percent over the budget."""
    points = sorted((float(e["step"]), _f(e["accuracy"])) for e in evals)
    if not points:
        return float("nan")
    if step >= points[-1][0]:
        return points[-1][1]
    for (s0, a0), (s1, a1) in zip(points, points[1:]):
        if s0 <= step <= s1:
            return a0 + (a1 - a0) * (step - s0) / (s1 - s0) if s1 > s0 else a1
    return points[0][1]


def verdict(arms: Sequence[Arm], *, cost_weight: float = 0.0, success: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """The best arm by mean final held-out success against the runner-up (``module docstring``);
    ``success`` (per arm, per seed) replaces the final success (``equal_cost``'s reading), and
    the McNemar test, which needs the final evaluation's rows, is then left out."""
    ready = [a for a in arms if len(a.records) >= MIN_SEEDS_FOR_VERDICT]
    done = sum(len(a.records) for a in arms)
    planned = sum(len(a.planned) for a in arms)
    out: dict[str, Any] = {"cells_finished": done, "cells_planned": planned}
    if len(ready) < len(arms) or len(arms) < 2:
        out["state"] = "pending"
        out["text"] = f"pending ({done} of {planned} cells)"
        return out
    def finals(a: Arm) -> list[float]:
        values = success[a.algorithm] if success is not None else a.values("success", "final_accuracy")
        return [x for x in values if math.isfinite(x)]

    ranked = sorted(arms, key=lambda a: statistics.mean(finals(a)) if finals(a) else -1.0, reverse=True)
    best, second = ranked[0], ranked[1]
    fa, fb = finals(best), finals(second)
    diff, lo, hi = welch_interval(fa, fb)
    worst = ranked[-1]
    fw = finals(worst)
    _, spread_lo, spread_hi = welch_interval(fa, fw)  # best - worst: "the choice did not matter" needs every arm close
    cost_a, cost_b = statistics.mean(best.charged(cost_weight)), statistics.mean(second.charged(cost_weight))
    out.update(state="partial" if done < planned else "complete", best=best.algorithm, runner_up=second.algorithm,
               difference=diff, low=lo, high=hi, cost_ratio=cost_a / cost_b if cost_b else float("nan"),
               mcnemar=pooled_mcnemar(best, second) if success is None else None, distinguishable=bool(lo > 0),
               worst=worst.algorithm,
               spread_low=spread_lo, spread_high=spread_hi)
    if diff == 0:
        out["distinguishable"] = False
    name = best.algorithm if out["distinguishable"] else "not distinguishable"
    out["text"] = name
    return out


def change_from_start(arm: Arm) -> tuple[float, float, float] | None:
    """Held-out success at the end minus at the start, mean over the arm's seeds, with its 95% t
    interval (None under ``MIN_SEEDS_FOR_VERDICT`` seeds)."""
    d = [f - s for f, s in zip(arm.values("success", "final_accuracy"), arm.values("success", "initial_accuracy"))
         if math.isfinite(f) and math.isfinite(s)]
    if len(d) < MIN_SEEDS_FOR_VERDICT:
        return None
    m = statistics.mean(d)
    half = t975(len(d) - 1) * statistics.stdev(d) / math.sqrt(len(d))
    return m, m - half, m + half


def below_start(arms: Sequence[Arm], best: str) -> str:
    """A clause for a verdict whose best arm ended below its start on average ('' otherwise): then
    the verdict ranks what the arms lost, not what they gained."""
    by = {a.algorithm: a for a in arms}
    start, end = by[best].mean("success", "initial_accuracy"), by[best].mean("success", "final_accuracy")
    if not (math.isfinite(start) and math.isfinite(end)) or end >= start:
        return ""
    ends = ", ".join(f"{a.algorithm} {fmt(a.mean('success', 'final_accuracy'))}" for a in arms if a.records)
    return (f"; every arm ended below the start's {fmt(start)} on average ({ends}): {best} lost the least, "
            "it did not gain")


# ============================================================================ the page
def fmt(v: float, spec: str = ".3f") -> str:
    return "n/a" if v is None or not math.isfinite(v) else format(v, spec)


def pm(arm: Arm, section: str, key: str, spec: str = ".3f") -> str:
    m, s = arm.mean(section, key), arm.sd(section, key)
    if not arm.records:
        return "pending"
    if not math.isfinite(m):  # finished cells without the value (env calls on the default task)
        return "n/a"
    return f"{fmt(m, spec)} ± {fmt(s, spec)}" if math.isfinite(s) else fmt(m, spec)


def cells_ref(arms: Sequence[Arm]) -> str:
    """The cells a row rests on, compactly: ``calculator.grpo.base.s0-2`` per arm (finished ones)."""
    parts = []
    for a in arms:
        seeds = sorted(r["cell"]["seed"] for r in a.records)
        if not seeds:
            continue
        stem = a.stem
        span = f"s{seeds[0]}" if len(seeds) == 1 else (f"s{seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1))
                                                        else "s" + ",".join(map(str, seeds)))
        parts.append(f"`{stem}.{span}`")
    return ", ".join(parts) if parts else "none yet"


@dataclass
class Row:
    factor: Factor
    level: Level
    task: str
    arms: list[Arm]
    verdict: dict[str, Any]
    equal_cost: EqualCost | None = None
    """``rollout_cost``'s levels: the reading at equal charged cost the verdict rests on."""


def build_rows(cells: dict[str, dict[str, Any]], seeds: dict[str, int]) -> list[Row]:
    from benchmarks.study_factors import applies

    rows = []
    for factor in FACTORS.values():
        for level in factor.levels:
            for task in ("calculator", "frozenlake", "default", "sql"):
                if not applies(factor, level, task):
                    continue
                arms = arms_of(factor, level, task, seeds[task], cells)
                if level.cost_weight is not None:  # rollout_cost: read at equal charged cost
                    ec = equal_cost(arms, level.cost_weight) if all(len(a.records) >= MIN_SEEDS_FOR_VERDICT for a in arms) else None
                    v = verdict(arms, cost_weight=level.cost_weight, success=ec.success if ec else None)
                    rows.append(Row(factor, level, task, arms, v, ec))
                else:
                    rows.append(Row(factor, level, task, arms, verdict(arms)))
    return rows


def summary_table(rows: Sequence[Row]) -> list[str]:
    out = ["| factor | level | task | winner | difference in final success (95% interval) | cost ratio | paired rows (McNemar) | cells |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        v = r.verdict
        if v["state"] == "pending":
            out.append(f"| {r.factor.name} | {r.level.name} | {r.task} | {v['text']} | | | | {cells_ref(r.arms)} |")
            continue
        m = v["mcnemar"]
        mc = (f"+{m['gained']}/-{m['lost']} of {m['rows']}, p={m['p_value']:.2g}" if m
              else "n/a (read at equal cost)" if r.equal_cost else "n/a")
        partial = f" (partial: {v['cells_finished']} of {v['cells_planned']} cells)" if v["state"] == "partial" else ""
        when = " at equal cost" if r.equal_cost else ""
        out.append(f"| {r.factor.name} | {r.level.name} | {r.task} | {v['text']}{partial} | {v['best']} − {v['runner_up']}{when}: "
                   f"{v['difference']:+.3f} ({v['low']:+.3f}, {v['high']:+.3f}) | {fmt(v['cost_ratio'], '.2f')}x | {mc} | "
                   f"{cells_ref(r.arms)} |")
    return out


def all_equal(arm: Arm) -> str:
    """Mean share of all-equal groups over the arm's seeds ("n/a" for groups of one trajectory,
    which are all-equal by definition and say nothing about the signal)."""
    if not arm.records:
        return "n/a"
    args = arm.records[0]["cell"].get("args", [])
    if "--ppo_group_size" in args and args[args.index("--ppo_group_size") + 1] == "1":
        return "n/a (groups of 1)"
    return fmt(statistics.mean([_f(x.get("frac_all_equal_groups")) for x in arm.records]), ".2f")


def factor_table(rows: Sequence[Row]) -> list[str]:
    out = ["| level | task | arm | seeds | success start | success end | success best | worst drop | Echo-Trap steps | NaN stops | "
           "all-equal groups | RL s | CPU s (warm-up excluded) | generated tokens | env calls | peak GB |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for a in r.arms:
            nan_stops = sum(1 for x in a.records if x.get("status") == "diverged")
            cpu = [cell_cpu_seconds(x) for x in a.records]
            out.append(
                f"| {r.level.name} | {r.task} | {a.algorithm} | {len(a.records)}/{len(a.planned)} | "
                f"{pm(a, 'success', 'initial_accuracy')} | {pm(a, 'success', 'final_accuracy')} | {pm(a, 'success', 'best_accuracy')} | "
                f"{pm(a, 'stability', 'reward_drop')} | {fmt(sum(a.values('stability', 'reward_std_collapse_steps')) if a.records else float('nan'), '.0f')} | "
                f"{nan_stops if a.records else 'n/a'} | "
                f"{all_equal(a)} | "
                f"{pm(a, 'cost', 'train_seconds', '.1f')} | {fmt(statistics.mean(cpu) if cpu else float('nan'), '.0f')} | "
                f"{pm(a, 'cost', 'generated_tokens', '.0f')} | {pm(a, 'cost', 'env_calls', '.0f')} | {pm(a, 'cost', 'peak_memory_gb', '.2f')} |")
    return out


def equal_cost_table(rows: Sequence[Row]) -> list[str]:
    """``rollout_cost``'s reading at equal charged cost, per level and task and arm."""
    out = ["| level | task | arm | charged s per step | budget (the cheaper arm's run) | steps afforded | "
           "success at equal cost | success at the end |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ec = r.equal_cost
        for a in r.arms:
            if ec is None:
                out.append(f"| {r.level.name} | {r.task} | {a.algorithm} | pending | | | | {pm(a, 'success', 'final_accuracy')} |")
                continue
            vals = ec.success[a.algorithm]
            out.append(f"| {r.level.name} | {r.task} | {a.algorithm} | {ec.per_step[a.algorithm]:.2f} | {ec.budget:.0f} s | "
                       f"{ec.affordable[a.algorithm]:.1f} of {fmt(a.mean('cost', 'steps'), '.0f')} | "
                       f"{statistics.mean(vals):.3f} ± {statistics.stdev(vals) if len(vals) > 1 else 0.0:.3f} | "
                       f"{pm(a, 'success', 'final_accuracy')} |")
    return out


def advice(rows: Sequence[Row]) -> tuple[list[str], list[str]]:
    """Sentences of advice (a distinguishable winner, or an interval inside ±``DETECT``: the
    choice did not matter), each with its cells, once per set of cells (levels that share their
    runs are named together), and the folklore's checks (held / did not hold / not tested yet)."""
    claims: dict[str, tuple[list[str], str]] = {}
    folk = []
    for r in rows:
        v = r.verdict
        where = f"{r.task}, {r.factor.name} = {r.level.name} ({r.level.condition})"
        claim = None
        if v["state"] != "pending" and v["distinguishable"]:
            claim = (f"**{v['best']}** beat {v['runner_up']} by {v['difference']:+.3f} held-out success"
                     f"{' at equal cost' if r.equal_cost else ''} "
                     f"(95% interval {v['low']:+.3f} to {v['high']:+.3f}) at {fmt(v['cost_ratio'], '.2f')}x its cost"
                     f"{below_start(r.arms, v['best'])}")
        elif v["state"] != "pending" and max(abs(v["spread_low"]), abs(v["spread_high"])) < DETECT:
            claim = (f"the choice between {', '.join(a.algorithm for a in r.arms)} did not matter: the best ({v['best']}) "
                     f"minus the worst ({v['worst']}) held-out success has the 95% interval {v['spread_low']:+.3f} to "
                     f"{v['spread_high']:+.3f}, inside ±{DETECT}; {v['best']} at {fmt(v['cost_ratio'], '.2f')}x "
                     f"{v['runner_up']}'s cost{below_start(r.arms, v['best'])}")
        if claim is not None:
            partial = f" (partial: {v['cells_finished']} of {v['cells_planned']} cells)" if v["state"] == "partial" else ""
            key = f"{claim}{partial}. Cells: {cells_ref(r.arms)}."
            claims.setdefault(key, ([], r.task))[0].append(f"{r.factor.name} = {r.level.name} ({r.level.condition})")
        if r.level.folklore is None:
            continue
        if v["state"] == "pending":
            state = "not tested yet (pending)"
        elif not v["distinguishable"] and r.level.folklore in (v["best"], v["runner_up"]) and (
                (v["high"] if v["best"] == r.level.folklore else -v["low"]) < DETECT):
            most = v["high"] if v["best"] == r.level.folklore else -v["low"]
            state = (f"**did not hold here**: no advantage of {r.level.folklore} as large as {DETECT} (at most {most:+.3f}: "
                     f"{v['best']} − {v['runner_up']} = {v['difference']:+.3f}, interval {v['low']:+.3f} to {v['high']:+.3f})")
        elif not v["distinguishable"]:
            state = f"not distinguishable here (best {v['best']} {v['difference']:+.3f}, interval {v['low']:+.3f} to {v['high']:+.3f})"
        elif v["best"] == r.level.folklore:
            state = "held here"
        else:
            state = f"**did not hold here**: {v['best']} won by {v['difference']:+.3f}"
        folk.append(f"- {r.factor.folklore} -- expected {r.level.folklore} to win on {where}: {state}. Cells: {cells_ref(r.arms)}.")
    said = [f"- On {task} ({'; '.join(levels)}): {key}" for key, (levels, task) in claims.items()]
    return said, folk


def brief(rows: Sequence[Row]) -> list[str]:
    """The answer in a few counted sentences: how many (factor, level, task) rows each arm won,
    how many were not distinguishable, and GRPO's cost against PPO's where both ran."""
    judged = [r for r in rows if r.verdict["state"] != "pending"]
    if not judged:
        return ["No row has a verdict yet."]
    wins: dict[str, list[Row]] = {}
    for r in judged:
        if r.verdict["distinguishable"]:
            wins.setdefault(r.verdict["best"], []).append(r)
    arms = sorted({a.algorithm for r in judged for a in r.arms})
    never = [a for a in arms if a not in wins]
    def distinct(rs: Sequence[Row]) -> int:
        """Sets of runs under ``rs`` (levels that share their runs rest on one)."""
        return len({cells_ref(r.arms) for r in rs})

    won = "; ".join(f"{a} won {len(rs)} (on {', '.join(sorted({r.task for r in rs}))}; {distinct(rs)} distinct sets of runs)"
                    for a, rs in sorted(wins.items()))
    tied = [r for r in judged if not r.verdict["distinguishable"]]
    out = [f"- Of the {len(judged)} rows of the table below with a verdict (a factor's level on a task; a factor's "
           "no-change level reuses the baseline's runs, so rows are not all independent evidence), "
           f"{won or 'no arm won any'}, and {len(tied)} ({distinct(tied)} distinct sets of runs) were not distinguishable."]
    if never:
        out.append(f"- {', '.join(never)} never won a row measurably.")
    pairs: dict[str, float] = {}
    for r in judged:
        by = {a.algorithm: a for a in r.arms}
        if "grpo" in by and "ppo" in by and by["grpo"].records and by["ppo"].records:
            pairs[cells_ref([by["grpo"], by["ppo"]])] = (statistics.mean(by["grpo"].charged(0.0))
                                                        / statistics.mean(by["ppo"].charged(0.0)))
    if pairs:
        ratios = list(pairs.values())
        out.append(f"- Where GRPO and PPO ran side by side ({len(ratios)} distinct pairs of arms), GRPO's CPU seconds per "
                   f"run were {min(ratios):.2f}x to {max(ratios):.2f}x PPO's (median {statistics.median(ratios):.2f}x; the "
                   "warm-up excluded, the same steps; PPO adds a critic's forward and update every step).")
    return out + [""]


def gain_section(rows: Sequence[Row]) -> list[str]:
    """Did the budget's RL raise held-out success at all? The baseline factor's arms, and those of
    a level with a start or a budget of its own, in a table (end minus start, with its interval),
    then per task a count over every arm of the study."""
    out = ["## Did RL help at all, at this budget?", "",
           "The verdicts compare arms with each other. This section asks whether any arm gained: held-out success at "
           "the end minus at the start (every arm of a level starts from the same checkpoint), mean over seeds with "
           "its 95% t interval; \"best\" is the best evaluation during the run. The table holds the baseline's arms "
           "and those of a level with a start or a budget of its own; the counts under it cover every arm.", "",
           "| task | arm | seeds | start | end − start (95% interval) | best − start |", "|---|---|---|---|---|---|"]
    seen: set[str] = set()
    per_task: dict[str, dict[str, int]] = {}
    gained: dict[str, list[str]] = {}
    for r in rows:
        for a in r.arms:
            if not a.records:
                continue
            stem = a.stem
            if stem in seen:
                continue
            seen.add(stem)
            change = change_from_start(a)
            if change is None:
                continue
            m, lo, hi = change
            tally = per_task.setdefault(r.task, {"above": 0, "below": 0, "neither": 0})
            tally["above" if lo > 0 else "below" if hi < 0 else "neither"] += 1
            if lo > 0:
                gained.setdefault(r.task, []).append(f"`{stem}`")
            if r.factor.name == "baseline" or r.level.start_args or r.level.budget_scale != 1:
                best = a.mean("success", "best_accuracy") - a.mean("success", "initial_accuracy")
                out.append(f"| {r.task} | {a.algorithm} (`{stem}`) | {len(a.records)} | {pm(a, 'success', 'initial_accuracy')} | "
                           f"{m:+.3f} ({lo:+.3f}, {hi:+.3f}) | {fmt(best, '+.3f')} |")
    out.append("")
    for task, t in per_task.items():
        total = sum(t.values())
        if t["above"] == 0 and t["below"]:
            gist = (" No arm gained measurably: at this budget (the task's `fastrl compare` budget) RL has not yet "
                    "raised this task's held-out success over its warm-up, so its verdicts rank what the arms lost "
                    "(or could not tell them apart), not which one learns the task; a longer budget is where its "
                    "comparison would go next.")
        elif t["below"] == 0 and t["above"]:
            gist = " No arm lost measurably."
        elif t["above"] <= 3:
            gist = f" Above: {', '.join(gained[task])}."
        else:
            gist = ""
        out.append(f"- {task}: of its {total} arms (every factor and level), {t['above']} ended measurably above their "
                   f"start, {t['below']} measurably below, {t['neither']} neither.{gist}")
    return out + [""]


INTRO = """# Choosing an algorithm

*Generated by `python benchmarks/render_algorithm_study.py` from the cells in
`benchmarks/results/algorithm_study/` (one JSON per finished cell, written by
`benchmarks/algorithm_study.py`); do not edit by hand.*

The question users bring: **PPO or GRPO for my task?** The usual answer: GRPO when rewards are
verifiable, group sampling is affordable and the samples of one prompt differ; PPO when a value
function can be learnt and step-level credit matters, especially when each rollout is
expensive; neither by default. This page tests those conditions one at a time, at equal
budget (`fastrl compare`'s per-task budget: calculator 24 RL steps, frozenlake 16, sql 12, the
default task 40; the budget factor also runs four times frozenlake's), each condition a factor
at two or three levels (`benchmarks/study_factors.py`), every arm of a level from the same
warmed-up start, many seeds.

!!! warning "Scale"
    These are tiny models (the built-in character-level policies: the calculator's has
    0.28 M parameters, 4 layers of width 64) trained for a few dozen steps on a 2-core CPU. What should transfer: the
    mechanisms -- all-equal groups give GRPO no gradient, a critic costs an extra forward and
    update per step (the cost ratios per stage), flipped rewards reach the advantages through
    the group's mean and std. What should not: the absolute success rates, the size of any
    effect, how sample efficiency grows with the model, and wall-time ratios on a GPU, where
    generation, not the update, dominates. Treat a verdict here as evidence about the
    mechanism on these tasks, not as a law for a 7B model.
"""


def _fastrl_tree(code: str) -> str | None:
    """The git tree of ``fastrl/`` at commit ``code`` (None: dirty, or not in this repository)."""
    import subprocess

    if "+" in code:
        return None
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "-q", f"{code}:fastrl"], capture_output=True, text=True)
    return out.stdout.strip() or None


def provenance(cells: dict[str, dict[str, Any]]) -> str:
    """Where the finished cells ran: the code, the CPU time, the machine's load."""
    codes = sorted({r.get("code", "?") for r in cells.values()})
    cpu = sum(_f(r["process"]["cpu_seconds"]) for r in cells.values())
    loads = [_f(r["process"].get(k)) for r in cells.values() for k in ("load_average_before", "load_average_after")]
    loads = [v for v in loads if math.isfinite(v)]
    text = (f" The finished cells ran at code {', '.join(codes)} (the commit of the run; `+dirty` when `fastrl/` had "
            f"uncommitted changes)")
    trees = {_fastrl_tree(c) for c in codes}
    if len(codes) > 1 and len(trees) == 1 and None not in trees:
        text += ", whose `fastrl/` trees are identical"
    text += f"; each single-threaded, at most two at a time (the runner's --jobs); {cpu / 3600:.2f} CPU-hours, warm-ups included"
    if loads:
        text += (f"; the machine was shared (1-minute load average {min(loads):.1f} to {max(loads):.1f} on 2 cores at the "
                 "cells' starts and ends), so seconds are noisier than steps, tokens and environment calls")
    return text + "."


def render(cells: dict[str, dict[str, Any]], seeds: dict[str, int], powers: dict[str, dict[str, Any]],
           plot: str | None) -> str:
    rows = build_rows(cells, seeds)
    planned = {i for r in rows for a in r.arms for i in a.planned}
    finished = planned & set(cells)
    said, folk = advice(rows)
    lines = [INTRO]
    lines += ["## Where the study stands", "",
              f"{len(finished)} of {len(planned)} planned cells have run" + (
                  "; every other row below is **pending**, not a result. The runner resumes (`python "
                  "benchmarks/algorithm_study.py`); `--dry-run` lists what is left and its predicted CPU time."
                  if len(finished) < len(planned) else ": the plan is complete.") + (provenance(cells) if cells else ""), ""]
    lines += ["## The answer in brief", ""] + brief(rows)
    lines += ["## The answer" + (" so far" if len(finished) < len(planned) else ""), "",
              "Per factor, level and task: the arm with the best mean held-out success at the end, when the 95% interval "
              "of its difference to the runner-up over seeds excludes zero; otherwise \"not distinguishable\". The cost "
              "ratio is the winner's (or best arm's) CPU seconds over the runner-up's (the cell's process tree, the "
              "shared warm-up excluded, its held-out evaluations included; for `rollout_cost` plus the level's charge "
              "per environment call, and the arms' success read at equal charged cost: its section). The McNemar "
              "column pools the paired held-out rows over seeds (seed k against seed k) and ignores run-to-run "
              "variance, so it is shown, not used for the verdict.", ""]
    lines += summary_table(rows) + [""]
    lines += gain_section(rows)
    lines += ["## Advice, with its evidence", ""]
    judged = [r for r in rows if r.verdict["state"] != "pending"]
    if said:
        lines += said
    elif judged:
        lines += ["No level has a distinguishable winner, or an interval narrow enough to call the arms equal, yet: "
                  "where a verdict exists, the arms did not differ measurably on these tasks and budgets (" + "; ".join(
                      f"{r.task} {r.factor.name} = {r.level.name}: {cells_ref(r.arms)}" for r in judged) + ")."]
    else:
        lines += ["No level has enough finished seeds for a verdict yet (two per arm at least), so this page gives "
                  "no advice yet."]
    hints, seen = [], set()
    for r in rows:
        v, ref = r.verdict, cells_ref(r.arms)
        m = v.get("mcnemar")
        if v["state"] == "pending" or v["distinguishable"] or not m or m["p_value"] >= HINT_P or ref in seen:
            continue
        seen.add(ref)
        lean = v["best"] if m["gained"] > m["lost"] else v["runner_up"]
        hints.append(f"- {r.task}, {r.factor.name} = {r.level.name}: the paired rows lean to {lean} (+{m['gained']}/-{m['lost']} "
                     f"of {m['rows']}, McNemar p={m['p_value']:.2g}) but the seeds do not separate the arms "
                     f"({v['difference']:+.3f}, interval {v['low']:+.3f} to {v['high']:+.3f}). Cells: {ref}.")
    lines += ["", "## Where more seeds are needed", "",
              f"Levels whose pooled paired rows favour one arm (p < {HINT_P}) while the seeds' interval still "
              "crosses zero: the run-to-run spread, not the held-out rows, is what hides the answer, so these "
              "are not results; they are where the study should add seeds first (`--seeds N`).", ""]
    lines += hints if hints else ["None so far."]
    broke = [line for line in folk if "did not hold here" in line]
    lines += ["", "## Where the folklore did not hold here", ""]
    lines += ["Where the expected winner lost measurably, or where the 95% interval rules out the advantage the "
              f"advice implies (one of {DETECT} or more in held-out success) for it:", ""]
    lines += broke if broke else ["Nowhere yet (each check, with its state, is listed below)."]
    lines += ["", "A task on which every arm reaches the same held-out success within the budget (see \"success best\" "
              "in the factor tables: on the calculator nearly every run peaks at 0.69) cannot show an advantage, so "
              "read a check that did not hold together with its table: it says the advantage did not appear at "
              "this scale and budget, not that it cannot."]
    lines += ["", "## The folklore, checked", ""]
    lines += folk + [""]
    lines += ["## How many seeds: the power analysis", "",
              f"The seeds per arm at which a difference of {DETECT} in final held-out success is detected with "
              f"probability {POWER} (two-sided test at {ALPHA}, normal approximation), from two measurements of the "
              "spread over seeds: `fastrl compare`'s reports (one shared start per task, as here; pooled over "
              "algorithms, 3 seeds each, so the estimate is itself uncertain: its relative error is about 50%) and "
              "this study's own finished cells (pooled over every arm with two seeds or more). The plan takes the "
              f"larger need, clamped to {MIN_SEEDS}..{MAX_SEEDS} seeds (the CPU budget), so the seeds grow when the "
              "study measures more spread than it planned for; where the cap binds, the last columns say what the "
              "planned seeds detect instead.", "",
              "| task | sd (compare) | seeds needed | sd (this study) | seeds needed | seeds planned | power at the planned seeds "
              "| difference detected with probability 0.8 | source |",
              "|---|---|---|---|---|---|---|---|---|"]
    for task, p in powers.items():
        own = (f"{p['own_sd']:.3f} ({p['own_cells']} cells) | {p['own_needed']}" if p.get("own_sd") is not None
               else "n/a (no arm with two seeds yet) | n/a")
        lines.append(f"| {task} | {p['sd']:.3f} | {p['needed']} | {own} | {p['planned']} | {p['power']:.2f} | "
                     f"{p['detectable']:.3f} | `{p['source']}` |")
    fresh = spread_fresh_warmup()
    if fresh:
        lines += ["", "For comparison, the spread when every seed also runs its own warm-up (`fastrl train` over seeds, "
                  "150 RL steps: no shared start), which a study of independent `fastrl train` runs would face:", "",
                  "| task | final success per seed | sd | seeds needed for the same test | source |", "|---|---|---|---|---|"]
        for task, f in fresh.items():
            lines.append(f"| {task} | {', '.join(f'{v:.3f}' for v in f['finals'])} | {f['sd']:.3f} | "
                         f"{seeds_needed(DETECT, f['sd'])} | `{f['source']}` |")
    lines += [""]
    if plot:
        lines += ["## Success by level", "", f"![final held-out success by level]({plot})", ""]
    for factor in FACTORS.values():
        mine = [r for r in rows if r.factor is factor]
        lines += [f"## {factor.name}: {factor.question}", "", f"Folklore: {factor.folklore}." + (f" {factor.how}" if factor.how else ""), ""]
        lines += ["| level | condition |", "|---|---|"] + [f"| {lv.name} | {lv.condition} |" for lv in factor.levels] + [""]
        lines += factor_table(mine) + [""]
        if any(r.level.cost_weight is not None for r in mine):
            every = sorted({(r.task, r.arms[0].records[0].get("eval_every")) for r in mine if r.arms and r.arms[0].records})
            lines += ["Read at equal cost (the verdicts above): the cheaper arm's whole run sets the budget, and the other arm "
                      "is read at the steps that budget affords it (`equal_cost`), linearly between the two held-out "
                      "evaluations around them (every " + ", ".join(f"{n} steps on {t}" for t, n in every) +
                      "): a coarse reading where the success changes between evaluations.", ""]
            lines += equal_cost_table([r for r in mine if r.level.cost_weight is not None]) + [""]
    lines += ["## Reproduce", "", "```bash",
              "OMP_NUM_THREADS=1 nice python benchmarks/algorithm_study.py --jobs 1     # resumes; --dry-run for the plan",
              "python benchmarks/render_algorithm_study.py                             # this page",
              "```", ""]
    return "\n".join(lines)


ALGORITHM_ORDER = ("grpo", "dr_grpo", "rloo", "gigpo", "ppo", "grpo_then_ppo")
"""Colour and offset of each algorithm in the plot (the same in every panel)."""


def render_plot(rows: Sequence[Row], path: Path) -> bool:
    """Final held-out success (mean ± std over seeds) per task and level, one colour per
    algorithm, one panel per factor. False (no file) without matplotlib or finished cells."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shown = [r for r in rows if any(a.records for a in r.arms)]
    if not shown:
        return False
    factors = list(dict.fromkeys(r.factor.name for r in shown))
    cols = min(3, len(factors))
    fig, axes = plt.subplots(math.ceil(len(factors) / cols), cols, figsize=(5.5 * cols, 4 * math.ceil(len(factors) / cols)),
                             squeeze=False)
    for ax in axes.flat[len(factors):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, factors):
        labels = []
        for x, r in enumerate(r for r in shown if r.factor.name == name):
            for a in r.arms:
                if not a.records:
                    continue
                k = ALGORITHM_ORDER.index(a.algorithm) if a.algorithm in ALGORITHM_ORDER else len(ALGORITHM_ORDER)
                ax.errorbar([x + 0.08 * (k - 2.5)], [a.mean("success", "final_accuracy")],
                            yerr=[a.sd("success", "final_accuracy") if len(a.records) > 1 else 0.0], fmt="o", capsize=3,
                            color=plt.get_cmap("tab10")(k), label=a.algorithm)
            labels.append(f"{r.task}\n{r.level.name}")
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set(title=name, ylabel="held-out success at the end (mean ± std)")
        ax.grid(alpha=0.3)
        handles, names = ax.get_legend_handles_labels()
        unique = dict(zip(names, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="render docs/choosing.md from the algorithm study's cells")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--page", type=Path, default=PAGE)
    p.add_argument("--plot", type=Path, default=PLOT, help="the PNG (skipped without matplotlib)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per arm (default: the power analysis', as the runner)")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 when --page is not what the cells render (the plot is not compared)")
    a = p.parse_args(argv)
    cells = load_cells(a.results)
    seeds = seeds_by_task(a.seeds, a.results)
    powers = power_table(spread_from_compare(), spread_from_study(a.results))
    rows = build_rows(cells, seeds)
    if a.check:
        expected = render(cells, seeds, powers, a.plot.name if cells and a.plot.exists() else None)
        if a.page.read_text() != expected:
            print(f"{a.page} is not the rendering of {a.results}: run python benchmarks/render_algorithm_study.py",
                  file=sys.stderr)
            return 1
        return 0
    plotted = render_plot(rows, a.plot)
    page = render(cells, seeds, powers, a.plot.name if plotted else None)
    a.page.write_text(page)
    print(f"{a.page}: {sum(1 for r in rows if r.verdict['state'] != 'pending')} of {len(rows)} rows with a verdict"
          + (f"; {a.plot}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
