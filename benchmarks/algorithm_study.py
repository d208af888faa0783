"""PPO or GRPO? The algorithm-choice study (issue 41): a resumable runner of independent cells.

    OMP_NUM_THREADS=1 python benchmarks/algorithm_study.py --dry-run          # the plan, predicted CPU time
    OMP_NUM_THREADS=1 nice python benchmarks/algorithm_study.py --jobs 2       # run (resumes where it stopped)
    python benchmarks/algorithm_study.py --factors baseline --tasks calculator --cells '*grpo*' '*.ppo.*'
    python benchmarks/render_algorithm_study.py                                # docs/choosing.md

A cell is one run: (task, algorithm, arm, seed), where the task is the default single-turn task
or a built-in environment, the arm the run options of one level of a factor
(``benchmarks/study_factors.py``; levels that run an algorithm the same way share its cells),
and the budget ``fastrl compare``'s for the task (``ENV_COMPARE_DEFAULTS``; 40 steps on the
default task). Each cell is a child process of its own (``python benchmarks/algorithm_study.py
_cell``): it builds its task's shared start once (the warm-up and the rows, as ``fastrl
compare`` does, under a file lock so two cells never build it twice; its files are complete
when ``start_fields.json`` exists), then runs ``fastrl train`` from it through ``fastrl
compare``'s machinery (``run_one``: the same options, metrics and ``grpo_then_ppo`` phases) and
writes what it measured. The runner writes ONE JSON per finished cell to
``benchmarks/results/algorithm_study/<cell>.json``, atomically (a temporary file renamed), only
after the child succeeded: a study killed at any point loses at most the cells in flight, and
a rerun skips every cell whose JSON exists. ``--jobs`` (default 2, at most 2) single-threaded
cells run at once.

Per cell: success (held-out accuracy at the start, the end and the best evaluation; the
per-row results of the first and last evaluation, for paired McNemar tests between arms, which
score the same held-out rows), stability (worst reward drop, Echo-Trap steps, KL/entropy
blow-ups, NaN stop), cost (wall and CPU seconds of the cell's process tree, RL seconds,
generated tokens, environment calls, peak memory) and the measured share of all-equal groups.

The seed count comes from the measured spread (``power_table``): the pooled standard deviation
over seeds of the final held-out accuracy, first in ``fastrl compare``'s reports
(``benchmarks/results/compare_*``: one shared start, as here; 3 seeds per algorithm, so the
estimate is itself uncertain), then, as cells finish, in this study's own cells
(``spread_from_study``). The larger of the two gives the seeds at which a difference of
``DETECT`` is found with probability ``POWER`` (two-sided, ``ALPHA``), clamped to
``MIN_SEEDS``..``MAX_SEEDS``: a sequential design whose seeds grow when the study measures more
spread than it planned for. The page states the difference detectable at the seeds actually run.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import fnmatch
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.study_factors import CRITIC_SCRATCH, ENV_TASKS, FACTORS, TASKS, applies  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "algorithm_study"
"""Where the cell JSONs go (one per finished cell)."""
WORK = ROOT / "runs" / "algorithm_study"
"""Scratch: the shared starts (warmed-up models, rows) and every cell's run directory and log."""
MAX_JOBS = 2
"""Cells at once, at most: the project's CPU has 2 cores and every cell is single-threaded."""
DETECT = 0.05
"""The difference in held-out success the seed count is sized to detect."""
POWER = 0.8
ALPHA = 0.05
MIN_SEEDS = 3
MAX_SEEDS = 10
"""Seeds per arm at most: the whole study must fit about 6 CPU-hours."""
DEFAULT_TASK_BUDGET = "40-steps"
"""The default single-turn task's budget (``fastrl compare``'s ``DEFAULT_BUDGET``)."""
TASK_ORDER = ("calculator", "frozenlake", "default", "sql")
"""Cheapest and most informative first (calculator's runs take ~30 s, sql's warm-up ~7 min)."""
FIRST_ALGORITHMS = ("grpo", "ppo")
"""The users' question: these arms of a factor run before the others."""
LOAD_SAMPLES = 3


