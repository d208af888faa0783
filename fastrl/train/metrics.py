"""Run monitoring: one JSONL line per step (always), TensorBoard (when installed), a
progress bar with the headline numbers, and the best/worst completions of each step.

Metric names are ``area/name`` (``reward/mean``, ``loss/clip_frac``, ``time/generate``, ...);
values are Python floats (the trainer converts 0-dim tensors once per step, never per op).

**One record per step.** A logger opened at ``start_step`` (a resumed run: the checkpoint's
step) first drops whatever a killed run logged after that step, so ``metrics.jsonl`` and
``samples.txt`` hold each step once and in order, and tells TensorBoard to discard events
past it (``purge_step``). The files are rewritten atomically (a temporary file renamed over
the old one). In ``samples.txt`` the cut is at the first ``=== step N`` header with
``N > start_step``: a completion that itself contains such a header line moves the cut
earlier (some samples of kept steps are lost, never a step duplicated).
"""

from __future__ import annotations

import json
import math
import os
import re
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
        _drop_records_after(self.dir / "metrics.jsonl", start_step)  # steps a killed run logged past its checkpoint
        _drop_samples_after(self.dir / "samples.txt", start_step)
        self.jsonl = open(self.dir / "metrics.jsonl", "a", buffering=1)
        self.samples = open(self.dir / "samples.txt", "a", buffering=1)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step: TensorBoard discards the earlier events from this step on
                self.tb = SummaryWriter(str(self.dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)
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


def _rewrite(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def _drop_records_after(path: Path, step: int) -> None:
    """Keep the records of ``metrics.jsonl`` up to ``step`` (a record without a step is kept)."""
    if not path.exists():
        return
    data = path.read_bytes()
    kept = []
    for line in data.splitlines(keepends=True):
        try:
            record_step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            record_step = None
        if isinstance(record_step, (int, float)) and record_step > step:
            break  # records are in step order: everything from here on is after the checkpoint
        kept.append(line)
    if len(kept) != len(data.splitlines()):
        _rewrite(path, b"".join(kept))


_SAMPLE_HEADER = re.compile(rb"^=== step (\d+) (?:best|worst) \(reward [^\n]*\)$", re.MULTILINE)


def _drop_samples_after(path: Path, step: int) -> None:
    """Cut ``samples.txt`` at the first sample header of a step after ``step``."""
    if not path.exists():
        return
    data = path.read_bytes()
    for header in _SAMPLE_HEADER.finditer(data):
        if int(header.group(1)) > step:
            _rewrite(path, data[: header.start()])
            return


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v
