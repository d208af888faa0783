"""`fastrl compare`: budgets, the verdict logic on synthetic numbers, bad input before any run,
the trainer's budget stop, and a real tiny comparison (fresh `fastrl train` processes)."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from fastrl.agents import metric_names as names
from fastrl.cli import main
from fastrl.commands.compare import (
    HYBRID,
    Budget,
    CompareError,
    axis_verdict,
    chain_phases,
    check_budget_fits,
    format_table,
    mean_std,
    parse_budget,
    plan_compare,
    reward_drop,
    run_fields_for,
    reward_std_collapse,
    run_metrics,
    summarize,
    verdicts,
)
from fastrl.train.config import TrainConfig
from fastrl.train.trainer import _budget_spent

# the tiny built-in setting of tests/train/test_train_cli.py's resume test: seconds per run
TINY = ["--task_digits", "1", "--task_train_size", "60", "--task_eval_size", "8", "--model_hidden_size", "32",
        "--model_layers", "1", "--prompts_per_step", "4", "--group_size", "4", "--max_new_tokens", "3",
        "--reward_workers", "0", "--pass_k", "2", "--sft_steps", "2", "--eval_every", "1"]


# ----------------------------------------------------------------------------- budgets
@pytest.mark.parametrize("text, kind, amount", [
    ("200-steps", "steps", 200), ("1step", "steps", 1), ("50k-tokens", "tokens", 50_000), ("1.5M-tokens", "tokens", 1_500_000),
    ("768 tokens", "tokens", 768), ("10m", "seconds", 600), ("90s", "seconds", 90), ("1h30m", "seconds", 5400),
    ("2.5min", "seconds", 150),
])
def test_budget_strings(text, kind, amount):
    b = parse_budget(text)
    assert (b.kind, b.amount) == (kind, amount)


@pytest.mark.parametrize("text", ["", "ten minutes", "10", "5 parsecs", "1.5-steps", "0.5k5-tokens", "10m-steps", "1.0001k-tokens"])
def test_unparsable_budgets(text):
    with pytest.raises(CompareError, match="budget"):
        parse_budget(text)


def test_budget_too_small_for_one_step():
    cfg = TrainConfig(prompts_per_step=4, group_size=4, max_new_tokens=3).resolved()  # one step: <= 48 tokens
    check_budget_fits(parse_budget("48-tokens"), cfg)
    with pytest.raises(CompareError, match="too small for one step.*48"):
        check_budget_fits(parse_budget("47-tokens"), cfg)
    with pytest.raises(CompareError, match="too small for one step"):
        check_budget_fits(parse_budget("0-steps"), cfg)
    with pytest.raises(CompareError, match="2 phases"):
        check_budget_fits(parse_budget("1-steps"), cfg, phases=2)
    with pytest.raises(CompareError, match="too small for one step"):
        check_budget_fits(parse_budget("2s"), cfg)


def test_budget_split_for_the_hybrid():
    first, second = Budget("steps", 7, "7-steps").split(0.5)
    assert (first.amount, second.amount) == (4, 3)
    first, second = Budget("steps", 2, "2-steps").split(0.9)
    assert (first.amount, second.amount) == (1, 1)  # each phase keeps one step
    first, second = Budget("seconds", 60, "1m").split(0.25)
    assert (first.amount, second.amount) == (15, 45)
    assert Budget("tokens", 1000, "1k-tokens").train_fields(steps_cap=None) == {"steps": 1_000_000, "max_generated_tokens": 1000}
    assert Budget("seconds", 30, "30s").train_fields(steps_cap=50) == {"steps": 50, "max_seconds": 30.0}


def test_trainer_budget_stop_condition():
    cfg = TrainConfig(max_seconds=10.0, max_generated_tokens=100).resolved()
    assert _budget_spent(cfg, seconds=9.9, generated_tokens=99) is None
    assert _budget_spent(cfg, seconds=10.0, generated_tokens=0) == "max_seconds"
    assert _budget_spent(cfg, seconds=0.0, generated_tokens=100) == "max_generated_tokens"
    assert _budget_spent(TrainConfig().resolved(), seconds=1e9, generated_tokens=1e12) is None
    for bad in ({"max_seconds": 0.0}, {"max_seconds": float("inf")}, {"max_generated_tokens": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TrainConfig(**bad).resolved()


# ----------------------------------------------------------------------------- per-run metrics
def _steps(rewards, *, seconds=1.0, tokens=10.0, kl=None, entropy=None):
    out = []
    for i, r in enumerate(rewards):
        rec = {"step": i + 1, "time/step": seconds, names.GENERATED_TOKENS: tokens, "reward/mean": r,
               "throughput/train_tokens_per_s": 50.0, "time/update": 0.5, "time/generate": 0.25, "memory/peak_gb": 1.0 + i}
        if kl is not None:
            rec["kl/ref"] = kl[i]
        if entropy is not None:
            rec["entropy/mean"] = entropy[i]
        out.append(rec)
    return out


def test_reward_drop_is_the_worst_fall_of_the_smoothed_curve():
    assert reward_drop([0.1, 0.2, 0.3, 0.4]) == 0.0
    assert reward_drop([0.0, 1.0, 2.0, 1.0, 0.0, 3.0], window=1) == 2.0
    # a one-step dip is smoothed away by the 5-step mean: 1 - mean(1, 1, 1, 1, 0) = 0.2
    assert reward_drop([1.0] * 5 + [0.0], window=5) == pytest.approx(0.2)
    assert reward_drop([float("nan"), 1.0, 0.5], window=1) == 0.5


def test_reward_std_collapse_is_the_echo_trap_warning_not_a_solved_batch():
    # the spread falls to 0 while the reward stays at 0.3: a collapse from step index 5 on (window 1)
    stds = [0.5, 0.5, 0.4, 0.2, 0.15, 0.05, 0.0, 0.0]
    assert reward_std_collapse(stds, [0.3] * 8, 1.0, window=1) == (3, 5)
    # the same spread falling because every sample is solved (mean 1 = the best reward): no warning
    assert reward_std_collapse(stds, [0.3] * 4 + [1.0] * 4, 1.0, window=1) == (0, None)
    assert reward_std_collapse(stds, [0.3] * 6 + [1.0] * 2, 1.0, window=1) == (1, 5)
    assert reward_std_collapse(stds, [1.0] * 8, 1.0, window=1) == (0, None)
    assert reward_std_collapse([0.0] * 4, [0.0] * 4, 0.0) == (0, None)  # never any spread: nothing collapsed
    steps = _steps([0.3] * 8)
    for rec, s in zip(steps, stds):
        rec["reward/std"], rec["reward/max"] = s, 1.0
    m = run_metrics(steps, [])
    assert m["stability"]["reward_std_collapse_steps"] > 0 and m["stability"]["reward_std_collapse_step"] >= 6


def test_run_metrics_from_logged_records():
    steps = _steps([0.1, 0.5, 0.2, 0.6], kl=[0.01, 0.02, 3.0, 0.01], entropy=[1.0, 1.2, 2.5, 0.5])
    evals = [{"step": 0, "event": "eval", "eval/accuracy": 0.3, "eval/pass@4": 0.5, "time/eval": 2.0},
             {"step": 2, "event": "eval", "eval/accuracy": 0.6, "eval/pass@4": 0.7, "time/eval": 2.0},
             {"step": 4, "event": "eval", "eval/accuracy": 0.5, "eval/pass@4": 0.8, "time/eval": 2.0}]
    m = run_metrics(steps, evals, pass_k=4)
    assert m["curve"]["seconds"] == [1.0, 2.0, 3.0, 4.0] and m["curve"]["generated_tokens"] == [10.0, 20.0, 30.0, 40.0]
    assert [(e["step"], e["seconds"], e["generated_tokens"]) for e in m["evals"]] == [(0, 0.0, 0.0), (2, 2.0, 20.0), (4, 4.0, 40.0)]
    assert m["success"]["initial_accuracy"] == 0.3 and m["success"]["final_accuracy"] == 0.5
    assert m["success"]["best_accuracy"] == 0.6 and m["success"]["final_pass@4"] == 0.8
    assert m["stability"]["kl_max"] == 3.0 and m["stability"]["kl_blowups"] == 1
    assert m["stability"]["entropy_blowups"] == 1 and m["stability"]["entropy_end_over_start"] == 0.5
    c = m["cost"]
    assert (c["steps"], c["train_seconds"], c["eval_seconds"], c["generated_tokens"]) == (4, 4.0, 6.0, 40.0)
    assert c["trained_tokens"] == pytest.approx(100.0) and c["peak_memory_gb"] == 4.0
    assert c["stage_seconds"] == {"generate": 1.0, "update": 2.0}
    # a non-finite loss logged as the string "nan" counts; a missing KL is "not measured", not 0
    bad = _steps([0.1, 0.2])
    bad[1]["loss/total"] = "nan"
    m = run_metrics(bad, [])
    assert m["stability"]["non_finite_steps"] == 1 and math.isnan(m["stability"]["kl_max"])
    assert math.isnan(m["success"]["final_accuracy"])


def test_agent_runs_cost_environment_calls_per_prompt():
    """GRPO's G trajectories per prompt each call the environment: calls per prompt scale with G."""
    def agent_steps(samples, calls_per_trajectory):
        steps = _steps([0.2, 0.4])
        for rec in steps:
            rec.update({names.ENV_CALLS: samples * calls_per_trajectory, "rollout/samples": samples,
                        names.TOOL_CALLS_PER_TRAJECTORY: calls_per_trajectory - 1})
        return steps

    grpo = run_metrics(agent_steps(16, 3), [], group_size=8)["cost"]  # 2 prompts x 8 trajectories, 3 calls each
    assert (grpo["env_calls"], grpo["tool_calls"], grpo["trajectories"], grpo["prompts"]) == (96, 64, 32, 4)
    assert grpo["env_calls_per_prompt"] == 24.0
    ppo = run_metrics(agent_steps(16, 3), [], group_size=1)["cost"]  # 16 prompts x 1 trajectory
    assert ppo["env_calls_per_prompt"] == 3.0
    assert math.isnan(run_metrics(_steps([0.1]), [], group_size=8)["cost"]["env_calls"])  # single-turn: not measured
    assert math.isnan(grpo["leaf_env_calls"])  # independent trajectories: nothing to compare with
    branching = agent_steps(16, 3)
    for rec in branching:  # --rollout tree: fewer calls than its leaves played independently
        rec.update({names.ENV_CALLS: 60, names.TREE_LEAF_ENV_CALLS: 96, names.TREE_LEAF_TOKENS: 500})
    tree = run_metrics(branching, [], group_size=8)["cost"]
    assert (tree["env_calls"], tree["leaf_env_calls"], tree["leaf_tokens"]) == (120, 192, 1000)
    tree_runs = [{"algorithm": "grpo", "seed": s, "status": "ok", "wall_seconds": 1.0,
                  **run_metrics(branching, [{"step": 0, "eval/accuracy": 0.1}], group_size=8)} for s in (0, 1)]
    assert "environment calls if played independently" in format_table(summarize(tree_runs), [])
    chained = chain_phases(run_metrics(agent_steps(16, 3), [], group_size=8), run_metrics(agent_steps(16, 3), [], group_size=1))
    assert chained["cost"]["env_calls"] == 192 and chained["cost"]["prompts"] == 4 + 32
    assert chained["cost"]["env_calls_per_prompt"] == pytest.approx(192 / 36)
    runs = [{"algorithm": a, "seed": s, "status": "ok", "wall_seconds": 1.0,
             **run_metrics(agent_steps(16, 3 + s + (a == "grpo")), [{"step": 0, "eval/accuracy": 0.1}], group_size=g)}
            for a, g in (("grpo", 8), ("ppo", 1)) for s in (0, 1)]
    found = [v for v in verdicts(summarize(runs), budget_kind="steps") if v["metric"] == "environment calls for the budget"]
    assert len(found) == 1 and found[0]["winner"] == "ppo" and "environment calls per prompt: grpo" in found[0]["text"]
    assert "environment calls per prompt" in format_table(summarize(runs), found)


