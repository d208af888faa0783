"""`fastrl train --env NAME` (a built-in environment with its defaults) per seed: the warm-up,
held-out success and tool-call rate at step 0 (after the warm-up, before RL) and after RL, the
held-out rows gained and lost between the two with the exact McNemar p-value
(``fastrl.commands.paired``: the same rows evaluated twice), the median RL step, the whole run's
wall time.

    nice python benchmarks/env_train_seeds.py --env calculator --seeds 0 1 2 \
        --out benchmarks/results/env_train_calculator_3seeds_cpu.json

Each seed is a fresh `OMP_NUM_THREADS=1 fastrl train --env NAME --seed S --threads 1` process,
one after the other (`--parallel`: all at once; under `nice` when this script is); a run's CPU
time is its own (``os.wait4``: the process and the workers it reaped); `--threads default` runs it as a user
does instead (`fastrl train --env NAME --seed S`: torch's default threads, no OMP_NUM_THREADS).
The machine's 1-minute load average is recorded before and after each run and sampled every
`LOAD_SAMPLE_SECONDS` during it (mean and max: the CPU is shared). benchmarks/render_tables.py
turns the JSON into the README's table. A seed's run is a process group of its own: SIGTERM or
SIGINT to this script kills every run still going, with its workers, before it exits.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastrl.commands.paired import paired_change  # noqa: E402

COMMANDS = {"1": "OMP_NUM_THREADS=1 fastrl train --env {env} --seed S --threads 1", "default": "fastrl train --env {env} --seed S"}
"""The command a seed runs, per ``--threads`` choice."""
LOAD_SAMPLE_SECONDS = 15.0
"""How often the load average is sampled during a run."""
EVAL_KEYS = {"accuracy": "eval/accuracy", "tool_call_rate": "eval/tool_call_rate", "turns_mean": "eval/turns_mean"}
"""What each held-out evaluation record gives (``fastrl.train.agent.evaluate``)."""


def code_version(*, results: Path | None = None) -> str:
    """The commit the run's fastrl is (``+dirty`` when the worktree has uncommitted changes other than
    ``results``, this study's own JSON, which is rewritten after every seed and may be a tracked file)."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    spec = ["--", "."]
    if results is not None and results.resolve().is_relative_to(ROOT):
        spec.append(f":(exclude){results.resolve().relative_to(ROOT)}")
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", *spec],
                           capture_output=True, text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


RUNNING: set[int] = set()
"""The process groups of the seeds' ``fastrl train`` runs now going (killed when this script is)."""


def kill_running(signum: int, _frame: object) -> None:
    """SIGTERM/SIGINT: end every seed's run with its workers (its own process group), then exit."""
    for pgid in list(RUNNING):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    raise SystemExit(128 + signum)


def run_seed(env_name: str, seed: int, out: Path, extra: list[str], *, threads: str = "1",
             results: Path | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    pinned = ["--threads", "1"] if threads == "1" else []
    if threads == "1":
        env["OMP_NUM_THREADS"] = "1"
    else:
        env.pop("OMP_NUM_THREADS", None)
    commit = code_version(results=results)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "fastrl.cli", "train", "--env", env_name, "--seed", str(seed), *pinned,
           "--output_dir", str(out), "--progress", "false", *extra]
    loads: list[float] = []
    done = threading.Event()

    def sample_load() -> None:
        while not done.wait(LOAD_SAMPLE_SECONDS):
            loads.append(os.getloadavg()[0])

    sampler = threading.Thread(target=sample_load, daemon=True)
    sampler.start()
    out.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}.log"
    try:
        with open(log, "w") as sink:
            proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
            RUNNING.add(proc.pid)
            try:
                _, status, usage = os.wait4(proc.pid, 0)  # this run's own CPU time (it and its reaped workers)
            finally:
                RUNNING.discard(proc.pid)
            proc.returncode = os.waitstatus_to_exitcode(status)
    finally:
        done.set()
        sampler.join()
    wall = time.perf_counter() - t0
    cpu = usage.ru_utime + usage.ru_stime
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed}: exit {proc.returncode}\n{log.read_text()[-4000:]}")
    return {**read_run(out), "commit": commit, "wall_seconds": round(wall, 1), "cpu_seconds": round(cpu, 1),
            "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
            "load_average_during_mean_max": [round(statistics.fmean(loads), 2), round(max(loads), 2)] if loads else None,
            "threads": threads}


