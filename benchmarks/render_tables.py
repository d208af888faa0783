"""The tables and prose figures of README.md and docs/ written from benchmarks/results/*.json (never by hand).

A page holds each table between ``<!-- table:NAME -->`` and ``<!-- /table -->`` (rendered by
``TABLES[NAME]`` here), and each sentence of figures between ``<!-- figure:NAME -->`` and
``<!-- /figure -->`` (rendered by ``FIGURES[NAME]`` of benchmarks/figures.py, which reads its files
through this module's helpers); this script replaces what is between the markers with what it
renders from the JSON:

    python benchmarks/render_tables.py          # rewrite the tables in README.md and docs/*.md
    python benchmarks/render_tables.py --check  # exit 1 when a page and the JSON disagree

``tests/test_docs.py`` runs the check, and ``tests/test_render_figures.py`` that every marker names
a known table or figure, so a results file and the page that quotes it cannot drift apart.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from functools import partial
from pathlib import Path
from typing import Callable

from env_train_seeds import COMMANDS

from result_files import (ENV_SEED_FILES, RESULTS, ROOT, SAMPLER_MULTITURN, SAMPLER_VS_GENERATE,  # noqa: F401
                          TRAINER_VS_TRL_REAL_SHAPE, load as _load, p_value as _p_value)
import figures as _figures
PAGES = ("README.md", "docs")
MARKER = re.compile(r"(<!-- table:(?P<name>[a-z_0-9]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)
FIGURE = re.compile(r"(<!-- figure:(?P<name>[a-z_0-9]+) -->)(?P<body>.*?)(<!-- /figure -->)", re.S)
"""Figures in prose: ``<!-- figure:NAME -->text<!-- /figure -->``, the text rendered by ``FIGURES[NAME]``."""


def _rows(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def default_train_seeds() -> str:
    """The embedded default (`fastrl train`) per seed: warm-up, held-out accuracy before/after GRPO."""
    data = _load("default_train_3seeds_cpu.json")
    rows = []
    for seed, run in sorted(data["runs"].items(), key=lambda kv: int(kv[0])):
        first, last = run["eval"][0], run["eval"][-1]
        label = f"{seed} (the default)" if seed == "0" else seed
        paired = run.get("heldout_first_last_paired")
        flips = f"+{paired['gained']} / -{paired['lost']} ({_p_value(paired['p_value'])})" if paired else "-"
        rows.append([label, _warm_up(run), f"{first['accuracy']:.3f} -> **{last['accuracy']:.3f}**", flips,
                     f"{first['pass@4']:.3f} -> {last['pass@4']:.3f}",
                     f"{run['grpo_step_seconds_median']:.2f} s", f"{run['wall_seconds']:.0f} s"])
    table = _rows(["seed", "warm-up steps (s), last probe", "held-out accuracy", "held-out rows gained / lost (McNemar p)",
                   "pass@4", "GRPO step (median)", "whole run"], rows)
    commits = sorted({run["commit"] for run in data["runs"].values() if run.get("commit")})
    code = f"code {', '.join(commits)}; " if commits else ""
    return table + f"\n`{data['command']}`; {code}{data['machine']}; {data['date']}.\n"


def _warm_up(run: dict) -> str:
    """A seed's warm-up: its steps, seconds and last probe accuracy (and how many probes, when logged)."""
    if run.get("sft_steps") is None:
        return "none"
    probe = run.get("sft_probe_accuracy")
    probes = f" ({run['sft_probes']:.0f} probes)" if run.get("sft_probes") else ""
    return f"{run['sft_steps']:.0f} ({run['sft_seconds']:.0f} s)" + (f", {probe:.2f}{probes}" if probe is not None else "")


def env_train_seeds() -> str:
    """`fastrl train --env NAME` per seed: held-out success and tool-call rate before/after RL."""
    rows, notes = [], []
    for name in ENV_SEED_FILES:
        data = _load(name)
        env = data["env"]
        for seed, run in sorted(data["runs"].items(), key=lambda kv: int(kv[0])):
            first, last = run["eval"][0], run["eval"][-1]
            sft = _warm_up(run)
            loads = "/".join(f"{x:.1f}" for x in run["load_average_before_after"])
            whole = f"{run['wall_seconds']:.0f} s" + (f" ({run['cpu_seconds']:.0f} s CPU)" if run.get("cpu_seconds") else "")
            paired = run.get("heldout_first_last_paired")
            flips = f"+{paired['gained']} / -{paired['lost']} ({_p_value(paired['p_value'])})" if paired else "-"
            rows.append([env, seed, sft, f"{first['accuracy']:.2f} -> **{last['accuracy']:.2f}**", flips,
                         f"{first['tool_call_rate']:.2f} -> {last['tool_call_rate']:.2f}",
                         f"{run['rl_steps']} ({run['rl_step_seconds_median']:.2f} s)", whole, loads])
        commits = sorted({run["commit"] for run in data["runs"].values() if run.get("commit")})
        code = data.get("code") or (f"code {', '.join(commits)}" if commits else "")
        notes.append((f"`{data['command']}`", "; ".join(x for x in (data["date"], code, data["machine"]) if x)))
    table = _rows(["env", "seed", "warm-up steps (s), last probe", "held-out success, step 0 -> end",
                   "held-out rows gained / lost (McNemar p)", "tool-call rate, step 0 -> end",
                   "RL steps (median step)", "whole run", "load before/after"], rows)
    if len({where for _, where in notes}) == 1:  # one date, code and machine: said once
        said = ", ".join(command for command, _ in notes) + f" ({notes[0][1]})"
    else:
        said = "; ".join(f"{command} ({where})" for command, where in notes)
    return table + "\n" + said + "; step 0 is after the warm-up, before RL; rows gained / lost: held-out rows " \
        "failed at step 0 and solved at the end / the reverse, with the exact two-sided McNemar p-value " \
        "(fastrl.commands.paired; - for runs logged before per-row results); load average = runnable " \
        "processes (2 cores); whole run = wall time (the run's own CPU time); frozenlake has no tools (a move is the " \
        "action), so its tool-call rate is 0.\n"


SQL_LEVER_FILES = ("env_train_sql_3seeds_cpu.json", "env_train_sql_100steps_3seeds_cpu.json",
                   "env_train_sql_answerweight10_100steps_3seeds_cpu.json", "env_train_sql_answerweight10_3seeds_cpu.json",
                   "env_train_sql_gigpo_3seeds_cpu.json", "env_train_sql_kl0_3seeds_cpu.json",
                   "env_train_sql_lr1e-3_3seeds_cpu.json", "env_train_sql_tree_3seeds_cpu.json",
                   "env_train_sql_group16_3seeds_cpu.json", "env_train_sql_rlwarmup20_3seeds_cpu.json",
                   "env_train_sql_heads2_3seeds_cpu.json", "env_train_sql_width128_3seeds_cpu.json")
"""sql's seed studies (benchmarks/env_train_seeds.py) on its first built-in model (64 wide): 150 RL steps
first, then 100 steps (sql's default until 796b761), then one lever each; the last, a 128-wide model,
is the default since 5002a4f."""
SQL_BASE_COMMAND = COMMANDS["1"].format(env="sql")
"""The one-thread study's command (benchmarks/env_train_seeds.py's), which each lever's adds options to."""


