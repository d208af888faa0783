"""``fastrl compare`` itself: plan (every check), the shared start, every run, the report."""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from typing import Sequence

from fastrl.commands.compare.defaults import CompareError
from fastrl.commands.compare.options import ComparePlan, plan_compare
from fastrl.commands.compare.processes import INTERRUPTED_STATUS, RunProcesses, cpu_seconds_used, run_all, stop_signals_exit
from fastrl.commands.compare.report import build_report, describe_run
from fastrl.commands.compare.runs import run_one
from fastrl.commands.compare.start import prepare_start


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
                           on_done=lambda i, r: say(f"[{i + 1}/{n_runs}] {order[i][0]} seed {order[i][1]}: {describe_run(r)}"))
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
