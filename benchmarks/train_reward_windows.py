"""The sampled side of a run: mean training reward and share of all-equal groups over its first and
last ``--window`` RL steps, read from each run directory's ``metrics.jsonl``.

    python benchmarks/train_reward_windows.py RUN_DIR [RUN_DIR ...] --out F

Held-out success is greedy; these are the step's own sampled trajectories (``reward/mean``,
``groups/frac_all_equal``), so the two can move apart (docs/agents.md, the sql defaults).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastrl.commands.compare import read_metrics_jsonl  # noqa: E402

WINDOW = 20
"""RL steps per window."""
KEYS = ("reward/mean", "groups/frac_all_equal")


def windows(run_dir: Path, window: int = WINDOW) -> dict:
    """``{key: [first-window mean, last-window mean]}`` over the run's RL steps (evaluations excluded)."""
    records, _ = read_metrics_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in records if "event" not in r and all(k in r for k in KEYS)]
    if len(steps) < 2 * window:
        raise SystemExit(f"{run_dir}: {len(steps)} RL steps with {KEYS}, fewer than two windows of {window}")
    return {"rl_steps": len(steps), **{key: [statistics.fmean(r[key] for r in part) for part in (steps[:window], steps[-window:])]
                                        for key in KEYS}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--window", type=int, default=WINDOW)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    payload = {"command": "python benchmarks/train_reward_windows.py " + shlex.join(sys.argv[1:] if argv is None else argv),
               "window": args.window, "runs": {run.name: windows(run, args.window) for run in args.runs}}
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    print(json.dumps(payload["runs"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
