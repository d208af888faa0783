"""The prose figures of README.md and docs/ (``<!-- figure:NAME -->`` ... ``<!-- /figure -->``),
each rendered from its results file under benchmarks/results/ by ``FIGURES[NAME]``.

benchmarks/render_tables.py finds the markers and writes what these functions return; they read
the JSON through result_files.py. A sentence whose figures come from here cannot drift from
its file: the renderer's ``--check`` (run by tests/test_docs.py) fails when they differ.
"""

from __future__ import annotations

import json
import math
import re
from typing import Callable

from result_files import ENV_SEED_FILES, RESULTS, load as _load, p_value as _p_value

TEN_MINUTES = 600.0
"""The wall-clock budget a built-in environment's defaults are sized for (seconds)."""
CLEAR_P = 0.05
"""A seed's rise counts as clear on its own below this exact McNemar p-value."""


def _runs(name: str) -> list[tuple[str, dict]]:
    """A seed study's runs, in seed order."""
    return sorted(_load(name)["runs"].items(), key=lambda kv: int(kv[0]))


def _span(values, fmt: str = ".0f", unit: str = "") -> str:
    """``lo-hi`` of ``values`` (one value when they agree at that precision)."""
    lo, hi = f"{min(values):{fmt}}", f"{max(values):{fmt}}"
    return (lo if lo == hi else f"{lo}-{hi}") + unit


def _join(values, fmt: str, sep: str = ", ") -> str:
    return sep.join(format(v, fmt) for v in values)


def _pairs(pairs, fmt: str = ".2f") -> str:
    """``a -> b, c -> d, ...``"""
    return ", ".join(f"{a:{fmt}} -> {b:{fmt}}" for a, b in pairs)


def _acc(run: dict, i: int) -> float:
    return run["eval"][i]["accuracy"]


def _rises(name: str) -> str:
    """Each seed's held-out success, first -> last evaluation."""
    return ", ".join(f"{_acc(r, 0):.2f} -> {_acc(r, -1):.2f}" for _, r in _runs(name))


def _flips(run: dict, p: bool = False) -> str:
    paired = run["heldout_first_last_paired"]
    return f"+{paired['gained']} / -{paired['lost']}" + (f" ({_p_value(paired['p_value'])})" if p else "")


def _pooled(names: list[str]) -> tuple[int, int]:
    """Rows gained and lost over every run of these studies."""
    runs = [r for name in names for _, r in _runs(name)]
    return (sum(r["heldout_first_last_paired"]["gained"] for r in runs),
            sum(r["heldout_first_last_paired"]["lost"] for r in runs))


def _mcnemar(gained: int, lost: int) -> float:
    """The exact two-sided McNemar p-value of ``gained`` against ``lost`` discordant rows."""
    n, k = gained + lost, min(gained, lost)
    return min(1.0, 2.0 * sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n) if n else 1.0


def _mean_rise(name: str) -> float:
    runs = [r for _, r in _runs(name)]
    return sum(_acc(r, -1) - _acc(r, 0) for r in runs) / len(runs)


def _warmup_step(run: dict) -> float:
    return run["sft_seconds"] / run["sft_steps"]


# -- README.md -------------------------------------------------------------------------------

SQL_PADDED_WARMUP = "env_train_sql_width128_default_threads_paired_cpu.json"
"""sql's seed study before its warm-up's batches ran as tries (the same defaults otherwise)."""
SQL_FRESH_SEEDS = "env_train_sql_fresh_seeds_default_threads_cpu.json"
"""sql's defaults on seeds never used to choose them."""


def _wall_range(name: str) -> str:
    return _span([run["wall_seconds"] for _, run in _runs(name)], unit=" s")


def _gains(name: str) -> str:
    return ", ".join(_flips(r) for _, r in _runs(name))


def sql_readme() -> str:
    """The README's sentence on sql's rows of the seed table, its slower first seed and its fresh seeds."""
    study = ENV_SEED_FILES[2]
    seed0 = _load(study)["runs"]["0"]
    fresh = [seed for seed, _ in _runs(SQL_FRESH_SEEDS)]
    return (f"sql's rows are its command as typed (two threads; warm-up target 0.5 since these runs), **within the 10 minutes** "
            f"({_wall_range(study)}; {_wall_range(SQL_PADDED_WARMUP)} before its warm-up ran as a trie); seed 0 starts at "
            f"{_acc(seed0, 0):.2f} and gains least ({_acc(seed0, -1):.2f} at the end, {_flips(seed0)}, "
            f"{_p_value(seed0['heldout_first_last_paired']['p_value'])}). "
            f"On three fresh seeds ({fresh[0]}-{fresh[-1]}, never used to choose) each rise is "
            f"clear: {_gains(SQL_FRESH_SEEDS)} in {_wall_range(SQL_FRESH_SEEDS)} "
            "([Agents](docs/agents.md#the-sql-defaults-and-how-they-were-chosen)).")


def _compare_env(env: str) -> dict:
    return json.loads((RESULTS / f"compare_env_{env}" / "compare.json").read_text())


def compare_env_readme() -> str:
    """The README's sentence on the three `fastrl compare --env` runs: code, date, load, jobs, wall minutes, sql's warm-up."""
    data = {env: _compare_env(env) for env in ("sql", "frozenlake", "calculator")}
    loads = [x for d in data.values() for x in (d["load_average"]["start"][0], d["load_average"]["end"][0])]
    jobs = {d["jobs"] for d in data.values()}
    minutes = {env: d["total_seconds"] / 60 for env, d in data.items()}
    start = data["sql"]["summary"][data["sql"]["algorithms"][0]]["initial_accuracy"]["mean"]
    separated = [f"{v['winner']} on {v['axis']} in {env}" for env, d in data.items() for v in d["verdicts"] if v["distinguishable"]]
    seeds = ("the seeds separate no algorithm on any axis but " + ", ".join(separated) if separated
             else "the seeds separate no algorithm on any axis")
    return (f"load average {min(loads):.1f}-{max(loads):.1f}: the comparison's own two runs), with the default "
            f"`--jobs {'/'.join(map(str, sorted(jobs)))}` (two single-threaded runs at once): {minutes['sql']:.1f} min wall (sql, its "
            f"warm-up {data['sql']['start']['seconds'] / 60:.1f} of it), {minutes['frozenlake']:.1f} (frozenlake) and "
            f"{minutes['calculator']:.1f} (calculator), each within the 15 minutes the defaults are sized for. At these budgets "
            f"{seeds}; on sql PPO and grpo_then_ppo fall from the warm-up's {start:.2f}")


# -- docs/agents.md --------------------------------------------------------------------------

REAL_TOKENIZER = "agent_real_tokenizer_cpu.json"
"""benchmarks/agent_real_tokenizer.py before (``before_4d84e71``) and after the tokenization fixes."""


def real_tokenizer_json() -> str:
    """The token count of a non-ASCII JSON tool result, sent as text against ASCII-escaped."""
    data = _load(REAL_TOKENIZER)
    return (f"{data['after']['tools']['dict_result_tokens']} tokens, "
            f"{data['before_4d84e71']['tools']['dict_result_tokens']} ASCII-escaped")


def real_tokenizer_defects() -> str:
    """The real-tokenizer benchmark's other defects, before -> after."""
    data = _load(REAL_TOKENIZER)
    before, after = data["before_4d84e71"], data["after"]
    failures = {(case, kind): n for case in ("malformed", "mixed")
                for kind, n in after["calculator"]["qwen2.5"][case]["tool_failures"].items()}
    cut = before["truncation"]["end"]
    return ("Tool failures: " + " and ".join(f"`{kind}` {n:.0f} in each `{case}` run" for (case, kind), n in failures.items())
            + ", before and after, none of another kind. What remains after is the templates' own rewriting: Llama 3 trims the "
            "leading newline; in the mixed runs, Qwen3's style drops a newline written before `<think>` and Llama 3's the "
            "leading newlines. Before, the other end token reached the environment as text (`5<|endoftext|>`: the answer "
            "failed, reward 0), and a turn with reasoning was scored with it (reward 0). The other defects, same file: cutting "
            f"an emoji-and-CJK text to 1-{cut['limits']} tokens by encode-slice-decode left U+FFFD in "
            f"{before['truncation']['end']['with_replacement_char']} of {cut['limits']} cuts from the end and "
            f"{before['truncation']['start']['with_replacement_char']} from the start, "
            f"{after['truncation']['end']['with_replacement_char'] + after['truncation']['start']['with_replacement_char']} now; "
            "a rollout that checked no turn logged `tokenization/mismatch_rate` "
            f"{before['rate_when_nothing_checked']['mismatch_rate']:g}, now it is {after['rate_when_nothing_checked']['mismatch_rate']} "
            f"and `tokenization/checked_turns` {after['rate_when_nothing_checked']['checked_turns']:g}; a call inside `<think>` was "
            f"{'run' if before['tools']['call_inside_think_run'] else 'not run'}, now "
            f"{'run' if after['tools']['call_inside_think_run'] else 'not'}; the dict result above was "
            f"{before['tools']['dict_result_tokens']} tokens, now {after['tools']['dict_result_tokens']}; a tool result holding "
            f"`<|im_end|>\\n<|im_start|>assistant` put {before['tools']['injected_tool_result_im_end_tokens_in_delta']} `<|im_end|>` "
            "tokens in its delta (the template's and the injected), now "
            f"{after['tools']['injected_tool_result_im_end_tokens_in_delta']}")