def sql_levers() -> str:
    """sql's held-out success per seed: 150 against 100 RL steps, and one changed option each."""
    rows, commits, machines = [], set(), {}
    for name in SQL_LEVER_FILES:
        data = _load(name)
        if not data["command"].startswith(SQL_BASE_COMMAND):
            raise ValueError(f"{name}: not a study of {SQL_BASE_COMMAND!r} plus options: {data['command']!r}")
        extra = data["command"][len(SQL_BASE_COMMAND):].strip()
        runs = [run for _, run in sorted(data["runs"].items(), key=lambda kv: int(kv[0]))]
        rises = [run["eval"][-1]["accuracy"] - run["eval"][0]["accuracy"] for run in runs]
        cpu = [run["cpu_seconds"] for run in runs]
        commits |= {data["code"].removeprefix("code ")} if data.get("code") else {run["commit"] for run in runs}
        mark = machines.setdefault(data["machine"], chr(ord("a") + len(machines)))
        rows.append([(f"`{extra}`" if extra else "none") + f" ({mark})", "/".join(sorted({str(run["rl_steps"]) for run in runs})),
                     ", ".join(f"{run['eval'][0]['accuracy']:.2f} -> {run['eval'][-1]['accuracy']:.2f}" for run in runs),
                     f"{sum(rises) / len(rises):+.3f}", ", ".join(f"{r:+.2f}" for r in rises), f"{min(cpu):.0f}-{max(cpu):.0f}"])
    table = _rows([f"options after `{SQL_BASE_COMMAND.split(' ', 1)[1]}`", "RL steps",
                   "held-out success, seeds 0, 1, 2 (step 0 -> end)", "mean change", "per seed", "CPU s per run"], rows)
    return table + f"\n`python benchmarks/env_train_seeds.py --env sql --seeds 0 1 2 --out F -- OPTIONS`; code " \
        f"{', '.join(sorted(commits))} (the RL steps each ran: sql's default was 100 until 796b761, 150 since; " \
        "every row ran the 64-wide built-in model but `--model_hidden_size 128`, the default since 5002a4f); " \
        f"{'; '.join(f'({mark}) {machine}' for machine, mark in machines.items())}; 100 " \
        "held-out rows (a difference of two evaluations near 0.5 has a standard error of 0.07).\n"


MULTITURN_ROLLOUT = "multiturn-rollout-cpu-20261201-205008.json"
"""benchmarks/bench_multiturn_rollout.py's run (3 interleaved rounds) the agent table quotes."""


def agent_benchmarks() -> str:
    """The agent benchmarks of issue 18: multi-turn rollout (KV continued vs re-prefill) and the
    training step (prompt shared per group vs repeated, environment tokens masked)."""
    mt = _load(MULTITURN_ROLLOUT)
    sh = mt["shape"]
    rows = [[f"rollout, {sh['turns']} turns x {sh['model_tokens_per_turn']} + {sh['observation_tokens_per_turn']} tokens, "
             f"prompt {sh['prompt']}, G={sh['G']}",
             f"KV continued: {mt['best_seconds']['continued']:.1f} s, {mt['prefill_tokens']['continued']} prefill tokens",
             f"re-prefill each turn: {mt['best_seconds']['reprefill']:.1f} s, {mt['prefill_tokens']['reprefill']} prefill tokens",
             f"{mt['speedup_continued_vs_reprefill']:.2f}x time, 1/{mt['prefill_ratio_reprefill_over_continued']:.1f} prefill",
             f"`{mt['command']}`"]]
    step = _load("agent_train_step_cpu.json")
    for r in step["results"]:
        kind = "fixed lengths" if not r["variable"] else "turns and lengths varying"
        mem = r.get("memory", {})
        rows.append([f"training step, prompt {r['prompt_len']}, G={step['group_size']}, {r['turns']} turns x "
                     f"{r['model_tokens_per_turn']} + {r['obs_tokens_per_turn']} ({kind}; {r['tokens_trained']['packed']} policy + "
                     f"{r['env_tokens']} environment tokens)",
                     f"prompt once per group: {r['best_s']['packed']:.1f} s, {r['tokens_forward']['packed']} tokens, "
                     f"{mem['packed']['peak_extra_mb']:.0f} MiB",
                     f"prompt per trajectory: {r['best_s']['padded']:.1f} s, {r['tokens_forward']['padded']} tokens, "
                     f"{mem['padded']['peak_extra_mb']:.0f} MiB",
                     f"{r['speedup_packed_over_padded']:.2f}x time, {r['tokens_ratio_padded_over_packed']:.2f}x tokens, "
                     f"{r['memory_ratio_padded_over_packed']:.2f}x memory; grads equal to {r['grad_max_rel_diff']:.0e}, "
                     f"d loss / d logp at env tokens = {r['max_abs_grad_at_env_tokens']:g}", f"`{step['command']}`"])
    return _rows(["what (CPU)", "fastrl", "baseline", "ratio", "command"], rows)


def _bench_row(results: list[dict], op: str, shape: str, impl: str) -> dict:
    return next(r for r in results if r["op"] == op and r["shape"] == shape and r["impl"] == impl)


def headline() -> str:
    """The README's headline: fastrl beside what users run instead, on this project's CPU."""
    ops = _load("bench-cpu-full-scans-advantages.json")["results"]
    gae = _bench_row(ops, "gae", "B=64 T=8192", "fastrl"), _bench_row(ops, "gae", "B=64 T=8192", "loop (verl-style carry)")
    adv = (_bench_row(ops, "group_advantages", "N=65536 G=16", "fastrl"),
           _bench_row(ops, "group_advantages", "N=65536 G=16", "dict_loop"))
    trl = _load("trl_memory_cpu.json")["results"]
    prefix = _load("shared_prefix_cpu_4096x512_interleaved.json")["results"][0]
    shared, repeated = prefix["interleaved"]["min_time_s"]["shared"], prefix["interleaved"]["min_time_s"]["repeated"]
    step = _load("trainer_vs_trl_cpu.json")["fixed_steps"]["best"]
    rows = [
        ["GAE, 64 x 8192 tokens", f"{gae[0]['best_ms']:.1f} ms", f"Python loop over time, verl-style: {gae[1]['best_ms']:.0f} ms",
         f"{gae[1]['best_ms'] / gae[0]['best_ms']:.0f}x faster"],
        ["GRPO group advantages, 65536 samples", f"{adv[0]['best_ms']:.1f} ms",
         f"Python dict loop over samples, verl-style: {adv[1]['best_ms']:.0f} ms", f"{adv[1]['best_ms'] / adv[0]['best_ms']:.0f}x faster"],
        ["TRL GRPOTrainer loss step (vocab 32768, 16 x 128 tokens)", f"{trl['fastrl']['step_peak_mib']:.0f} MiB",
         f"TRL's own loss: {trl['trl']['step_peak_mib']:.0f} MiB",
         f"{trl['fastrl']['step_peak_mib'] / trl['trl']['step_peak_mib']:.2f}x memory"],
        [f"GRPO forward+backward, prompt {prefix['prompt_len']} + {prefix['group_size']} x {prefix['completion_len']}",
         f"shared prefix: {shared:.0f} s, {prefix['shared']['peak_extra_mb']:.0f} MiB",
         f"prompt repeated per sample: {repeated:.0f} s, {prefix['repeated']['peak_extra_mb']:.0f} MiB",
         f"{repeated / shared:.1f}x faster, {prefix['repeated']['peak_extra_mb'] / prefix['shared']['peak_extra_mb']:.1f}x less memory"],
        ["whole GRPO step, tiny Llama, 16 x 8 samples", f"{step['fastrl-grpo']['step_s_median']:.2f} s, "
         f"{step['fastrl-grpo']['peak_rss_mib']:.0f} MiB", f"TRL GRPOTrainer: {step['trl-grpo']['step_s_median']:.2f} s, "
         f"{step['trl-grpo']['peak_rss_mib']:.0f} MiB",
         f"{step['trl-grpo']['step_s_median'] / step['fastrl-grpo']['step_s_median']:.2f}x speed (per-call overhead dominates)"],
    ]
    return _rows(["what (CPU, torch path)", "fastrl", "what you would run instead", "ratio"], rows)