def test_hybrid_phases_chain_into_one_curve():
    first = run_metrics(_steps([0.1, 0.2]), [{"step": 0, "eval/accuracy": 0.3}, {"step": 2, "eval/accuracy": 0.4}])
    second = run_metrics(_steps([0.3, 0.4, 0.5], seconds=2.0), [{"step": 0, "eval/accuracy": 0.4}, {"step": 3, "eval/accuracy": 0.7}])
    m = chain_phases(first, second)
    assert m["curve"]["step"] == [1, 2, 3, 4, 5]
    assert m["curve"]["seconds"] == [1.0, 2.0, 4.0, 6.0, 8.0]
    assert [(e["step"], e["seconds"], e["accuracy"]) for e in m["evals"]] == [(0, 0.0, 0.3), (2, 2.0, 0.4), (5, 8.0, 0.7)]
    assert m["success"]["initial_accuracy"] == 0.3 and m["success"]["final_accuracy"] == 0.7
    assert m["cost"]["steps"] == 5 and m["cost"]["train_seconds"] == 8.0 and m["cost"]["generated_tokens"] == 50.0


# ----------------------------------------------------------------------------- verdicts (synthetic numbers)
def test_mean_std_is_the_sample_std_over_finite_values():
    assert mean_std([1.0, 2.0, 3.0]) == (2.0, 1.0)
    assert mean_std([4.0, float("nan")]) == (4.0, 0.0)
    assert all(math.isnan(x) for x in mean_std([]))