# ============================================================================ power (pure)
def normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def normal_quantile(p: float) -> float:
    """Inverse of ``normal_cdf`` (bisection; |error| < 1e-9)."""
    lo, hi = -12.0, 12.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if normal_cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def pooled_sd(groups: Sequence[Sequence[float]]) -> float:
    """Pooled within-group sample standard deviation: sqrt(sum (n_i - 1) s_i^2 / sum (n_i - 1))
    over the groups with at least two values (NaN when none has)."""
    num = den = 0.0
    for g in groups:
        v = [float(x) for x in g if x is not None and math.isfinite(float(x))]
        if len(v) >= 2:
            num += (len(v) - 1) * statistics.variance(v)
            den += len(v) - 1
    return math.sqrt(num / den) if den else float("nan")


def power(delta: float, sd: float, n: int, *, alpha: float = ALPHA) -> float:
    """Probability that a two-sided two-sample z-test at ``alpha`` detects a true difference
    ``delta`` between two arms of ``n`` seeds each whose values spread with ``sd`` (normal
    approximation: optimistic at a few seeds, where a t-test is wider)."""
    if sd <= 0:
        return 1.0
    z = abs(delta) / (sd * math.sqrt(2.0 / n))
    crit = normal_quantile(1 - alpha / 2)
    return normal_cdf(z - crit) + normal_cdf(-z - crit)


def seeds_needed(delta: float, sd: float, *, target: float = POWER, alpha: float = ALPHA) -> int:
    """Fewest seeds per arm at which ``power(delta, sd, n) >= target``."""
    if not math.isfinite(sd):
        raise ValueError("no spread measured")
    n = 1
    while power(delta, sd, n, alpha=alpha) < target:
        n += 1
    return n


def detectable(sd: float, n: int, *, target: float = POWER, alpha: float = ALPHA) -> float:
    """Smallest difference detected with probability ``target`` at ``n`` seeds per arm
    (``(z_{1-alpha/2} + z_target) * sd * sqrt(2 / n)``, ignoring the far tail)."""
    return (normal_quantile(1 - alpha / 2) + normal_quantile(target)) * sd * math.sqrt(2.0 / n)


def spread_from_compare(results: Path = ROOT / "benchmarks" / "results") -> dict[str, dict[str, Any]]:
    """Per task, the per-algorithm final held-out accuracies over seeds in ``fastrl compare``'s
    reports (``compare_env_<task>``, ``compare_default_cpu``) and their pooled std."""
    out = {}
    for task in TASKS:
        name = "compare_default_cpu" if task == "default" else f"compare_env_{task}"
        path = results / name / "compare.json"
        if not path.exists():
            continue
        report = json.loads(path.read_text())
        finals = {a: [v for v in e["final_accuracy"]["values"] if v is not None] for a, e in report["summary"].items()}
        out[task] = {"source": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
                     "finals": finals, "sd": pooled_sd(list(finals.values())), "rows": report["start"]["eval_rows"],
                     "budget": report["budget"]["text"], "seeds": len(report["seeds"]),
                     "run_wall": {a: [r["wall_seconds"] for r in report["runs"] if r["algorithm"] == a]
                                  for a in report["summary"]},
                     "start_cpu": report["start"].get("cpu_seconds", report["start"].get("seconds"))}
    return out


FRESH_WARMUP_RESULTS = {"calculator": "env_train_calculator_3seeds_cpu.json", "frozenlake": "env_train_frozenlake_3seeds_cpu.json",
                        "sql": "env_train_sql_3seeds_cpu.json", "default": "default_train_3seeds_cpu.json"}
"""Per task, a ``fastrl train`` over seeds where every seed runs its own warm-up (150 RL steps;
``benchmarks/env_train_seeds.py``, ``default_train_seeds.py``): the spread a study without a shared
start would face, for comparison with ``spread_from_compare``'s."""