def benchmarks_cpu() -> str:
    """The benchmarks page: every measured op and step beside its baseline, with its command."""
    ops = _load("bench-cpu-full-scans-advantages.json")["results"]

    def op(name, shape, impl):
        return _bench_row(ops, name, shape, impl)["best_ms"]

    gae = op("gae", "B=64 T=8192", "fastrl")
    ret = op("discounted_returns", "B=64 T=8192", "fastrl")
    adv = op("group_advantages", "N=65536 G=16", "fastrl")
    vl = op("value_loss fwd+bwd", "B=64 T=4096 clip=0.2", "fastrl")
    lp = {r["impl"]: r for r in _load("logprobs-memory-cpu-20261129-211224.json")["results"]}
    hf256 = _load("rollout-hf-cpu-quick-20261129-214426.json")["rows"]
    hf64 = _load("rollout-hf-cpu-quick-20261129-214313.json")["rows"]
    h256 = next(r for r in hf256 if (r["P"], r["G"], r["L"]) == (2048, 8, 64))
    h64 = next(r for r in hf64 if (r["P"], r["G"], r["L"]) == (2048, 8, 64))
    vrows = {r["mode"]: r for r in _load("rollout_vllm_cpu.json")["rows"] if (r["P"], r["G"], r["L"]) == (2048, 16, 64)}
    srv = _load("vllm_server_cpu.json")
    sb, sr = srv["seconds_best"], srv["ratios"]
    trl = _load("trl_memory_cpu.json")["results"]
    lt = _load("long_trajectory_cpu.json")
    lt_fastrl = max((r for r in lt["results"] if r["impl"] == "fastrl" and r["ok"]), key=lambda r: r["trajectory_tokens"])
    lt_sum, KiB = lt["summary"], 1024
    naive_oom = int(re.search(r"at (\d+) tokens", lt_sum["naive"]["stopped"]).group(1))
    prefix = _load("shared_prefix_cpu_4096x512_interleaved.json")["results"][0]
    shared, repeated = prefix["interleaved"]["min_time_s"]["shared"], prefix["interleaved"]["min_time_s"]["repeated"]
    tree_file = _load("tree_stepwise_cpu.json")
    tree_rows = {r["template"]: r for r in tree_file["results"]}
    tshape = tree_file["shapes"]
    step_file = _load("trainer_vs_trl_cpu.json")
    step, shapes = step_file["fixed_steps"]["best"], step_file["shapes"]
    f, t = step["fastrl-grpo"], step["trl-grpo"]
    rvg = _load(SAMPLER_VS_GENERATE)
    real = _load(TRAINER_VS_TRL_REAL_SHAPE)
    rshape, rsum = real["shapes"], real["fixed_steps"]["summary"]
    rf, rt = real["fixed_steps"]["best"]["fastrl-grpo"], real["fixed_steps"]["best"]["trl-grpo"]
    previous_rev = re.search(r"--previous (\S+)", rvg["command"]).group(1)
    mt = _load(SAMPLER_MULTITURN)
    rows = [
        ["GAE, B=64 T=8192", f"{gae:.1f} ms",
         f"Python loop over T, verl-style carry: {op('gae', 'B=64 T=8192', 'loop (verl-style carry)'):.0f} ms",
         f"{op('gae', 'B=64 T=8192', 'loop (verl-style carry)') / gae:.0f}x", "`fastrl bench --only scans`"],
        ["", "", f"Python loop, OpenRLHF-style (no carry across holes): {op('gae', 'B=64 T=8192', 'loop (OpenRLHF-style)'):.0f} ms",
         f"{op('gae', 'B=64 T=8192', 'loop (OpenRLHF-style)') / gae:.0f}x", ""],
        ["discounted returns, B=64 T=8192", f"{ret:.1f} ms", f"Python loop: {op('discounted_returns', 'B=64 T=8192', 'loop'):.0f} ms",
         f"{op('discounted_returns', 'B=64 T=8192', 'loop') / ret:.0f}x", ""],
        ["group advantages (grpo), N=65536", f"{adv:.1f} ms",
         f"Python dict loop over samples (verl): {op('group_advantages', 'N=65536 G=16', 'dict_loop'):.0f} ms",
         f"{op('group_advantages', 'N=65536 G=16', 'dict_loop') / adv:.0f}x", "`fastrl bench --only advantages`"],
        ["", "", f"unique + scatter (eager): {op('group_advantages', 'N=65536 G=16', 'unique_scatter'):.1f} ms",
         f"{op('group_advantages', 'N=65536 G=16', 'unique_scatter') / adv:.2f}x (the eager baseline is faster here)", ""],
        ["value loss fwd+bwd, 64x4096", f"{vl:.1f} ms", f"eager multi-op: {op('value_loss fwd+bwd', 'B=64 T=4096 clip=0.2', 'eager'):.1f} ms",
         f"{op('value_loss fwd+bwd', 'B=64 T=4096 clip=0.2', 'eager') / vl:.1f}x", ""],
        [f"GRPO loss from hidden states, {lp['fastrl']['tokens']} tokens x {lp['fastrl']['vocab']} vocab (H={lp['fastrl']['hidden']}, fp32)",
         f"{lp['fastrl']['peak_extra_mb']:.0f} MB peak extra, {lp['fastrl']['min_time_s']:.1f} s",
         f"naive logits + log_softmax: {lp['naive']['peak_extra_mb']:.0f} MB, {lp['naive']['min_time_s']:.1f} s",
         f"{lp['fastrl']['mem_vs_naive']:.3f}x memory, {lp['fastrl']['time_vs_naive']:.2f}x time",
         "`python benchmarks/bench_logprobs_memory.py --shapes 8192:256:151936`"],
        ["", "", f"Liger fused GRPO loss: {lp['liger']['peak_extra_mb']:.0f} MB, {lp['liger']['min_time_s']:.1f} s", "", ""],
        ["HF group sampling, P=2048 G=8 L=64, tiny Llama (hidden 64 / 256)",
         f"prefill {h256['prefill_tokens_shared']} tokens, KV {h256['kv_shared_over_ideal']:.3f}x of P+G*L slots",
         f"`model.generate` on G prompt copies: {h256['prefill_tokens_duplicated']} tokens",
         f"{h64['speedup']:.1f}x / {h256['speedup']:.1f}x wall",
         "`python benchmarks/bench_rollout.py --quick --threads 1 [--hidden 256 --layers 4]`"],
        *[[f"HF sampler vs `generate`, {r['prompts']} prompts x G={r['G']}, P={r['P']} L={r['L']} "
           f"({'issue 20 real shape: Qwen2 vocab 151936, hidden 256, 4 layers' if r['shape'] == 'real' else 'embedded default model'})",
           f"{r['cpu_tokens_per_s']['fastrl']:.0f} tokens/s CPU time ({r['tokens_per_s']['fastrl']:.0f} wall)",
           f"`model.generate` on G copies: {r['cpu_tokens_per_s']['hf_generate']:.0f} ({r['tokens_per_s']['hf_generate']:.0f} wall); "
           f"the sampler at {previous_rev}: {r['cpu_tokens_per_s']['previous']:.0f}",
           f"{r['cpu_speed_vs_hf_generate']['fastrl']:.2f}x CPU time ({r['speed_vs_hf_generate']['fastrl']:.2f}x wall); "
           f"{r['cpu_speed_vs_previous']:.2f}x the previous",
           f"`{rvg['command']}`" if i == 0 else ""] for i, r in enumerate(rvg["rows"])],
        [f"multi-turn rollout, {mt['shape']['turns']} turns x {mt['shape']['model_tokens_per_turn']} sampled + "
         f"{mt['shape']['observation_tokens_per_turn']} observation tokens, G={mt['shape']['G']}, P={mt['shape']['prompt']}",
         f"KV continued: {mt['cpu_sampled_tokens_per_s']['continued']:.0f} tokens/s CPU time, {mt['prefill_tokens']['continued']} prefill tokens",
         f"`generate` on the whole history each turn: {mt['cpu_sampled_tokens_per_s']['hf_generate']:.0f}, "
         f"{mt['prefill_tokens']['hf_generate']} tokens; the sampler re-prefilling: {mt['cpu_sampled_tokens_per_s']['reprefill']:.0f}",
         f"{mt['cpu_speed_vs_hf_generate']['continued']:.2f}x CPU time ({mt['speed_vs_hf_generate']['continued']:.2f}x wall); "
         f"{mt['cpu_speedup_continued_vs_reprefill']:.2f}x re-prefilling",
         f"`{mt['command']}`"],
        ["vLLM n=G with prefix cache, P=2048 G=16 L=64",
         f"{vrows['shared']['prefill_tokens_computed']} prefill tokens, hit rate {vrows['shared']['prefix_cache_hit_rate']:.2f}",
         f"duplicated prompts, no cache: {vrows['duplicated']['prefill_tokens_computed']}",
         f"{vrows['duplicated']['seconds'] / vrows['shared']['seconds']:.1f}x wall", "`python benchmarks/bench_rollout_vllm.py`"],
        [f"`fastrl vllm-server`, {srv['shape']['prompts']} prompts x G={srv['shape']['group_size']}, "
         f"P={srv['shape']['prompt_len']} L={srv['shape']['gen_len']} (best of 3)",
         f"rollout {sb['generate_server']:.2f} s (2 clients at once: {sb['generate_server_2_clients']:.2f} s, one engine call); "
         f"weight push {sb['update_server']:.2f} s over HTTP, {sb['update_server_file']:.2f} s as files in `--weights_dir`",
         f"the same engine in-process: {sb['generate_in_process']:.2f} s; push {sb['update_in_process']:.3f} s",
         f"{sr['generate_server_over_in_process']:.2f}x rollout; push {sr['update_server_over_in_process']:.1f}x / "
         f"{sr['update_server_file_over_in_process']:.1f}x", f"`OMP_NUM_THREADS=1 {srv['command']}`"],
        ["TRL GRPOTrainer dapo loss step (vocab 32768, 16x128 tokens)",
         f"{trl['fastrl']['step_peak_mib']:.0f} MiB, {trl['fastrl']['step_time_s']:.2f} s",
         f"TRL 1.16: {trl['trl']['step_peak_mib']:.0f} MiB, {trl['trl']['step_time_s']:.2f} s",
         f"{trl['fastrl']['step_peak_mib'] / trl['trl']['step_peak_mib']:.2f}x memory", "`python benchmarks/bench_trl_memory.py`"],
        ["GRPO training step vs trajectory length (Qwen2 hidden 256, 4 layers, vocab 151936; G=8)",
         f"shared prefix + fused loss + checkpointing: {lt_fastrl['trajectory_tokens'] // 1024}K tokens in "
         f"{lt_fastrl['peak_extra_mib']:.0f} MiB, slope {lt_sum['fastrl']['memory_slope_bytes_per_token'] / KiB:.1f} KiB/token",
         f"naive logits: {lt_sum['naive']['memory_slope_bytes_per_token'] / KiB:.0f} KiB/token, out of memory at "
         f"{naive_oom // 1024}K; TRL loss path "
         f"{lt_sum['trl']['memory_slope_bytes_per_token'] / KiB:.0f} KiB/token (to {lt_sum['trl']['max_trajectory_tokens'] // 1024}K)",
         f"1/{lt['ratios']['slope_naive_over_fastrl']:.0f} memory slope", "`python benchmarks/bench_long_trajectory.py`"],
        [f"shared vs repeated prefix, fwd+bwd, P={prefix['prompt_len']} L={prefix['completion_len']} G={prefix['group_size']}",
         f"{shared:.1f} s, {prefix['shared']['peak_extra_mb']:.0f} MiB",
         f"repeated prefix: {repeated:.1f} s, {prefix['repeated']['peak_extra_mb']:.0f} MiB",
         f"{repeated / shared:.2f}x time, 1/{prefix['memory_ratio_repeated_over_shared']:.1f} memory",
         "`OMP_NUM_THREADS=1 python benchmarks/bench_shared_prefix.py --shapes 4096x512 --threads 1 --interleaved-rounds 2`"],
        *[[f"{tshape['turns']}-turn trajectory as {tshape['turns']} step-wise samples, fwd+bwd ({template} template; "
           f"Qwen2 hidden {tshape['hidden']}, {tshape['layers']} layers)",
           f"prefix tree: {r['tree']['tokens']} tokens, {r['tree']['min_time_s']:.2f} s, {r['tree']['peak_extra_mb']:.0f} MiB "
           f"= {r['ratios_vs_single']['tree']['flops']:.2f}x the FLOPs of the single sequence",
           f"padded rows: {r['padded']['tokens']} tokens, {r['padded']['min_time_s']:.2f} s, {r['padded']['peak_extra_mb']:.0f} MiB "
           f"({r['ratios_vs_single']['padded']['flops']:.1f}x the FLOPs)",
           f"{r['padded']['min_time_s'] / r['tree']['min_time_s']:.1f}x time, 1/{r['padded']['peak_extra_mb'] / r['tree']['peak_extra_mb']:.1f} "
           f"memory; grads equal ({r['tree']['grad_max_rel_diff_vs_padded']:.0e})",
           f"`OMP_NUM_THREADS=1 {tree_file['command']}`" if i == 0 else ""]
          for i, (template, r) in enumerate(tree_rows.items())],
        [f"whole training step, tiny Llama ({shapes['parameters'] / 1000:.0f}K params, vocab {shapes['vocab_size']}), "
         f"{shapes['prompts_per_step']}x{shapes['group_size']} samples",
         f"{f['step_s_median']:.2f} s/step, {f['peak_rss_mib']:.0f} MiB",
         f"TRL GRPOTrainer: {t['step_s_median']:.2f} s/step, {t['peak_rss_mib']:.0f} MiB",
         f"{t['step_s_median'] / f['step_s_median']:.2f}x speed, {f['peak_rss_mib'] / t['peak_rss_mib']:.2f}x memory",
         "`python benchmarks/bench_trainer_vs_trl.py`"],
        [f"whole GRPO step, issue 20 real shape (Qwen2 vocab {rshape['vocab_size']}, hidden {rshape['hidden_size']}, "
         f"{rshape['layers']} layers; {rshape['prompts_per_step']}x{rshape['group_size']} samples, "
         f"P={rshape['prompt_tokens_example']} L={rshape['max_new_tokens']})",
         f"{rf['step_cpu_s_median']:.1f} CPU s/step, {rf['peak_rss_mib']:.0f} MiB",
         f"TRL GRPOTrainer: {rt['step_cpu_s_median']:.1f} CPU s/step, {rt['peak_rss_mib']:.0f} MiB",
         f"{rsum['step_cpu_time_fastrl_over_trl']:.2f}x CPU time, {rsum['peak_rss_fastrl_over_trl']:.2f}x memory",
         f"`{real['command']}`"],
    ]
    return _rows(["what", "fastrl", "baseline", "ratio", "command"], rows)