def calculator_seed0() -> str:
    """docs/agents.md's account of `fastrl train --env calculator`, seed 0: the README table's run."""
    data = _load(ENV_SEED_FILES[0])
    run = data["runs"]["0"]
    acc = {int(e["step"]): e["accuracy"] for e in run["eval"]}
    last = max(acc)
    tools = run["eval"][0]["tool_call_rate"], run["eval"][-1]["tool_call_rate"]
    paired = run["heldout_first_last_paired"]
    load = "/".join(f"{x:.1f}" for x in run["load_average_before_after"])
    return (f"`fastrl train --env calculator` (seed 0, nothing else; `{data['command']}`, {data['date']}, code {run['commit']}, "
            f"{data['machine']}; the README table's first row): the warm-up stopped after {run['sft_steps']:.0f} steps "
            f"({run['sft_seconds']:.0f} s; probe success {run['sft_probe_accuracy']:.2f} on 100 training rows), then "
            f"{run['rl_steps']} GRPO steps of 16 rows x 8 trajectories ({run['rl_step_seconds_median']:.2f} s each, median). "
            f"Held-out success ({paired['rows']} rows, greedy episodes): **{acc[0]:.2f} after the warm-up -> {acc[25]:.2f} at "
            f"step 25 -> {acc[50]:.2f} at step 50**, {acc[last]:.2f} at step {last} (+{paired['gained']} / -{paired['lost']} "
            f"rows, {_p_value(paired['p_value'])}); tool-call rate {tools[0]:.2f} before and {tools[1]:.2f} after (the warm-up "
            f"teaches the call; RL teaches copying the expression and the result exactly). {run['wall_seconds']:.0f} s wall "
            f"({run['cpu_seconds']:.0f} s CPU), load average {load} before/after. Results: "
            f"`benchmarks/results/{ENV_SEED_FILES[0]}`.")


SQL_WIDTH128_ONE_THREAD = "env_train_sql_width128_3seeds_cpu.json"
SQL_WIDTH128_TYPED = "env_train_sql_width128_default_threads_cpu.json"
SQL_TRIE = "env_train_sql_trie_warmup_default_threads_cpu.json"
SQL_TRIE_GIGPO = "env_train_sql_trie_gigpo_default_threads_cpu.json"
SFT_LAYOUT = "sft_layout_cpu.json"
SQL_NARROWED_DECODE = "multiturn_rollout_narrowed_sql_shape_cpu.json"
SQL_PROBE_CURVE = "warmup_probe_curve_sql_seed0_cpu.json"
PROBE_SOONER = {"sql": "env_train_sql_probe_sooner_default_threads_cpu.json",
                "frozenlake": "env_train_frozenlake_probe_sooner_cpu.json",
                "calculator": "env_train_calculator_probe_sooner_cpu.json"}
"""The seed studies with ``--sft_probe_sooner`` on (code 1992e0f), beside ENV_SEED_FILES' fixed-interval runs."""
SQL_FAILURES_PROBE_SOONER = "sql_failures_probe_sooner_cpu.json"
DEFAULT_PROBE_SOONER = "default_train_probe_sooner_cpu.json"
DEFAULT_SEEDS = "default_train_3seeds_cpu.json"
PADDED_WARMUP = {"calculator": "env_train_calculator_3seeds_paired_cpu.json",
                 "frozenlake": "env_train_frozenlake_3seeds_paired_cpu.json"}
"""The calculator's and frozenlake's seed studies before the warm-up's tries and the narrowed decode (code 16a80a5)."""


def _clear(run: dict) -> bool:
    return run["heldout_first_last_paired"]["p_value"] < CLEAR_P


def _commits(name: str) -> str:
    return ", ".join(sorted({run["commit"].split("+")[0] for _, run in _runs(name)}))


def _within(name: str) -> str:
    """How far inside (or over) the 10 minutes a study's runs ended."""
    walls = [run["wall_seconds"] for _, run in _runs(name)]
    if max(walls) <= TEN_MINUTES:
        return f"within the 10 minutes, by {_span([TEN_MINUTES - w for w in walls], unit=' s')}"
    return "over the 10 minutes"


def sql_width128() -> str:
    """The 128-wide sql model on one thread, then as typed (two threads), 2026-12-03."""
    typed = _runs(SQL_WIDTH128_TYPED)
    walls = {seed: run["wall_seconds"] for seed, run in typed}
    slowest = max(walls, key=walls.get)
    one = [r for _, r in _runs(SQL_WIDTH128_ONE_THREAD)]
    return ("A 128-wide model (head dimension 32, ~4x the FLOPs) rose on every seed, one thread each: "
            + ", ".join(f"{_acc(r, -1) - _acc(r, 0):+.2f}" for r in one)
            + f" (`benchmarks/results/{SQL_WIDTH128_ONE_THREAD}`). As a user types it (`{_load(SQL_WIDTH128_TYPED)['command']}`, "
            "two threads, one seed after the other on the idle machine; `python benchmarks/env_train_seeds.py --env sql --seeds "
            f"0 1 2 --threads default --out F`, code {_commits(SQL_WIDTH128_TYPED)}, `benchmarks/results/{SQL_WIDTH128_TYPED}`): "
            f"held-out **{_rises(SQL_WIDTH128_TYPED)}** ("
            + ", ".join(f"{_acc(r, -1) - _acc(r, 0):+.2f}" for _, r in typed)
            + f"; seed 1's {len(typed[1][1]['eval'])} evaluations: {_join([e['accuracy'] for e in typed[1][1]['eval']], '.2f')}), "
            f"warm-up {_span([r['sft_steps'] for _, r in typed])} steps ({_span([r['sft_seconds'] for _, r in typed], unit=' s')}), "
            f"RL step {_span([r['rl_step_seconds_median'] for _, r in typed], '.1f', ' s')}, "
            f"**{_wall_range(SQL_WIDTH128_TYPED)} wall** ({_span([r['cpu_seconds'] for _, r in typed])} CPU-s): within the 10 "
            f"minutes, by {TEN_MINUTES - walls[slowest]:.0f} s on seed {slowest}, so a loaded machine takes longer. On one thread "
            f"a run takes {_span([r['cpu_seconds'] for r in one])} CPU-s (over 10 minutes), which is why sql's seed studies since "
            "are the two-thread runs.")


def sql_paired() -> str:
    """The 128-wide sql model as typed on 2026-12-04's instance, rows gained and lost, against 2026-12-03's runs."""
    runs, before = _runs(SQL_PADDED_WARMUP), _runs(SQL_WIDTH128_TYPED)
    clear = all(_clear(r) for _, r in runs)
    return (f"The same command on today's machine (`python benchmarks/env_train_seeds.py --env sql --seeds 0 1 2 --threads default "
            f"--out F`, code {_commits(SQL_PADDED_WARMUP)}, `benchmarks/results/{SQL_PADDED_WARMUP}`): held-out "
            f"**{_rises(SQL_PADDED_WARMUP)}**, rows **{', '.join(_flips(r, p=True) for _, r in runs)}**: "
            + ("the rise is clear on every seed" if clear else "the rise is not clear on every seed")
            + f". The curves differ from the day before's ({_acc(before[0][1], 0):.2f} -> {_acc(before[0][1], -1):.2f} on seed 0): a "
            "run is deterministic on one machine (seed 0 twice today, with and without a sampling profiler attached: the same "
            "evaluations and the same rows) but not across machines, whose CPUs take other BLAS paths. Today's instance is also "
            f"slower (warm-up step {_span([_warmup_step(r) for _, r in runs], '.2f', ' s')} against "
            f"{_span([_warmup_step(r) for _, r in before], '.2f')}, RL step {_span([r['rl_step_seconds_median'] for _, r in runs], '.1f', ' s')} "
            f"against {_span([r['rl_step_seconds_median'] for _, r in before], '.1f')}): **{_wall_range(SQL_PADDED_WARMUP)} wall, "
            f"{_within(SQL_PADDED_WARMUP)}** that the earlier instance met ({_wall_range(SQL_WIDTH128_TYPED)}).")


def sft_layout_trie() -> str:
    """benchmarks/bench_sft_layout.py: a warm-up batch as a trie against padded, per built-in task."""
    data = _load(SFT_LAYOUT)
    task = {r["task"]: r for r in data["results"]}
    sql, lake = task["sql"], task["frozenlake"]
    slower = [t for t in ("calculator", "default") if task[t]["speed_trie_vs_padded"] < 1]
    return (f"Its forward runs {sql['trie_tokens_mean']:,.0f} tokens against {sql['padded_tokens_mean']:,.0f} padded, and a warm-up "
            f"step takes **{sql['trie_step_s']:.2f} s against {sql['padded_step_s']:.2f} s ({sql['speed_trie_vs_padded']:.2f}x)**; "
            f"frozenlake's {lake['speed_trie_vs_padded']:.2f}x ({lake['trie_tokens_mean']:,.0f} of {lake['padded_tokens_mean']:,.0f} "
            "tokens). The "
            + " and the ".join(f"{'default task' if t == 'default' else t}'s ({task[t]['trie_saving']:.0%} saving)" for t in slower)
            + " batches run slower as a trie ("
            + ", ".join(f"{task[t]['speed_trie_vs_padded']:.2f}x" for t in slower)
            + ": the tree attention costs more per token than the padded causal kernel), so `auto` takes the trie only when it "
            f"runs at most half the padded tokens (`{data['command']}`, torch's {data['threads']} threads, interleaved best of the "
            f"rounds, {data['created'][:10]}).")


