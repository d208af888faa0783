"""``fastrl compare``: RL algorithms side by side on one model, task and budget.

    fastrl compare --algorithms ppo grpo dr_grpo --seeds 3 --budget 200-steps [train options]

1. start    One starting point shared by every run, built once in this process: the
            training and held-out rows (written as jsonl, so every run sees the same split
            and the same held-out prompts) and, when the configuration has a supervised
            warm-up (the built-in model has one), the warmed-up model. Every run then starts
            from that model with no warm-up of its own: the comparison measures the RL
            algorithms alone, and the warm-up is paid once, not once per run.
2. runs     Every algorithm x seed is ``fastrl train`` (``python -m RUN_MODULE train``) in a fresh process with
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
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from fastrl.agents import metric_names
from fastrl.train.config import AGENT_FIELDS, ALGORITHMS, TrainConfig

__all__ = [
    "HYBRID",
    "COMPARE_ALGORITHMS",
    "Budget",
    "CompareError",
    "parse_budget",
    "check_budget_fits",
    "reward_drop",
    "reward_std_collapse",
    "mean_std",
    "run_metrics",
    "summarize",
    "axis_verdict",
    "verdicts",
    "format_table",
    "run_compare",
]

HYBRID = "grpo_then_ppo"
"""GRPO for a share of the budget, then PPO from its final policy, the critic initialised from it."""
COMPARE_ALGORITHMS: tuple[str, ...] = (*ALGORITHMS, HYBRID)

DEFAULT_ALGORITHMS = ("ppo", "grpo")
DEFAULT_SEEDS = 3
DEFAULT_BUDGET = "40-steps"
"""The default budget: 40 RL steps per run. With the built-in task (16 prompts x 8 samples a
step) PPO and GRPO see the same 5120 samples. Timed end to end at code c54dab1 on the
project's 2-core CPU shared with other sessions (load 2.0 at the start and the end,
``--jobs 1``, torch's default threads): 12.3 min wall, 10.6 min CPU, of which the shared
warm-up took 11.3 min wall and 9.2 min CPU (it ran to 500 SFT steps, probe accuracy 0.48) and
each of the six runs about 10 s wall (2-3 s of RL steps). Not timed on an idle machine."""


@dataclass(frozen=True)
class EnvCompareDefaults:
    """What ``fastrl compare --env NAME`` uses for a built-in environment where the command
    line leaves it out: sized so that ``--algorithms grpo gigpo ppo grpo_then_ppo`` (four
    algorithms, five ``fastrl train`` processes a seed) fits 15 minutes on the project's
    2-core CPU, warm-up included, with the default ``--jobs`` (2 there: two single-threaded
    runs at once). An agent step costs several times a single-turn one, so ``DEFAULT_BUDGET``
    would not fit. Timed end to end at code 17b71b6 on that CPU, otherwise idle:
    sql 13.6 min wall (its warm-up 7.1), frozenlake 11.5, calculator 4.4; at load ~5-10 from
    other sessions (code db8c24e) 37.3, 21.9 and 12.7. The reports are in ``docs/compare.md``."""

    budget: str
    """``--budget`` of every run."""
    seeds: int
    """``--seeds``."""
    evaluations: int
    """Held-out evaluations along the budget after the start's (``--eval_every`` is the budget
    over this, rounded up): each one plays every held-out row, so fewer than the single-turn
    default's six."""
    threads: int = 1
    """``--threads`` of the shared warm-up and of every run (unless given): the built-in
    environments' tiny model gains little from a second intra-op thread, and on a shared CPU
    a second thread waits at every parallel region for a descheduled partner (measured in
    this project at load ~13 on 2 cores: the warm-up's second thread used as much CPU as the
    first, and the warm-up ran several times longer than its single-thread time)."""


ENV_COMPARE_DEFAULTS: dict[str, EnvCompareDefaults] = {
    # per step on an idle core (GRPO, 16 prompts x 8 trajectories): frozenlake ~2 s, calculator ~1 s;
    # sql's warm-up (~280 SFT steps) is most of its time
    "frozenlake": EnvCompareDefaults(budget="16-steps", seeds=3, evaluations=2),
    "calculator": EnvCompareDefaults(budget="24-steps", seeds=3, evaluations=3),
    "sql": EnvCompareDefaults(budget="12-steps", seeds=3, evaluations=2),
}
"""Per built-in environment (keys among ``fastrl.agents.envs.BUILTIN_ENVS``)."""
DEFAULT_EVALUATIONS = 6
"""Held-out evaluations along a steps budget after the start's (``--eval_every`` = budget / this)."""
DEFAULT_JOBS = 1
"""``--jobs`` for runs of a user's model without ``--threads``: one after another. Such a run's
threads are ``fastrl train``'s rule's for its size (the free cores for a model of 0.5M parameters
or more), so two at once would share the cores and each wait at its parallel regions for the
other's threads; not measured to pay off. The built-in model's runs take the rule's one
thread (``fastrl.train.threads``) and go ``cores`` at a time."""
INTERRUPTED_STATUS = 128 + signal.SIGINT
"""Exit status of a comparison stopped by Ctrl-C (the shell's convention for SIGINT)."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""Signals that stop a comparison like Ctrl-C (SIGINT): every live run's process group is killed."""
STEP_CAP = 1_000_000
"""``steps`` of a run whose budget is seconds or tokens (the budget stops it): the cosine
schedule over this many steps keeps the learning rate at its peak for the whole run."""
MIN_SECONDS = 5.0
"""Shortest time budget accepted: every run takes at least one step (the budget is checked
after each step), and a budget under a few seconds cannot hold one step on any machine."""
SMOOTHING_STEPS = 5
"""Window of the trailing moving average of the reward curve before its worst drop is taken
(a single step's batch mean is noisy)."""
KL_BLOWUP = 1.0
"""A step whose mean per-token KL to the reference policy exceeds this (nats) is a KL blow-up."""
ENTROPY_BLOWUP_FACTOR = 2.0
"""A step whose mean token entropy exceeds this multiple of the run's first step is an entropy
blow-up (the policy drifting towards uniform); a collapse shows as a low end/start ratio."""
ECHO_TRAP_STD_FRACTION = 0.2
"""Reward-std collapse (the "Echo Trap" of RAGEN, Wang et al. 2025, arXiv:2504.20073): a step
whose trailing ``SMOOTHING_STEPS``-step mean of the batch reward std is below this fraction of
that curve's earlier peak, while the trailing mean reward is below ``ECHO_TRAP_SOLVED`` of the
best reward seen (a batch that is all solved has no spread either, and that is no trap)."""
ECHO_TRAP_SOLVED = 0.95
"""Share of the best logged reward (``reward/max``) above which a collapsed std counts as solved."""
SAMPLES_METRIC = "rollout/samples"
"""Per step: trajectories (samples) of the rollout."""
STAGES = ("generate", "reward", "old_logp", "ref_logp", "values", "advantages", "update", "sync")
"""Per-stage timers the trainer logs as ``time/<stage>`` (reported disjoint: ``advantages``
without the critic's ``values`` pass, which the trainer times inside it)."""
FORBIDDEN_TRAIN_OPTIONS = {
    "algorithm": "--algorithms",
    "seed": "--seeds",
    "output_dir": "compare's own --output_dir",
    "resume": "nothing (a comparison starts every run fresh)",
    "critic_init": f"the {HYBRID} algorithm (GRPO's final policy initialises the critic)",
    "max_seconds": "--budget (e.g. 10m)",
    "max_generated_tokens": "--budget (e.g. 50k-tokens)",
}
"""Train options a comparison sets itself, with what to use instead."""