def compare_default() -> str:
    """`fastrl compare` on its defaults: one row per verdict axis, mean +- std over seeds."""
    data = _load("compare_default_cpu/compare.json")
    algorithms = data["algorithms"]
    rows = []
    for v in data["verdicts"]:
        cells = {v["winner"]: (v["winner_mean"], v["winner_std"]), v["runner_up"]: (v["runner_up_mean"], v["runner_up_std"])}
        digits = 1 if v["axis"] == "cost" else (2 if v["axis"] == "memory" else 3)
        shown = [f"{cells[a][0]:.{digits}f} ± {cells[a][1]:.{digits}f}" for a in algorithms]
        better = "higher" if v["higher_is_better"] else "lower"
        verdict = f"{v['winner']} ({v['ratio']:.2f}x), " + ("distinguishable" if v["distinguishable"]
                                                          else "not distinguishable over the seeds")
        rows.append([f"{v['axis']}: {v['metric']} ({better} is better)", *shown, verdict])
    table = _rows(["axis", *algorithms, "verdict"], rows)
    return table + f"\n`{data['command']}`: {len(data['seeds'])} seeds, budget {data['budget']['text']}.\n"


COMPARE_ENVS = ("frozenlake", "calculator", "sql")
"""The built-in environments whose ``fastrl compare --env`` results (``compare_env_<env>/``) the README shows."""