def sql_narrowed_decode() -> str:
    """benchmarks/bench_multiturn_rollout.py on a sql-shaped rollout: the decode of the rows still sampling against all rows."""
    data = _load(SQL_NARROWED_DECODE)
    shape = data["shape"]
    return (f"On a sql-shaped rollout ({shape['G']} trajectories, budgets {1 - shape['budget_spread']:.0%}-100% of "
            f"{shape['model_tokens_per_turn']} tokens, {shape['turns']} turns, the {shape['model']['hidden']}-wide model, "
            f"{data['threads']} thread) that is **{data['cpu_speedup_narrowed']:.2f}x** in CPU time, the same tokens "
            f"(`{data['command']}`); in the runs below the RL step's median was "
            f"{_span([r['rl_step_seconds_median'] for _, r in _runs(SQL_TRIE)], '.1f', ' s')}, against "
            f"{_span([r['rl_step_seconds_median'] for _, r in _runs(SQL_PADDED_WARMUP)], '.1f', ' s')} before, so most of the "
            "saving is the warm-up's.")


def sql_trie_summary() -> str:
    """sql's runs with the warm-up as a trie (target 0.4) against the padded warm-up's."""
    runs, before = _runs(SQL_TRIE), _runs(SQL_PADDED_WARMUP)
    gained, lost = _pooled([SQL_TRIE])
    clear = [seed for seed, r in runs if _clear(r)]
    unclear = [(seed, r) for seed, r in runs if not _clear(r)]
    rows = sum(r["heldout_first_last_paired"]["rows"] for _, r in runs)
    churn = "; ".join(f"**not on seed {seed}**, whose rows churned ({_flips(r)})" for seed, r in unclear)
    return (f"Every run is now **{_within(SQL_TRIE)}** ({_wall_range(SQL_TRIE)} against {_wall_range(SQL_PADDED_WARMUP)}; the "
            f"warm-up {_span([r['sft_seconds'] for _, r in runs], unit=' s')} against "
            f"{_span([r['sft_seconds'] for _, r in before], unit=' s')}). Held-out success rises clearly on seeds "
            f"{' and '.join(clear)} and over the three seeds together (rows +{gained} / -{lost}, exact McNemar "
            f"{_p_value(_mcnemar(gained, lost))} on the {rows} rows; mean {_mean_rise(SQL_TRIE):+.3f}), but {churn}. The trie's "
            "float sums are not the padded batch's (the same math in another order), so each seed's run is a new draw: the day "
            f"before, seed 1 rose {_flips(before[1][1])} and seed 0 {_flips(before[0][1])}.")


def _same_or_both(a, b, fmt: str) -> str:
    return f"{a:{fmt}}" if f"{a:{fmt}}" == f"{b:{fmt}}" else f"{a:{fmt}} and {b:{fmt}}"


def sql_trie_gigpo() -> str:
    """GiGPO against GRPO on sql's trie warm-up runs."""
    runs, grpo = _runs(SQL_TRIE_GIGPO), dict(_runs(SQL_TRIE))
    held = ", ".join((f"**{_acc(r, 0):.2f} -> {_acc(r, -1):.2f} ({_flips(r)})**" if not _clear(r)
                      else f"{_acc(r, 0):.2f} -> {_acc(r, -1):.2f} ({_flips(r)})") for _, r in runs)
    g1, r1 = dict(runs)["1"], grpo["1"]
    return (f"Held-out {held}, {_wall_range(SQL_TRIE_GIGPO)}: the same picture. Seed 1's warm-up is "
            f"{'the same in both' if (g1['sft_steps'], g1['sft_probe_accuracy']) == (r1['sft_steps'], r1['sft_probe_accuracy']) else 'not the same'} "
            f"({_same_or_both(r1['sft_steps'], g1['sft_steps'], '.0f')} steps, probe "
            f"{_same_or_both(r1['sft_probe_accuracy'], g1['sft_probe_accuracy'], '.2f')}) and both algorithms fall to "
            f"{_span([r1['eval'][1]['accuracy'], g1['eval'][1]['accuracy']], '.2f')} at step {r1['eval'][1]['step']:.0f}")


def sql_target05_intro() -> str:
    runs = _runs(ENV_SEED_FILES[2])
    return (f"took {_span([r['sft_steps'] for _, r in runs])} steps ({_span([r['sft_seconds'] for _, r in runs], unit=' s')})")


def sql_target05_summary() -> str:
    """sql's warm-up target 0.5 against 0.4 on the same three seeds."""
    runs, at04 = _runs(ENV_SEED_FILES[2]), _runs(SQL_TRIE)
    gained, lost = _pooled([ENV_SEED_FILES[2]])
    s0, s2 = runs[0][1], runs[2][1]
    return (f"Over the three seeds rows +{gained} / -{lost} (mean {_mean_rise(ENV_SEED_FILES[2]):+.2f}, against "
            f"{_mean_rise(SQL_TRIE):+.3f} at 0.4), and every seed ends "
            + ("higher than at 0.4 or the same" if all(_acc(r, -1) >= _acc(q, -1) for (_, r), (_, q) in zip(runs, at04))
               else "not always higher than at 0.4")
            + f" ({', '.join(f'{_acc(r, -1):.2f}' for _, r in runs)} against {', '.join(f'{_acc(r, -1):.2f}' for _, r in at04)}; "
            f"seed 2's warm-up overshot to {s2['sft_probe_accuracy']:.2f} at step {s2['sft_steps']:.0f} under both targets, so its "
            f"run is the same). Seed 0's rise is the smallest and not clear on its own: its warm-up overshot to "
            f"{s0['sft_probe_accuracy']:.2f} (probe) and {_acc(s0, 0):.2f} held-out, leaving "
            f"{round((1 - _acc(s0, 0)) * s0['heldout_first_last_paired']['rows'])} rows to gain.")


def sql_fresh_summary() -> str:
    """sql's defaults on three fresh seeds, and over all six."""
    runs = _runs(SQL_FRESH_SEEDS)
    six = [r for _, r in _runs(ENV_SEED_FILES[2])] + [r for _, r in runs]
    gained, lost = _pooled([ENV_SEED_FILES[2], SQL_FRESH_SEEDS])
    s0, s4 = _load(ENV_SEED_FILES[2])["runs"]["0"], dict(runs)["4"]
    return (f"Each rises {'clearly' if all(_clear(r) for _, r in runs) else 'but not always clearly'}, "
            f"{_within(SQL_FRESH_SEEDS).split(', by')[0]} ({_wall_range(SQL_FRESH_SEEDS)}; the RL step's median "
            f"{_span([r['rl_step_seconds_median'] for _, r in runs], '.1f', ' s')}). Over the six seeds at sql's defaults, held-out "
            f"rows went +{gained} / -{lost}, and {sum(map(_clear, six))} of the six rises are clear on their own (seed 0's, from "
            f"{_acc(s0, 0):.2f}, is {_flips(s0)}). Seed 4, like seed 0, overshot its target ({s4['sft_probe_accuracy']:.2f}) and "
            "still rose.")


def sql_probe_curve() -> str:
    """benchmarks/warmup_probe_curve.py: sql seed 0's warm-up probed at every step near its target."""
    data = _load(SQL_PROBE_CURVE)
    probes, target, every = data["probes"], data["target"], data["check_every"]
    first = next(i for i, (_, acc) in enumerate(probes) if acc >= target)
    settled = next(i for i in range(len(probes)) if all(acc >= target for _, acc in probes[i:]))
    dip = [acc for _, acc in probes[first + 1:settled]]
    below = [acc for _, acc in probes[:first]]
    stop = data["stops"]["fixed_interval"][0]
    seen = [(s, acc) for s, acc in probes if s % every == 0 and s <= stop and s > probes[0][0]]
    return (f"Probed at every step from {probes[0][0]} to {probes[-1][0]} (`{data['command'].split(' --out')[0]}`, code "
            f"{data['commit']}, `benchmarks/results/{SQL_PROBE_CURVE}`), its probe stays at {_span(below, '.2f')} to step "
            f"{probes[first - 1][0]}, first reaches {target} at step {probes[first][0]} ({probes[first][1]:.2f}), then moves between "
            f"{_span(dip, '.2f')} for {len(dip)} steps and climbs from {probes[settled][1]:.2f} at step {probes[settled][0]} to "
            f"{data['stops']['fixed_interval'][1]:.2f} at {stop}. Probing every {every} steps sees "
            + ", ".join(f"{acc:.2f} ({s})" for s, acc in seen[-3:]) + ".")