def spread_fresh_warmup(results: Path = ROOT / "benchmarks" / "results") -> dict[str, dict[str, Any]]:
    """Per task: the final held-out accuracy of each seed of ``FRESH_WARMUP_RESULTS`` and their sd."""
    out = {}
    for task, name in FRESH_WARMUP_RESULTS.items():
        path = results / name
        if not path.exists():
            continue
        report = json.loads(path.read_text())
        finals = [float(r["eval"][-1]["accuracy"]) for r in report["runs"].values() if r.get("eval")]
        out[task] = {"finals": finals, "sd": pooled_sd([finals]), "steps": [int(r["eval"][-1]["step"]) for r in report["runs"].values()
                                                                            if r.get("eval")][0],
                     "source": f"benchmarks/results/{name}"}
    return out


def spread_from_study(results: Path = RESULTS) -> dict[str, dict[str, Any]]:
    """Per task, the pooled std over seeds of the final held-out accuracy within each arm
    (algorithm and run options) of this study's finished cells, and how many cells it rests on."""
    groups: dict[str, dict[tuple[str, str], list[Any]]] = {}
    for path in sorted(results.glob("*.json")) if results.is_dir() else ():
        record = json.loads(path.read_text())
        c = record["cell"]
        groups.setdefault(c["task"], {}).setdefault((c["algorithm"], c["arm"]), []).append(
            record.get("success", {}).get("final_accuracy"))
    out = {}
    for task, arms in groups.items():
        sd = pooled_sd(list(arms.values()))
        if math.isfinite(sd):
            out[task] = {"sd": sd, "cells": sum(len(v) for v in arms.values() if len(v) >= 2)}
    return out