def compare_env() -> str:
    """``fastrl compare --env NAME`` on the environment's compare defaults: the command, its
    wall and CPU time and load, then the report's table and verdicts as printed."""
    parts = []
    for env in COMPARE_ENVS:
        path = RESULTS / f"compare_env_{env}" / "compare.json"
        if not path.exists():
            parts.append(f"**{env}**: not measured (no `benchmarks/results/compare_env_{env}/compare.json`).\n")
            continue
        data = json.loads(path.read_text())
        start, load = data["start"], data["load_average"]
        threads = data["train_options"].get("threads")
        jobs = data.get("jobs", 1)  # reports before --jobs ran one run at a time
        parts.append(
            f"**{env}**: `{data['command']}` ({data['budget']['text']} per run, {len(data['seeds'])} seeds, evaluated every "
            f"{data['eval_every']} steps on {start['eval_rows']} held-out rows"
            + (f", `--threads {threads}`" if threads else "")
            + (f", {jobs} runs at once (`--jobs {jobs}`)" if jobs > 1 else "")
            + f"): **{data['total_seconds'] / 60:.1f} min wall, {data['cpu_seconds'] / 60:.1f} min CPU**, load average "
            f"{load['start'][0]:.1f} at the start and {load['end'][0]:.1f} at the end; the shared warm-up took "
            f"{start['seconds']:.0f} s ({start['sft']['sft/steps']:.0f} steps"
            + (f", {start['cpu_seconds']:.0f} s CPU" if "cpu_seconds" in start else "")
            + f").\n\n```text\n{data['table']}\n```\n")
    return "\n".join(parts)


def compare_env_summary() -> str:
    """One row per built-in environment of ``compare_env``: held-out success at the start and
    at the end per algorithm (mean +- std over seeds), the success verdict, wall and CPU time."""
    rows, algorithms = [], None
    for env in COMPARE_ENVS:
        path = RESULTS / f"compare_env_{env}" / "compare.json"
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        algorithms = algorithms or data["algorithms"]
        summary = data["summary"]
        start = summary[algorithms[0]]["initial_accuracy"]["mean"]
        cells = [f"{summary[a]['final_accuracy']['mean']:.3f} ± {summary[a]['final_accuracy']['std']:.3f}" for a in algorithms]
        success = next(v for v in data["verdicts"] if v["axis"] == "success")
        verdict = f"{success['winner']} first; " + ("distinguishable" if success["distinguishable"] else "not distinguishable over the seeds")
        rows.append([env, data["budget"]["text"], f"{start:.3f}", *cells, verdict,
                     f"{data['total_seconds'] / 60:.1f} / {data['cpu_seconds'] / 60:.1f} min"])
    if not rows:
        return "Not measured yet.\n"
    return _rows(["env", "budget", "success at start", *algorithms, "verdict", "wall / CPU"], rows)


ASYNC_RESULTS = "async_default_cpu_v3.json"
"""benchmarks/bench_async.py's results, on the idle machine (async_default_cpu_v2.json: earlier code, before the heap and warm-up fixes, on the loaded machine; async_default_cpu.json: before the shared-memory slots)."""


def async_default() -> str:
    """``--async_steps 1`` vs the synchronous loop on the embedded default, per seed (benchmarks/bench_async.py)."""
    data = _load(ASYNC_RESULTS)
    rows = []
    for seed, run in sorted(data["runs"].items(), key=lambda kv: int(kv[0])):
        sync, asy, r = run["sync"], run["async"], data["per_seed"][seed]
        rows.append([seed, f"{sync['step_seconds_median']:.3f} s", f"{sync['generate_seconds_median']:.3f} s",
                     f"{sync['rest_seconds_median']:.3f} s", f"{asy['step_seconds_median']:.3f} s",
                     f"{r['async_step_over_sync_step']:.2f}x", f"{r['async_step_over_max_gen_rest']:.2f}x",
                     f"{r['cpu_least_disturbed_async_step_over_max_gen_rest']:.2f}x",
                     f"{sync['eval'][-1]['accuracy']:.3f}", f"{asy['eval'][-1]['accuracy']:.3f}"])
    table = _rows(["seed", "sync step", "sync: generation", "sync: rest of the step", "async step", "async / sync",
                   "async / max(gen, rest)", "same, CPU seconds", "held-out acc. sync (step 150)", "async (step 150)"], rows)
    acc = data["summary"]["final_accuracy"]
    return table + (f"\nMedians over each run's GRPO steps (the first excluded). CPU seconds: the trainer process's CPU "
                    f"time per step (every thread; not the time other processes held the core) over max(the synchronous "
                    f"run's generation CPU, the rest of its step's CPU), each mode's least disturbed pass in CPU terms. Held-out accuracy at step 150: sync "
                    f"{acc['sync']['mean']:.3f} (spread {acc['sync']['spread']:.3f}), async {acc['async']['mean']:.3f} "
                    f"(spread {acc['async']['spread']:.3f}). `{data['command']}`; {data['pinning']}; {data['machine']}; "
                    f"{data['date']}.\n")