def probe_sooner_summary() -> str:
    """The seed studies with the warm-up probed sooner near its target, against the fixed-interval runs."""
    by_env = {env: [r for _, r in _runs(name)] for env, name in PROBE_SOONER.items()}
    fixed = {env: [r for _, r in _runs(name)] for env, name in zip(("calculator", "frozenlake", "sql"), ENV_SEED_FILES)}
    sooner_clear = sum(_clear(r) for env in ("sql", "frozenlake") for r in by_env[env])
    fixed_clear = sum(_clear(r) for env in ("sql", "frozenlake") for r in fixed[env])
    curve = _load(SQL_PROBE_CURVE)["probes"]
    stop = next(i for i, (_, acc) in enumerate(curve) if acc >= _load(SQL_PROBE_CURVE)["target"])
    failures = {(r["seed"], r["model"].rsplit("/", 1)[1]): r["total"] for r in _load(SQL_FAILURES_PROBE_SOONER)["results"]}
    default, every50 = _runs(DEFAULT_PROBE_SOONER), _runs(DEFAULT_SEEDS)
    rows = default[0][1]["heldout_first_last_paired"]["rows"]
    return (f"The warm-ups stop where meant, near the target, but RL did no better from there: {sooner_clear} of the six sql "
            f"and frozenlake runs rose clearly (p < {CLEAR_P}), against {fixed_clear} of six in the fixed-interval runs. Probing "
            f"often, the warm-up stops at the first probe noise lifts over the target (sql seed 0's {curve[stop][1]:.2f} at step "
            f"{curve[stop][0]} is followed by {curve[stop + 1][1]:.2f} and {curve[stop + 2][1]:.2f}), one step of a rate that still "
            "jitters from step to step. Seed 0's flat run failed by copying the query's result wrongly, "
            f"{failures[(0, 'reference')]['copy_fail']} of 100 held-out rows at step 0 and {failures[(0, 'final')]['copy_fail']} at "
            f"the end, while seeds 1 and 2 cut their copy failures from {failures[(1, 'reference')]['copy_fail']} to "
            f"{failures[(1, 'final')]['copy_fail']} and {failures[(2, 'reference')]['copy_fail']} to {failures[(2, 'final')]['copy_fail']} "
            f"(`benchmarks/sql_failures.py` on each run's `reference/` and `final/`, `benchmarks/results/{SQL_FAILURES_PROBE_SOONER}`). "
            f"The default task, with the rule (`benchmarks/results/{DEFAULT_PROBE_SOONER}`), rose on "
            f"{'every seed' if all(_clear(r) for _, r in default) else 'some seeds'} ({', '.join(_flips(r) for _, r in default)} of "
            f"{rows} rows; every 50 steps, docs/train.md's table: {', '.join(_flips(r) for _, r in every50)}).")


def calculator_frozenlake_rerun() -> str:
    """The calculator's and frozenlake's seed studies on the trie warm-up and narrowed decode (the README's rows) against before."""
    calc, lake = _runs(ENV_SEED_FILES[0]), _runs(ENV_SEED_FILES[1])
    calc_before, lake_before = _runs(PADDED_WARMUP["calculator"]), _runs(PADDED_WARMUP["frozenlake"])
    same = all([e["accuracy"] for e in a["eval"]] == [e["accuracy"] for e in b["eval"]] for (_, a), (_, b) in zip(calc, calc_before))
    trie = {r["task"]: r for r in _load(SFT_LAYOUT)["results"]}["frozenlake"]
    rises = ", ".join(f"{_acc(r, 0):.2f} -> {_acc(r, -1):.2f} ({_flips(r)}"
                      + (f", {_p_value(r['heldout_first_last_paired']['p_value'])})" if r["heldout_first_last_paired"]["p_value"] >= 0.001 else ")")
                      for _, r in lake)
    return (f"The other two environments, rerun on this code (code {_commits(ENV_SEED_FILES[0])}, `--threads 1`, two studies at a "
            "time; the README's rows): the calculator's three runs are "
            + ("the earlier ones to the last held-out evaluation" if same else "not the earlier ones")
            + f" (its warm-up stays padded, and narrowing its decode sampled the same tokens), {_wall_range(ENV_SEED_FILES[0])}; "
            f"frozenlake's warm-up took {_span([r['sft_seconds'] for _, r in lake], unit=' s')} against "
            f"{_span([r['sft_seconds'] for _, r in lake_before], unit=' s')} (a trie of ~{trie['trie_tokens_mean'] / trie['padded_tokens_mean']:.0%} "
            f"of the padded tokens), its runs {_wall_range(ENV_SEED_FILES[1])} against {_wall_range(PADDED_WARMUP['frozenlake'])}, "
            f"and its rise is {'clear on all three seeds' if all(_clear(r) for _, r in lake) else 'not clear on every seed'}: {rises}.")


SQL_WIDTH64 = "env_train_sql_3seeds_cpu.json"
"""sql's first seed study at 150 RL steps, 64 wide, one thread: the lever table's first row."""
SQL_WIDTH64_100 = "env_train_sql_100steps_3seeds_cpu.json"
SQL_LEVERS = {"gigpo": "env_train_sql_gigpo_3seeds_cpu.json", "kl0": "env_train_sql_kl0_3seeds_cpu.json",
              "lr": "env_train_sql_lr1e-3_3seeds_cpu.json", "tree": "env_train_sql_tree_3seeds_cpu.json",
              "group16": "env_train_sql_group16_3seeds_cpu.json", "rlwarmup": "env_train_sql_rlwarmup20_3seeds_cpu.json",
              "heads2": "env_train_sql_heads2_3seeds_cpu.json", "answer10": "env_train_sql_answerweight10_3seeds_cpu.json",
              "answer10_100": "env_train_sql_answerweight10_100steps_3seeds_cpu.json"}
"""The 64-wide levers of the sql_levers table, by what they change."""
SQL_TRAIN_REWARD = "env_train_sql_train_reward_cpu.json"
SQL_WIDTH64_TYPED_150 = "env_train_sql_default_threads_150steps_cpu.json"
SQL_WIDTH64_TYPED_100 = "env_train_sql_default_threads_cpu.json"
SQL_FAILURES = "sql_failures_cpu.json"
SQL_NO_HEADER = "env_train_sql_noheader_seed1_cpu.json"
SQL_TARGET03 = "env_train_sql_target03_seed1_cpu.json"
HELDOUT_ROWS = 100
STANDARD_ERROR = math.sqrt(2 * 0.5 * 0.5 / HELDOUT_ROWS)
"""The standard error of a difference of two evaluations near 0.5 on 100 held-out rows."""


def _rise(run: dict) -> float:
    return _acc(run, -1) - _acc(run, 0)


def sql_150_vs_100() -> str:
    return f"{_mean_rise(SQL_WIDTH64) - _mean_rise(SQL_WIDTH64_100):+.2f}"


def sql_width64() -> str:
    """sql's 64-wide defaults over three seeds, and the levers measured on them (the sql_levers table's runs)."""
    runs = [r for _, r in _runs(SQL_WIDTH64)]
    walls = [r["wall_seconds"] for r in runs]
    tools = [e["tool_call_rate"] for r in runs for e in r["eval"]]
    rises = [_rise(r) for r in runs]
    order = sorted(range(len(runs)), key=lambda i: -rises[i])
    means = {name: _mean_rise(f) for name, f in SQL_LEVERS.items() if not name.startswith("answer")}
    gigpo = [_rise(r) for _, r in _runs(SQL_LEVERS["gigpo"])]
    kl0 = _load(SQL_LEVERS["kl0"])["runs"]["0"]
    lr = [r for _, r in _runs(SQL_LEVERS["lr"])]
    same_start = [f for f in [SQL_WIDTH64, SQL_WIDTH64_100, *SQL_LEVERS.values()]
                  if _acc(_load(f)["runs"]["2"], 0) == _acc(runs[2], 0) and _load(f)["runs"]["2"]["sft_steps"] == runs[2]["sft_steps"]]
    reward = _load(SQL_TRAIN_REWARD)
    windows = [reward["runs"][f"seed{s}"] for s in range(3)]
    return (f"At width 64, with the defaults ({runs[0]['rl_steps']} steps) the warm-up stopped after "
            f"{_join([r['sft_steps'] for r in runs], '.0f')} steps (probe {_join([r['sft_probe_accuracy'] for r in runs], '.2f')}) "
            f"and a run took {_span(walls, unit=' s')} of wall clock ({_span([w / 60 for w in walls], '.1f', ' min')}, "
            f"{'within' if max(walls) <= TEN_MINUTES else 'over'} the 10), the tool-call rate {_span(tools, '.1f')} throughout. "
            f"Held-out success rises on {'every seed' if min(rises) > 0 else 'some seeds'} ({', '.join(f'{x:+.2f}' for x in rises)}), "
            f"**but clearly on seed {order[0]} only**: {rises[order[0]]:+.2f} is {rises[order[0]] / STANDARD_ERROR:.0f} standard errors "
            f"of a difference, {rises[order[1]]:+.2f} (seed {order[1]}) about {rises[order[1]] / STANDARD_ERROR:.0f} and "
            f"{rises[order[2]]:+.2f} (seed {order[2]}) less. None of the levers makes the rise clear on all three seeds. GiGPO's "
            f"step-group credit has {'the largest' if max(means, key=means.get) == 'gigpo' else 'a'} mean change "
            f"({means['gigpo']:+.3f}: {', '.join(f'{x:+.2f}' for x in gigpo)}), within the seeds' noise of GRPO's "
            f"{_mean_rise(SQL_WIDTH64):+.3f}; without the KL term (`--kl_coef 0`) seed 0 collapsed ({_acc(kl0, 0):.2f} -> "
            f"{_acc(kl0, 1):.2f} at step {kl0['eval'][1]['step']:.0f}, {_acc(kl0, -1):.2f} at the end); a learning rate of 1e-3 left "
            f"seeds 1 and 2 where they started ({', '.join(f'{_acc(r, 0):.2f} -> {_acc(r, -1):.2f}' for r in lr[1:])}); a weight of 10 "
            "on the warm-up's answer turn, a tree that branches at the answer turn (2 queries x 4 answers, so siblings share their "
            "query and differ only in the copy), and groups of 16 on 8 rows a step (the same trajectories a step, twice as many "
            "per row: more groups with a success to learn from), did no better. Seed 2 rises by at most "
            f"{max(_rise(_load(f)['runs']['2']) for f in same_start):.2f} under every setting that keeps its warm-up (the answer "
            "weight and the wider heads change the warm-up, hence the start). The sampled trajectories do learn: the mean "
            f"training reward of the first and last {reward['window']} steps went "
            f"{_pairs([w['reward/mean'] for w in windows])} (groups all equal "
            f"{_pairs([w['groups/frac_all_equal'] for w in windows])}; the "
            f"defaults' runs, `python benchmarks/train_reward_windows.py RUN_DIR ...`, `benchmarks/results/{SQL_TRAIN_REWARD}`)")


