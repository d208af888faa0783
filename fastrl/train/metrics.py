"""Run monitoring: one JSONL line per step (always), TensorBoard (when installed), a
progress bar with the headline numbers, and the best/worst completions of each step.

Metric names are ``area/name`` (``reward/mean``, ``loss/clip_frac``, ``time/generate``, ...);
values are Python floats (the trainer converts 0-dim tensors once per step, never per op).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this run: CUDA's max allocated on a GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def histogram(values: torch.Tensor, bins: int = 10) -> dict[str, list[float]]:
    """Counts over ``bins`` equal-width bins between min and max (for the JSONL log)."""
    v = values.detach().float().cpu()
    lo, hi = float(v.min()), float(v.max())
    if hi == lo:
        return {"edges": [lo, hi], "counts": [float(v.numel())]}
    counts = torch.histc(v, bins=bins, min=lo, max=hi)
    edges = torch.linspace(lo, hi, bins + 1)
    return {"edges": [round(float(e), 6) for e in edges], "counts": [float(c) for c in counts]}


class MetricsLogger:
    """Writes ``metrics.jsonl``, ``samples.txt`` and TensorBoard events under ``output_dir``."""

    def __init__(self, output_dir: str | os.PathLike, *, total_steps: int, tensorboard: bool = True, progress: bool = True, start_step: int = 0,
                 progress_desc: str = "RL"):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        _drop_torn_last_line(self.dir / "metrics.jsonl")  # a run killed mid-write, resumed here
        self.jsonl = open(self.dir / "metrics.jsonl", "a", buffering=1)
        self.samples = open(self.dir / "samples.txt", "a", buffering=1)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.dir / "tensorboard"))
            except Exception:  # tensorboard not installed: JSONL only
                self.tb = None
        self.bar = None
        if progress:
            from fastrl.train.progress import Progress

            self.bar = Progress(total=total_steps, initial=start_step, desc=progress_desc, unit="step")

    def log(self, step: int, metrics: dict[str, Any], *, extra: dict[str, Any] | None = None) -> None:
        record = {"step": step, "time": time.time(), **{k: _jsonable(v) for k, v in metrics.items()}}
        if extra:
            record.update(extra)
        self.jsonl.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
        if self.bar is not None:
            from fastrl.train.progress import step_values

            self.bar.advance(step_values(metrics))

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        self.jsonl.write(json.dumps({"step": step, "time": time.time(), "event": "eval", **metrics}) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
        if self.bar is not None:
            title = "warm-up done" if all(k.startswith("sft/") for k in metrics) else f"held-out evaluation at RL step {step}"
            self.bar.write(f"{title}: " + "  ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k != "step"))

    def write_samples(self, step: int, best: tuple[str, str, float], worst: tuple[str, str, float]) -> None:
        for tag, (prompt, completion, reward) in (("best", best), ("worst", worst)):
            self.samples.write(f"=== step {step} {tag} (reward {reward:.4g})\n{prompt}{completion}\n")

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        self.jsonl.close()
        self.samples.close()


def _drop_torn_last_line(path: Path) -> None:
    """Cut a trailing line without its newline (the process was killed while writing it)."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v
