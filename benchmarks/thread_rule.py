"""`fastrl train`'s thread rule (fastrl/train/run/threads.py) against 1 and 2 intra-op threads, on the
embedded default and `--env calculator`, with nothing of ours beside it, beside a busy-loop
neighbour this script starts itself, and with that neighbour arriving a few seconds into the run
(what the rule's governor, which re-reads the machine every second, is for).

    python benchmarks/thread_rule.py --repeats 2 --out benchmarks/results/thread_rule_cpu.json

Each run is a fresh `fastrl train` process cut short (a warm-up of at most `--sft_steps` steps --
`--sft_target_accuracy null` leaves the built-in task's target, so it may stop at a probe, the
same step in every setting: the seed is fixed -- then a few RL steps, no evaluation): the per-step rates are what the thread
count changes, and short runs keep the study to minutes on a shared machine. A run that has
not finished after `--limit` seconds is stopped and recorded as such (a lower bound). Each
setting runs `--repeats` times, interleaved; the verdict compares each setting's best run. The
load average is recorded before and after each run: on a machine shared with other work,
"no neighbour" means none started by this script, not an idle CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.env_train_seeds import code_version  # noqa: E402

TASKS = {
    # name -> the options of the short run (warm-up steps fixed, no probes, few RL steps, no evaluation)
    "default": ["--sft_steps", "60", "--sft_target_accuracy", "null", "--steps", "4"],
    "calculator": ["--env", "calculator", "--sft_steps", "30", "--sft_target_accuracy", "null", "--steps", "4"],
}
COMMON = ["--eval_every", "0", "--progress", "false", "--tensorboard", "false", "--overwrite", "true"]
SETTINGS = {"rule": [], "1": ["--threads", "1"], "2": ["--threads", "2"]}
NEIGHBOUR = "while True: pass"
"""The CPU-bound neighbour: one Python busy loop (one core)."""
NEIGHBOURS = ("none", "before", "arrives")
"""Where the busy loop is: absent, running before the run starts, started ``ARRIVAL_SECONDS`` into the run."""
ARRIVAL_SECONDS = 5.0
SLOWER_BOUND = 1.2
"""The rule may be at most this much slower than the best setting (issue 39)."""


def load() -> float:
    return round(os.getloadavg()[0], 2)


def busy_loop() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", NEIGHBOUR])


def run_once(task: str, setting: str, out: Path, *, limit: float, arriving: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT)
    argv = [sys.executable, "-m", "fastrl", "train", *TASKS[task], *COMMON, *SETTINGS[setting], "--output_dir", str(out)]
    before = load()
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    late = None
    try:
        if arriving:
            try:
                output, _ = proc.communicate(timeout=ARRIVAL_SECONDS)
            except subprocess.TimeoutExpired:
                late = busy_loop()
        output, _ = proc.communicate(timeout=max(1.0, limit - (time.perf_counter() - t0)))
        finished = proc.returncode == 0
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        finished = False
    finally:
        if late is not None:
            late.kill()
            late.wait()
    wall = time.perf_counter() - t0
    record = {"task": task, "setting": setting, "finished": finished, "wall_seconds": round(wall, 1),
              "load_before": before, "load_after": load()}
    chosen = [line for line in output.splitlines() if line.startswith("fastrl train: threads:")]
    record["threads_line"] = chosen[0] if chosen else None
    metrics = out / "metrics.jsonl"
    if finished and metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        sft = next((r for r in rows if r.get("event") == "eval" and "sft/steps" in r), None)
        steps = [r["time/step"] for r in rows if "event" not in r]
        if sft:
            record["warmup_steps_per_s"] = round(sft["sft/steps"] / sft["sft/seconds"], 2)
        if steps:
            record["rl_step_seconds_median"] = round(statistics.median(steps), 3)
    elif not finished:
        record["output_tail"] = output.splitlines()[-3:]
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--neighbours", nargs="+", default=list(NEIGHBOURS), choices=NEIGHBOURS)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each setting (best-of-n in the verdict)")
    parser.add_argument("--limit", type=float, default=150.0, help="seconds before a run is stopped (recorded as unfinished)")
    parser.add_argument("--machine", default="the project's 2-core CPU, shared with other sessions' work")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for neighbour in args.neighbours:
            busy = busy_loop() if neighbour == "before" else None
            try:
                if busy is not None:
                    time.sleep(5)  # let the load average see it
                for repeat in range(args.repeats):  # settings interleaved, so a change in the load hits them alike
                    for task in args.tasks:
                        for setting in SETTINGS:
                            record = run_once(task, setting, Path(tmp) / f"{task}-{setting}", limit=args.limit,
                                              arriving=neighbour == "arrives")
                            record.update(neighbour=neighbour, repeat=repeat)
                            runs.append(record)
                            print(json.dumps(record), flush=True)
            finally:
                if busy is not None:
                    busy.kill()
                    busy.wait()
    verdicts = []
    for neighbour in args.neighbours:
        for task in args.tasks:
            # best of the repeats per setting (the least disturbed run), as `fastrl bench` reports best-of-n
            best_of = {setting: min(r["wall_seconds"] for r in runs
                                    if r["task"] == task and r["neighbour"] == neighbour and r["setting"] == setting)
                       for setting in SETTINGS}
            ratio = best_of["rule"] / min(best_of.values())
            verdicts.append({"task": task, "neighbour": neighbour, "best_wall_seconds": best_of,
                             "rule_over_best": round(ratio, 2), "within_bound": ratio <= SLOWER_BOUND})
    neighbours = "" if list(args.neighbours) == list(NEIGHBOURS) else " --neighbours " + " ".join(args.neighbours)
    payload = {"what": "fastrl train cut short (fixed warm-up, few RL steps, no evaluation): the thread rule vs 1 and 2 threads, "
                       "without a busy-loop neighbour, with one running before the run, and with one arriving "
                       f"{ARRIVAL_SECONDS:g} s into the run",
               "command": f"python benchmarks/thread_rule.py{neighbours} --repeats {args.repeats} --limit {args.limit:g} --out {args.out}", "tasks": {k: TASKS[k] + COMMON for k in args.tasks},
               "machine": args.machine, "cores": len(os.sched_getaffinity(0)), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "code": code_version(results=args.out), "limit_seconds": args.limit, "repeats": args.repeats, "slower_bound": SLOWER_BOUND,
               "runs": runs, "verdicts": verdicts}
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(json.dumps(verdicts, indent=1))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