def test_verdict_names_a_distinguishable_winner_and_the_margin():
    v = axis_verdict("success", "accuracy", {"ppo": [0.30, 0.32, 0.34], "grpo": [0.50, 0.52, 0.54]}, higher_is_better=True)
    assert v["winner"] == "grpo" and v["runner_up"] == "ppo" and v["distinguishable"] is True
    assert v["difference"] == pytest.approx(0.20) and v["ratio"] == pytest.approx(0.52 / 0.32)
    assert "grpo wins, 0.520 ± 0.020 vs ppo 0.320 ± 0.020 (+0.200, 1.62x)" in v["text"]
    assert "distinguishable" in v["text"] and "not distinguishable" not in v["text"]


def test_overlapping_seeds_are_not_distinguishable():
    v = axis_verdict("success", "accuracy", {"ppo": [0.30, 0.50, 0.40], "grpo": [0.35, 0.55, 0.45]}, higher_is_better=True)
    assert v["winner"] == "grpo" and v["distinguishable"] is False and "not distinguishable" in v["text"]


def test_lower_is_better_axes_and_one_seed():
    v = axis_verdict("cost", "seconds", {"ppo": [120.0], "grpo": [80.0]}, higher_is_better=False, fmt=".1f")
    assert v["winner"] == "grpo" and v["difference"] == -40.0 and v["distinguishable"] is None
    assert "fewer than 2 seeds" in v["text"] and "80.0 (1 seed)" in v["text"]
    v = axis_verdict("cost", "seconds", {"ppo": [10.0, 11.0], "grpo": [20.0, 21.0], "rloo": [15.0, 15.5]}, higher_is_better=False)
    assert v["ranking"] == ["ppo", "rloo", "grpo"] and "order ppo < rloo < grpo" in v["text"]