def async_equal_wall() -> str:
    """Held-out accuracy of the same runs at equal wall time (RL seconds, evaluation not counted)."""
    data = _load(ASYNC_RESULTS)
    rows = []
    for seed, run in sorted(data["runs"].items(), key=lambda kv: int(kv[0])):
        sync, asy, r = run["sync"], run["async"], data["per_seed"][seed]
        rows.append([seed, f"{sync['rl_seconds']:.1f} s", f"{asy['rl_seconds']:.1f} s", f"{r['equal_wall_seconds']:.1f} s",
                     f"{r['equal_wall_accuracy_sync']:.3f} (step {r['equal_wall_step_sync']:.0f})",
                     f"{r['equal_wall_accuracy_async']:.3f} (step {r['equal_wall_step_async']:.0f})",
                     f"{sync['load_1min']['start']:.1f}-{sync['load_1min']['end']:.1f}",
                     f"{asy['load_1min']['start']:.1f}-{asy['load_1min']['end']:.1f}"])
    table = _rows(["seed", "sync: RL seconds, 150 steps", "async: RL seconds, 150 steps", "equal wall time W",
                   "held-out acc. sync at W", "async at W", "load sync run", "load async run"], rows)
    acc = data["summary"]["equal_wall_accuracy"]
    return table + (f"\n{data['equal_wall_time']}. Mean held-out accuracy at W: sync {acc['sync']['mean']:.3f} (spread "
                    f"{acc['sync']['spread']:.3f}), async {acc['async']['mean']:.3f} (spread {acc['async']['spread']:.3f}). "
                    f"Load: the 1-minute load average at the start and end of each run (2 cores).\n")


ASYNC_STAGES = (("generate", "generation (sync) / the wait for the rollout (async)"),
                ("weights", "weights into the sampler's shared slot"), ("receive", "decoding the rollout"),
                ("reward", "scoring"), ("ref_logp", "reference log-probs"), ("advantages", "advantages"),
                ("update", "update"), ("sync", "weight sync + probe"), ("untimed", "the rest (experience, metrics, logs; async: the worker thread too)"))
"""The rows of ``async_breakdown``: (stage, what it is)."""


def async_breakdown() -> str:
    """Where a step's CPU goes, sync vs async, per seed (the same runs as ``async_default``)."""
    data = _load(ASYNC_RESULTS)
    seeds = sorted(data["runs"], key=int)

    def cells(mode: str, stage: str) -> str:
        return " / ".join(f"{data['runs'][s][mode]['stages_cpu_median_ms'].get(stage, 0.0):.1f}" for s in seeds)

    rows = [[what, cells("sync", stage), cells("async", stage)] for stage, what in ASYNC_STAGES]
    rows.append(["**step**", " / ".join(f"{1e3 * data['runs'][s]['sync']['step_cpu_seconds_median']:.1f}" for s in seeds),
                 " / ".join(f"{1e3 * data['runs'][s]['async']['step_cpu_seconds_median']:.1f}" for s in seeds)])
    sampler = [data["runs"][s]["async"]["stages_median_ms"] for s in seeds]
    per = lambda key: " / ".join(f"{m.get(key, 0.0):.1f}" for m in sampler)  # noqa: E731
    gc = " / ".join(f"{data['runs'][s][m]['gc_seconds_in_steps']:.2f}" for m in ("sync", "async") for s in seeds)
    table = _rows([f"trainer CPU ms per step, median (seeds {' / '.join(seeds)})", "sync", "async"], rows)
    return table + (f"\nThe main thread's CPU per stage (`time.thread_time`; the step: the whole process). The sampler "
                    f"process per rollout (wall ms, seeds {' / '.join(seeds)}): sampling {per('async/sampler_seconds')} "
                    f"(CPU {per('async/sampler_cpu_seconds')}), its weight copy {per('async/sampler_load_seconds')}, "
                    f"encoding {per('async/sampler_encode_seconds')}, idle waiting for the next request "
                    f"{per('async/sampler_waited_seconds')}. GC pauses within the 150 steps, sync then async: {gc} s. "
                    f"Same JSON and command as the table above.\n")


TABLES: dict[str, Callable[[], str]] = {"default_train_seeds": default_train_seeds, "env_train_seeds": env_train_seeds,
                                        "agent_benchmarks": agent_benchmarks, "headline": headline,
                                        "compare_default": compare_default, "benchmarks_cpu": benchmarks_cpu,
                                        "async_default": async_default, "async_equal_wall": async_equal_wall,
                                        "async_breakdown": async_breakdown,
                                        "compare_env": compare_env, "compare_env_summary": compare_env_summary,
                                        "sql_levers": sql_levers}


OPS_QUICK = "bench-cpu-quick-policy_loss-advantages.json"
"""`fastrl bench --quick --only policy_loss advantages` on this project's CPU: every op beside every baseline."""


def ops_quick_cpu() -> str:
    """Every op of `fastrl bench --quick --only policy_loss advantages` beside each of its
    baselines, the ones fastrl loses to included (ratio < 1)."""
    data = _load(OPS_QUICK)
    rows = []
    by_case: dict[tuple[str, str], list[dict]] = {}
    for r in data["results"]:
        by_case.setdefault((r["op"], r["shape"]), []).append(r)
    for (op, shape), impls in by_case.items():
        fastrl = next(r for r in impls if r["impl"] == "fastrl")
        for i, base in enumerate(r for r in impls if r["impl"] != "fastrl"):
            ratio = base["best_ms"] / fastrl["best_ms"]
            verdict = " ~" if base.get("within_noise") else "" if ratio >= 1.0 else " (slower)"
            rows.append([f"`{op}`" if i == 0 else "", shape if i == 0 else "", f"{fastrl['best_ms']:.3f} ms" if i == 0 else "",
                         f"{base['impl']}: {base['best_ms']:.3f} ms", f"{ratio:.2f}x{verdict}"])
    env = data["environment"]
    table = _rows(["op (fwd+bwd where it has a gradient)", "shape", "fastrl (best)", "baseline (best)", "ratio"], rows)
    return table + (f"\n`fastrl bench --quick --only policy_loss advantages --out benchmarks/results/{OPS_QUICK}` "
                    f"({data['created'][:10]}; code {data.get('code', 'not recorded')}; torch {env['torch']}, one intra-op thread, "
                    "the project's 2-core CPU shared with "
                    "other sessions' work); ratio = baseline time / fastrl time, best of n; ~: inside the run's noise "
                    "(the spread, median / best, of the two rows), too noisy to rank.\n")


