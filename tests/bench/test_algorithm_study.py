"""The algorithm-choice study's machinery: the power computation against hand-computed cases,
the renderer's tables against the cell JSONs they come from, and the runner's resume (a study
killed outright loses only its cell in flight; a rerun keeps and skips the finished cells)."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import algorithm_study as study  # noqa: E402
from benchmarks import render_algorithm_study as render  # noqa: E402
from benchmarks.study_factors import FACTORS, noisy, unsolvable  # noqa: E402


# ============================================================================ power
def test_power_matches_the_hand_computed_normal_approximation():
    # delta 0.05, sd 0.05, 16 seeds an arm: z = 0.05 / (0.05 * sqrt(2/16)) = 2.828; power = Phi(2.828 - 1.960) + Phi(-4.788)
    assert study.power(0.05, 0.05, 16) == pytest.approx(0.8074, abs=5e-4)
    # n = 2 (1.960 + 0.8416)^2 (sd/delta)^2 = 15.7 -> 16; at 15 the power is Phi(2.739 - 1.960) = 0.782
    assert study.power(0.05, 0.05, 15) == pytest.approx(0.782, abs=1e-3)
    assert study.seeds_needed(0.05, 0.05) == 16
    assert study.seeds_needed(0.05, 0.025) == 4  # a quarter of the variance: 15.7 / 4 = 3.9 -> 4
    assert study.detectable(0.05, 16) == pytest.approx((1.95996 + 0.84162) * 0.05 * math.sqrt(2 / 16), rel=1e-4)
    # pooled sd: groups [0, 2] (variance 2, 1 df) and [1, 3, 5] (variance 4, 2 df): sqrt((2 + 8) / 3)
    assert study.pooled_sd([[0, 2], [1, 3, 5], [7]]) == pytest.approx(math.sqrt(10 / 3))
    assert math.isnan(study.pooled_sd([[1], []]))


def test_welch_interval_by_hand():
    # means 0.8 and 0.2, sd 0.1 each over 3 seeds: se = sqrt(0.01/3 * 2) = 0.08165, Welch df = 4, t = 2.776
    diff, lo, hi = render.welch_interval([0.7, 0.8, 0.9], [0.1, 0.2, 0.3])
    assert diff == pytest.approx(0.6)
    assert (lo, hi) == (pytest.approx(0.6 - 2.776 * 0.081650, abs=1e-5), pytest.approx(0.6 + 2.776 * 0.081650, abs=1e-5))


# ============================================================================ reward wrappers
def test_reward_wrappers_flip_and_mask_the_share_they_say():
    prompts = [[{"role": "user", "content": f"q{i}"}] for i in range(2000)]
    completions = [[{"role": "assistant", "content": "a"}]] * 2000
    outcome = [1.0, 0.0] * 1000
    flipped = noisy(prompts, completions, rate=0.3, env_reward=outcome)
    share = sum(1 for a, b in zip(outcome, flipped) if a != b) / 2000
    assert 0.26 < share < 0.34 and all(b == 1 - a for a, b in zip(outcome, flipped) if a != b)
    masked = unsolvable(prompts, completions, share=0.5, env_reward=[1.0] * 2000)
    assert 0.45 < masked.count(0.0) / 2000 < 0.55
    assert unsolvable(prompts, completions, share=0.5, env_reward=[1.0] * 2000) == masked  # fixed prompts, every call
    # the default task: no environment outcome, the built-in exact match on the answer column
    assert noisy(["1+1=", "2+2="], ["2", "5"], rate=0.0, answer=["2", "4"]) == [1.0, 0.0]


# ============================================================================ renderer
def _cell(task, algo, arm, seed, final, rows, train_seconds, **extra):
    cell = study.Cell(task, algo, arm, (), (), seed, "24-steps")
    return {"cell": cell.to_json(), "status": "ok",
            "success": {"initial_accuracy": 0.5, "final_accuracy": final, "best_accuracy": final + 0.05, "final_reward": 0.4},
            "stability": {"reward_drop": 0.1, "reward_std_collapse_steps": 1 if algo == "ppo" else 0},
            "cost": {"train_seconds": train_seconds, "generated_tokens": 1000.0, "env_calls": 500.0, "peak_memory_gb": 0.5},
            "process": {"cpu_seconds": train_seconds + 10, "wall_seconds": train_seconds + 12},
            "start": {"built_by_this_cell": False, "warmup_cpu_seconds": 30.0},
            "row_success_final": rows, "frac_all_equal_groups": 0.25, **extra}


def test_renderer_tables_match_the_cell_jsons(tmp_path):
    results = tmp_path / "cells"
    results.mkdir()
    grpo = [(0.7, "1111111000"), (0.8, "1111111100"), (0.9, "1111111110")]
    ppo = [(0.1, "1000000000"), (0.2, "1100000000"), (0.3, "1110000000")]
    for seed, ((fg, rg), (fp, rp)) in enumerate(zip(grpo, ppo)):
        for algo, final, rows, secs in (("grpo", fg, rg, 20.0), ("ppo", fp, rp, 25.0)):
            record = _cell("calculator", algo, "base", seed, final, rows, secs)
            if seed == 0 and algo == "ppo":  # the cell that built the start: its 30 s of warm-up are not the arm's
                record["process"]["cpu_seconds"] += 30.0
                record["start"]["built_by_this_cell"] = True
            (results / f"{record['cell']['id']}.json").write_text(json.dumps(record))
    seeds = {"calculator": 3, "frozenlake": 3, "sql": 3, "default": 3}
    cells = render.load_cells(results)
    page = render.render(cells, seeds, {}, None)
    table = [line for line in page.splitlines() if line.startswith("| reward_noise | flip0 | calculator |")]
    # grpo - ppo = 0.6, Welch interval 0.6 -/+ 2.776 * 0.08165; 18 rows gained, none lost, of 30: p = 2 / 2^18
    # cost: CPU seconds without the warm-up, 30 vs 35 (ppo seed 0 built the start: its 30 s of warm-up are not counted)
    assert table == ["| reward_noise | flip0 | calculator | grpo | grpo − ppo: +0.600 (+0.373, +0.827) | 0.86x | "
                     "+18/-0 of 30, p=7.6e-06 | `calculator.grpo.base.s0-2`, `calculator.ppo.base.s0-2` |"]
    pending = [line for line in page.splitlines() if line.startswith("| rollout_cost | w100ms | calculator |")]
    assert pending == ["| rollout_cost | w100ms | calculator | pending (3 of 6 cells) | | | | `calculator.grpo.base.s0-2` |"]
    arm_rows = [line for line in page.splitlines() if line.startswith("| flip0 | calculator | ppo |")]
    assert arm_rows == ["| flip0 | calculator | ppo | 3/3 | 0.500 ± 0.000 | 0.200 ± 0.100 | 0.250 ± 0.100 | 0.100 ± 0.000 | 3 | 0 | 0.25 | "
                        "25.0 ± 0.0 | 35 | 1000 ± 0 | 500 ± 0 | 0.50 ± 0.00 |"]
    # advice only from a distinguishable verdict, naming its cells; the folklore's untested levels say so
    # one sentence for the levels that share these runs (the task's defaults), naming its cells
    assert ("- On calculator (reward_noise = flip0 (no reward flipped); difficulty = unsolvable0 (every prompt solvable); "
            "value_learnability = critic_policy (PPO's critic a copy of the policy, fastrl's default)): **grpo** beat ppo by "
            "+0.600 held-out success (95% interval +0.373 to +0.827) at 0.86x its cost. "
            "Cells: `calculator.grpo.base.s0-2`, `calculator.ppo.base.s0-2`.") in page.splitlines()
    assert "expected ppo to win on calculator, reward_noise = flip10 (10% of the rewards flipped): not tested yet (pending)" in page
    # the baseline level of five arms has only two run: pending, never a result
    assert "| baseline | default | calculator | pending (6 of 15 cells) |" in page
    planned = {i for r in render.build_rows(cells, seeds) for a in r.arms for i in a.planned}
    assert f"6 of {len(planned)} planned cells have run" in page
    # the brief counts the rows (flip0, unsolvable0 and critic_policy share these runs: one set) and the cost (30 / 35 s)
    assert ("grpo won 3 (on calculator; 1 distinct sets of runs), and 0 (0 distinct sets of runs) were not "
            "distinguishable.") in page
    assert "- ppo never won a row measurably." in page.splitlines()
    assert "(1 distinct pairs of arms), GRPO's CPU seconds per run were 0.86x to 0.86x PPO's (median 0.86x;" in page


def test_the_committed_page_is_the_rendering_of_the_committed_cells():
    assert render.main(["--check"]) == 0


def test_a_changed_cell_makes_the_check_fail(tmp_path):
    results = tmp_path / "cells"
    results.mkdir()
    record = _cell("calculator", "grpo", "base", 0, 0.7, "1110", 20.0)
    path = results / f"{record['cell']['id']}.json"
    path.write_text(json.dumps(record))
    argv = ["--results", str(results), "--page", str(tmp_path / "page.md"), "--plot", str(tmp_path / "page.png")]
    assert render.main(argv) == 0 and render.main([*argv, "--check"]) == 0
    record["success"]["final_accuracy"] = 0.6
    path.write_text(json.dumps(record))
    assert render.main([*argv, "--check"]) == 1


def test_not_distinguishable_when_the_interval_crosses_zero(tmp_path):
    arms = [render.Arm("grpo", ["a", "b", "c"], [_cell("calculator", "grpo", "base", s, f, "1", 20.0) for s, f in enumerate([0.7, 0.8, 0.9])]),
            render.Arm("ppo", ["d", "e", "f"], [_cell("calculator", "ppo", "base", s, f, "1", 20.0) for s, f in enumerate([0.5, 0.6, 0.7])])]
    v = render.verdict(arms)
    assert v["best"] == "grpo" and v["difference"] == pytest.approx(0.2) and v["low"] < 0 < v["high"]
    assert v["text"] == "not distinguishable" and not v["distinguishable"]
    # a cost weight charges the environment calls: (30 + 0.1 * 500) / (30 + 0.1 * 500) = 1
    assert render.verdict(arms, cost_weight=0.1)["cost_ratio"] == pytest.approx(1.0)


# ============================================================================ runner: resume
FAKE = r'''
import json, os, sys, time
cell, out, marks, token = sys.argv[1:5]
open(os.path.join(marks, f"{token}.{cell}.started"), "w").write(str(os.getpid()))
if token == "first" and ".ppo.base.s0" in cell:
    sys.exit(3)  # a failed cell: no JSON, reruns next time
if token == "first" and ".grpo.base.s1" in cell:
    time.sleep(120)  # in flight when the study is killed
json.dump({"status": "ok", "token": token}, open(out, "w"))
'''


def _study(tmp_path, token):
    return [sys.executable, str(ROOT / "benchmarks" / "algorithm_study.py"), "--jobs", "1", "--factors", "baseline",
            "--tasks", "calculator", "--seeds", "2", "--cells", "calculator.grpo.*", "calculator.ppo.*",
            "--results", str(tmp_path / "results"), "--work", str(tmp_path / "work"),
            "--cell_command", f"{sys.executable} {tmp_path / 'fake.py'} {{id}} {{out}} {tmp_path / 'marks'} {token}"]


def test_a_killed_study_loses_only_the_cell_in_flight_and_resumes(tmp_path, capsys):
    (tmp_path / "fake.py").write_text(FAKE)
    (tmp_path / "marks").mkdir()
    results = tmp_path / "results"
    first = subprocess.Popen(_study(tmp_path, "first"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    in_flight = tmp_path / "marks" / "first.calculator.grpo.base.s1.started"
    deadline = time.monotonic() + 60
    while not in_flight.exists():
        assert first.poll() is None and time.monotonic() < deadline, first.stdout.read() if first.poll() is not None else "timeout"
        time.sleep(0.05)
    assert study.main(_study(tmp_path, "second")[2:]) == 2  # one study at a time on a work directory
    assert "another study is running" in capsys.readouterr().err
    first.kill()  # SIGKILL: no handler runs
    first.wait()
    orphan = int(in_flight.read_text())
    os.kill(orphan, signal.SIGKILL)  # the runner could not end it (a real cell ends itself: parent-death signal)
    kept = sorted(p.name for p in results.iterdir())
    assert kept == ["calculator.grpo.base.s0.json"]  # the finished cell; nothing partial, none for the failed one
    before = (results / kept[0]).read_text()

    # the reruns in this process (only the killed study needed one of its own)
    assert study.main(_study(tmp_path, "second")[2:]) == 0
    assert "4 cells, 1 already finished, 3 to run" in capsys.readouterr().out
    assert (results / kept[0]).read_text() == before  # kept, not rerun
    assert not (tmp_path / "marks" / "second.calculator.grpo.base.s0.started").exists()
    for cell in ("calculator.ppo.base.s0", "calculator.grpo.base.s1", "calculator.ppo.base.s1"):
        record = json.loads((results / f"{cell}.json").read_text())
        assert record["token"] == "second" and record["cell"]["id"] == cell and record["process"]["cpu_seconds"] >= 0
    assert sorted(p.name for p in results.iterdir()) == sorted(
        f"{c}.json" for c in ("calculator.grpo.base.s0", "calculator.ppo.base.s0", "calculator.grpo.base.s1", "calculator.ppo.base.s1"))
    assert study.main(_study(tmp_path, "third")[2:]) == 0
    assert "4 cells, 4 already finished, 0 to run" in capsys.readouterr().out


def test_the_plan_shares_cells_between_levels_and_orders_grpo_and_ppo_first():
    cells = study.plan_cells({"calculator": 2, "frozenlake": 2, "sql": 2, "default": 2}, tasks=["calculator"])
    ids = [c.id for c in cells]
    assert len(ids) == len(set(ids))
    assert ids[:4] == ["calculator.grpo.base.s0", "calculator.ppo.base.s0", "calculator.grpo.base.s1", "calculator.ppo.base.s1"]
    # rollout_cost's three cost weights read the same PPO runs (one trajectory per prompt)
    group1 = [c for c in cells if c.arm == "group1"]
    assert [c.id for c in group1] == ["calculator.ppo.group1.s0", "calculator.ppo.group1.s1"]
    assert group1[0].args == ("--ppo_group_size", "1")
    noisy_cells = [c for c in cells if c.arm == "flip10"]
    assert noisy_cells[0].args == ("--rewards", "[benchmarks.study_factors:flip_rewards_10]", "--env_reward_weight", "0")
    assert not any(c.task != "calculator" for c in cells)
    assert set(FACTORS) == {"baseline", "rollout_cost", "reward_noise", "difficulty", "horizon", "budget", "value_learnability"}
    long = [c for c in study.plan_cells({"frozenlake": 2}, factors=["budget"]) if c.arm == "steps4x"]
    assert [c.id for c in long] == ["frozenlake.grpo.steps4x.s0", "frozenlake.ppo.steps4x.s0", "frozenlake.grpo.steps4x.s1", "frozenlake.ppo.steps4x.s1"]
    assert {c.budget for c in long} == {"64-steps"} and long[0].args == ()
    assert study.scaled_budget("16-steps", 1) == "16-steps" and study.scaled_budget("16-steps", 4) == "64-steps"
    with pytest.raises(ValueError, match="only a steps budget"):
        study.scaled_budget("60-seconds", 2)


def test_the_dry_run_predicts_from_the_finished_cells_first():
    measured = {("calculator", "grpo", "base"): [10.0, 20.0], ("calculator", "grpo", "flip10"): [40.0]}
    cell = study.Cell("calculator", "grpo", "base", (), (), 5, "24-steps")
    assert study.predicted_cpu_seconds(cell, {}, measured) == 15.0  # its own arm
    other = study.Cell("calculator", "grpo", "unsolvable50", (), (), 0, "24-steps")
    assert study.predicted_cpu_seconds(other, {}, measured) == pytest.approx(70 / 3)  # the algorithm's cells on the task
    unseen = study.Cell("calculator", "ppo", "base", (), (), 0, "24-steps")
    spread = {"calculator": {"run_wall": {"ppo": [30.0, 40.0], "grpo": [20.0]}}}
    assert study.predicted_cpu_seconds(unseen, spread, measured) == 35.0  # fastrl compare's runs
    assert math.isnan(study.predicted_cpu_seconds(unseen, {}, measured))


def test_paired_rows_that_lean_without_the_seeds_separating_are_listed_as_needing_seeds(tmp_path):
    results = tmp_path / "cells"
    results.mkdir()
    for seed, grpo_final in enumerate([0.3, 0.6, 0.5]):
        for algo, final in (("grpo", grpo_final), ("ppo", 0.7)):
            rows = "1" * round(final * 100) + "0" * (100 - round(final * 100))
            record = _cell("calculator", algo, "flip30", seed, final, rows, 20.0)
            (results / f"{record['cell']['id']}.json").write_text(json.dumps(record))
    page = render.render(render.load_cells(results), {"calculator": 3, "frozenlake": 3, "sql": 3, "default": 3}, {}, None)
    # ppo - grpo = 0.233; grpo's sd 0.153 over 3 seeds: Welch df 2, t 4.303, interval 0.233 -/+ 0.380; rows +70/-0 of 300
    assert ("- calculator, reward_noise = flip30: the paired rows lean to ppo (+70/-0 of 300, McNemar p=1.7e-21) but the "
            "seeds do not separate the arms (+0.233, interval -0.146 to +0.613). "
            "Cells: `calculator.grpo.flip30.s0-2`, `calculator.ppo.flip30.s0-2`.") in page.splitlines()
    assert "**ppo**" not in page  # not advice
    # a seed run beyond the plan (--seeds 4) counts: 4 of 4 planned for each arm
    for algo, final in (("grpo", 0.4), ("ppo", 0.7)):
        record = _cell("calculator", algo, "flip30", 3, final, "1" * 100, 20.0)
        (results / f"{record['cell']['id']}.json").write_text(json.dumps(record))
    page = render.render(render.load_cells(results), {"calculator": 3, "frozenlake": 3, "sql": 3, "default": 3}, {}, None)
    assert "| flip30 | calculator | grpo | 4/4 | 0.500 ± 0.000 | 0.450 ± 0.129 |" in page


def test_the_choice_did_not_matter_only_when_the_worst_arm_is_close_too():
    def arm(algo, finals):
        return render.Arm(algo, [str(i) for i in range(len(finals))],
                          [_cell("calculator", algo, "base", s, f, "1", 20.0) for s, f in enumerate(finals)])

    close = [arm("grpo", [0.70, 0.70, 0.71]), arm("rloo", [0.70, 0.70, 0.70])]
    far = [*close, arm("ppo", [0.50, 0.52, 0.51])]
    v2, v3 = render.verdict(close), render.verdict(far)
    assert (v2["best"], v2["runner_up"]) == (v3["best"], v3["runner_up"]) == ("grpo", "rloo")
    assert v3["worst"] == "ppo" and v3["spread_low"] > 0.15  # best - worst, not best - runner-up
    level = FACTORS["baseline"].levels[0]
    said = lambda arms: render.advice([render.Row(FACTORS["baseline"], level, "calculator", arms, render.verdict(arms))])[0]
    assert len(said(close)) == 1 and "did not matter" in said(close)[0]
    assert said(far) == []


def test_the_folklore_did_not_hold_when_the_interval_rules_out_its_advantage():
    def arm(algo, finals):
        return render.Arm(algo, [str(i) for i in range(len(finals))],
                          [_cell("calculator", algo, "flip10", s, f, "1", 20.0) for s, f in enumerate(finals)])

    level = FACTORS["reward_noise"].levels[1]  # flip10: the advice expects ppo to win
    arms = [arm("grpo", [0.70, 0.70, 0.71]), arm("ppo", [0.70, 0.70, 0.70])]
    _, folk = render.advice([render.Row(FACTORS["reward_noise"], level, "calculator", arms, render.verdict(arms))])
    # grpo - ppo = +0.0033, se 0.0033, Welch df 2 (t 4.303): low = -0.011, so ppo's advantage is at most +0.011
    assert len(folk) == 1 and "**did not hold here**: no advantage of ppo as large as 0.05 (at most +0.011" in folk[0]


# ============================================================================ the seeds follow the measured spread
def _write_cells(results, task, algo, arm, finals, start=0.5):
    results.mkdir(exist_ok=True)
    for seed, final in enumerate(finals):
        record = _cell(task, algo, arm, seed, final, "1", 20.0)
        record["success"]["initial_accuracy"] = start
        (results / f"{record['cell']['id']}.json").write_text(json.dumps(record))


def test_the_plan_takes_the_larger_of_compares_and_the_studys_own_spread(tmp_path):
    results = tmp_path / "cells"
    # the study's own arms: [0.6, 0.7, 0.8] and [0.4, 0.5, 0.6], sd 0.1 each: pooled sd 0.1 over 6 cells
    _write_cells(results, "calculator", "grpo", "base", [0.6, 0.7, 0.8])
    _write_cells(results, "calculator", "ppo", "base", [0.4, 0.5, 0.6])
    _write_cells(results, "calculator", "rloo", "base", [0.9])  # one seed: no spread, not counted
    own = study.spread_from_study(results)
    assert own == {"calculator": {"sd": pytest.approx(0.1), "cells": 6}}
    compare = {"calculator": {"sd": 0.011, "source": "c.json"}, "sql": {"sd": 0.03, "source": "s.json"}}
    table = study.power_table(compare, own)
    # compare alone: 1 seed needed (clamped up to MIN_SEEDS); the study's sd 0.1 needs 2 (1.96 + 0.84)^2 4 = 62.8 -> 63
    assert table["calculator"]["needed"] == 1 and table["calculator"]["own_needed"] == 63
    assert table["calculator"]["planned"] == study.MAX_SEEDS  # capped: the page says what 10 seeds detect
    assert table["calculator"]["detectable"] == pytest.approx(study.detectable(0.1, study.MAX_SEEDS))
    # no cells of its own yet: compare's spread decides (0.03 -> 6 seeds)
    assert table["sql"]["own_sd"] is None and table["sql"]["planned"] == study.seeds_needed(0.05, 0.03) == 6
    assert study.power_table(compare)["calculator"]["planned"] == study.MIN_SEEDS
    assert study.spread_from_study(tmp_path / "none") == {}


def test_a_winner_that_ended_below_its_start_is_said_to_have_lost_least(tmp_path):
    def arm(algo, finals, start):
        cells = [_cell("sql", algo, "base", s, f, "1", 20.0) for s, f in enumerate(finals)]
        for c in cells:
            c["success"]["initial_accuracy"] = start
        return render.Arm(algo, [str(i) for i in range(len(finals))], cells)

    # both below the start 0.49: grpo -0.05 on average, ppo -0.45
    arms = [arm("grpo", [0.43, 0.44, 0.45], 0.49), arm("ppo", [0.03, 0.04, 0.05], 0.49)]
    level = FACTORS["baseline"].levels[0]
    said, _ = render.advice([render.Row(FACTORS["baseline"], level, "sql", arms, render.verdict(arms))])
    assert len(said) == 1 and "**grpo** beat ppo by +0.400" in said[0]
    assert ("every arm ended below the start's 0.490 on average (grpo 0.440, ppo 0.040): grpo lost the least, "
            "it did not gain") in said[0]
    # end minus start by hand: grpo's differences -0.06, -0.05, -0.04: mean -0.05, sd 0.01, t(2) 4.303
    m, lo, hi = render.change_from_start(arms[0])
    assert (m, lo, hi) == (pytest.approx(-0.05), pytest.approx(-0.05 - 4.303 * 0.01 / math.sqrt(3)),
                           pytest.approx(-0.05 + 4.303 * 0.01 / math.sqrt(3)))
    # above the start: no such clause
    up = [arm("grpo", [0.63, 0.64, 0.65], 0.49), arm("ppo", [0.53, 0.54, 0.55], 0.49)]
    said, _ = render.advice([render.Row(FACTORS["baseline"], level, "sql", up, render.verdict(up))])
    assert len(said) == 1 and "lost the least" not in said[0]


def test_the_page_says_per_task_whether_rl_gained_and_marks_values_a_task_lacks(tmp_path):
    results = tmp_path / "cells"
    _write_cells(results, "sql", "grpo", "base", [0.43, 0.44, 0.45], start=0.49)
    _write_cells(results, "sql", "ppo", "base", [0.03, 0.04, 0.05], start=0.49)
    _write_cells(results, "default", "grpo", "base", [0.73, 0.74, 0.75], start=0.47)
    for path in results.glob("default.*.json"):  # the default task has no environment: no env calls
        record = json.loads(path.read_text())
        del record["cost"]["env_calls"]
        path.write_text(json.dumps(record))
    page = render.render(render.load_cells(results), {"calculator": 3, "frozenlake": 3, "sql": 3, "default": 3}, {}, None)
    lines = page.splitlines()
    assert "| sql | grpo (`sql.grpo.base`) | 3 | 0.490 ± 0.000 | -0.050 (-0.075, -0.025) | +0.000 |" in lines
    gist = [line for line in lines if line.startswith("- sql: of its 2 arms")]
    assert gist and "0 ended measurably above their start, 2 measurably below, 0 neither. No arm gained measurably" in gist[0]
    assert any(line.startswith("- default: of its 1 arms") and "No arm lost measurably." in line for line in lines)
    default_row = [line for line in lines if line.startswith("| default | default | grpo | 3/3 |")][0]
    assert "| n/a |" in default_row and "pending" not in default_row  # finished cells without env calls: n/a
    # one arm up, one down: the few that gained are named
    _write_cells(results, "default", "ppo", "base", [0.40, 0.41, 0.42], start=0.47)
    page = render.render(render.load_cells(results), {"calculator": 3, "frozenlake": 3, "sql": 3, "default": 3}, {}, None)
    assert ("- default: of its 2 arms (every factor and level), 1 ended measurably above their start, 1 measurably below, "
            "0 neither. Above: `default.grpo.base`.") in page.splitlines()


# ============================================================================ rollout_cost: equal charged cost
def test_interpolate_reads_between_the_evaluations_around_a_step():
    evals = [{"step": 0, "accuracy": 0.3}, {"step": 8, "accuracy": 0.5}, {"step": 16, "accuracy": 0.4}]
    assert render.interpolate(evals, 16) == 0.4 and render.interpolate(evals, 20) == 0.4  # the end, and beyond it
    assert render.interpolate(evals, 4) == pytest.approx(0.4)  # half way from 0.3 to 0.5
    assert render.interpolate(evals, 12) == pytest.approx(0.45)
    assert render.interpolate(evals, 0) == 0.3
    assert math.isnan(render.interpolate([], 3))


def test_equal_cost_reads_the_dearer_arm_where_the_cheaper_arms_budget_runs_out():
    def arm(algo, cpu, calls, evals):
        cells = []
        for seed in range(2):
            c = _cell("frozenlake", algo, "base" if algo == "grpo" else "group1", seed, evals[-1][1], "1", 20.0)
            c["process"]["cpu_seconds"] = cpu
            c["cost"].update(steps=16, env_calls=calls)
            c["evals"] = [{"step": s, "accuracy": a} for s, a in evals]
            cells.append(c)
        return render.Arm(algo, ["a", "b"], cells)

    grpo = arm("grpo", 40.0, 1000.0, [(0, 0.3), (8, 0.5), (16, 0.6)])
    ppo = arm("ppo", 80.0, 1000.0, [(0, 0.3), (8, 0.7), (16, 0.8)])
    # compute alone: grpo's 40 s buy ppo 8 of its 16 steps (5 s each): ppo read at step 8, 0.7 against grpo's 0.6
    ec = render.equal_cost([grpo, ppo], 0.0)
    assert ec.budget == 40.0 and ec.per_step == {"grpo": 2.5, "ppo": 5.0} and ec.affordable == {"grpo": 16.0, "ppo": 8.0}
    assert ec.success == {"grpo": [0.6, 0.6], "ppo": [0.7, 0.7]}
    # 0.1 s a call: 140 s against 180 s, ppo's 11.25 s a step buy it 12.44 steps: 0.7 + 0.1 * 4.44 / 8
    ec = render.equal_cost([grpo, ppo], 0.1)
    assert ec.budget == pytest.approx(140.0) and ec.affordable["ppo"] == pytest.approx(140 / 11.25)
    assert ec.success["ppo"][0] == pytest.approx(0.7 + 0.1 * (140 / 11.25 - 8) / 8)
    v = render.verdict([grpo, ppo], cost_weight=0.0, success=render.equal_cost([grpo, ppo], 0.0).success)
    assert v["best"] == "ppo" and v["difference"] == pytest.approx(0.1) and v["mcnemar"] is None
    # a cell without its evaluations: no reading
    del grpo.records[0]["evals"]
    assert render.equal_cost([grpo, ppo], 0.0) is None