def read_run(out: Path) -> dict:
    """The warm-up, evaluations and RL steps of one run's ``metrics.jsonl`` (so far, for a run still going)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    sft = next((r for r in records if r.get("event") == "eval" and "sft/steps" in r), {})
    evals = [r for r in records if r.get("event") == "eval" and "eval/accuracy" in r]
    steps = [r for r in records if "event" not in r]
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    paired = None
    if len(evals) >= 2 and "row_success" in evals[0] and "row_success" in evals[-1]:
        change = paired_change(evals[0]["row_success"], evals[-1]["row_success"])
        paired = {"gained": change.gained, "lost": change.lost, "rows": change.rows, "p_value": change.p_value}
    return {
        "sft_steps": sft.get("sft/steps"), "sft_seconds": round(sft["sft/seconds"], 1) if "sft/seconds" in sft else None,
        "sft_probe_accuracy": sft.get("sft/probe_accuracy"),
        "sft_probes": sft.get("sft/probes"),
        "eval": [{"step": r["step"], **{k: r.get(v) for k, v in EVAL_KEYS.items()}} for r in evals],
        "heldout_first_last_paired": paired,
        "rl_steps": len(steps),
        "rl_step_seconds_median": round(statistics.median(r["time/step"] for r in steps), 3) if steps else None,
        "train_tool_call_rate_first_last": [steps[0].get("agent/tool_call_rate"), steps[-1].get("agent/tool_call_rate")]
        if steps else None,
        "env_calls": sum(r.get("agent/env_calls", 0.0) for r in steps),
        "stopped_by": summary.get("stopped_by"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", required=True, help="a built-in environment: calculator, sql, frozenlake")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", choices=sorted(COMMANDS), default="1",
                        help="1: OMP_NUM_THREADS=1 and --threads 1 (CPU time comparable); default: as a user runs it")
    parser.add_argument("--machine", default="the project's 2-core CPU, shared with other sessions; seeds one after the other")
    parser.add_argument("--parallel", action="store_true",
                        help="run the seeds at the same time (one process each) instead of one after the other")
    parser.add_argument("--runs_dir", type=Path, default=None,
                        help="keep each seed's run directory here (seed<S>); default: a temporary directory")
    parser.add_argument("extra", nargs="*", help="more `fastrl train` options after --, given to every seed")
    args = parser.parse_args()
    command = COMMANDS[args.threads].format(env=args.env) + (" " + shlex.join(args.extra) if args.extra else "")
    runs: dict[str, dict] = {}
    payload = {"what": f"fastrl train --env {args.env} (built-in defaults: warm-up on synthetic transcripts, then RL) per seed",
               "env": args.env, "command": command, "machine": args.machine, "niceness": os.nice(0),
               "date": time.strftime("%Y-%m-%d"), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, kill_running)
    with tempfile.TemporaryDirectory() as tmp:
        where = args.runs_dir or Path(tmp)
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(args.seeds) if args.parallel else 1) as pool:
            futures = {pool.submit(run_seed, args.env, seed, where / f"seed{seed}", args.extra, threads=args.threads,
                                   results=args.out): seed
                       for seed in args.seeds}
            for future in concurrent.futures.as_completed(futures):
                seed = futures[future]
                runs[str(seed)] = future.result()
                print(f"seed {seed}: {json.dumps(runs[str(seed)])}", flush=True)
                args.out.write_text(json.dumps(payload, indent=1) + "\n")  # after each seed: a partial study survives
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