THREAD_RULE = "thread_rule_governor_cpu.json"
"""The thread rule as it is (the free cores, kept by the governor). Before it: ``thread_rule_cpu.json``
(one thread under 0.5M parameters, on a shared machine) and ``thread_rule_idle_cpu.json`` (the same on
the idle CPU, where two threads beat it by 1.38x)."""
NEIGHBOURS = {"none": "none", "before": "busy loop from the start", "arrives": "busy loop arriving 5 s in"}


def thread_rule() -> str:
    """`benchmarks/thread_rule.py`: fastrl train's thread rule vs 1 and 2 threads: alone, beside a
    busy loop, and with one arriving mid-run."""
    data = _load(THREAD_RULE)
    rows = []
    for verdict in data["verdicts"]:
        task, neighbour = verdict["task"], verdict["neighbour"]
        for setting in ("rule", "1", "2"):
            runs = [r for r in data["runs"] if r["task"] == task and r["neighbour"] == neighbour and r["setting"] == setting]
            best = min(runs, key=lambda r: r["wall_seconds"])
            walls = ", ".join(f"{r['wall_seconds']:.1f}" + ("" if r["finished"] else "+") for r in runs)
            threads = "rule: " + best["threads_line"].split("threads: ", 1)[1].split(" ", 1)[0] + " at the start" \
                if setting == "rule" else setting
            rate = f"{best['warmup_steps_per_s']:.1f}" if best.get("warmup_steps_per_s") else "-"
            step = f"{best['rl_step_seconds_median']:.2f} s" if best.get("rl_step_seconds_median") else "-"
            loads = "; ".join(f"{r['load_before']:.1f}/{r['load_after']:.1f}" for r in runs)
            ratio = (f"{verdict['rule_over_best']:.2f}x the best" + ("" if verdict["within_bound"] else
                     f" (over {data['slower_bound']:g}x)")) if setting == "rule" else ""
            rows.append([task if setting == "rule" else "", NEIGHBOURS[neighbour] if setting == "rule" else "",
                         threads, walls, rate, step, loads, ratio])
    table = _rows(["task", "neighbour", "threads", "wall s per run (+: stopped at the limit)", "warm-up steps/s (best run)",
                   "RL step (best run)", "load before/after", "rule vs best"], rows)
    return table + (f"\n`{data['command']}` ({data['date']}; code {data['code']}; {data['machine']}; each run cut short: "
                    f"`{' '.join(data['tasks']['default'])}` and `{' '.join(data['tasks']['calculator'])}`, so the per-step "
                    f"rates are what counts; {data['repeats']} run(s) per setting, interleaved; a run still going after "
                    f"{data['limit_seconds']:.0f} s was stopped). The load average is the 1-minute one, so it still carries "
                    "the runs before it (and, after a row with a busy loop, the loop).\n")


TABLES["ops_quick_cpu"] = ops_quick_cpu
TABLES["thread_rule"] = thread_rule


def seed_curves(name: str) -> str:
    """One seed study of benchmarks/env_train_seeds.py, a row per seed: the warm-up, held-out success at
    every evaluation, the rows gained and lost, the RL step and the whole run."""
    data = _load(name)
    runs = sorted(data["runs"].items(), key=lambda kv: int(kv[0]))
    steps = [f"{e['step']:.0f}" for e in runs[0][1]["eval"]]
    rows = []
    for seed, run in runs:
        curve = ", ".join(f"{e['accuracy']:.2f}" for e in run["eval"][:-1]) + f", **{run['eval'][-1]['accuracy']:.2f}**"
        paired = run["heldout_first_last_paired"]
        rows.append([seed, _warm_up(run), curve, f"+{paired['gained']} / -{paired['lost']} ({_p_value(paired['p_value'])})",
                     f"{run['rl_step_seconds_median']:.2f} s", f"{run['wall_seconds']:.0f} s ({run['cpu_seconds']:.0f} CPU-s)"])
    table = _rows(["seed", "warm-up steps (s), last probe", f"held-out success, steps {steps[0]}, {steps[1]}, ..., {steps[-1]}",
                   "rows gained / lost (p)", "RL step (median)", "whole run"], rows)
    commits = sorted({run["commit"].split("+")[0] for _, run in runs})
    return table + f"\n`{data['command']}` ({data['date']}; code {', '.join(commits)}; {data['machine']}); `benchmarks/results/{name}`.\n"


PROBE_SOONER_FILES = (("sql", "env_train_sql_probe_sooner_default_threads_cpu.json"),
                      ("frozenlake", "env_train_frozenlake_probe_sooner_cpu.json"),
                      ("calculator", "env_train_calculator_probe_sooner_cpu.json"))
"""The seed studies with the warm-up probed sooner near its target (code 1992e0f), each beside ENV_SEED_FILES' run."""


def probe_sooner() -> str:
    """The warm-up probed sooner near its target against every ``sft_check_every`` steps (the README's rows), per seed."""
    fixed = {_load(name)["env"]: _load(name)["runs"] for name in ENV_SEED_FILES}
    rows = []
    for env, name in PROBE_SOONER_FILES:
        for seed, run in sorted(_load(name)["runs"].items(), key=lambda kv: int(kv[0])):
            paired, base = run["heldout_first_last_paired"], fixed[env][seed]
            rows.append([env, seed, f"{run['sft_steps']:.0f}, {run['sft_probe_accuracy']:.2f} ({run['sft_probes']:.0f})",
                         f"{run['eval'][0]['accuracy']:.2f} -> {run['eval'][-1]['accuracy']:.2f}",
                         f"+{paired['gained']} / -{paired['lost']} ({_p_value(paired['p_value'])})",
                         f"{base['sft_steps']:.0f}; {base['eval'][0]['accuracy']:.2f} -> {base['eval'][-1]['accuracy']:.2f}, "
                         f"+{base['heldout_first_last_paired']['gained']} / -{base['heldout_first_last_paired']['lost']}"])
    return _rows(["env", "seed", "warm-up steps, last probe (probes)", "held-out success, step 0 -> end", "rows gained / lost (p)",
                  "every 10 steps (the README's rows): warm-up steps; held-out, rows"], rows) + (
        "\n" + "; ".join(f"`{_load(name)['command']}`" for _, name in PROBE_SOONER_FILES)
        + f" ({_load(PROBE_SOONER_FILES[0][1])['date']}); `benchmarks/results/"
        + "`, `benchmarks/results/".join(name for _, name in PROBE_SOONER_FILES) + "`.\n")


REAL_TOKENIZER = "agent_real_tokenizer_cpu.json"
TOKENIZER_STYLES = (("qwen2.5", "Qwen2.5 style"), ("qwen3", "Qwen3 style"), ("llama3", "Llama 3 style"))


def real_tokenizer() -> str:
    """benchmarks/agent_real_tokenizer.py: mismatched/checked turns (samples per trajectory, outcome reward), before -> after."""
    data = _load(REAL_TOKENIZER)
    before, after = data["before_4d84e71"]["calculator"], data["after"]["calculator"]

    def cell(r: dict) -> str:
        return f"{r['mismatched_turns']}/{r['checked_turns']} ({r['samples_per_trajectory']:.2f}, {r['outcome_reward_mean']:.2f})"

    rows = [[case] + [f"{cell(before[style][case])} -> {cell(after[style][case])}" for style, _ in TOKENIZER_STYLES]
            for case in before[TOKENIZER_STYLES[0][0]]]
    return _rows(["policy turns", *(label for _, label in TOKENIZER_STYLES)], rows) + (
        f"\n`{data['command']}`: before at {data['before_4d84e71']['commit']}, after at {data['after']['commit']}; "
        f"{data['after']['rows_per_run']} rows a run, seed {data['after']['seed']}; `benchmarks/results/{REAL_TOKENIZER}`.\n")