def sql_width64_typed() -> str:
    """sql at width 64 as typed (two threads, 150 RL steps)."""
    data, runs = _load(SQL_WIDTH64_TYPED_150), [r for _, r in _runs(SQL_WIDTH64_TYPED_150)]
    walls = [r["wall_seconds"] for r in runs]
    return (f"(`python benchmarks/env_train_seeds.py --env sql --seeds 0 1 2 --threads default --out F`, code "
            f"{_commits(SQL_WIDTH64_TYPED_150)}; `benchmarks/results/{SQL_WIDTH64_TYPED_150}`, {data['date']}): "
            f"**{_span(walls, unit=' s')} wall ({_span([w / 60 for w in walls], '.1f', ' min')})**, "
            f"{_span([r['cpu_seconds'] for r in runs])} CPU-s; held-out success **{_rises(SQL_WIDTH64_TYPED_150)}** (the two "
            "threads change the float sums, so these are not the one-thread runs' figures): rises of "
            + ", ".join(f"{_rise(r):+.2f} ({_rise(r) / STANDARD_ERROR:.1f} standard errors)" for r in runs) + ".")


def sql_width64_before_heap_fix() -> str:
    """sql at width 64 as typed, 100 RL steps, before the CPU heap fix (/usr/bin/time -v per seed)."""
    data = _load(SQL_WIDTH64_TYPED_100)
    runs = [run for _, run in sorted(data["runs"].items(), key=lambda kv: int(kv[0]))]
    clock = ", ".join(f"{int(r['wall_seconds'] // 60)} min {r['wall_seconds'] % 60:02.0f} s" for r in runs)
    return (f"(`/usr/bin/time -v python -m fastrl train --env sql --seed S`, code {data['code'].split(' (')[0]}/"
            f"{data['code'].split('), ')[1].split(' ')[0]}; `benchmarks/results/{SQL_WIDTH64_TYPED_100}`, {data['date']}): "
            f"**{clock} wall** ({_join([r['cpu_seconds'] for r in runs], '.0f')} CPU-s; load at most "
            f"{max(x for r in runs for x in r['load_1min_before_after']):.1f}), held-out success "
            f"**{_pairs([(_acc(r['run'], 0), _acc(r['run'], -1)) for r in runs])}** after {runs[0]['run']['rl_steps']} "
            "GRPO steps (rises of "
            + ", ".join(f"{_rise(r['run']) / STANDARD_ERROR:.1f}" for r in runs) + " standard errors)")


def sql_failures() -> str:
    """benchmarks/sql_failures.py on the 64-wide, 100-step runs' saved policies: why seed 1 hardly rose."""
    res = _load(SQL_FAILURES)["results"]

    def pick(seed, stage, rows="heldout", temperature=0.0):
        return next(r for r in res if r["seed"] == seed and r["model"].endswith(stage) and r["rows"] == rows
                    and r["temperature"] == temperature)

    s1 = pick(1, "reference")
    kinds = {k: v["ok"] for k, v in s1["per_kind"].items()}
    sizes = {k: sum(v.values()) for k, v in s1["per_kind"].items()}
    earn, spend = "What did {product}s earn?", "How much did {name} spend?"
    ordered, bought = "How many {product}s were ordered?", "How many items did {name} buy?"
    f1 = pick(1, "final")
    starts = [pick(s, "reference")["total"] for s in (0, 2)]
    ends = [pick(s, "final") for s in (0, 2)]
    hot = pick(1, "reference", temperature=1.0)
    revenue = sum(hot["per_kind"][k]["ok"] for k in (earn, spend)) / sum(sum(hot["per_kind"][k].values()) for k in (earn, spend))
    cold = [pick(1, "reference", temperature=t) for t in (0.7, 0.5)]
    train = pick(1, "reference", rows="train")
    return (f"Seed 1's policy after the warm-up (its frozen `reference/`, step 0) wrote a **correct query on "
            f"{'all' if s1['total']['wrong_query'] == 0 else 'not all'} {s1['episodes']} held-out rows** and then answered a number "
            f"other than the one the query returned on {s1['total']['copy_fail']} of them (`319` -> `318`, `60` -> `4801`): the "
            "bottleneck is the **copy of the result into the answer**, worst on the revenue questions (2-4 digit sums: "
            f"{kinds[earn]} and {kinds[spend]} of {sizes[earn]} right, against {kinds[ordered]} of {sizes[ordered]} and "
            f"{kinds[bought]} of {sizes[bought]} for the item counts). After 100 GRPO steps: {f1['total']['copy_fail']} copy "
            f"failures and {f1['total']['wrong_query']} wrong queries ({f1['success']:.2f}): RL fixed "
            f"{s1['total']['copy_fail'] - f1['total']['copy_fail']} copies and broke {f1['total']['wrong_query'] - s1['total']['wrong_query']} "
            f"queries. Seeds 0 and 2 started with wrong queries too ({starts[0]['wrong_query']} and {starts[1]['wrong_query']}; "
            f"copy failures {starts[0]['copy_fail']} and {starts[1]['copy_fail']}) and RL fixed both kinds "
            f"({ends[0]['total']['wrong_query']} and {ends[1]['total']['wrong_query']} wrong queries, {ends[0]['total']['copy_fail']} "
            f"and {ends[1]['total']['copy_fail']} copy failures at the end: {pick(0, 'reference')['success']:.2f} -> "
            f"{ends[0]['success']:.2f}, {pick(2, 'reference')['success']:.2f} -> {ends[1]['success']:.2f}). Why seed 1's copy moves "
            f"so little: sampled at temperature 1 ({hot['episodes'] // hot['groups']} per row, seed 1's step-0 policy) "
            f"{hot['total']['copy_fail']} of {hot['episodes']} trajectories ran a right query and miscopied, the revenue questions "
            f"succeeded {revenue:.0%} of the time, so their groups were all 0 (no signal); and in a group whose queries are "
            "identical the query tokens' advantages sum to zero, so the update is carried by the 2-4 answer tokens among its "
            "~75 policy tokens. A lower temperature does not help: 0.7 and 0.5 gave "
            f"{cold[0]['total']['ok']} and {cold[1]['total']['ok']} successes of {hot['episodes']} (1.0: {hot['total']['ok']}) and more "
            f"groups all equal ({cold[0]['groups_all_equal']} and {cold[1]['groups_all_equal']} of {hot['groups']}, against "
            f"{hot['groups_all_equal']}): the wrong digits are confident, not sampling noise. On the first 100 training rows (the "
            f"warm-up's probe) the same policy succeeded {train['success']:.2f}, on held-out rows {s1['success']:.2f}.")


def sql_answer_weight() -> str:
    return (f"mean change {_mean_rise(SQL_LEVERS['answer10_100']):+.3f} against {_mean_rise(SQL_WIDTH64_100):+.3f} at 100 steps, "
            f"{_mean_rise(SQL_LEVERS['answer10']):+.3f} against {_mean_rise(SQL_WIDTH64):+.3f} at 150")