def power_table(spread: dict[str, dict[str, Any]], own: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Per task: the pooled sd of ``fastrl compare``'s reports and of the study's own cells, the
    seeds each needs for ``DETECT`` at ``POWER``, the seeds planned (the larger need, clamped to
    ``MIN_SEEDS``..``MAX_SEEDS``), and the power and detectable difference at them under the
    larger sd."""
    own = own or {}
    out = {}
    for task, s in spread.items():
        mine = own.get(task)
        needed = seeds_needed(DETECT, s["sd"])
        own_needed = seeds_needed(DETECT, mine["sd"]) if mine else None
        plan_sd = max(s["sd"], mine["sd"]) if mine else s["sd"]
        planned = min(MAX_SEEDS, max(MIN_SEEDS, needed, own_needed or 0))
        out[task] = {"sd": s["sd"], "needed": needed, "own_sd": mine["sd"] if mine else None,
                     "own_cells": mine["cells"] if mine else 0, "own_needed": own_needed, "plan_sd": plan_sd,
                     "planned": planned, "power": power(DETECT, plan_sd, planned),
                     "detectable": detectable(plan_sd, planned), "source": s["source"]}
    return out


# ============================================================================ the plan
def task_budget(task: str) -> str:
    from fastrl.commands.compare import ENV_COMPARE_DEFAULTS

    return ENV_COMPARE_DEFAULTS[task].budget if task in ENV_TASKS else DEFAULT_TASK_BUDGET


def steps_in(budget: str) -> int | None:
    """The RL steps of a steps budget (``"16-steps"``: 16); None for another kind of budget."""
    count, _, unit = budget.partition("-")
    return int(count) if unit == "steps" and count.isdigit() else None


def scaled_budget(budget: str, scale: int) -> str:
    """A steps budget (``"16-steps"``) times ``scale`` (``"64-steps"``); other budgets only at scale 1."""
    if scale == 1:
        return budget
    steps = steps_in(budget)
    if steps is None:
        raise ValueError(f"budget {budget!r}: only a steps budget can be scaled")
    return f"{steps * scale}-steps"


def task_args(task: str) -> list[str]:
    return ["--env", task] if task in ENV_TASKS else []


@dataclass(frozen=True)
class Cell:
    """One run of the study."""

    task: str
    algorithm: str
    arm: str
    """The name of the run options (``base``: the task's defaults)."""
    args: tuple[str, ...]
    start_args: tuple[str, ...]
    seed: int
    budget: str

    @property
    def id(self) -> str:
        return f"{self.task}.{self.algorithm}.{self.arm}.s{self.seed}"

    @property
    def start_key(self) -> str:
        """The shared start this cell runs from: its task and the options that shape the warm-up."""
        return self.task + ("" if not self.start_args else "." + "_".join(a.strip("-") for a in self.start_args))

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "args": list(self.args), "start_args": list(self.start_args), "id": self.id}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Cell":
        return cls(task=d["task"], algorithm=d["algorithm"], arm=d["arm"], args=tuple(d["args"]),
                   start_args=tuple(d["start_args"]), seed=int(d["seed"]), budget=d["budget"])


def plan_cells(seeds: dict[str, int], *, factors: Sequence[str] | None = None, tasks: Sequence[str] | None = None,
               budget: Callable[[str], str] = task_budget) -> list[Cell]:
    """Every cell of the study, each once, in running order: factor by factor (the page's
    order), GRPO and PPO before the other arms, then task (``TASK_ORDER``), seed, level."""
    keyed: dict[str, tuple[tuple, Cell]] = {}
    for f_rank, (fname, factor) in enumerate(FACTORS.items()):
        if factors is not None and fname not in factors:
            continue
        for l_rank, level in enumerate(factor.levels):
            for task in TASK_ORDER:
                if (tasks is not None and task not in tasks) or not applies(factor, level, task):
                    continue
                for seed in range(seeds.get(task, MIN_SEEDS)):
                    for a_rank, algo in enumerate(level.algorithms):
                        cell = Cell(task, algo, level.arm(algo), tuple(level.run_args(task, algo)), level.start_args,
                                    seed, scaled_budget(budget(task), level.budget_scale))
                        key = (f_rank, algo not in FIRST_ALGORITHMS, TASK_ORDER.index(task), seed, l_rank, a_rank)
                        if cell.id not in keyed or key < keyed[cell.id][0]:
                            keyed[cell.id] = (key, cell)
    return [c for _, c in sorted(keyed.values(), key=lambda kc: kc[0])]


def measured_cpu(results: Path) -> dict[tuple[str, str, str], list[float]]:
    """CPU seconds of the finished cells per (task, algorithm, arm), the shared warm-up excluded."""
    out: dict[tuple[str, str, str], list[float]] = {}
    for path in results.glob("*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            r = json.loads(path.read_text())
            cpu = float(r["process"]["cpu_seconds"])
            if r["start"].get("built_by_this_cell"):
                cpu -= float(r["start"]["warmup_cpu_seconds"])
            out.setdefault((r["cell"]["task"], r["cell"]["algorithm"], r["cell"]["arm"]), []).append(cpu)
    return out


def predicted_cpu_seconds(cell: Cell, spread: dict[str, dict[str, Any]],
                          measured: dict[tuple[str, str, str], list[float]] | None = None) -> float:
    """A cell's CPU seconds: the mean of this study's finished cells of the same task,
    algorithm and arm (``measured_cpu``), else of the same task and algorithm; else predicted
    from ``fastrl compare``'s measured runs of its task (single-threaded: process wall ~ CPU):
    its algorithm's mean run, else the slowest algorithm's, with ``turns12`` doubling frozenlake's."""
    measured = measured or {}
    own = measured.get((cell.task, cell.algorithm, cell.arm))
    if own:
        return statistics.mean(own)
    # another arm's cells, or compare's runs, ran the task's budget: a longer one costs in proportion to its steps
    longer = (steps_in(cell.budget) or 1) / (steps_in(task_budget(cell.task)) or 1)
    same = [v for (t, a, _), vs in measured.items() if (t, a) == (cell.task, cell.algorithm) for v in vs]
    if same and not cell.start_args:
        return statistics.mean(same) * longer
    s = spread.get(cell.task)
    if not s:
        return float("nan")
    walls = s["run_wall"].get(cell.algorithm) or max(s["run_wall"].values(), key=lambda w: statistics.mean(w))
    scale = 2.0 if "12" in cell.start_args else 1.0
    return statistics.mean(walls) * scale * longer



def predicted_start_cpu_seconds(start_key: str, spread: dict[str, dict[str, Any]]) -> float:
    task = start_key.split(".")[0]
    s = spread.get(task)
    return float(s["start_cpu"]) if s and s.get("start_cpu") is not None else float("nan")


# ============================================================================ the runner
def cell_path(results: Path, cell: Cell) -> Path:
    return results / f"{cell.id}.json"


def finished(results: Path, cell: Cell) -> bool:
    """The cell's JSON exists and parses (a torn file cannot exist: it is written by rename)."""
    path = cell_path(results, cell)
    try:
        return json.loads(path.read_text()).get("cell", {}).get("id") == cell.id
    except (OSError, ValueError):
        return False


def write_atomic(path: Path, data: dict[str, Any]) -> None:
    """``data`` as JSON at ``path``, all or nothing (a temporary file in the same directory, renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def default_command(cell: Cell, out: Path, work: Path) -> list[str]:
    """The child process of a real cell."""
    return [sys.executable, str(Path(__file__).resolve()), "_cell", "--cell", json.dumps(cell.to_json()),
            "--out", str(out), "--work", str(work)]


def template_command(template: str) -> Callable[[Cell, Path, Path], list[str]]:
    """A test seam: ``--cell_command 'python fake.py {id} {out}'`` replaces the child command
    (placeholders ``{id}``, ``{out}``, ``{work}``, ``{cell_json}``)."""
    def command(cell: Cell, out: Path, work: Path) -> list[str]:
        fill = {"id": cell.id, "out": str(out), "work": str(work), "cell_json": json.dumps(cell.to_json())}
        return [token.format(**fill) for token in shlex.split(template)]
    return command


class Children:
    """The live cell processes (each the leader of its own process group), killed as a whole."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: set[int] = set()
        self.stopped = False

    def kill_all(self) -> None:
        with self.lock:
            self.stopped = True
            for pid in self.live:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)


def run_cell(cell: Cell, *, results: Path, work: Path, command: Callable[[Cell, Path, Path], list[str]],
             children: Children, say: Callable[[str], None]) -> bool:
    """One cell as a child process; its JSON written (atomically) only when it succeeded."""
    log_dir = work / "cells" / cell.id
    log_dir.mkdir(parents=True, exist_ok=True)
    out = log_dir / "result.json"
    with contextlib.suppress(FileNotFoundError):
        out.unlink()  # a result left by an earlier, killed attempt
    cmd = command(cell, out, work)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(log_dir / "cell.log", "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
               "OMP_NUM_THREADS": "1"}
        with children.lock:
            if children.stopped:
                return False
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True, cwd=ROOT)
            children.live.add(proc.pid)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            with children.lock:
                children.live.discard(proc.pid)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not out.exists():
        say(f"{cell.id}: failed (exit status {proc.returncode}; log {log_dir / 'cell.log'}); it reruns next time")
        return False
    try:
        record = json.loads(out.read_text())
    except ValueError:
        say(f"{cell.id}: its result does not parse; it reruns next time")
        return False
    record["cell"] = cell.to_json()
    record["process"] = {"wall_seconds": wall, "cpu_seconds": usage.ru_utime + usage.ru_stime,
                         "max_rss_gb_of_a_child": usage.ru_maxrss / 2**20, "load_average_before": load_before,
                         "load_average_after": os.getloadavg()[0], "command": shlex.join(cmd)}
    write_atomic(cell_path(results, cell), record)
    out.unlink()
    return True


