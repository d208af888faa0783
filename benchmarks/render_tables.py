"""The tables of README.md and docs/ written from benchmarks/results/*.json (never by hand).

A page holds each table between ``<!-- table:NAME -->`` and ``<!-- /table -->``; this script
replaces what is between the markers with the table rendered from the JSON:

    python benchmarks/render_tables.py          # rewrite the tables in README.md and docs/*.md
    python benchmarks/render_tables.py --check  # exit 1 when a page and the JSON disagree

``tests/test_docs.py`` runs the check, so a results file and the page that quotes it cannot
drift apart.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = ("README.md", "docs")
MARKER = re.compile(r"(<!-- table:(?P<name>[a-z_]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


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
        rows.append([label, f"{run['sft_steps']:.0f} ({run['sft_seconds']:.0f} s)",
                     f"{first['accuracy']:.3f} -> **{last['accuracy']:.3f}**",
                     f"{first['pass@4']:.3f} -> {last['pass@4']:.3f}",
                     f"{run['grpo_step_seconds_median']:.2f} s", f"{run['wall_seconds']:.0f} s"])
    table = _rows(["seed", "warm-up steps (s)", "held-out accuracy", "pass@4", "GRPO step (median)", "whole run"], rows)
    return table + f"\n`{data['command']}`; {data['machine']}; {data['date']}.\n"


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


TABLES: dict[str, Callable[[], str]] = {"default_train_seeds": default_train_seeds, "headline": headline,
                                        "compare_default": compare_default}


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

    return MARKER.sub(replace, text)


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