def test_verdict_edge_cases():
    v = axis_verdict("success", "accuracy", {"ppo": [0.4, 0.4], "grpo": [0.4, 0.4]}, higher_is_better=True)
    assert v["winner"] is None and "tie" in v["text"]
    v = axis_verdict("success", "accuracy", {"ppo": [float("nan")], "grpo": [0.4, 0.5]}, higher_is_better=True)
    assert v["winner"] == "grpo" and v["runner_up"] is None and "only grpo" in v["text"]
    v = axis_verdict("success", "accuracy", {"ppo": [float("nan")]}, higher_is_better=True)
    assert v["winner"] is None and "no run measured it" in v["text"]


def _synthetic_run(algorithm, seed, final, *, drop_at=None, status="ok"):
    rewards = [0.1 * i for i in range(8)]
    if drop_at is not None:
        rewards[drop_at:] = [0.0] * (8 - drop_at)
    steps = _steps(rewards, seconds=2.0 if algorithm == "ppo" else 1.0, kl=[0.01] * 8, entropy=[1.0] * 8)
    m = run_metrics(steps, [{"step": 0, "eval/accuracy": 0.3}, {"step": 8, "eval/accuracy": final}])
    return {"algorithm": algorithm, "seed": seed, "status": status, "wall_seconds": 30.0, **m}