def run_study(cells: Sequence[Cell], *, results: Path, work: Path, jobs: int,
              command: Callable[[Cell, Path, Path], list[str]], say: Callable[[str], None] = print) -> dict[str, int]:
    """Every cell not yet finished, up to ``jobs`` at once in plan order. SIGTERM/SIGINT/SIGHUP
    kill every live cell's process group before exiting (status 128 + signal)."""
    todo = [c for c in cells if not finished(results, c)]
    say(f"algorithm study: {len(cells)} cells, {len(cells) - len(todo)} already finished, {len(todo)} to run "
        f"({jobs} at once); results in {results}")
    children = Children()
    lock = threading.Lock()
    queue = list(todo)
    counts = {"done": 0, "failed": 0}

    def worker() -> None:
        while True:
            with lock:
                if not queue or children.stopped:
                    return
                cell = queue.pop(0)
                index = len(todo) - len(queue)
            say(f"[{index}/{len(todo)}] {cell.id} ...")
            t0 = time.perf_counter()
            ok = run_cell(cell, results=results, work=work, command=command, children=children, say=say)
            with lock:
                counts["done" if ok else "failed"] += 1
            if ok:
                say(f"[{index}/{len(todo)}] {cell.id}: done in {time.perf_counter() - t0:.0f} s")

    def stop(signum: int, _frame: Any) -> None:
        children.kill_all()
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, min(jobs, MAX_JOBS)))]
    try:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(timeout=0.2)
    finally:
        children.kill_all()
        for s, h in previous.items():
            signal.signal(s, h)
    say(f"algorithm study: {counts['done']} cells finished now, {counts['failed']} failed")
    return counts


