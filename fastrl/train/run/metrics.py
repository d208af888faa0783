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

import contextlib
import json
import math
import os
import re
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from fastrl.rollout import metric_names as names

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from fastrl.rollout.base import GroupRollout
    from fastrl.train.ranks import Ranks


LOGP_GAP_MEAN, LOGP_GAP_MAX = "rollout/logp_gap_mean", "rollout/logp_gap_max"
"""Per step: mean and largest ``|trainer - sampler|`` log-prob over trained tokens (``LogpGap``)."""


class LogpGap:
    """The sampler-vs-trainer log-prob gap on trained tokens (loss mask > 0 only: whatever a
    padded or environment position holds is never read), accumulated over passes without a
    host sync. The trainer feeds it its own pass of the rollout when it makes one, else the
    update's forwards before its first optimizer step (on an on-policy update, all of them:
    the current log-probs are the trainer's at rollout time), so it costs no extra forward."""

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        self._count: torch.Tensor | None = None
        self._max: torch.Tensor | None = None

    def add(self, trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor) -> None:
        d = (trainer.detach().float() - sampler.float()).abs()[mask > 0]
        total, count = d.sum(), torch.tensor(d.numel(), device=d.device)
        largest = d.max() if d.numel() else torch.zeros((), device=d.device)
        if self._sum is None:
            self._sum, self._count, self._max = total, count, largest
        else:
            self._sum, self._count, self._max = self._sum + total, self._count + count, torch.maximum(self._max, largest)

    def metrics(self, ranks: Ranks) -> dict[str, float]:
        """``{LOGP_GAP_MEAN, LOGP_GAP_MAX}`` over every rank's tokens; empty when none was measured."""
        count = ranks.sum(float(self._count)) if self._count is not None else ranks.sum(0.0)
        if not count:
            return {}
        total = ranks.sum(float(self._sum)) if self._sum is not None else ranks.sum(0.0)
        largest = ranks.max(float(self._max)) if self._max is not None else ranks.max(0.0)
        return {LOGP_GAP_MEAN: total / count, LOGP_GAP_MAX: largest}


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
            from fastrl.train.run.progress import Progress

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
            from fastrl.train.run.progress import step_values

            self.bar.advance(step_values(metrics))

    def log_eval(self, step: int, metrics: dict[str, float], *, row_success: list[int] | None = None,
                 probes: Sequence[tuple[int, float]] = ()) -> None:
        """An ``event: eval`` record; ``row_success``: the success (0/1) per held-out row, in row
        order (``row_success`` in the record: two evaluations compared row by row, ``fastrl.commands.paired``);
        ``probes``: the warm-up's ``(steps done, accuracy)`` probes (``probes`` in the record, pairs)."""
        record = {"step": step, "time": time.time(), "event": "eval", **metrics}
        if row_success is not None:
            record["row_success"] = list(row_success)
        if probes:
            record["probes"] = [[int(s), float(a)] for s, a in probes]
        self.jsonl.write(json.dumps(record) + "\n")
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


# ---------------------------------------------------------------------------- the trainer's metrics
LOSS_SHARES = frozenset({"pg_loss", "kl_loss", "entropy_loss", "critic_loss"})
"""Loss terms a micro-batch reports as its share of the mini-batch loss (global count): they add up."""

_UPDATE_METRIC_NAMES = {
    "pg_loss": "loss/pg", "clip_frac": "loss/clip_frac", "clip_frac_low": "loss/clip_frac_low",
    "clip_frac_high": "loss/clip_frac_high", "dual_clip_frac": "loss/dual_clip_frac", "approx_kl": "kl/approx_old",
    "ratio_mean": "ratio/mean", "ratio_min": "ratio/min", "ratio_max": "ratio/max", "kl_loss": "loss/kl",
    "kl_ref_mean": "kl/ref", "entropy_loss": "loss/entropy", "entropy_mean": "entropy/mean",
    "is_weight_mean": "rollout/is_weight_mean", "critic_loss": "critic/loss", "loss": "loss/total",
}


def update_metric_name(name: str) -> str:
    """The logged name of a loss op's metric (``critic_*`` from the value loss)."""
    if name in _UPDATE_METRIC_NAMES:
        return _UPDATE_METRIC_NAMES[name]
    if name.startswith("critic_"):
        return "critic/" + name[len("critic_"):]
    return "loss/" + name


class SilentLogger:
    """The logger of ranks other than 0 under torchrun: writes nothing."""

    def log(self, *args, **kwargs) -> None: ...
    def log_eval(self, *args, **kwargs) -> None: ...
    def write_samples(self, *args, **kwargs) -> None: ...
    def message(self, *args, **kwargs) -> None: ...
    def close(self) -> None: ...


class StageTimer:
    """Seconds per stage of a step (``with timer("generate"): ...``), the device synchronised
    at both ends so asynchronous GPU work is counted where it runs."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}
        self._sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    @contextlib.contextmanager
    def __call__(self, stage: str):
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0


def rollout_metrics(rollout: GroupRollout, ranks: Ranks) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Reward, length and rollout metrics of a ``GroupRollout`` over every rank's samples, and
    the rewards' histogram."""
    batch = rollout.batch
    metrics: dict[str, float] = {}
    r = ranks.gather(rollout.rewards.float())
    metrics["reward/mean"] = float(r.mean())
    metrics["reward/std"] = float(r.std()) if r.numel() > 1 else 0.0
    metrics["reward/min"] = float(r.min())
    metrics["reward/max"] = float(r.max())
    pooled = ranks.pool_reward_metrics(rollout.reward_metrics)
    metrics.update({k if k.startswith("reward") else f"reward/{k}": v for k, v in pooled.items()})
    lengths = ranks.gather(torch.tensor([len(c) for c in batch.completion_ids], dtype=torch.float32))
    truncated = ranks.gather(torch.tensor([f == "length" for f in batch.finish_reasons], dtype=torch.float32))
    metrics["response/length_mean"] = float(lengths.mean())
    metrics["response/length_max"] = float(lengths.max())
    metrics["response/truncated_frac"] = float(truncated.mean())
    metrics["rollout/samples"] = float(lengths.numel())
    metrics[names.GENERATED_TOKENS] = float(ranks.sum(batch.stats.generated_tokens))
    metrics["rollout/prefill_tokens"] = float(ranks.sum(batch.stats.prefill_tokens_computed))
    return metrics, histogram(r)


def best_and_worst(rollout: GroupRollout, tokenizer: PreTrainedTokenizerBase,
                   group_size: int) -> tuple[tuple[str, str, float], tuple[str, str, float]]:
    """``(prompt, completion, reward)`` of the rollout's best and worst sample (``write_samples``)."""
    r, batch = rollout.rewards, rollout.batch
    best, worst = int(r.argmax()), int(r.argmin())

    def sample(b: int) -> tuple[str, str, float]:
        return tokenizer.decode(batch.prompt_ids[b // group_size], skip_special_tokens=True), rollout.completions[b], float(r[b])

    return sample(best), sample(worst)
