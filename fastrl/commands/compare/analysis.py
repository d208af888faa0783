"""One run's success, stability and cost from its logged records (pure: lists of numbers in,
dicts out): the per-step curves, the stability detectors (reward drop, KL and entropy blow-ups,
the reward-std collapse) and the chaining of ``grpo_then_ppo``'s two phases into one run."""

from __future__ import annotations

import math
from typing import Any, Sequence

from fastrl.agents import metric_names

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


def as_float(value: Any) -> float:
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
    seconds = cumulative([as_float(r.get("time/step")) for r in steps])
    generated = cumulative([as_float(r.get(metric_names.GENERATED_TOKENS)) for r in steps])
    # the trainer logs the update's throughput: tokens through the training forward x epochs
    trained = cumulative([as_float(r.get("throughput/train_tokens_per_s")) * as_float(r.get("time/update")) for r in steps])
    rewards = [as_float(r.get("reward/mean")) for r in steps]
    kls = [as_float(r["kl/ref"]) for r in steps if "kl/ref" in r]
    entropies = [as_float(r.get("entropy/mean")) for r in steps if "entropy/mean" in r]

    at = {0: (0.0, 0.0)}
    for s, t, g in zip(step_ids, seconds, generated):
        at[s] = (t, g)
    eval_points = []
    for e in sorted(evals, key=lambda r: r["step"]):
        if "eval/accuracy" not in e:
            continue
        s = int(e["step"])
        t, g = at.get(s, (float("nan"), float("nan")))
        point = {"step": s, "seconds": t, "generated_tokens": g, "accuracy": as_float(e["eval/accuracy"])}
        if pass_k and f"eval/pass@{pass_k}" in e:
            point[f"pass@{pass_k}"] = as_float(e[f"eval/pass@{pass_k}"])
        eval_points.append(point)
    accuracies = [p["accuracy"] for p in eval_points if math.isfinite(p["accuracy"])]

    non_finite = sum(
        1 for r in steps for k in ("loss/total", "grad_norm", "reward/mean") if k in r and not math.isfinite(as_float(r[k]))
    )
    first_entropy = next((e for e in entropies if math.isfinite(e)), float("nan"))
    stage_seconds = {st: sum(as_float(r.get(f"time/{st}", 0.0)) for r in steps) for st in STAGES}
    # the trainer times the critic's values inside the advantages stage: keep the stages disjoint
    stage_seconds["advantages"] = max(0.0, stage_seconds["advantages"] - stage_seconds["values"])
    stage_seconds = {k: v for k, v in stage_seconds.items() if v > 0}
    peaks = [as_float(r.get("memory/peak_gb")) for r in steps]
    last = rewards[-SMOOTHING_STEPS:]
    agent = any(metric_names.ENV_CALLS in r for r in steps)
    nan = float("nan")
    env_calls = sum(as_float(r.get(metric_names.ENV_CALLS, 0.0)) for r in steps) if agent else nan
    trajectories = sum(as_float(r.get(SAMPLES_METRIC, 0.0)) for r in steps) if agent else nan
    tool_calls = (sum(as_float(r.get(metric_names.TOOL_CALLS_PER_TRAJECTORY, 0.0)) * as_float(r.get(SAMPLES_METRIC, 0.0)) for r in steps)
                  if agent else nan)
    prompts = trajectories / group_size if agent and group_size else nan
    tree = any(metric_names.TREE_LEAF_TOKENS in r for r in steps)
    leaf_tokens = sum(as_float(r.get(metric_names.TREE_LEAF_TOKENS, 0.0)) for r in steps) if tree else nan
    leaf_env_calls = (sum(as_float(r.get(metric_names.TREE_LEAF_ENV_CALLS, 0.0)) for r in steps)
                      if agent and any(metric_names.TREE_LEAF_ENV_CALLS in r for r in steps) else nan)
    best_reward = max((v for v in (as_float(r.get("reward/max")) for r in steps) if math.isfinite(v)), default=float("nan"))
    collapse, collapse_at = reward_std_collapse([as_float(r.get("reward/std")) for r in steps], rewards, best_reward)
    return {
        "curve": {
            "step": step_ids, "seconds": seconds, "generated_tokens": generated, "trained_tokens": trained,
            "reward": rewards, "reward_std": [as_float(r.get("reward/std")) for r in steps],
            "reward_max": [as_float(r.get("reward/max")) for r in steps],
            "kl": [as_float(r.get("kl/ref")) for r in steps], "entropy": [as_float(r.get("entropy/mean")) for r in steps],
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
            "eval_seconds": sum(as_float(e.get("time/eval", 0.0)) for e in evals),
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
        cost[key] = as_float(k1.get(key)) + as_float(k2.get(key))
    cost["env_calls_per_prompt"] = cost["env_calls"] / cost["prompts"] if cost["prompts"] > 0 else float("nan")
    return {"curve": curve, "evals": evals, "success": success, "stability": stability, "cost": cost}