# ============================================================================ a cell (the child process)
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "w")
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


def _compare_plan(cell: Cell, output_dir: Path, extra: Sequence[str] = (), algorithm: str | None = None):
    from fastrl.commands.compare import plan_compare

    argv = [*task_args(cell.task), *cell.start_args, "--algorithms", algorithm or cell.algorithm, "--seeds", "1",
            "--budget", cell.budget, "--output_dir", str(output_dir), "--overwrite", "--threads", "1", "--jobs", "1", *extra]
    return plan_compare(argv)


def ensure_start(cell: Cell, work: Path) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """The shared start of ``cell``'s task (built once, under a lock): the run fields, its
    ``start.json`` and whether this call built it. Complete when ``start_fields.json`` exists."""
    directory = work / "starts" / cell.start_key
    marker = directory / "start_fields.json"
    with _locked(work / "starts" / f"{cell.start_key}.lock"):
        if marker.exists():
            return json.loads(marker.read_text()), json.loads((directory / "start" / "start.json").read_text()), False
        shutil.rmtree(directory, ignore_errors=True)  # a build that was killed
        from fastrl.commands.compare import prepare_start

        plan = _compare_plan(cell, directory, algorithm="grpo")
        (directory / "start").mkdir(parents=True, exist_ok=True)
        start = prepare_start(plan)
        fields = dict(start["fields"])
        scratch = directory / "start" / CRITIC_SCRATCH
        _random_model_like(Path(fields.get("model") or start["info"]["model"]), scratch)
        fields["_critic_scratch"] = str(scratch)
        write_atomic(marker, fields)
        return fields, start["info"], True