class CompareError(ValueError):
    """A mistake in the ``fastrl compare`` command line, found before any run starts."""


# ============================================================================ budget
@dataclass(frozen=True)
class Budget:
    """What every run may spend: RL ``steps``, ``seconds`` of RL steps, or generated ``tokens``."""

    kind: str
    """``steps``, ``seconds`` or ``tokens``."""
    amount: float
    """How many steps, seconds or generated completion tokens."""
    text: str
    """As the user wrote it."""

    def describe(self) -> str:
        if self.kind == "steps":
            return f"{int(self.amount)} RL steps per run"
        if self.kind == "tokens":
            return f"{int(self.amount):,} generated tokens per run"
        return f"{self.amount:g} s of RL steps per run (evaluation not counted)"

    def split(self, fraction: float) -> tuple["Budget", "Budget"]:
        """Two budgets summing to this one: ``fraction`` of it, then the rest (whole steps/tokens)."""
        if self.kind == "seconds":
            first = self.amount * fraction
        else:
            first = float(max(1, min(int(self.amount) - 1, round(self.amount * fraction))))
        return Budget(self.kind, first, self.text), Budget(self.kind, self.amount - first, self.text)

    def train_fields(self, *, steps_cap: int | None) -> dict[str, Any]:
        """The ``TrainConfig`` fields that make a run spend exactly this budget."""
        if self.kind == "steps":
            return {"steps": int(self.amount)}
        cap = steps_cap if steps_cap is not None else STEP_CAP
        if self.kind == "tokens":
            return {"steps": cap, "max_generated_tokens": int(self.amount)}
        return {"steps": cap, "max_seconds": float(self.amount)}


_TIME_UNITS = {"h": 3600.0, "m": 60.0, "min": 60.0, "s": 1.0, "sec": 1.0}
_SIZE_SUFFIX = {"": 1, "k": 1_000, "m": 1_000_000}


def parse_budget(text: str) -> Budget:
    """``200-steps`` | ``50k-tokens`` (also ``1.5M-tokens``, ``50000-tokens``) | ``10m``,
    ``90s``, ``1h30m``, ``2.5min`` -> ``Budget``; anything else is a ``CompareError``."""
    s = str(text).strip().lower()
    m = re.fullmatch(r"(\d+)\s*-?\s*steps?", s)
    if m:
        return Budget("steps", float(int(m.group(1))), text)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([km]?)\s*-?\s*tokens?", s)
    if m:
        amount = float(m.group(1)) * _SIZE_SUFFIX[m.group(2)]
        if amount != int(amount):
            raise CompareError(f"--budget {text!r}: a token budget is a whole number of tokens")
        return Budget("tokens", amount, text)
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*(min|sec|h|m|s)", s)
    if parts and re.fullmatch(r"(?:\d+(?:\.\d+)?\s*(?:min|sec|h|m|s)\s*)+", s):
        return Budget("seconds", sum(float(n) * _TIME_UNITS[u] for n, u in parts), text)
    raise CompareError(
        f"--budget {text!r} is not a budget: write N-steps (200-steps), N-tokens (50k-tokens, 1.5M-tokens) "
        "or a wall time (10m, 90s, 1h30m)"
    )


def tokens_per_step(cfg: TrainConfig) -> int:
    """Most completion tokens one step generates (one sampling round; DAPO may add rounds)."""
    if cfg.prompt_token_budget is not None:
        # the batcher packs (prompt + max_new_tokens) x group_size per prompt up to the budget
        return int(cfg.prompt_token_budget)
    return cfg.prompts_per_step * cfg.group_size * cfg.max_new_tokens


def check_budget_fits(budget: Budget, cfg: TrainConfig | None, *, phases: int = 1) -> None:
    """CompareError when ``budget`` cannot hold one step in each of ``phases`` phases
    (``grpo_then_ppo`` has two); ``cfg`` is a resolved run configuration (needed for a token
    budget only)."""
    per = f" ({phases} phases of {HYBRID} need one step each)" if phases > 1 else ""
    if budget.kind == "steps" and budget.amount < phases:
        raise CompareError(f"--budget {budget.text!r} is too small for one step{per}")
    if budget.kind == "tokens" and cfg is not None:
        one = tokens_per_step(cfg)
        if budget.amount < phases * one:
            raise CompareError(
                f"--budget {budget.text!r} is too small for one step{per}: one step generates up to {one:,} tokens "
                f"(prompts_per_step {cfg.prompts_per_step} x group_size {cfg.group_size} x max_new_tokens "
                f"{cfg.max_new_tokens}); give at least {phases * one:,} tokens"
            )
    if budget.kind == "seconds" and budget.amount < phases * MIN_SECONDS:
        raise CompareError(f"--budget {budget.text!r} is too small for one step{per}: give at least {phases * MIN_SECONDS:g} s")