def sql_no_header() -> str:
    """The reverted experiment: sql's tool result without its column-name line, seed 1."""
    data = _load(SQL_NO_HEADER)
    run, fail = data["runs"]["1"], data["failures_at_d152a7c"]
    greedy, hot = fail["greedy_heldout"], fail["sampled_temperature_1_group_8"]
    before = next(r for r in _load(SQL_FAILURES)["results"] if r["seed"] == 1 and r["model"].endswith("reference")
                  and r["temperature"] == 1.0)
    return (f"Seed 1, one thread (`benchmarks/results/{SQL_NO_HEADER}`): the warm-up again took {run['sft_steps']:.0f} steps "
            f"(probe {run['sft_probe_accuracy']:.2f}) and left {greedy['copy_fail']} copy failures and "
            f"{'no' if not greedy['wrong_query'] else greedy['wrong_query']} wrong query on held-out ({greedy['ok']} right; sampled at "
            f"temperature 1: {hot['ok']} of {hot['groups'] * 8} right, {hot['groups_all_equal']} of {hot['groups']} groups all equal, "
            f"against {before['total']['ok']} and {before['groups_all_equal']} with the header), held-out "
            f"**{_join([e['accuracy'] for e in run['eval']], '.2f', ' -> ')}** (steps {run['eval'][0]['step']:.0f}-"
            f"{run['eval'][-1]['step']:.0f}): a {_rise(run):+.2f} rise, {run['cpu_seconds']:.0f} CPU-s on the loaded machine")


def sql_target03() -> str:
    data = _load(SQL_TARGET03)
    run = data["runs"]["1"]
    return (f"(one thread, `benchmarks/results/{SQL_TARGET03}`) stopped after {run['sft_steps']:.0f} steps (probe "
            f"{run['sft_probe_accuracy']:.2f}, an overshoot) and went **{_join([e['accuracy'] for e in run['eval']], '.2f', ' -> ')}** "
            f"({run['cpu_seconds']:.0f} CPU-s)")


# -- docs/train.md ---------------------------------------------------------------------------

ASYNC = "async_default_cpu_v3.json"
ASYNC_LOADED = "async_default_cpu_v2.json"
ASYNC_TRANSFER = "async_transfer_cpu.json"
VLLM_SERVER = "vllm_server_cpu.json"


def sft_layout_agent_share() -> str:
    """The share of a padded warm-up batch's tokens the trie runs, for the agent environments."""
    task = {r["task"]: r for r in _load(SFT_LAYOUT)["results"]}
    return _span([100 * task[t]["trie_tokens_mean"] / task[t]["padded_tokens_mean"] for t in ("sql", "frozenlake")], unit="%")


def vllm_server_weights() -> str:
    """`fastrl vllm-server`'s weight push: as files in --weights_dir against in the request bodies."""
    data = _load(VLLM_SERVER)
    best = data["seconds_best"]
    return (f"{best['update_server'] / best['update_server_file']:.1f}x faster here ({best['update_server_file']:.2f} s vs "
            f"{best['update_server']:.2f} s for {data['shape']['weights_mb']} MB, best of {len(data['seconds_all']['update_server'])}; "
            f"`{data['command']}`, `benchmarks/results/{VLLM_SERVER}`)")


def _async_passes() -> dict[tuple[str, str], list[float]]:
    data = _load(ASYNC)
    return {(seed, mode): [p["step_seconds_median"] for p in runs[mode]] for seed, runs in data["repeats"].items()
            for mode in ("sync", "async")}


def async_setup() -> str:
    """How steady the async benchmark's passes were: the machine's load and each seed and mode's spread."""
    data = _load(ASYNC)
    loads = [x for runs in data["repeats"].values() for mode in ("sync", "async") for p in runs[mode]
             for x in (p["load_1min"]["start"], p["load_1min"]["end"])]
    spreads = sorted(((max(v) - min(v), key, v) for key, v in _async_passes().items()), reverse=True)
    (_, (seed, mode), values), second = spreads[0], spreads[1][0]
    return (f"(1-minute load average {_span(loads, '.1f')} during the runs: the benchmark's own processes). The training is the "
            "same in every pass (checked: the same held-out curve), only the clock differs, so each seed and mode is "
            "represented by its least disturbed run (the smallest RL seconds; every pass's own pair is in the JSON); here a "
            f"seed and mode's three passes agree within {second:.3f} s a step (median step) but for the {mode} passes of seed "
            f"{seed} ({_join(values, '.3f')} s)")


def async_transfer() -> str:
    """The async step's own transfer cost before and after the shared-memory slots, and in the training runs."""
    t, data = _load(ASYNC_TRANSFER), _load(ASYNC)
    seeds = sorted(data["runs"], key=int)
    runs = [data["runs"][s] for s in seeds]
    stage = lambda mode, key: [r[mode]["stages_cpu_median_ms"].get(key, 0.0) for r in runs]  # noqa: E731
    worker = [a - s for a, s in zip(stage("async", "untimed"), stage("sync", "untimed"))]
    own = [w + x + y for w, x, y in zip(worker, stage("async", "weights"), stage("async", "receive"))]
    step = [1e3 * r["async"]["step_cpu_seconds_median"] for r in runs]
    sampler = [r["async"]["stages_median_ms"]["async/sampler_seconds"] for r in runs]
    waited = [r["async"]["stages_median_ms"]["time/generate"] for r in runs]
    gc = [r[m]["gc_seconds_in_steps"] for r in runs for m in ("sync", "async")]
    return (f"serialised a `state_dict` snapshot with `torch.save` ({t['bytes']['weights_before'] / 1e6:.1f} MB, sent through the "
            "pipe) and its worker thread deserialised the rollout with `torch.load` while holding the interpreter lock: "
            f"{t['ms']['weights']['before']['cpu_ms']:.1f} ms and {t['ms']['receive']['before']['cpu_ms']:.1f} ms of CPU per step "
            f"(`{t['command']}`, {t['date']}), with the pipe transfer on top. Now the weights are a copy into a shared slot "
            f"({t['ms']['weights']['now']['cpu_ms']:.1f} ms) and the rollout is decoded from raw tensor bytes "
            f"({t['ms']['receive']['now']['cpu_ms']:.1f} ms); in the training runs `time/weights` and `time/receive` cost "
            f"{_span(stage('async', 'weights'), '.1f', ' ms')} and {_span(stage('async', 'receive'), '.1f', ' ms')} of CPU, the "
            f"worker thread {_span(worker, '.1f', ' ms')} (in \"the rest\" below), the sampler did not make the trainer wait "
            f"(median `time/generate` {_span(waited, '.1f', ' ms')}: its rollout, {_span(sampler, '.0f', ' ms')}, takes under half "
            f"the trainer's {_span(step, '.0f', ' ms')} step; `async/sampler_waited_seconds` is its idle time), and GC pauses "
            f"{'are nil' if max(gc) < 0.005 else f'take at most {max(gc):.2f} s'} within the 150 steps. The table below is each "
            f"stage's CPU: the asynchrony's own cost is about {_span(own, '.1f', ' ms')} a step "
            f"({_span([100 * o / s for o, s in zip(own, step)], '.0f', '%')})")


def async_verdict() -> str:
    """bench_async.py's verdicts: held-out accuracy at equal wall time and steps, and the async step against its bound."""
    data, loaded = _load(ASYNC), _load(ASYNC_LOADED)
    summary, per = data["summary"], data["per_seed"]
    seeds = sorted(per, key=int)
    runs = [data["runs"][s] for s in seeds]
    final = summary["final_accuracy"]
    wall = summary["equal_wall_accuracy"]
    ratios = [per[s]["async_step_over_max_gen_rest"] for s in seeds]
    target = summary["target_async_step_over_max_gen_rest"]
    gen = [1e3 * r["sync"]["generate_cpu_seconds_median"] for r in runs]
    rest = [1e3 * r["sync"]["rest_cpu_seconds_median"] for r in runs]
    ends = [abs(per[s]["final_accuracy_sync"] - per[s]["final_accuracy_async"]) for s in seeds]
    lloads = [x for r in loaded["repeats"].values() for m in ("sync", "async") for p in r[m] for x in p["load_1min"].values()]
    return (f"At equal wall time the mean held-out accuracy is async {wall['async']['mean']:.3f} vs sync {wall['sync']['mean']:.3f}, "
            f"at equal steps (step 150) {final['async']['mean']:.3f} vs {final['sync']['mean']:.3f}: both within the synchronous "
            f"seeds' spread ({final['sync']['spread']:.3f}), the issue's bar; per seed the two modes end within "
            f"{max(ends):.2f} of each other. **The async step is {', '.join(f'{x:.2f}x' for x in ratios)} max(generation, "
            f"rest of the step) on seeds {', '.join(seeds)} (target at most {target:.2f}x: "
            f"{'met on every seed' if summary['every_seed_within_target'] else 'not met on every seed'})**, and "
            f"{_span(summary['cpu_least_disturbed_async_step_over_max_gen_rest']['values'], '.2f', 'x')} in CPU seconds (each mode's "
            f"least disturbed pass): with the generation ({_span(gen, '.0f', ' ms')} of CPU) on the other core, the step is the rest "
            f"({_span(rest, '.0f', ' ms')}) plus the asynchrony's own work, "
            f"{_span([per[s]['async_step_over_sync_step'] for s in seeds], '.2f', 'x')} the synchronous step. RL seconds async / "
            f"sync: {_join([per[s]['async_rl_seconds_over_sync'] for s in seeds], '.2f')} "
            f"for the least disturbed runs. On the loaded machine and earlier code (`{ASYNC_LOADED}`, load {_span(lloads, '.1f')}) "
            f"the same benchmark gave {_join([loaded['per_seed'][s]['async_step_over_max_gen_rest'] for s in seeds], '.2f', 'x, ')}x")