def _random_model_like(model_dir: Path, out: Path, seed: int = 0) -> None:
    """A freshly initialised model of ``model_dir``'s architecture (and its tokenizer) at ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)


def _phase_logs(record: dict[str, Any]) -> list[tuple[list[dict], list[dict]]]:
    from fastrl.commands.compare import read_metrics_jsonl

    return [read_metrics_jsonl(Path(p["dir"]) / "metrics.jsonl") for p in record.get("phases", [])]


def cell_measures(record: dict[str, Any]) -> dict[str, Any]:
    """What a cell keeps beyond ``run_one``'s record: per-row results of the first and last
    held-out evaluation, environment calls at every evaluation, the share of all-equal groups."""
    logs = _phase_logs(record)
    evals_rows = [e for steps, evals in logs for e in evals if "row_success" in e]
    equal = [float(r["groups/frac_all_equal"]) for steps, _ in logs for r in steps if "groups/frac_all_equal" in r]
    env_calls, total = [], 0.0
    for steps, _ in logs:
        for r in sorted(steps, key=lambda r: r["step"]):
            total += float(r.get("agent/env_calls", 0.0) or 0.0)
            env_calls.append(total)
    return {
        "row_success_start": "".join(str(int(v)) for v in evals_rows[0]["row_success"]) if evals_rows else None,
        "row_success_final": "".join(str(int(v)) for v in evals_rows[-1]["row_success"]) if evals_rows else None,
        "env_calls_curve": env_calls,
        "frac_all_equal_groups": statistics.mean(equal) if equal else None,
    }


def run_cell_child(cell: Cell, out: Path, work: Path) -> int:
    """``_cell``: the start (built if missing), the run, the result at ``out``; exit status 0
    when the run finished (completed, or stopped by a NaN: a stability result), 1 otherwise."""
    from fastrl.commands.compare import RunProcesses, run_one, strict_json
    from fastrl.workers import set_parent_death_signal

    set_parent_death_signal(signal.SIGTERM)  # a runner killed outright leaves no cell behind
    t0 = time.perf_counter()
    fields, start_info, built = ensure_start(cell, work)
    start_seconds = time.perf_counter() - t0
    args = list(cell.args)
    run_fields = {k: v for k, v in fields.items() if not k.startswith("_")}
    if "--critic_init" in args:  # compare sets critic_init itself (grpo_then_ppo); a study arm may choose it
        i = args.index("--critic_init")
        value = args[i + 1]
        del args[i : i + 2]
        run_fields["critic_init"] = fields["_critic_scratch"] if value == CRITIC_SCRATCH else value
    run_dir = work / "cells" / cell.id / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    plan = _compare_plan(cell, run_dir, extra=args)
    (run_dir / "runs").mkdir(parents=True, exist_ok=True)
    record = run_one(plan, run_fields, cell.algorithm, cell.seed, RunProcesses())
    if record.get("status") == "failed" or not record.get("success"):
        print(f"cell {cell.id}: {record.get('status')}: {record.get('error')}", file=sys.stderr)
        return 1

    result = {
        "what": "one cell of the algorithm-choice study (benchmarks/algorithm_study.py)",
        "status": record["status"], "stopped_by": record.get("stopped_by"),
        "code": code_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "train_options": strict_json(plan.user_fields), "eval_every": plan.eval_every,
        "start": {"key": cell.start_key, "built_by_this_cell": built, "seconds_in_this_cell": start_seconds,
                  "warmup_seconds": start_info.get("seconds"), "warmup_cpu_seconds": start_info.get("cpu_seconds"),
                  "eval_rows": start_info.get("eval_rows"), "sft": start_info.get("sft")},
        "success": record["success"], "stability": record["stability"], "cost": record["cost"], "evals": record["evals"],
        "curve": {k: record["curve"][k] for k in ("step", "seconds", "generated_tokens", "reward", "reward_std")},
        "run_wall_seconds": record["wall_seconds"], "phases": record["phases"],
        **cell_measures(record),
    }
    write_atomic(out, strict_json(result))
    return 0


def code_version() -> str:
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no", "--", "fastrl"],
                           capture_output=True, text=True).stdout.strip()
    return head + ("+dirty" if dirty else "")


# ============================================================================ command line
def select(cells: Sequence[Cell], patterns: Sequence[str] | None) -> list[Cell]:
    if not patterns:
        return list(cells)
    return [c for c in cells if any(fnmatch.fnmatchcase(c.id, p) for p in patterns)]


def seeds_by_task(override: int | None, results: Path = RESULTS) -> dict[str, int]:
    """Seeds per arm for every task: ``override``, else ``power_table``'s plan from the spread of
    ``fastrl compare``'s reports and of the finished cells in ``results``."""
    table = power_table(spread_from_compare(), spread_from_study(results))
    return {t: (override if override is not None else table.get(t, {}).get("planned", MIN_SEEDS)) for t in TASKS}