def test_summary_verdicts_and_table_from_synthetic_runs():
    runs = [_synthetic_run("ppo", s, f, drop_at=4 if s == 0 else None, status="diverged" if s == 0 else "ok")
            for s, f in enumerate([0.40, 0.42, 0.44])]
    runs += [_synthetic_run("grpo", s, f) for s, f in enumerate([0.60, 0.62, 0.64])]
    summary = summarize(runs)
    assert summary["ppo"]["final_accuracy"]["mean"] == pytest.approx(0.42)
    assert summary["ppo"]["final_accuracy"]["values"] == [0.40, 0.42, 0.44]
    assert summary["ppo"]["nan_stops"] == 1 and summary["grpo"]["nan_stops"] == 0
    assert summary["ppo"]["final_accuracy_range"] == pytest.approx(0.04)
    assert summary["ppo"]["stage_seconds"]["update"] == pytest.approx(4.0)
    found = {v["axis"]: v for v in verdicts(summary, budget_kind="steps")}
    assert set(found) == {"success", "stability", "cost", "memory"}
    assert found["success"]["winner"] == "grpo" and found["success"]["distinguishable"] is True
    assert found["stability"]["winner"] == "grpo" and "ppo: 1 NaN stop(s)" in found["stability"]["text"]
    assert found["cost"]["winner"] == "grpo" and found["cost"]["metric"] == "RL seconds for the budget"
    assert found["memory"]["winner"] is None  # same peak memory everywhere: a tie
    # a time budget gives every run the same seconds: cost compares the tokens generated in them
    assert {v["axis"]: v for v in verdicts(summary, budget_kind="seconds")}["cost"]["metric"].startswith("generated tokens")
    table = format_table(summary, list(found.values()), pass_k=None)
    assert "held-out accuracy, end" in table and "0.420 ± 0.020" in table and "0.620 ± 0.020" in table
    assert "NaN stops / failed runs" in table and "1 / 0" in table
    assert "-- seconds per stage" in table and found["success"]["text"] in table


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("args, needle", [
    (["--algorithms", "ppo", "sac"], "unknown algorithm.*'sac'"),
    (["--algorithms", "ppo", "ppo"], "twice"),
    (["--budget", "ten minutes"], "is not a budget"),
    (["--budget", "0-steps"], "too small for one step"),
    (["--budget", "100-tokens"], "too small for one step.*768"),  # 16 prompts x 8 samples x 6 tokens
    (["--algorithms", HYBRID, "--budget", "1-steps"], "2 phases"),
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--seed", "3"], "--seed is set by the comparison itself; use --seeds"),
    (["--algorithm", "ppo"], "--algorithm is set by the comparison"),
    (["--budget", "5-steps", "--steps", "9"], "both set the number of steps"),
    (["--group_size", "1"], "grpo: group_size must be >= 2"),
    (["--hybrid_split", "1.5"], "hybrid_split"),
    (["--eval_every", "0"], "success is measured"),
    (["--algorithms", "grpo", "--ppo_group_size", "1"], "needs ppo or grpo_then_ppo"),
    (["--ppo_group_size", "3"], "does not divide the 128 samples"),
])
def test_bad_input_is_an_error_before_any_run(args, needle, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "--output_dir", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastrl compare: error:")
    import re

    assert re.search(needle, err), err
    assert not out.exists()  # nothing was started


def test_a_train_option_that_does_not_parse_is_an_error(tmp_path, capsys):
    assert main(["compare", "--output_dir", str(tmp_path / "c"), "--lrr", "1"]) == 2
    assert "do not parse" in capsys.readouterr().err


def test_an_earlier_comparison_is_not_overwritten_silently(tmp_path, capsys):
    (tmp_path / "compare.json").write_text("{}")
    assert main(["compare", "--output_dir", str(tmp_path)]) == 2
    assert "--overwrite" in capsys.readouterr().err


# ----------------------------------------------------------------------------- a real comparison
# what a run's record holds that the machine decides (times, memory, float products of times)
MACHINE_DEPENDENT = {"seconds", "train_seconds", "eval_seconds", "stage_seconds", "peak_memory_gb", "trained_tokens",
                     "wall_seconds", "phases"}


def _measured(record):
    """A run record without what depends on the machine: what must not change with --jobs."""
    if isinstance(record, dict):
        return {k: _measured(v) for k, v in record.items() if k not in MACHINE_DEPENDENT}
    if isinstance(record, list):
        return [_measured(v) for v in record]
    return record


def test_a_tiny_comparison_end_to_end(tmp_path, capsys):
    """grpo vs ppo, 2 seeds, a budget of 96 generated tokens (2+ steps), fresh `fastrl train`
    processes from one shared warm-up, two at once (--jobs 2): table, compare.json with every
    field, compare.png; the seed-0 runs equal those of a comparison that runs one at a time."""
    out = tmp_path / "cmp"
    assert main(["compare", "--algorithms", "grpo", "ppo", "--seeds", "2", "--budget", "96-tokens", "--jobs", "2",
                 "--output_dir", str(out), *TINY, "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert "up to 2 at once" in printed
    for k, (algo, seed) in enumerate([("grpo", 0), ("ppo", 0), ("grpo", 1), ("ppo", 1)], start=1):
        assert f"[{k}/4] {algo} seed {seed} ...\n" in printed and f"[{k}/4] {algo} seed {seed}: accuracy" in printed
    for needle in ("held-out accuracy, end", "worst reward drop", "RL seconds", "peak memory", "seconds per stage",
                   "success (held-out accuracy at the end", "stability (worst drop", "cost (RL seconds", "memory (peak"):
        assert needle in printed, needle
    report = json.loads((out / "compare.json").read_text())
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["algorithms"] == ["grpo", "ppo"] and report["seeds"] == [0, 1]
    assert report["budget"] == {"kind": "tokens", "amount": 96.0, "text": "96-tokens"}
    assert len(report["runs"]) == 4
    start_model = str(out / "start" / "model")
    initial = set()
    for run in report["runs"]:
        assert run["status"] == "ok" and run["stopped_by"] == "max_generated_tokens"
        assert set(run["success"]) >= {"initial_accuracy", "final_accuracy", "best_accuracy", "final_pass@2"}
        assert set(run["stability"]) >= {"reward_drop", "kl_blowups", "entropy_blowups", "non_finite_steps"}
        assert set(run["cost"]) >= {"train_seconds", "generated_tokens", "trained_tokens", "peak_memory_gb", "stage_seconds"}
        cost = run["cost"]
        # the budget stops each run after the step that reaches it (a step generates at most 48 tokens)
        assert 96 <= cost["generated_tokens"] < 96 + 48 and cost["steps"] >= 2 and cost["trained_tokens"] > 0
        assert {"generate", "update"} <= set(cost["stage_seconds"])
        assert run["curve"]["generated_tokens"][-1] == cost["generated_tokens"]
        assert [e["step"] for e in run["evals"]] == list(range(cost["steps"] + 1))  # eval_every 1: start + each step
        # every run starts from the shared warm-up, with no warm-up of its own, on the same held-out rows
        cfg = yaml.safe_load((tmp_path / run["dir"] / "config.yaml").read_text())
        assert cfg["model"] == start_model and cfg["sft_steps"] == 0 and cfg["eval_dataset"] == str(out / "start" / "eval.jsonl")
        assert cfg["algorithm"] == run["algorithm"] and cfg["seed"] == run["seed"]
        initial.add(run["success"]["initial_accuracy"])
    assert len(initial) == 1  # same model, same held-out prompts, greedy: the same starting accuracy
    assert report["runs"][1]["algorithm"] == "ppo" and "values" in report["runs"][1]["cost"]["stage_seconds"]
    assert report["start"]["sft"]["sft/steps"] == 2.0 and 0 < report["start"]["cpu_seconds"] < report["cpu_seconds"]
    for algo in ("grpo", "ppo"):
        s = report["summary"][algo]
        assert len(s["final_accuracy"]["values"]) == 2 and s["runs_measured"] == 2
        assert s["final_accuracy"]["std"] is not None and s["nan_stops"] == 0
    assert [v["axis"] for v in report["verdicts"]] == ["success", "stability", "cost", "memory"]
    assert report["table"] in printed and (out / "compare.txt").read_text().strip() == report["table"].strip()
    # what the machine gave it: CPU seconds of this process and its runs, the load before and after
    assert math.isfinite(report["cpu_seconds"]) and report["cpu_seconds"] > 0 and "s CPU" in printed
    assert len(report["load_average"]["start"]) == len(report["load_average"]["end"]) == 3
    assert report["jobs"] == 2
    # results do not depend on --jobs: the same seed-0 runs, one at a time
    one = tmp_path / "one"
    assert main(["compare", "--algorithms", "grpo", "ppo", "--seeds", "1", "--budget", "96-tokens", "--jobs", "1",
                 "--output_dir", str(one), *TINY, "--threads", "1"]) == 0
    alone = json.loads((one / "compare.json").read_text())
    assert alone["jobs"] == 1 and [r["dir"] for r in alone["runs"]] == [str(one / "runs" / f"{a}-seed0") for a in ("grpo", "ppo")]
    for together, single in zip(report["runs"][:2], alone["runs"]):
        assert _measured({**together, "dir": None}) == _measured({**single, "dir": None})
        assert together["cost"]["trained_tokens"] == pytest.approx(single["cost"]["trained_tokens"], rel=1e-6)


def test_the_hybrid_runs_ppo_from_the_grpo_policy(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "--algorithms", HYBRID, "--seeds", "1", "--budget", "3-steps", "--output_dir", str(out), *TINY]) == 0
    report = json.loads((out / "compare.json").read_text())
    (run,) = report["runs"]
    grpo_dir, ppo_dir = (out / "runs" / f"{HYBRID}-seed0" / p for p in ("grpo", "ppo"))
    assert [p["dir"] for p in run["phases"]] == [str(grpo_dir), str(ppo_dir)]
    ppo_cfg = yaml.safe_load((ppo_dir / "config.yaml").read_text())
    assert ppo_cfg["algorithm"] == "ppo" and ppo_cfg["steps"] == 1
    assert ppo_cfg["model"] == ppo_cfg["critic_init"] == str(grpo_dir / "final")
    assert yaml.safe_load((grpo_dir / "config.yaml").read_text())["steps"] == 2
    assert run["cost"]["steps"] == 3 and run["curve"]["step"] == [1, 2, 3]
    assert "values" in run["cost"]["stage_seconds"]  # the PPO phase ran its critic
    assert [e["step"] for e in run["evals"]] == [0, 1, 2, 3]


def test_ppo_group_size_gives_ppo_fewer_samples_per_prompt_and_more_prompts(tmp_path):
    plan = plan_compare(["--algorithms", "grpo", "ppo", HYBRID, "--budget", "2-steps", "--ppo_group_size", "2",
                         "--prompts_per_step", "4"])
    assert plan.ppo_overrides == {"group_size": 2, "prompts_per_step": 16}  # 4 x 8 samples a step, as GRPO's
    ppo = run_fields_for(plan, {}, "ppo", 0, tmp_path, plan.budget)
    grpo = run_fields_for(plan, {}, "grpo", 0, tmp_path, plan.budget)
    assert (ppo["group_size"], ppo["prompts_per_step"]) == (2, 16) and "group_size" not in grpo
    assert grpo["prompts_per_step"] == 4


def test_a_builtin_environment_brings_its_own_default_budget_seeds_and_evaluations(capsys):
    from fastrl.agents.envs import BUILTIN_ENVS
    from fastrl.commands.compare import DEFAULT_BUDGET, DEFAULT_SEEDS, ENV_COMPARE_DEFAULTS, build_compare_parser

    assert set(ENV_COMPARE_DEFAULTS) == set(BUILTIN_ENVS)
    algos = ["--algorithms", "grpo", "gigpo", "ppo", HYBRID]
    for env, d in ENV_COMPARE_DEFAULTS.items():
        plan = plan_compare(["--env", env, *algos])
        assert plan.budget == parse_budget(d.budget) and plan.seeds == list(range(d.seeds))
        assert plan.eval_every == math.ceil(plan.budget.amount / d.evaluations)
        assert plan.budget.amount != parse_budget(DEFAULT_BUDGET).amount  # an agent step costs more
        assert plan.user_fields["threads"] == d.threads == 1  # the warm-up and every run
    # the command line wins; a user's environment and no environment keep compare's defaults
    plan = plan_compare(["--env", "frozenlake", *algos, "--budget", "6-steps", "--seeds", "2"])
    assert plan.budget.amount == 6 and plan.seeds == [0, 1] and plan.eval_every == 3
    assert plan_compare(["--env", "frozenlake", *algos, "--threads", "2"]).user_fields["threads"] == 2
    plan = plan_compare(["--algorithms", "grpo", "ppo"])
    assert plan.budget == parse_budget(DEFAULT_BUDGET) and len(plan.seeds) == DEFAULT_SEEDS
    assert plan.user_fields["threads"] == 1  # the built-in model: fastrl train's thread rule gives it one thread
    with pytest.raises(CompareError, match="both set the number of steps"):
        plan_compare(["--env", "frozenlake", "--steps", "5"])
    help_text = " ".join(build_compare_parser().format_help().split())  # argparse wraps lines
    for env, d in ENV_COMPARE_DEFAULTS.items():
        assert f"--env {env}: {d.budget}" in help_text and f"--env {env}: {d.seeds}" in help_text


def test_train_options_take_the_vllm_server_form():
    plan = plan_compare(["--algorithms", "grpo", "ppo", "--budget", "2-steps", "--sampler", "vllm-server",
                         "http://127.0.0.1:8000", "--sft_steps", "0"])
    assert plan.user_fields["sampler"] == "vllm-server" and plan.base.sampler_url == "http://127.0.0.1:8000"


ENV_TINY = ["--prompts_per_step", "2", "--group_size", "2", "--task_train_size", "16", "--task_eval_size", "2",
            "--model_hidden_size", "16", "--model_layers", "1", "--sft_steps", "2", "--sft_check_every", "1000",
            "--env_workers", "1", "--reward_workers", "0", "--max_turns", "2", "--max_turn_tokens", "8", "--threads", "1"]


def test_an_agent_comparison_counts_environment_calls(tmp_path, capsys):
    """compare --env: the environment reaches every run (from the shared warm-up, with the
    environment's tool-call format), and cost counts environment calls per prompt: GRPO's 2
    trajectories per prompt against PPO's one (--ppo_group_size 1, twice the prompts)."""
    out = tmp_path / "cmp"
    assert main(["compare", "--env", "calculator", "--algorithms", "grpo", "ppo", "--seeds", "1", "--budget", "2-steps",
                 "--ppo_group_size", "1", "--output_dir", str(out), *ENV_TINY]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "compare.json").read_text())
    assert "environment calls per prompt" in printed and "cost (environment calls for the budget" in printed
    runs = {r["algorithm"]: r for r in report["runs"]}
    for algo, group_size, prompts in (("grpo", 2, 2), ("ppo", 1, 4)):
        run = runs[algo]
        assert run["status"] == "ok", run.get("error")
        cfg = yaml.safe_load((out / "runs" / f"{algo}-seed0" / "config.yaml").read_text())
        assert cfg["env"] == "calculator" and cfg["env_call_format"] == "compact" and cfg["sft_steps"] == 0
        assert (cfg["group_size"], cfg["prompts_per_step"]) == (group_size, prompts)
        steps = [json.loads(line) for line in (out / "runs" / f"{algo}-seed0" / "metrics.jsonl").read_text().splitlines()
                 if "event" not in json.loads(line)]
        cost = run["cost"]
        assert cost["trajectories"] == 2 * 4 and cost["prompts"] == 2 * prompts
        assert cost["env_calls"] == sum(s[names.ENV_CALLS] for s in steps) >= cost["trajectories"]  # a reset each
        assert cost["env_calls_per_prompt"] == pytest.approx(cost["env_calls"] / cost["prompts"])
        assert cost["env_calls_per_prompt"] >= group_size  # each of a prompt's trajectories is reset at least
        assert set(run["stability"]) >= {"reward_std_collapse_steps", "non_finite_steps"}
