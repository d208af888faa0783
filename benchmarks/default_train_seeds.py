"""The embedded default (`fastrl train`, no options) per seed: warm-up steps and seconds,
held-out greedy accuracy and pass@4 before and after GRPO, the median GRPO step, the whole run.

    python benchmarks/default_train_seeds.py --seeds 0 1 2 --out benchmarks/results/default_train_3seeds_cpu.json

Each seed is a fresh `OMP_NUM_THREADS=1 fastrl train --seed S --threads 1` process, one after
the other; benchmarks/render_tables.py turns the JSON into the docs' table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.env_train_seeds import code_version  # noqa: E402
from fastrl.commands.paired import paired_change  # noqa: E402

COMMAND = "OMP_NUM_THREADS=1 fastrl train --seed S --threads 1"


def run_seed(seed: int, out: Path, *, results: Path | None = None) -> dict:
    commit = code_version(results=results)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fastrl.cli", "train", "--seed", str(seed), "--threads", "1",
                    "--output_dir", str(out), "--progress", "false"], env=env, check=True)
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    sft = next(r for r in records if r.get("event") == "eval" and "sft/steps" in r)
    evals = [r for r in records if r.get("event") == "eval" and "eval/accuracy" in r]
    steps = [r["time/step"] for r in records if "event" not in r]
    paired = None
    if len(evals) >= 2 and "row_success" in evals[0] and "row_success" in evals[-1]:
        change = paired_change(evals[0]["row_success"], evals[-1]["row_success"])
        paired = {"gained": change.gained, "lost": change.lost, "rows": change.rows, "p_value": change.p_value}
    return {"sft_steps": sft["sft/steps"], "sft_seconds": round(sft["sft/seconds"], 1),
            "sft_probes": sft.get("sft/probes"), "sft_probe_accuracy": sft.get("sft/probe_accuracy"),
            "eval": [{"step": r["step"], "accuracy": r["eval/accuracy"], "pass@4": r["eval/pass@4"]} for r in evals],
            "heldout_first_last_paired": paired,
            "grpo_step_seconds_median": round(statistics.median(steps), 3), "wall_seconds": round(wall, 1), "commit": commit}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--machine", default="the project's 2-core CPU, shared with other sessions; seeds one after the other")
    args = parser.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            runs[str(seed)] = run_seed(seed, Path(tmp) / f"seed{seed}", results=args.out)
            print(f"seed {seed}: {json.dumps(runs[str(seed)])}", flush=True)
    payload = {"what": "fastrl train (embedded default: SFT warm-up to 30%, then GRPO 150 steps of 16 prompts x 8) per seed",
               "command": COMMAND, "machine": args.machine, "date": time.strftime("%Y-%m-%d"), "runs": runs}
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