def describe_plan(cells: Sequence[Cell], results: Path) -> str:
    spread, measured = spread_from_compare(), measured_cpu(results)
    lines = [f"{'cell':<52} {'predicted CPU s':>15}  state"]
    total, starts = 0.0, {}
    for c in cells:
        p = predicted_cpu_seconds(c, spread, measured)
        done = finished(results, c)
        if not done:
            total += p if math.isfinite(p) else 0.0
            starts.setdefault(c.start_key, predicted_start_cpu_seconds(c.start_key, spread))
        lines.append(f"{c.id:<52} {p:>15.0f}  {'finished' if done else 'pending'}")
    warm = sum(v for v in starts.values() if math.isfinite(v))
    pending = sum(1 for c in cells if not finished(results, c))
    lines.append(f"{len(cells)} cells, {pending} pending: predicted {total / 3600:.2f} CPU-hours of runs + "
                 f"{warm / 3600:.2f} of {len(starts)} shared warm-ups (from this study's finished cells where they exist, "
                 "else fastrl compare's measured runs, benchmarks/results/compare_*; already-built starts are not subtracted)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_cell"]:
        p = argparse.ArgumentParser(prog="algorithm_study.py _cell")
        p.add_argument("--cell", required=True)
        p.add_argument("--out", required=True, type=Path)
        p.add_argument("--work", required=True, type=Path)
        a = p.parse_args(argv[1:])
        return run_cell_child(Cell.from_json(json.loads(a.cell)), a.out, a.work)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="list the plan and its predicted CPU time; run nothing")
    p.add_argument("--jobs", type=int, default=MAX_JOBS, help=f"cells at once (1..{MAX_JOBS}, each single-threaded)")
    p.add_argument("--cells", nargs="+", metavar="GLOB", help="only cells whose id matches (task.algorithm.arm.sSEED)")
    p.add_argument("--factors", nargs="+", choices=list(FACTORS), help="only these factors")
    p.add_argument("--tasks", nargs="+", choices=list(TASKS), help="only these tasks")
    p.add_argument("--seeds", type=int, default=None, help="seeds per arm for every task (default: the power analysis')")
    p.add_argument("--max_cells", type=int, default=None, help="run at most this many pending cells")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--work", type=Path, default=WORK)
    p.add_argument("--cell_command", default=None,
                   help="test seam: the child command instead of a real cell ({id}, {out}, {work}, {cell_json})")
    a = p.parse_args(argv)
    if not 1 <= a.jobs <= MAX_JOBS:
        p.error(f"--jobs must be 1..{MAX_JOBS}")
    cells = select(plan_cells(seeds_by_task(a.seeds, a.results), factors=a.factors, tasks=a.tasks), a.cells)
    if a.dry_run:
        print(describe_plan(cells, a.results))
        return 0
    if a.max_cells is not None:
        cells = [c for c in cells if not finished(a.results, c)][: a.max_cells]
    command = template_command(a.cell_command) if a.cell_command else (lambda c, o, w: default_command(c, o, w))
    a.work.mkdir(parents=True, exist_ok=True)
    guard = open(a.work / "study.lock", "w")  # held while this study runs; released by the kernel when it dies
    try:
        fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"algorithm study: another study is running on {a.work} (it holds {a.work / 'study.lock'})", file=sys.stderr)
        return 2
    counts = run_study(cells, results=a.results, work=a.work, jobs=a.jobs, command=command,
                       say=lambda s: print(s, flush=True))
    return 0 if counts["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