# -- docs/compare.md -------------------------------------------------------------------------

def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def compare_env_timing() -> str:
    """`fastrl compare --env NAME` on each environment's compare defaults, end to end: wall, CPU, warm-up, load."""
    data = {env: _compare_env(env) for env in ("sql", "frozenlake", "calculator")}
    loads = [x for d in data.values() for x in (d["load_average"]["start"][0], d["load_average"]["end"][0])]
    parts = []
    for i, (env, d) in enumerate(data.items()):
        start = d["start"]
        warm = (f"the warm-up's {start['sft']['sft/steps']:.0f} SFT steps {_minutes(start['seconds'])} of it" if i == 0
                else f"warm-up {_minutes(start['seconds'])}")
        parts.append(f"{env} {d['total_seconds'] / 60:.1f}" + (" min wall" if i == 0 else "")
                     + f" ({d['cpu_seconds'] / 60:.1f}" + (" min CPU" if i == 0 else " CPU") + f"; {warm})")
    nearest = max(data, key=lambda env: data[env]["total_seconds"])
    return (f"(load average {_span(loads, '.1f')}, the comparison's own runs), one after another: "
            + ", ".join(parts[:-1]) + f" and {parts[-1]}. {nearest} is the one nearest the line "
            "(`benchmarks/results/compare_env_<env>/compare.json`)")


def compare_default_timing() -> str:
    """`fastrl compare` on its defaults, end to end."""
    d = json.loads((RESULTS / "compare_default_cpu" / "compare.json").read_text())
    return f"took {d['total_seconds'] / 60:.1f} min wall and {d['cpu_seconds'] / 60:.1f} min CPU"


def compare_default_warmup() -> str:
    """The default comparison's load, warm-up and runs."""
    d = json.loads((RESULTS / "compare_default_cpu" / "compare.json").read_text())
    load, start = d["load_average"], d["start"]
    runs = [r["wall_seconds"] for r in d["runs"]]
    return (f"(load {load['start'][0]:.1f} at the start and {load['end'][0]:.1f} at the end); the warm-up was "
            f"{start['seconds'] / 60:.1f} min of it ({start['sft']['sft/steps']:.0f} SFT steps, {start['cpu_seconds'] / 60:.1f} min "
            f"CPU), each run {_span(runs, unit=' s')}")



# -- docs/integrations.md --------------------------------------------------------------------

TRL_MEMORY = "trl_memory_cpu.json"


def trl_memory() -> str:
    """`benchmarks/bench_trl_memory.py`: TRL's GRPO loss step with fastrl's loss against TRL's own."""
    data = _load(TRL_MEMORY)
    shape, res, ratio = data["shapes"], data["results"], data["ratios"]
    return (f"one {shape['loss_type']} loss step, compute_loss + backward, Llama with vocab {shape['vocab']}, "
            f"{shape['completions']} x {shape['max_completion_length']} completion tokens, fresh process per side, torch at "
            f"{data['threads']} threads, TRL {data['versions']['trl']}; `benchmarks/results/{TRL_MEMORY}`): peak memory "
            f"{res['fastrl']['step_peak_mib']:.0f} MiB vs {res['trl']['step_peak_mib']:.0f} MiB "
            f"({ratio['peak_memory_fastrl_over_trl']:.2f}x), time {res['fastrl']['step_time_s']:.2f} s vs "
            f"{res['trl']['step_time_s']:.2f} s ({ratio['time_fastrl_over_trl']:.2f}x)")



# -- docs/benchmarks.md ----------------------------------------------------------------------

H200 = "gpu_h200_20261204"


def _h200_tests() -> dict[str, list[str]]:
    """The H200 kernel tests' outcomes (``tests_outcomes.tsv``): test ids by outcome."""
    out: dict[str, list[str]] = {}
    for line in (RESULTS / H200 / "tests_outcomes.tsv").read_text().splitlines():
        if line and not line.startswith("#"):
            outcome, test = line.split("\t", 1)
            out.setdefault(outcome, []).append(test)
    return out


def _h200_failure_kinds() -> dict[str, int]:
    failed = _h200_tests()["FAILED"]
    oracle = sum("float64" in t for t in failed)
    host_sync = sum("test_no_host_sync" in t for t in failed)
    return {"oracle": oracle, "host_sync": host_sync, "device": len(failed) - oracle - host_sync}


def h200_tests() -> str:
    tests = _h200_tests()
    skipped_file = {t.split("::")[0] for t in tests.get("NOT RUN (the 250 s limit)", [])}
    return (f"{len(tests['PASSED'])} passed, {len(tests['FAILED'])} failed, {len(tests.get('SKIPPED', []))} skipped, "
            f"{len(tests.get('NOT RUN (the 250 s limit)', []))} not reached in 250 s ({', '.join(f'`{f}`' for f in sorted(skipped_file))}). "
            f"None of the {len(tests['FAILED'])} is a wrong value from a bf16/fp16/fp32 path")


def h200_failed_device() -> str:
    return str(_h200_failure_kinds()["device"])


def h200_failed_oracle() -> str:
    return str(_h200_failure_kinds()["oracle"])


def h200_failed_host_sync() -> str:
    return str(_h200_failure_kinds()["host_sync"])


def _h200_kernel(op: str, impl: str) -> list[dict]:
    return [r for r in _load(f"{H200}/kernels.json")["results"] if r["op"].startswith(op) and r["impl"] == impl]


def h200_speed() -> str:
    """How far the H200's kernels were from its speed: the loss against the naive GEMMs, decode against SDPA."""
    naive = _h200_kernel("grpo_loss", "naive")[0]
    n, h, v = (int(x.split("=")[1]) for x in naive["shape"].split()[:3])
    tflop = 3 * 2 * n * h * v / 1e12
    decode = [r["speedup_of_fastrl"] for r in _h200_kernel("decode_attention", "sdpa_expanded")]
    return (f"the log-prob loss at {naive['speedup_of_fastrl']:.2f}x the naive GEMMs' speed (those do {tflop:.1f} TFLOP in "
            f"{naive['best_ms']:.0f} ms, ~{tflop / naive['best_ms'] * 1e3:.0f} TFLOP/s) and decode attention at "
            f"{_span(decode, '.1f', 'x')} SDPA")


def logprob_naive_model() -> str:
    """The log-prob model's naive figures against what the H200 measured for naive."""
    naive = _h200_kernel("grpo_loss", "naive")[0]
    n, h, v = (int(x.split("=")[1]) for x in naive["shape"].split()[:3])
    row = next(r for r in _load("logprob_floor_predicted_h200.json") if (r["N"], r["H"], r["V"]) == (n, h, v))
    return (f"The same model puts naive at {row['naive_ms']:.1f} ms and {row['naive_peak_gib']:.1f} GiB at N={n}, H={h}, where "
            f"the H200 measured {naive['best_ms']:.0f} ms and {naive['peak_mem_mb']:,.0f} MiB")


def long_grpo_saving() -> str:
    """What the shared prefix saves of the long-trajectory GRPO step on the H200."""
    res = _load(f"{H200}/long_grpo_gpu.json")["results"]
    step = {(r["mode"], r["tokens_per_group"]): r for r in res if r["ok"]}
    tokens = sorted({t for _, t in step})
    savings = [100 * (1 - step[(m, t)]["step_s"] / step[("repeated", t)]["step_s"]) for t in tokens for m in ("shared:triton", "shared:flex")]
    run = {t: step[("shared:triton", t)]["setup"]["tokens_run"] for t in tokens}
    saved_memory = [t for t in tokens if step[("shared:triton", t)]["peak_extra_mib"] < 0.95 * step[("repeated", t)]["peak_extra_mib"]]
    return (f"running {run[tokens[0]]} instead of {tokens[0]} tokens (or {run[tokens[1]]} instead of {tokens[1]}) saves "
            f"{_span(savings, '.0f', '%')} of the step, and memory only at {', '.join(f'{t // 1024}K' for t in saved_memory)}")


def h200_sampler() -> str:
    data = _load(f"{H200}/sampler_gpu.json")
    shape, sec = data["shape"], data["seconds"]
    return (f"{sec['fastrl_eager']:.3f} s against `generate`'s {sec['hf_generate']:.3f} s for {shape['prompts']} x {shape['G']} x "
            f"{shape['L']} tokens ({data['speed_vs_hf_generate']['fastrl_eager']:.2f}x)")


def sampler_loads() -> str:
    """The load averages while the sampler rows of the CPU table were measured."""
    from result_files import SAMPLER_MULTITURN, SAMPLER_VS_GENERATE
    loads = [x for name in (SAMPLER_VS_GENERATE, SAMPLER_MULTITURN) for pair in _load(name)["load_average_start_end"] for x in pair[:1]]
    return f"load averages {_span(loads, '.1f')} at the start and end of the runs"