# ============================================================================ per-run metrics (pure)
def _num(value: Any) -> float:
    """A logged value as a float ("nan"/"inf" strings are how the log writes non-finite numbers)."""
    if value is None:
        return float("nan")
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def cumulative(values: Sequence[float]) -> list[float]:
    out, total = [], 0.0
    for v in values:
        total += v if math.isfinite(v) else 0.0
        out.append(total)
    return out


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` finite values (the first points average fewer)."""
    out = []
    for i in range(len(values)):
        recent = [v for v in values[max(0, i - window + 1) : i + 1] if math.isfinite(v)]
        out.append(sum(recent) / len(recent) if recent else float("nan"))
    return out


def reward_drop(rewards: Sequence[float], *, window: int = SMOOTHING_STEPS) -> float:
    """Worst drop of the reward curve: the largest fall of its trailing ``window``-step moving
    average below the highest value it reached before (0 for a curve that never falls)."""
    peak, worst = -math.inf, 0.0
    for v in moving_average(rewards, window):
        if not math.isfinite(v):
            continue
        peak = max(peak, v)
        worst = max(worst, peak - v)
    return worst


def reward_std_collapse(stds: Sequence[float], means: Sequence[float], best: float, *,
                        window: int = SMOOTHING_STEPS) -> tuple[int, int | None]:
    """Steps in the reward-std collapse (``ECHO_TRAP_STD_FRACTION``) and the index of the first
    (None: never): ``stds``/``means`` are the per-step batch reward std and mean, ``best`` the
    highest reward logged."""
    count, first, peak = 0, None, -math.inf
    for i, (s, m) in enumerate(zip(moving_average(stds, window), moving_average(means, window))):
        if not (math.isfinite(s) and math.isfinite(m)):
            continue
        peak = max(peak, s)
        solved = math.isfinite(best) and m >= ECHO_TRAP_SOLVED * best
        if peak > 0 and s < ECHO_TRAP_STD_FRACTION * peak and not solved:
            count += 1
            first = i if first is None else first
    return count, first


def run_metrics(steps: Sequence[dict[str, Any]], evals: Sequence[dict[str, Any]], *, pass_k: int | None = None,
                group_size: int | None = None) -> dict[str, Any]:
    """Success, stability and cost of one run from its logged step and evaluation records
    (``metrics.jsonl`` lines: step lines, and ``event: eval`` lines with ``eval/*`` keys).

    Curves are indexed by step; ``seconds`` is the cumulative time of the RL steps
    (evaluation excluded) and ``generated_tokens`` the cumulative completion tokens, so an
    evaluation after step k sits at the totals of steps 1..k (step 0: the start).

    Agent runs (``--env``) also cost environment calls (``metric_names.ENV_CALLS``) and tool calls;
    ``group_size`` (the run's trajectories per prompt) turns them into calls per prompt.
    Single-turn runs leave these NaN (not measured).
    """
    steps = sorted(steps, key=lambda r: r["step"])
    step_ids = [int(r["step"]) for r in steps]
    seconds = cumulative([_num(r.get("time/step")) for r in steps])
    generated = cumulative([_num(r.get(metric_names.GENERATED_TOKENS)) for r in steps])
    # the trainer logs the update's throughput: tokens through the training forward x epochs
    trained = cumulative([_num(r.get("throughput/train_tokens_per_s")) * _num(r.get("time/update")) for r in steps])
    rewards = [_num(r.get("reward/mean")) for r in steps]
    kls = [_num(r["kl/ref"]) for r in steps if "kl/ref" in r]
    entropies = [_num(r.get("entropy/mean")) for r in steps if "entropy/mean" in r]

    at = {0: (0.0, 0.0)}
    for s, t, g in zip(step_ids, seconds, generated):
        at[s] = (t, g)
    eval_points = []
    for e in sorted(evals, key=lambda r: r["step"]):
        if "eval/accuracy" not in e:
            continue
        s = int(e["step"])
        t, g = at.get(s, (float("nan"), float("nan")))
        point = {"step": s, "seconds": t, "generated_tokens": g, "accuracy": _num(e["eval/accuracy"])}
        if pass_k and f"eval/pass@{pass_k}" in e:
            point[f"pass@{pass_k}"] = _num(e[f"eval/pass@{pass_k}"])
        eval_points.append(point)
    accuracies = [p["accuracy"] for p in eval_points if math.isfinite(p["accuracy"])]

    non_finite = sum(
        1 for r in steps for k in ("loss/total", "grad_norm", "reward/mean") if k in r and not math.isfinite(_num(r[k]))
    )
    first_entropy = next((e for e in entropies if math.isfinite(e)), float("nan"))
    stage_seconds = {st: sum(_num(r.get(f"time/{st}", 0.0)) for r in steps) for st in STAGES}
    # the trainer times the critic's values inside the advantages stage: keep the stages disjoint
    stage_seconds["advantages"] = max(0.0, stage_seconds["advantages"] - stage_seconds["values"])
    stage_seconds = {k: v for k, v in stage_seconds.items() if v > 0}
    peaks = [_num(r.get("memory/peak_gb")) for r in steps]
    last = rewards[-SMOOTHING_STEPS:]
    agent = any(metric_names.ENV_CALLS in r for r in steps)
    nan = float("nan")
    env_calls = sum(_num(r.get(metric_names.ENV_CALLS, 0.0)) for r in steps) if agent else nan
    trajectories = sum(_num(r.get(SAMPLES_METRIC, 0.0)) for r in steps) if agent else nan
    tool_calls = (sum(_num(r.get(metric_names.TOOL_CALLS_PER_TRAJECTORY, 0.0)) * _num(r.get(SAMPLES_METRIC, 0.0)) for r in steps)
                  if agent else nan)
    prompts = trajectories / group_size if agent and group_size else nan
    tree = any(metric_names.TREE_LEAF_TOKENS in r for r in steps)
    leaf_tokens = sum(_num(r.get(metric_names.TREE_LEAF_TOKENS, 0.0)) for r in steps) if tree else nan
    leaf_env_calls = (sum(_num(r.get(metric_names.TREE_LEAF_ENV_CALLS, 0.0)) for r in steps)
                      if agent and any(metric_names.TREE_LEAF_ENV_CALLS in r for r in steps) else nan)
    best_reward = max((v for v in (_num(r.get("reward/max")) for r in steps) if math.isfinite(v)), default=float("nan"))
    collapse, collapse_at = reward_std_collapse([_num(r.get("reward/std")) for r in steps], rewards, best_reward)
    return {
        "curve": {
            "step": step_ids, "seconds": seconds, "generated_tokens": generated, "trained_tokens": trained,
            "reward": rewards, "reward_std": [_num(r.get("reward/std")) for r in steps],
            "reward_max": [_num(r.get("reward/max")) for r in steps],
            "kl": [_num(r.get("kl/ref")) for r in steps], "entropy": [_num(r.get("entropy/mean")) for r in steps],
        },
        "evals": eval_points,
        "success": {
            "initial_accuracy": accuracies[0] if accuracies else float("nan"),
            "final_accuracy": accuracies[-1] if accuracies else float("nan"),
            "best_accuracy": max(accuracies) if accuracies else float("nan"),
            **({f"final_pass@{pass_k}": eval_points[-1].get(f"pass@{pass_k}", float("nan"))} if pass_k and eval_points else {}),
            "final_reward": sum(last) / len(last) if last else float("nan"),
        },
        "stability": {
            "reward_drop": reward_drop(rewards),
            "kl_max": max(kls) if kls and all(math.isfinite(k) for k in kls) else (float("inf") if kls else float("nan")),
            "kl_blowups": sum(1 for k in kls if not (k <= KL_BLOWUP)),
            "entropy_end_over_start": (entropies[-1] / first_entropy) if entropies and first_entropy > 0 else float("nan"),
            "entropy_blowups": sum(1 for e in entropies if not (e <= ENTROPY_BLOWUP_FACTOR * first_entropy)) if entropies else 0,
            "non_finite_steps": non_finite,
            "reward_std_collapse_steps": collapse,
            "reward_std_collapse_step": step_ids[collapse_at] if collapse_at is not None else None,
        },
        "cost": {
            "steps": len(steps),
            "train_seconds": seconds[-1] if seconds else 0.0,
            "eval_seconds": sum(_num(e.get("time/eval", 0.0)) for e in evals),
            "generated_tokens": generated[-1] if generated else 0.0,
            "trained_tokens": trained[-1] if trained else 0.0,
            "peak_memory_gb": max((p for p in peaks if math.isfinite(p)), default=float("nan")),
            "stage_seconds": stage_seconds,
            "env_calls": env_calls,
            "tool_calls": tool_calls,
            "trajectories": trajectories,
            "prompts": prompts,
            "env_calls_per_prompt": env_calls / prompts if prompts and math.isfinite(prompts) else nan,
            "leaf_tokens": leaf_tokens,
            "leaf_env_calls": leaf_env_calls,
        },
    }


def chain_phases(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """One run's metrics from two consecutive phases (``grpo_then_ppo``): the second phase's
    steps, seconds and tokens continue the first's; its start evaluation (the first phase's
    final model again) is dropped."""
    c1, c2 = first["curve"], second["curve"]
    n = c1["step"][-1] if c1["step"] else 0
    t0 = c1["seconds"][-1] if c1["seconds"] else 0.0
    g0 = c1["generated_tokens"][-1] if c1["generated_tokens"] else 0.0
    tr0 = c1["trained_tokens"][-1] if c1["trained_tokens"] else 0.0
    curve = {
        "step": c1["step"] + [s + n for s in c2["step"]],
        "seconds": c1["seconds"] + [t + t0 for t in c2["seconds"]],
        "generated_tokens": c1["generated_tokens"] + [g + g0 for g in c2["generated_tokens"]],
        "trained_tokens": c1["trained_tokens"] + [g + tr0 for g in c2["trained_tokens"]],
        "reward": c1["reward"] + c2["reward"],
        "reward_std": c1["reward_std"] + c2["reward_std"],
        "reward_max": c1["reward_max"] + c2["reward_max"],
        "kl": c1["kl"] + c2["kl"],
        "entropy": c1["entropy"] + c2["entropy"],
    }
    evals = list(first["evals"]) + [
        {**e, "step": e["step"] + n, "seconds": e["seconds"] + t0, "generated_tokens": e["generated_tokens"] + g0}
        for e in second["evals"] if e["step"] > 0
    ]
    accuracies = [e["accuracy"] for e in evals if math.isfinite(e["accuracy"])]
    success = {**second["success"], "initial_accuracy": first["success"]["initial_accuracy"]}
    success["best_accuracy"] = max(accuracies) if accuracies else float("nan")
    if accuracies:
        success["final_accuracy"] = accuracies[-1]
    kls = [k for k in curve["kl"] if math.isfinite(k)]
    entropies = [e for e in curve["entropy"] if math.isfinite(e)]
    s1, s2 = first["stability"], second["stability"]
    stability = {
        "reward_drop": reward_drop(curve["reward"]),
        "kl_max": max(kls) if kls else float("nan"),
        "kl_blowups": s1["kl_blowups"] + s2["kl_blowups"],
        "entropy_end_over_start": entropies[-1] / entropies[0] if entropies and entropies[0] > 0 else float("nan"),
        # the second phase's blow-ups measured against the first phase's starting entropy
        "entropy_blowups": sum(1 for e in curve["entropy"] if entropies and not (e <= ENTROPY_BLOWUP_FACTOR * entropies[0])),
        "non_finite_steps": s1["non_finite_steps"] + s2["non_finite_steps"],
    }
    best = max((v for v in curve["reward_max"] if math.isfinite(v)), default=float("nan"))
    collapse, collapse_at = reward_std_collapse(curve["reward_std"], curve["reward"], best)
    stability.update(reward_std_collapse_steps=collapse,
                     reward_std_collapse_step=curve["step"][collapse_at] if collapse_at is not None else None)
    k1, k2 = first["cost"], second["cost"]
    stages = dict(k1["stage_seconds"])
    for k, v in k2["stage_seconds"].items():
        stages[k] = stages.get(k, 0.0) + v
    cost = {
        "steps": k1["steps"] + k2["steps"],
        "train_seconds": k1["train_seconds"] + k2["train_seconds"],
        "eval_seconds": k1["eval_seconds"] + k2["eval_seconds"],
        "generated_tokens": k1["generated_tokens"] + k2["generated_tokens"],
        "trained_tokens": k1["trained_tokens"] + k2["trained_tokens"],
        "peak_memory_gb": max(k1["peak_memory_gb"], k2["peak_memory_gb"]),
        "stage_seconds": stages,
    }
    for key in ("env_calls", "tool_calls", "trajectories", "prompts", "leaf_tokens", "leaf_env_calls"):
        cost[key] = _num(k1.get(key)) + _num(k2.get(key))
    cost["env_calls_per_prompt"] = cost["env_calls"] / cost["prompts"] if cost["prompts"] > 0 else float("nan")
    return {"curve": curve, "evals": evals, "success": success, "stability": stability, "cost": cost}


# ============================================================================ across seeds (pure)
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
        return _num(run.get("wall_seconds"))
    section = run.get(metric.axis, {})
    if metric.key == "final_pass@k":
        found = [v for k, v in section.items() if k.startswith("final_pass@")]
        return _num(found[0]) if found else float("nan")
    return _num(section.get(metric.key))


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


def _fmt(value: float, fmt: str) -> str:
    if value is None or not math.isfinite(value):
        return "n/a" if value is None or math.isnan(value) else str(value)
    return format(value, fmt)


def _pm(mean: float, std: float, n: int, fmt: str) -> str:
    """``mean ± std`` (``mean`` alone for one value, ``n/a`` when not measured)."""
    if mean is None or math.isnan(mean):
        return "n/a"
    return f"{_fmt(mean, fmt)} ± {_fmt(std, fmt)}" if n > 1 else _fmt(mean, fmt)


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
        return f"{_fmt(m, fmt)} ± {_fmt(s, fmt)}" if n > 1 else f"{_fmt(m, fmt)} (1 seed)"

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
        by = f"{'+' if diff > 0 else ''}{_fmt(diff, fmt)}"
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
    spread = ", ".join(f"{a} {_fmt(e['final_accuracy']['std'], '.3f')}" for a, e in summary.items())
    note = f"seed spread of the final accuracy (std): {spread}; " + ("; ".join(trouble) if trouble else "no NaN stops, blow-ups or reward-std collapse")
    out.append(axis_verdict("stability", "worst drop of the reward curve", vals("reward_drop"), higher_is_better=False, note=note))
    if budget_kind == "seconds":
        out.append(axis_verdict("cost", "generated tokens in the same RL seconds", vals("generated_tokens"),
                                higher_is_better=True, fmt=".0f"))
    else:
        out.append(axis_verdict("cost", "RL seconds for the budget", vals("train_seconds"), higher_is_better=False, fmt=".1f"))
    if any(math.isfinite(v) for e in summary.values() for v in e["env_calls"]["values"]):
        # agent runs: what the environment is asked for, the cost GRPO's G trajectories per prompt multiply
        per_prompt = ", ".join(f"{a} {_fmt(e['env_calls_per_prompt']['mean'], '.1f')}" for a, e in summary.items())
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
                         + "".join(f"{_fmt(summary[a]['final_accuracy_range'], '.3f'):>{col_w}}" for a in algos))
            lines.append(f"  {'NaN stops / failed runs':<{label_w - 2}}"
                         + "".join(f"{str(summary[a]['nan_stops']) + ' / ' + str(summary[a]['failed']):>{col_w}}" for a in algos))
    stages = [st for st in STAGES if any(st in summary[a]["stage_seconds"] for a in algos)]
    if stages:
        lines.append("-- seconds per stage (mean over seeds)")
        for st in stages:
            lines.append(f"  {st:<{label_w - 2}}" + "".join(f"{_fmt(summary[a]['stage_seconds'].get(st, 0.0), '.1f'):>{col_w}}" for a in algos))
    lines.append("")
    lines.extend(v["text"] for v in verdict_list)
    return "\n".join(lines)


# ============================================================================ plot
def plot_runs(runs: Sequence[dict[str, Any]], path: Path, *, title: str) -> Path | None:
    """``compare.png``: held-out accuracy over RL seconds and over generated tokens, the
    smoothed reward over tokens, entropy and KL over steps, seconds per stage. One colour per
    algorithm, one line per seed. None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    algos = list(dict.fromkeys(r["algorithm"] for r in runs))
    colors = {a: plt.get_cmap("tab10")(i % 10) for i, a in enumerate(algos)}
    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    (acc_t, acc_g, rew), (ent, kl, stages) = axes
    labelled: set[tuple[int, str]] = set()

    def line(ax, x, y, algo, **kw):
        key = (id(ax), algo)
        ax.plot(x, y, color=colors[algo], alpha=0.8, label=None if key in labelled else algo, **kw)
        labelled.add(key)

    for r in runs:
        if not r.get("success"):
            continue
        a = r["algorithm"]
        ev, c = r["evals"], r["curve"]
        line(acc_t, [e["seconds"] for e in ev], [e["accuracy"] for e in ev], a, marker="o", ms=3)
        line(acc_g, [e["generated_tokens"] for e in ev], [e["accuracy"] for e in ev], a, marker="o", ms=3)
        line(rew, c["generated_tokens"], moving_average(c["reward"], SMOOTHING_STEPS), a)
        line(ent, c["step"], c["entropy"], a)
        if any(math.isfinite(k) for k in c["kl"]):
            line(kl, c["step"], c["kl"], a)
    acc_t.set(xlabel="RL seconds (evaluation excluded)", ylabel="held-out accuracy", title="success over wall time")
    acc_g.set(xlabel="generated tokens", ylabel="held-out accuracy", title="success over tokens")
    rew.set(xlabel="generated tokens", ylabel=f"train reward ({SMOOTHING_STEPS}-step mean)", title="reward curve")
    ent.set(xlabel="step", ylabel="mean token entropy", title="entropy")
    kl.set(xlabel="step", ylabel="KL to reference (per token)", title="KL (runs with a reference)")
    summary = summarize(runs)
    names = [st for st in STAGES if any(st in summary[a]["stage_seconds"] for a in algos)]
    bottom = [0.0] * len(algos)
    for i, st in enumerate(names):
        heights = [summary[a]["stage_seconds"].get(st, 0.0) for a in algos]
        stages.bar(algos, heights, bottom=bottom, label=st, color=plt.get_cmap("tab20")(i % 20))
        bottom = [b + h for b, h in zip(bottom, heights)]
    stages.set(ylabel="seconds (mean over seeds)", title="cost per stage")
    for ax in (acc_t, acc_g, rew, ent, kl, stages):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ============================================================================ planning (validation before any run)
def ppo_fields(of: TrainConfig, group_size: int) -> dict[str, Any]:
    """The fields that give a PPO run ``group_size`` samples per prompt and as many samples per
    step as ``of`` (the resolved run configuration without them): ``prompts_per_step`` scaled
    by ``of.group_size / group_size`` (a ``prompt_token_budget`` batcher already packs by
    samples). CompareError when the group sizes do not divide."""
    fields: dict[str, Any] = {"group_size": group_size}
    if of.prompt_token_budget is None:
        samples = of.prompts_per_step * of.group_size
        if samples % group_size:
            raise CompareError(f"--ppo_group_size {group_size} does not divide the {samples} samples a step "
                               f"(prompts_per_step {of.prompts_per_step} x group_size {of.group_size})")
        fields["prompts_per_step"] = samples // group_size
    return fields


@dataclass
class ComparePlan:
    algorithms: list[str]
    seeds: list[int]
    budget: Budget
    output_dir: Path
    user_fields: dict[str, Any]
    """TrainConfig fields the user set (values that differ from the defaults)."""
    base: TrainConfig
    """The user's options resolved for the first algorithm: the values every run gets spelled out."""
    warmup: bool
    """The configuration has a supervised warm-up: run it once, start every run from its model."""
    hybrid_split: float
    ppo_group_size: int | None
    """Trajectories per prompt of PPO runs (and the PPO phase of ``grpo_then_ppo``); None: the
    runs' ``group_size``. PPO needs no group: with fewer per prompt it gets proportionally more
    prompts per step (``ppo_fields``), so every algorithm samples as many trajectories a step."""
    ppo_overrides: dict[str, Any]
    """The ``TrainConfig`` fields ``ppo_group_size`` sets on PPO runs (empty without it)."""
    warmup_seed: int
    steps_cap: int | None
    eval_every: int
    overwrite: bool
    argv: list[str]
    jobs: int = DEFAULT_JOBS
    """Runs at once (``--jobs``); results do not depend on it."""


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_jobs(*, threads: int | None, cores: int) -> int:
    """``--jobs`` when not given: ``cores // threads`` for runs of a fixed thread count (a
    built-in ``--env``: ``--threads`` 1 unless given), at least 1; ``DEFAULT_JOBS`` for runs
    whose threads are torch's default (``threads`` None)."""
    if threads is None or threads < 1:
        return DEFAULT_JOBS
    return max(1, cores // threads)


def build_compare_parser() -> argparse.ArgumentParser:
    from fastrl.cli_style import ArgumentParser

    parser = ArgumentParser(
        prog="fastrl compare",
        allow_abbrev=False,  # `--seed` must not abbreviate `--seeds`: unknown options go to `fastrl train`
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run RL algorithms side by side on one model, task and budget (a fresh `fastrl train` process per\n"
                    "algorithm x seed) and report success, stability and cost with a verdict per axis.\n"
                    "Any other option is a `fastrl train` option (fastrl train --help) given to every run.",
        epilog=f"algorithms: {', '.join(COMPARE_ALGORITHMS)}\n"
               f"  {HYBRID}: GRPO for --hybrid_split of the budget, then PPO from its final policy (critic initialised from it)\n"
               "budgets: N-steps (200-steps), generated tokens (50k-tokens, 1.5M-tokens), wall time of the RL steps\n"
               "  (10m, 90s, 1h30m; evaluation not counted)\n"
               "outputs (under --output_dir): compare.json, compare.png, compare.txt, runs/<algorithm>-seed<k>/ (each run's\n"
               "  metrics.jsonl, config.yaml, train.log), start/ (the shared rows and warmed-up model)\n"
               "example:\n  fastrl compare --algorithms ppo grpo dr_grpo --seeds 3 --budget 5m --prompts_per_step 8",
    )
    parser.add_argument("--algorithms", nargs="+", default=list(DEFAULT_ALGORITHMS), metavar="NAME",
                        help=f"algorithms to compare (default: {' '.join(DEFAULT_ALGORITHMS)})")
    env_seeds = ", ".join(f"--env {n}: {d.seeds}" for n, d in ENV_COMPARE_DEFAULTS.items())
    env_budgets = ", ".join(f"--env {n}: {d.budget}" for n, d in ENV_COMPARE_DEFAULTS.items())
    parser.add_argument("--seeds", type=int, default=None, metavar="N",
                        help=f"seeds per algorithm: 0..N-1 (default {DEFAULT_SEEDS}; {env_seeds})")
    parser.add_argument("--budget", default=None,
                        help=f"per run: N-steps, N-tokens or a wall time (default {DEFAULT_BUDGET}; {env_budgets}: "
                             "sized so four algorithms x 3 seeds fit 15 min on a 2-core CPU; a built-in --env also "
                             "defaults --threads to 1)")
    parser.add_argument("--output_dir", default="runs/compare", help="where runs and the report go (default runs/compare)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier comparison in --output_dir")
    parser.add_argument("--hybrid_split", type=float, default=0.5,
                        help=f"share of the budget {HYBRID} spends on GRPO before PPO (default 0.5)")
    parser.add_argument("--ppo_group_size", type=int, default=None, metavar="K",
                        help="samples (trajectories) per prompt of PPO and of the PPO phase of grpo_then_ppo, with "
                             "prompts_per_step scaled by group_size / K so each step samples as many as the others "
                             "(1: one trajectory per prompt; with --env, GRPO then pays group_size trajectories' "
                             "environment calls per prompt and PPO one). Default: the runs' group_size")
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="runs at once after the shared warm-up, each a `fastrl train` process of its own (a "
                             f"{HYBRID} run's PPO phase still waits for its GRPO phase). Runs are seeded, so results "
                             "do not depend on N. Default: the cores this process may use divided by --threads, which is 1 "
                             "with a built-in --env and on the built-in model (fastrl train's thread rule); 1 for a user's "
                             "model without --threads, whose runs take the free cores and would contend for them")
    parser.add_argument("--warmup_seed", type=int, default=1,
                        help="seed of the shared warm-up (model init and SFT data order; default 1, which reaches the built-in "
                             "task's probe target in fewer SFT steps than seed 0)")
    return parser


def _explicit_train_options(argv: Sequence[str]) -> set[str]:
    names = set()
    for token in argv:
        if token.startswith("--"):
            names.add(token[2:].split("=", 1)[0].replace("-", "_"))
    return names


def plan_compare(argv: Sequence[str]) -> ComparePlan:
    """Parse and check everything before any run: unknown algorithms, a budget that does not
    parse or cannot hold one step, seeds < 1, train options that do not parse or that a
    comparison sets itself, and every algorithm's resolved configuration."""
    from fastrl.train.cli import build_train_parser, expand_sampler_url

    parser = build_compare_parser()
    args, rest = parser.parse_known_args(list(argv))
    rest = expand_sampler_url(rest)  # --sampler vllm-server URL
    unknown = [a for a in args.algorithms if a not in COMPARE_ALGORITHMS]
    if unknown:
        raise CompareError(f"--algorithms: unknown algorithm(s) {', '.join(map(repr, unknown))}; "
                           f"choose from {', '.join(COMPARE_ALGORITHMS)}")
    if len(set(args.algorithms)) != len(args.algorithms):
        raise CompareError(f"--algorithms: {args.algorithms} names an algorithm twice")
    if args.seeds is not None and args.seeds < 1:
        raise CompareError(f"--seeds must be >= 1, got {args.seeds}")
    if not 0.0 < args.hybrid_split < 1.0:
        raise CompareError(f"--hybrid_split must be in (0, 1), got {args.hybrid_split}")
    ppo_runs = "ppo" in args.algorithms or HYBRID in args.algorithms
    if args.ppo_group_size is not None and (args.ppo_group_size < 1 or not ppo_runs):
        raise CompareError(f"--ppo_group_size must be >= 1 and needs ppo or {HYBRID} in --algorithms, "
                           f"got {args.ppo_group_size} with {' '.join(args.algorithms)}")
    explicit = _explicit_train_options(rest)
    for name, instead in FORBIDDEN_TRAIN_OPTIONS.items():
        if name in explicit:
            raise CompareError(f"--{name} is set by the comparison itself; use {instead}")

    train_parser = build_train_parser()
    try:
        ns = train_parser.parse_args(list(rest))
    except SystemExit as e:  # jsonargparse printed what is wrong
        raise CompareError(f"the train options {' '.join(rest)!r} do not parse (see above)") from e
    defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())  # type: ignore[misc]
                for f in dataclasses.fields(TrainConfig)}
    user_fields = {f.name: getattr(ns, f.name) for f in dataclasses.fields(TrainConfig)
                   if getattr(ns, f.name) != defaults[f.name]}
    for name in FORBIDDEN_TRAIN_OPTIONS:  # also from a --config YAML file
        if name in user_fields:
            raise CompareError(f"{name} (set in the --config file) is set by the comparison itself; "
                               f"use {FORBIDDEN_TRAIN_OPTIONS[name]}")
    env_defaults = ENV_COMPARE_DEFAULTS.get(user_fields.get("env"))  # a built-in environment's sizes
    budget = parse_budget(args.budget if args.budget is not None
                          else env_defaults.budget if env_defaults is not None else DEFAULT_BUDGET)
    seeds = args.seeds if args.seeds is not None else env_defaults.seeds if env_defaults is not None else DEFAULT_SEEDS
    if budget.kind == "steps" and "steps" in explicit:
        raise CompareError(f"--steps and --budget {budget.text!r} both set the number of steps; give one")
    if env_defaults is not None and "threads" not in user_fields:
        user_fields["threads"] = env_defaults.threads
    elif "threads" not in user_fields and "model" not in user_fields:
        # the built-in model: fastrl train's thread rule (one thread for a model this small), so runs go side by side
        from fastrl.train.threads import builtin_model_parameters, machine_threads

        sizes = {k: user_fields[k] for k in ("model_hidden_size", "model_layers") if k in user_fields}
        user_fields["threads"] = machine_threads(parameters=builtin_model_parameters(**sizes)).threads
    if args.jobs is not None and args.jobs < 1:
        raise CompareError(f"--jobs must be >= 1, got {args.jobs}")
    jobs = args.jobs if args.jobs is not None else default_jobs(threads=user_fields.get("threads"), cores=available_cores())

    def resolve(algorithm: str, overrides: dict[str, Any] | None = None) -> TrainConfig:
        try:
            return TrainConfig(**{**defaults, **user_fields, "algorithm": algorithm,
                                  **budget.train_fields(steps_cap=user_fields.get("steps")), **(overrides or {})}).resolved()
        except ValueError as e:
            raise CompareError(f"{algorithm}: {e}") from None

    ppo_overrides = ppo_fields(resolve("ppo"), args.ppo_group_size) if args.ppo_group_size is not None else {}

    if budget.kind != "tokens":  # needs no configuration: checked before any other option
        check_budget_fits(budget, None, phases=2 if HYBRID in args.algorithms else 1)
    resolved = {}
    for algo in args.algorithms:
        for phase in (("grpo", "ppo") if algo == HYBRID else (algo,)):
            resolved[phase] = resolve(phase, ppo_overrides if phase == "ppo" else None)
            check_budget_fits(budget, resolved[phase], phases=2 if algo == HYBRID else 1)
    base = resolve(args.algorithms[0] if args.algorithms[0] != HYBRID else "grpo")
    eval_every = user_fields.get("eval_every", None)
    if eval_every is None:
        # about six evaluations along a steps budget (a built-in environment: its own count); every 10 steps otherwise
        evaluations = env_defaults.evaluations if env_defaults is not None else DEFAULT_EVALUATIONS
        eval_every = max(1, math.ceil(budget.amount / evaluations)) if budget.kind == "steps" else 10
    if eval_every == 0:
        raise CompareError("--eval_every 0 turns held-out evaluation off, and success is measured by it")
    return ComparePlan(
        algorithms=list(args.algorithms), seeds=list(range(seeds)), budget=budget, output_dir=Path(args.output_dir),
        user_fields=user_fields, base=base, warmup=base.sft_steps > 0, hybrid_split=args.hybrid_split,
        ppo_group_size=args.ppo_group_size, ppo_overrides=ppo_overrides, warmup_seed=args.warmup_seed,
        steps_cap=user_fields.get("steps"), eval_every=eval_every, overwrite=args.overwrite, argv=list(argv), jobs=jobs,
    )


# ============================================================================ the shared start
def _jsonable_row(row: dict[str, Any]) -> dict[str, Any]:
    def conv(v):
        if hasattr(v, "tolist"):
            return v.tolist()
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        return v

    return {k: conv(v) for k, v in row.items()}


def prepare_start(plan: ComparePlan) -> dict[str, Any]:
    """Build the starting point every run shares, in this process: the training and held-out
    rows as jsonl and, with a warm-up or the built-in model, the starting model directory.

    Returns the ``TrainConfig`` fields each run gets for it (``model``, ``tokenizer``,
    ``dataset``, ``eval_dataset``, no warm-up) and a description for the report."""
    from fastrl.train.trainer import Trainer

    start = plan.output_dir / "start"
    warmup_seed = plan.warmup_seed
    first = plan.algorithms[0] if plan.algorithms[0] != HYBRID else "grpo"  # a configuration already checked
    fields = {**plan.user_fields, "algorithm": first, "seed": warmup_seed, "output_dir": str(start / "trainer"),
              "steps": 1, "progress": False, "tensorboard": False, "overwrite": True}
    t0, cpu0 = time.perf_counter(), _self_cpu_seconds()
    with Trainer(TrainConfig(**fields)) as trainer:
        model_dir = None
        if trainer.builtin or trainer.warmup.metrics:
            model_dir = start / "model"
            trainer.policy.save_pretrained(model_dir, safe_serialization=True)
            trainer.tokenizer.save_pretrained(model_dir)
        for name, rows in (("train.jsonl", trainer.train_rows), ("eval.jsonl", trainer.eval_rows)):
            with open(start / name, "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(_jsonable_row(row)) + "\n")
        info = {"seconds": time.perf_counter() - t0, "cpu_seconds": _self_cpu_seconds() - cpu0,
                "warmup_seed": warmup_seed, "sft": dict(trainer.warmup.metrics),
                "model": str(model_dir) if model_dir else plan.base.model, "train_rows": len(trainer.train_rows),
                "eval_rows": len(trainer.eval_rows)}
    if not info["eval_rows"]:
        raise CompareError("the configuration has no held-out rows: success is measured on them (give --eval_dataset)")
    shutil.rmtree(start / "trainer", ignore_errors=True)
    run_fields: dict[str, Any] = {"dataset": str(start / "train.jsonl"), "eval_dataset": str(start / "eval.jsonl"),
                                  "sft_steps": 0, "sft_target_accuracy": None}
    if model_dir is not None:
        run_fields.update(model=str(model_dir), tokenizer=str(model_dir))
    # defaults that depend on the built-in model/task (or environment), spelled out now that runs name a model
    spelled = ("max_new_tokens", "lr", "eval_prompts")
    if plan.base.env is not None:
        # an environment's defaults for the built-in model: its tool-call format and its trajectory limits
        spelled += ("env_call_format", *AGENT_FIELDS)
    for name in spelled:
        run_fields[name] = getattr(plan.base, name)
    (start / "start.json").write_text(json.dumps(info, indent=1))
    return {"fields": run_fields, "info": info}


# ============================================================================ runs
def _train_env() -> dict[str, str]:
    """The environment of a run: this fastrl first on the path (not another install)."""
    import fastrl

    root = str(Path(fastrl.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def read_metrics_jsonl(path: Path) -> tuple[list[dict], list[dict]]:
    """A run's ``metrics.jsonl`` as (step records, ``event: eval`` records); a missing file is empty
    and a torn line (a run killed mid-write) is skipped."""
    steps, evals = [], []
    if not path.exists():
        return steps, evals
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        (evals if rec.get("event") == "eval" else steps).append(rec)
    return steps, evals


class RunsStopped(RuntimeError):
    """A run was not started because the comparison is stopping (Ctrl-C, a signal, a failure)."""


class RunProcesses:
    """The live ``fastrl train`` processes of a comparison, started from any thread.

    Each run leads a new session and process group (so a terminal's Ctrl-C reaches only the
    comparison, which then stops every run itself) and is told by the kernel to end with its
    parent (``RUN_MODULE``'s parent-death signal, Linux): a comparison killed with SIGKILL
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


RUN_MODULE = "fastrl.train.compare"
"""What each run executes (``python -m RUN_MODULE train ...``): ``fastrl train`` after asking the
kernel for SIGTERM when the comparison's thread that started it ends."""
PARENT_PID_ENV = "FASTRL_COMPARE_PID"
"""Environment variable giving a run its comparison's process id: a run whose parent is already
another process (the comparison ended while it started) exits at once."""


def _run_phase(directory: Path, fields: dict[str, Any], processes: RunProcesses) -> dict[str, Any]:
    """One ``fastrl train`` process; its return code, wall seconds, and measured metrics."""
    import yaml

    directory.mkdir(parents=True, exist_ok=True)
    args_file = directory / "train_args.yaml"
    args_file.write_text(yaml.safe_dump(fields, sort_keys=False))
    cmd = [sys.executable, "-m", RUN_MODULE, "train", "--config", str(args_file)]
    t0 = time.perf_counter()
    with open(directory / "train.log", "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        returncode = processes.run(cmd, log=log, env={**_train_env(), PARENT_PID_ENV: str(os.getpid())})
    wall = time.perf_counter() - t0
    log_text = (directory / "train.log").read_text(errors="replace")
    steps, evals = read_metrics_jsonl(directory / "metrics.jsonl")
    summary_file = directory / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    if returncode == 0:
        status, error = "ok", None
    else:
        diverged = returncode == 3 and "non-finite" in log_text
        status = "diverged" if diverged else "failed"
        tail = [line for line in log_text.splitlines() if line.strip()][-3:]
        error = f"exit status {returncode}: " + " | ".join(tail)
    pass_k = int(fields.get("pass_k", TrainConfig.pass_k))
    config_file = directory / "config.yaml"  # the run's resolved options (an environment's defaults included)
    resolved = yaml.safe_load(config_file.read_text()) if config_file.exists() else {}
    group_size = int(resolved.get("group_size") or fields.get("group_size", TrainConfig.group_size))
    metrics = (run_metrics(steps, evals, pass_k=pass_k if pass_k > 1 else None, group_size=group_size)
               if (steps or evals) else None)
    return {"returncode": returncode, "status": status, "error": error, "wall_seconds": wall,
            "stopped_by": summary.get("stopped_by"), "metrics": metrics, "final_model": summary.get("final_model"),
            "dir": str(directory)}


def run_fields_for(plan: ComparePlan, start_fields: dict[str, Any], algorithm: str, seed: int, directory: Path,
                   budget: Budget) -> dict[str, Any]:
    """The complete option set of one run (what goes into its ``train_args.yaml``)."""
    return {
        **plan.user_fields, **start_fields, "algorithm": algorithm, "seed": seed, "output_dir": str(directory),
        "eval_every": plan.eval_every, "progress": False, "tensorboard": plan.user_fields.get("tensorboard", False),
        **budget.train_fields(steps_cap=plan.steps_cap), **(plan.ppo_overrides if algorithm == "ppo" else {}),
    }


def run_one(plan: ComparePlan, start_fields: dict[str, Any], algorithm: str, seed: int,
            processes: RunProcesses) -> dict[str, Any]:
    """One algorithm x seed (two processes for ``grpo_then_ppo``); the run's record for the report."""
    directory = plan.output_dir / "runs" / f"{algorithm}-seed{seed}"
    record: dict[str, Any] = {"algorithm": algorithm, "seed": seed, "dir": str(directory)}
    if algorithm != HYBRID:
        phases = [_run_phase(directory, run_fields_for(plan, start_fields, algorithm, seed, directory, plan.budget),
                             processes)]
        metrics = phases[0]["metrics"]
    else:
        first_budget, second_budget = plan.budget.split(plan.hybrid_split)
        grpo = _run_phase(directory / "grpo", run_fields_for(plan, start_fields, "grpo", seed, directory / "grpo", first_budget),
                          processes)
        phases = [grpo]
        metrics = grpo["metrics"]
        if grpo["status"] == "ok" and grpo["final_model"]:
            # PPO continues from GRPO's final policy; the critic's body starts from the same weights
            fields = {**start_fields, "model": grpo["final_model"], "tokenizer": grpo["final_model"]}
            ppo_fields = run_fields_for(plan, fields, "ppo", seed + 1000, directory / "ppo", second_budget)
            ppo_fields["critic_init"] = grpo["final_model"]
            ppo = _run_phase(directory / "ppo", ppo_fields, processes)
            phases.append(ppo)
            if ppo["metrics"] is not None and metrics is not None:
                metrics = chain_phases(metrics, ppo["metrics"])
    bad = [p for p in phases if p["status"] != "ok"]
    record.update(
        status=bad[0]["status"] if bad else "ok",
        error=bad[0]["error"] if bad else None,
        returncode=bad[0]["returncode"] if bad else 0,
        wall_seconds=sum(p["wall_seconds"] for p in phases),
        stopped_by=phases[-1]["stopped_by"],
        phases=[{k: p[k] for k in ("dir", "status", "returncode", "wall_seconds", "stopped_by")} for p in phases],
    )
    if metrics is not None:
        record.update(metrics)
    return record


# ============================================================================ the command
def _describe_run(r: dict[str, Any]) -> str:
    if not r.get("success"):
        return f"{r['status']}: {r.get('error')}"
    s, c = r["success"], r["cost"]
    text = (f"accuracy {_fmt(s['initial_accuracy'], '.3f')} -> {_fmt(s['final_accuracy'], '.3f')} "
            f"(best {_fmt(s['best_accuracy'], '.3f')}), {c['steps']} steps, {c['train_seconds']:.0f} s RL, "
            f"{c['generated_tokens']:,.0f} tokens, {r['wall_seconds']:.0f} s wall")
    if r["status"] != "ok":
        text += f"; {r['status']}: {r.get('error')}"
    return text


def _claim_output_dir(plan: ComparePlan) -> None:
    out = plan.output_dir
    previous = [out / n for n in ("compare.json", "compare.png", "compare.txt", "runs", "start") if (out / n).exists()]
    if previous and not plan.overwrite:
        raise CompareError(f"--output_dir {str(out)!r} already holds a comparison ({', '.join(p.name for p in previous)}): "
                           "pass --overwrite to replace it, or choose another --output_dir")
    for p in previous:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    (out / "start").mkdir(parents=True, exist_ok=True)


def run_compare(argv: Sequence[str]) -> int:
    """``fastrl compare``: plan (every check), the shared start, every run, the report."""
    try:
        plan = plan_compare(argv)
        _claim_output_dir(plan)
    except CompareError as e:
        print(f"fastrl compare: error: {e}", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    n_runs = len(plan.algorithms) * len(plan.seeds)
    print(f"fastrl compare: {', '.join(plan.algorithms)} x {len(plan.seeds)} seed(s), budget {plan.budget.describe()}; "
          f"outputs in {plan.output_dir}")
    what = "the supervised warm-up and the rows" if plan.warmup else "the rows"
    print(f"start: building {what} every run shares (seed {plan.warmup_seed}) ...", flush=True)
    try:
        start = prepare_start(plan)
    except (CompareError, ValueError) as e:
        print(f"fastrl compare: error: the shared start could not be built: {e}", file=sys.stderr)
        return 2
    info = start["info"]
    sft = info["sft"]
    if sft:
        probe = f", probe accuracy {sft['sft/probe_accuracy']:.3f}" if "sft/probe_accuracy" in sft else ""
        print(f"start: {sft.get('sft/steps', 0):.0f} warm-up steps{probe}, {info['seconds']:.0f} s ({info['cpu_seconds']:.0f} s CPU); "
              f"every run starts from {info['model']}")
    # seeds outer: a comparison cut short still has every algorithm on the first seeds
    order = [(algorithm, seed) for seed in plan.seeds for algorithm in plan.algorithms]
    processes = RunProcesses()
    print_lock = threading.Lock()

    def say(text: str) -> None:
        with print_lock:
            print(text, flush=True)

    if plan.jobs > 1:
        say(f"runs: up to {plan.jobs} at once (--jobs), each a process of its own; results do not depend on it")
    try:
        with stop_signals_exit():
            runs = run_all([lambda a=a, s=s: run_one(plan, start["fields"], a, s, processes) for a, s in order],
                           jobs=plan.jobs, processes=processes,
                           on_start=lambda i: say(f"[{i + 1}/{n_runs}] {order[i][0]} seed {order[i][1]} ..."),
                           on_done=lambda i, r: say(f"[{i + 1}/{n_runs}] {order[i][0]} seed {order[i][1]}: {_describe_run(r)}"))
    except KeyboardInterrupt:
        print("fastrl compare: interrupted: every live run was killed; no report (each run's directory is under "
              f"{plan.output_dir / 'runs'})", file=sys.stderr)
        return INTERRUPTED_STATUS
    report = build_report(plan, runs, start=info, seconds=time.perf_counter() - t_start,
                          cpu_seconds=cpu_seconds_used(), load_average=[list(load_start), list(os.getloadavg())])
    print()
    print(report["table"])
    print()
    print(f"total {report['total_seconds']:.0f} s wall, {report['cpu_seconds']:.0f} s CPU (this process and its runs; "
          f"load average at start {load_start[0]:.1f}, at end {os.getloadavg()[0]:.1f}); report: {plan.output_dir / 'compare.json'}, "
          f"{report['plot'] or 'no plot (pip install matplotlib, or the compare extra)'}, {plan.output_dir / 'compare.txt'}")
    return 0 if all(r.get("success") and r["status"] != "failed" for r in runs) else 1


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


def _self_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process alone (the shared start runs in it)."""
    import resource

    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def cpu_seconds_used() -> float:
    """CPU seconds (user + system) of this process and of its finished child processes (the runs)."""
    import resource

    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


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
    (plan.output_dir / "compare.json").write_text(json.dumps(_strict_json(report), indent=1, allow_nan=False))
    (plan.output_dir / "compare.txt").write_text(table + "\n")
    return report


def _strict_json(value: Any) -> Any:
    """Plain JSON: NaN (not measured) -> null, +-inf -> "inf"/"-inf", paths -> strings."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return value if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if hasattr(value, "tolist"):
        return _strict_json(value.tolist())
    return str(value)


if __name__ == "__main__":  # a run of a comparison (RUN_MODULE): ``fastrl train``, ended with its parent
    from fastrl import cli_style
    from fastrl.train.cli import run_train
    from fastrl.workers import set_parent_death_signal

    set_parent_death_signal(signal.SIGTERM)
    if os.environ.get(PARENT_PID_ENV) not in (None, str(os.getppid())):
        sys.exit(128 + signal.SIGTERM)  # the comparison ended before the signal was asked for
    run_argv, run_debug = cli_style.pop_debug(sys.argv[1:])
    if run_argv[:1] != ["train"]:
        sys.exit(f"usage: python -m {RUN_MODULE} train [train options]")
    sys.exit(cli_style.run_reporting_input_errors("train", lambda: run_train(run_argv[1:]), debug=run_debug))
