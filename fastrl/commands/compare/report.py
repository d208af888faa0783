"""The report of finished runs: summaries, verdicts, the table, the plot, ``compare.json`` and
``compare.txt``; and the one line that describes a finished run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fastrl.commands.compare.analysis import (
    ECHO_TRAP_SOLVED,
    ECHO_TRAP_STD_FRACTION,
    ENTROPY_BLOWUP_FACTOR,
    KL_BLOWUP,
    SMOOTHING_STEPS,
)
from fastrl.commands.compare.defaults import HYBRID
from fastrl.commands.compare.options import ComparePlan
from fastrl.commands.compare.plot import plot_runs
from fastrl.commands.compare.summary import format_table, format_value, summarize, verdicts


def describe_run(r: dict[str, Any]) -> str:
    """One finished run in a line: accuracy start -> end (best), steps, RL seconds, tokens, wall
    seconds; or why it failed."""
    if not r.get("success"):
        return f"{r['status']}: {r.get('error')}"
    s, c = r["success"], r["cost"]
    text = (f"accuracy {format_value(s['initial_accuracy'], '.3f')} -> {format_value(s['final_accuracy'], '.3f')} "
            f"(best {format_value(s['best_accuracy'], '.3f')}), {c['steps']} steps, {c['train_seconds']:.0f} s RL, "
            f"{c['generated_tokens']:,.0f} tokens, {r['wall_seconds']:.0f} s wall")
    if r["status"] != "ok":
        text += f"; {r['status']}: {r.get('error')}"
    return text


def build_report(plan: ComparePlan, runs: list[dict[str, Any]], *, start: dict[str, Any], seconds: float,
                 cpu_seconds: float = float("nan"), load_average: list[list[float]] | None = None) -> dict[str, Any]:
    """Summaries, verdicts, table, plot and ``compare.json`` of finished runs."""
    summary = summarize(runs)
    verdict_list = verdicts(summary, budget_kind=plan.budget.kind)
    pass_k = plan.base.pass_k if plan.base.pass_k > 1 else None
    header = (f"fastrl compare: {plan.budget.describe()}; {len(plan.seeds)} seed(s); mean ± std over seeds; "
              f"held-out accuracy on {start['eval_rows']} prompts")
    table = header + "\n" + format_table(summary, verdict_list, pass_k=pass_k)
    plot = plot_runs(runs, plan.output_dir / "compare.png", title=header)
    report = {
        "command": "fastrl compare " + " ".join(plan.argv),
        "algorithms": plan.algorithms,
        "seeds": plan.seeds,
        "budget": {"kind": plan.budget.kind, "amount": plan.budget.amount, "text": plan.budget.text},
        "hybrid_split": plan.hybrid_split if HYBRID in plan.algorithms else None,
        "ppo_group_size": plan.ppo_group_size,
        "eval_every": plan.eval_every,
        "jobs": plan.jobs,
        "train_options": plan.user_fields,
        "start": start,
        "definitions": {
            "seconds": "time of the RL steps (rollout, rewards, log-probs, advantages, update, sync); held-out evaluation excluded",
            "generated_tokens": "completion tokens sampled by the rollouts",
            "trained_tokens": "prompt + completion tokens through the policy's training forward, times ppo_epochs",
            "reward_drop": f"largest fall of the {SMOOTHING_STEPS}-step trailing mean of the batch reward below its earlier peak",
            "kl_blowups": f"steps whose mean per-token KL to the reference exceeds {KL_BLOWUP}",
            "entropy_blowups": f"steps whose mean token entropy exceeds {ENTROPY_BLOWUP_FACTOR}x the first step's",
            "reward_std_collapse_steps": f"steps whose {SMOOTHING_STEPS}-step mean batch reward std is below "
                                         f"{ECHO_TRAP_STD_FRACTION}x its earlier peak while the mean reward is below "
                                         f"{ECHO_TRAP_SOLVED}x the best reward (the Echo Trap warning)",
            "peak_memory_gb": "CUDA max allocated on a GPU; the process's peak RSS on a CPU",
            "distinguishable": "the mean ± std (sample std over seeds) intervals of winner and runner-up do not overlap",
        },
        "runs": runs,
        "summary": summary,
        "verdicts": verdict_list,
        "table": table,
        "plot": str(plot) if plot else None,
        "total_seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "load_average": {"start": load_average[0], "end": load_average[1]} if load_average else None,
    }
    (plan.output_dir / "compare.json").write_text(json.dumps(strict_json(report), indent=1, allow_nan=False))
    (plan.output_dir / "compare.txt").write_text(table + "\n")
    return report


def strict_json(value: Any) -> Any:
    """Plain JSON: NaN (not measured) -> null, +-inf -> "inf"/"-inf", paths -> strings."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return value if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if hasattr(value, "tolist"):
        return strict_json(value.tolist())
    return str(value)