SQL_SEED_CURVES = {"sql_trie_warmup": "env_train_sql_trie_warmup_default_threads_cpu.json",
                   "sql_target05": ENV_SEED_FILES[2], "sql_fresh_seeds": "env_train_sql_fresh_seeds_default_threads_cpu.json"}
"""docs/agents.md's per-seed tables of sql's studies since the warm-up ran as a trie."""
TABLES.update({name: partial(seed_curves, file) for name, file in SQL_SEED_CURVES.items()})
TABLES["probe_sooner"] = probe_sooner
TABLES["real_tokenizer"] = real_tokenizer


H200 = "gpu_h200_20261204"
"""The first GPU run (benchmarks/gpu/run.sh on one H200): its folder under benchmarks/results/."""
H200_BASELINES = {"sdpa_expanded": "SDPA over the prefix expanded per sample", "flex_expanded": "FlexAttention",
                  "liger": "Liger `LigerFusedLinearGRPOLoss`", "naive": "naive logits"}


def h200_kernels() -> str:
    """The H200's kernels against their baselines (``kernels.json``), best times, fastrl's losses included."""
    data = _load(f"{H200}/kernels.json")
    by_case: dict[tuple[str, str], list[dict]] = {}
    for r in data["results"]:
        by_case.setdefault((r["op"], r["shape"]), []).append(r)
    calls: dict[str, list[int]] = {}
    for r in data["results"]:
        calls.setdefault(r["op"], []).append(r["calls"])
    rows = []
    for (op, shape), impls in by_case.items():
        mine = next(r for r in impls if r["impl"] == "fastrl")
        others = [r for r in impls if r["impl"] != "fastrl"]
        memory = op.startswith("grpo_loss")
        cell = lambda r: f"{r['best_ms']:.3f} ms" if not memory else f"{r['best_ms']:.0f} ms, {r['peak_mem_mb']:.0f} MiB"  # noqa: E731
        ratios = [f"{r['speedup_of_fastrl']:.2f}x {H200_BASELINES[r['impl']].split(' ')[0]}"
                  + (f" at {mine['peak_mem_mb'] / r['peak_mem_mb']:.2f}x its memory" if memory else "") for r in others]
        rows.append([f"`{op}` {shape}", cell(mine), "; ".join(f"{H200_BASELINES[r['impl']]}: {cell(r)}" for r in others),
                     ", ".join(ratios)])
    return _rows(["case", "fastrl (best)", "baselines (best)", "speed of fastrl / baseline"], rows) + (
        f"\n`benchmarks/results/{H200}/kernels.json` ({data['created'][:10]}; {data['environment']['gpu']}, torch "
        f"{data['environment']['torch']}, Triton {data['environment']['triton']}); the best of each implementation's timed calls "
        f"(`calls` in the JSON: " + "; ".join(f"`{op}` {min(c)}-{max(c)}" if min(c) != max(c) else f"`{op}` {c[0]}"
                                              for op, c in calls.items())
        + "), each after its check against the reference passed; below 1x fastrl is slower.\n")


def logprob_floor() -> str:
    """benchmarks/gpu/logprob_floor.py's predictions on the H200 (a model, not a measurement)."""
    rows = []
    for r in _load("logprob_floor_predicted_h200.json"):
        rows.append([f"{r['N']}, {r['H']}, {r['V']}", f"{r['floor_ms']:.1f} ms",
                     f"{r['chunked_one_pass_ms']:.1f} ms ({r['chunked_one_pass_ms'] / r['floor_ms']:.2f}x)",
                     f"{r['chunked_two_pass_ms']:.1f} ms",
                     f"{r['floor_fwd_ms']:.1f} / {r['chunked_forward_ms']:.1f} ms ({r['chunked_forward_ms'] / r['floor_fwd_ms']:.2f}x)",
                     f"{r['chunked_one_pass_peak_gib']:.1f} / {r['naive_peak_gib']:.1f} GiB"])
    return _rows(["N, H, V", "floor fwd+bwd (3 GEMMs)", "chunked one pass (predicted)", "two pass (predicted)",
                  "no-grad: 1 GEMM / chunked (predicted)", "peak above inputs, chunked / naive (predicted)"], rows)


def long_grpo_gpu() -> str:
    """The long-trajectory GRPO step on the H200 (``long_grpo_gpu.json``): prompt repeated vs shared prefix."""
    data = _load(f"{H200}/long_grpo_gpu.json")
    modes = (("repeated", "prompt repeated"), ("shared:triton", "shared prefix, Triton kernel"),
             ("shared:flex", "shared prefix, FlexAttention"))
    rows = []
    for tokens in data["shapes"]["tokens_per_group"]:
        cells = {r["mode"]: r for r in data["results"] if r["tokens_per_group"] == tokens and r["ok"]}
        rows.append([str(tokens)] + [f"{cells[m]['step_s']:.3f} s, +{cells[m]['peak_extra_mib']:.0f} MiB" if m in cells else "-"
                                     for m, _ in modes])
    return _rows(["tokens per group", *(label for _, label in modes)], rows)


TABLES["h200_kernels"] = h200_kernels
TABLES["logprob_floor"] = logprob_floor
TABLES["long_grpo_gpu"] = long_grpo_gpu

def figures() -> dict[str, Callable[[], str]]:
    """``FIGURES`` of benchmarks/figures.py, the prose figures."""
    return _figures.FIGURES


def pages() -> list[Path]:
    out = []
    for entry in PAGES:
        path = ROOT / entry
        out += sorted(path.rglob("*.md")) if path.is_dir() else [path]
    return out


def render(text: str) -> str:
    """``text`` with every marked table re-rendered; an unknown table name is an error."""
    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in TABLES:
            raise KeyError(f"no table named {name!r} (known: {', '.join(TABLES)})")
        return match.group(1) + TABLES[name]() + match.group(4)

    def figure(match: re.Match) -> str:
        name = match.group("name")
        known = figures()
        if name not in known:
            raise KeyError(f"no figure named {name!r} (known: {', '.join(known)})")
        return match.group(1) + known[name]() + match.group(4)

    return FIGURE.sub(figure, MARKER.sub(replace, text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report pages whose tables disagree with the JSON; write nothing")
    args = parser.parse_args(argv)
    stale = []
    for page in pages():
        text = page.read_text()
        new = render(text)
        if new != text:
            stale.append(page.relative_to(ROOT))
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        print("tables out of date with benchmarks/results (run python benchmarks/render_tables.py): "
              + ", ".join(map(str, stale)), file=sys.stderr)
        return 1
    print(("rewrote " + ", ".join(map(str, stale))) if stale and not args.check else "tables match benchmarks/results")
    return 0


if __name__ == "__main__":
    sys.exit(main())