def agent_step_notes() -> str:
    """The agent training-step benchmark's load, and what the shared prompt saves at fixed lengths."""
    data = _load("agent_train_step_cpu.json")
    fixed = next(r for r in data["results"] if not r["variable"])
    return (f"load average {data['load_average_at_end'][0]:.0f} at the end of the step benchmark), so the seconds are high "
            "and only the ratios of the interleaved rounds mean much. Where every trajectory has the same turns and lengths "
            f"the padded rows carry no padding, and the shared prompt saves its {data['group_size'] - 1} repeats only: "
            f"{fixed['tokens_ratio_padded_over_packed']:.2f}x tokens, {fixed['speedup_packed_over_padded']:.2f}x time, and "
            + ("no memory saving at this size" if fixed["memory_ratio_padded_over_packed"] < 1.05 else
               f"{fixed['memory_ratio_padded_over_packed']:.2f}x memory")
            + f" ({fixed['memory_ratio_padded_over_packed']:.2f}x: the peak is within the RSS measure's noise)")



# -- docs/ops.md -----------------------------------------------------------------------------

DECODE_CPU = "decode_cascade_cpu_20261206"


def flex_vs_triton_step() -> str:
    """The 1.5B GRPO step at the longest group on the H200: FlexAttention against the first Triton kernels."""
    res = _load(f"{H200}/long_grpo_gpu.json")["results"]
    tokens = max(r["tokens_per_group"] for r in res)
    step = {r["mode"]: r["step_s"] for r in res if r["tokens_per_group"] == tokens and r["ok"]}
    return (f"the 1.5B GRPO step at {tokens // 1024}K tokens per group: {step['shared:flex']:.2f} s against "
            f"{step['shared:triton']:.2f} s")


def lm_head_transposed() -> str:
    """benchmarks/bench_lm_head_layout.py: the LM head through a transposed weight copy, CPU time, up to 16 rows."""
    data = _load("lm-head-layout-cpu-20261201-235130.json")
    ratios = [r["cpu_speed_transposed_vs_linear"] for r in data["rows"] if r["rows"] <= 16]
    return (f"MKL's small-batch GEMM is {_span(ratios, '.1f', 'x')} faster on it in CPU time (`{data['command']}`, "
            "`benchmarks/results/lm-head-layout-cpu-20261201-235130.json`)")


def decode_sdpa_h200() -> str:
    """SDPA over the expanded prompt on the H200 at issue 37's decode shape: best and median microseconds."""
    sdpa = next(r for r in _h200_kernel("decode_attention", "sdpa_expanded") if "Hq=28" in r["shape"])
    return f"{sdpa['best_ms'] * 1e3:.0f}-{sdpa['median_ms'] * 1e3:.0f} us (best-median)"


def _hopper_lint() -> dict[str, dict]:
    """hopper_lint's reading of the decode kernels' sm_90 build: each kernel's line of the check, and its counts."""
    lines = (RESULTS / DECODE_CPU / "hopper_lint_check.txt").read_text().splitlines()
    out = {}
    for entry in _load(f"{DECODE_CPU}/hopper_lint_summary.json"):
        line = next(x for x in lines if x.startswith(f"decode_attention.{entry['kernel']}:"))
        regs, ctas = re.search(r"regs (\d+), (\d+) CTA/SM", line).groups()
        grid = math.prod(entry["grid"])
        wgmma = re.search(r"wgmma (.*)$", line).group(1)
        out[entry["kernel"]] = {"regs": int(regs), "ctas": int(ctas), "grid": grid, "entry": entry,
                                "wgmma": re.findall(r"m\d+n\d+", wgmma)}
    return out


def decode_compile_facts() -> str:
    """What the sm_90 compiler made of the two decode kernels at issue 37's shape (hopper_lint on a CPU)."""
    lint = _hopper_lint()
    pre, suf = lint["_prefix_attn_kernel"], lint["_suffix_merge_kernel"]
    loops = all(k["entry"]["ttgir"]["scf.while"] == 0 for k in lint.values())
    return (f"both loops are `scf.for` with cp.async ({pre['entry']['sass']['LDGSTS']} and {suf['entry']['sass']['LDGSTS']} "
            f"`LDGSTS`) and {'no' if loops else 'a'} `while`; the prefix phase runs wgmma ({' and '.join(pre['wgmma'])}), "
            f"{pre['regs']} registers, {pre['entry']['shared_bytes'] // 1024} KiB of shared memory, {pre['ctas']} CTA per SM over "
            f"{pre['grid']} CTAs; the suffix phase runs `mma.sync` (16 query rows are too few for wgmma), {suf['regs']} registers, "
            f"{suf['ctas']} CTAs per SM (`benchmarks/results/{DECODE_CPU}/hopper_lint_check.txt`)")


def decode_compile_variants() -> str:
    data = _load(f"{DECODE_CPU}/sm90_compile_decode.json")
    spills = sum(r["spill_store_bytes"] + r["spill_load_bytes"] for r in data["reports"])
    return (f"{'no spills' if spills == 0 else f'{spills} bytes of spills'} in any of the {data['variants']} compiled variants "
            f"(`{data['command']}`)")


def decode_host_cost() -> str:
    """The decode plan's per-call host cost on meta tensors (benchmarks/gpu/bench_decode.py --host-cost)."""
    data = _load(f"{DECODE_CPU}/host_cost.json")
    us = data["us_per_call_best_of_rounds"]
    plan = us["prepared_plan (the sampler's per-layer call)"]
    own = us["prepared_plan, launches replaced by a no-op (fastrl's own Python)"]
    checked = us["shared_prefix_decode_attention (checked, fresh plan)"]
    return (f"(load average {data['load_average_1min']:.1f}): {plan:.0f} us, of which {own:.0f} us is fastrl's own Python and the "
            f"rest Triton's argument binding for two launches (the checked one-shot call: {checked:.0f} us) (`{data['command']}`) -- "
            f"{'above' if plan > data['budget_us'] else 'within'} the {data['budget_us']:.0f} us budget")


def thread_rule_arrival() -> str:
    """The thread rule with a busy loop arriving mid-run, over repeats (benchmarks/thread_rule.py --neighbours arrives)."""
    import statistics

    data = _load("thread_rule_arrival_cpu.json")
    parts = []
    for task in ("default", "calculator"):
        walls = {s: [r["wall_seconds"] for r in data["runs"] if r["task"] == task and r["setting"] == s] for s in ("rule", "1")}
        best = min(walls["rule"]) / min(walls["1"])
        median = statistics.median(walls["rule"]) / statistics.median(walls["1"])
        parts.append(f"{task}: the rule's best run {best:.2f}x one thread's best, its median {median:.2f}x "
                     f"(rule {_join(walls['rule'], '.1f')} s; one thread {_join(walls['1'], '.1f')} s)")
    return (f"With the busy loop arriving 5 s into the run, over {data['repeats']} interleaved repeats ({'; '.join(parts)}; "
            f"two threads never finished in {data['limit_seconds']:.0f} s; `{data['command']}`, {data['date']}, code {data['code']})")


FIGURES: dict[str, Callable[[], str]] = {
    "thread_rule_arrival": thread_rule_arrival,
    "sql_readme": sql_readme, "compare_env_readme": compare_env_readme,
    "real_tokenizer_json": real_tokenizer_json, "real_tokenizer_defects": real_tokenizer_defects,
    "calculator_seed0": calculator_seed0, "sql_150_vs_100": sql_150_vs_100, "sql_width128": sql_width128,
    "sql_paired": sql_paired, "sft_layout_trie": sft_layout_trie, "sql_narrowed_decode": sql_narrowed_decode,
    "sql_trie_summary": sql_trie_summary, "sql_trie_gigpo": sql_trie_gigpo, "sql_target05_intro": sql_target05_intro,
    "sql_target05_summary": sql_target05_summary, "sql_fresh_summary": sql_fresh_summary,
    "sql_probe_curve": sql_probe_curve, "probe_sooner_summary": probe_sooner_summary,
    "calculator_frozenlake_rerun": calculator_frozenlake_rerun, "sql_width64": sql_width64,
    "sql_width64_typed": sql_width64_typed, "sql_width64_before_heap_fix": sql_width64_before_heap_fix,
    "sql_failures": sql_failures, "sql_answer_weight": sql_answer_weight, "sql_no_header": sql_no_header,
    "sql_target03": sql_target03, "sft_layout_agent_share": sft_layout_agent_share,
    "vllm_server_weights": vllm_server_weights, "async_setup": async_setup, "async_transfer": async_transfer,
    "async_verdict": async_verdict, "compare_env_timing": compare_env_timing,
    "trl_memory": trl_memory, "h200_tests": h200_tests, "h200_failed_device": h200_failed_device,
    "h200_failed_oracle": h200_failed_oracle, "h200_failed_host_sync": h200_failed_host_sync, "h200_speed": h200_speed,
    "logprob_naive_model": logprob_naive_model, "long_grpo_saving": long_grpo_saving, "h200_sampler": h200_sampler,
    "sampler_loads": sampler_loads, "agent_step_notes": agent_step_notes, "flex_vs_triton_step": flex_vs_triton_step,
    "lm_head_transposed": lm_head_transposed, "decode_sdpa_h200": decode_sdpa_h200,
    "decode_compile_variants": decode_compile_variants, "decode_compile_facts": decode_compile_facts, "decode_host_cost": decode_host_cost, "compare_default_timing": compare_default_timing, "compare_default_warmup": compare_default_warmup,
}
"""Every prose figure, by the name its ``<!-- figure:NAME -->`` marker gives."""
