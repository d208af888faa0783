"""One run of a comparison: an algorithm x seed as ``fastrl train`` processes (two for
``grpo_then_ppo``), its options, and its record measured from the ``metrics.jsonl`` it wrote."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from fastrl.commands.compare.analysis import chain_phases, run_metrics
from fastrl.commands.compare.budget import Budget
from fastrl.commands.compare.defaults import HYBRID
from fastrl.commands.compare.options import ComparePlan
from fastrl.commands.compare.processes import RunProcesses
from fastrl.train.config import TrainConfig


def _train_env() -> dict[str, str]:
    """The environment of a run: this fastrl first on the path (not another install)."""
    import fastrl

    root = str(Path(fastrl.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def read_metrics_jsonl(path: Path) -> tuple[list[dict], list[dict]]:
    """A run's ``metrics.jsonl`` as (step records, ``event: eval`` records); a missing file is empty
    and a torn line (a run killed mid-write) is skipped."""
    steps, evals = [], []
    if not path.exists():
        return steps, evals
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        (evals if rec.get("event") == "eval" else steps).append(rec)
    return steps, evals


RUN_MODULE = "fastrl.commands.compare"
"""What each run executes (``python -m RUN_MODULE train ...``): ``fastrl train`` after asking the
kernel for SIGTERM when the comparison's thread that started it ends."""
PARENT_PID_ENV = "FASTRL_COMPARE_PID"
"""Environment variable giving a run its comparison's process id: a run whose parent is already
another process (the comparison ended while it started) exits at once."""


def _run_phase(directory: Path, fields: dict[str, Any], processes: RunProcesses) -> dict[str, Any]:
    """One ``fastrl train`` process; its return code, wall seconds, and measured metrics."""
    import yaml

    directory.mkdir(parents=True, exist_ok=True)
    args_file = directory / "train_args.yaml"
    args_file.write_text(yaml.safe_dump(fields, sort_keys=False))
    cmd = [sys.executable, "-m", RUN_MODULE, "train", "--config", str(args_file)]
    t0 = time.perf_counter()
    with open(directory / "train.log", "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        returncode = processes.run(cmd, log=log, env={**_train_env(), PARENT_PID_ENV: str(os.getpid())})
    wall = time.perf_counter() - t0
    log_text = (directory / "train.log").read_text(errors="replace")
    steps, evals = read_metrics_jsonl(directory / "metrics.jsonl")
    summary_file = directory / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    if returncode == 0:
        status, error = "ok", None
    else:
        diverged = returncode == 3 and "non-finite" in log_text
        status = "diverged" if diverged else "failed"
        tail = [line for line in log_text.splitlines() if line.strip()][-3:]
        error = f"exit status {returncode}: " + " | ".join(tail)
    pass_k = int(fields.get("pass_k", TrainConfig.pass_k))
    config_file = directory / "config.yaml"  # the run's resolved options (an environment's defaults included)
    resolved = yaml.safe_load(config_file.read_text()) if config_file.exists() else {}
    group_size = int(resolved.get("group_size") or fields.get("group_size", TrainConfig.group_size))
    metrics = (run_metrics(steps, evals, pass_k=pass_k if pass_k > 1 else None, group_size=group_size)
               if (steps or evals) else None)
    return {"returncode": returncode, "status": status, "error": error, "wall_seconds": wall,
            "stopped_by": summary.get("stopped_by"), "metrics": metrics, "final_model": summary.get("final_model"),
            "dir": str(directory)}


def run_fields_for(plan: ComparePlan, start_fields: dict[str, Any], algorithm: str, seed: int, directory: Path,
                   budget: Budget) -> dict[str, Any]:
    """The complete option set of one run (what goes into its ``train_args.yaml``)."""
    return {
        **plan.user_fields, **start_fields, "algorithm": algorithm, "seed": seed, "output_dir": str(directory),
        "eval_every": plan.eval_every, "progress": False, "tensorboard": plan.user_fields.get("tensorboard", False),
        **budget.train_fields(steps_cap=plan.steps_cap), **(plan.ppo_overrides if algorithm == "ppo" else {}),
    }


def run_one(plan: ComparePlan, start_fields: dict[str, Any], algorithm: str, seed: int,
            processes: RunProcesses) -> dict[str, Any]:
    """One algorithm x seed (two processes for ``grpo_then_ppo``); the run's record for the report."""
    directory = plan.output_dir / "runs" / f"{algorithm}-seed{seed}"
    record: dict[str, Any] = {"algorithm": algorithm, "seed": seed, "dir": str(directory)}
    if algorithm != HYBRID:
        phases = [_run_phase(directory, run_fields_for(plan, start_fields, algorithm, seed, directory, plan.budget),
                             processes)]
        metrics = phases[0]["metrics"]
    else:
        first_budget, second_budget = plan.budget.split(plan.hybrid_split)
        grpo = _run_phase(directory / "grpo", run_fields_for(plan, start_fields, "grpo", seed, directory / "grpo", first_budget),
                          processes)
        phases = [grpo]
        metrics = grpo["metrics"]
        if grpo["status"] == "ok" and grpo["final_model"]:
            # PPO continues from GRPO's final policy; the critic's body starts from the same weights
            fields = {**start_fields, "model": grpo["final_model"], "tokenizer": grpo["final_model"]}
            ppo_fields = run_fields_for(plan, fields, "ppo", seed + 1000, directory / "ppo", second_budget)
            ppo_fields["critic_init"] = grpo["final_model"]
            ppo = _run_phase(directory / "ppo", ppo_fields, processes)
            phases.append(ppo)
            if ppo["metrics"] is not None and metrics is not None:
                metrics = chain_phases(metrics, ppo["metrics"])
    bad = [p for p in phases if p["status"] != "ok"]
    record.update(
        status=bad[0]["status"] if bad else "ok",
        error=bad[0]["error"] if bad else None,
        returncode=bad[0]["returncode"] if bad else 0,
        wall_seconds=sum(p["wall_seconds"] for p in phases),
        stopped_by=phases[-1]["stopped_by"],
        phases=[{k: p[k] for k in ("dir", "status", "returncode", "wall_seconds", "stopped_by")} for p in phases],
    )
    if metrics is not None:
        record.update(metrics)
    return record
