"""A small timing harness: one case, several implementations, one process.

Each implementation is called after a warm-up until it has run ``repeats`` times and for at
least ``min_seconds`` (CUDA is synchronised around each call); the table reports the best
and the median time. Ratios use the best time: on a shared machine other processes only
ever add time, so the minimum is the estimate least disturbed by them. On CUDA the peak memory of each implementation is measured with
``torch.cuda.max_memory_allocated`` above what was allocated before it ran. On CPU,
peak memory needs a fresh process (see ``fastrl.bench.memory``), so it is left out of
the in-process table.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch


@dataclass
class BenchCase:
    """One operation at one shape, with the fastrl implementation and its baselines.

    ``impls`` maps a label to a zero-argument callable doing the whole measured work
    (forward, or forward + backward). The ``fastrl`` entry is compared to each other
    entry; ``ratio`` in the results is baseline time / fastrl time (> 1: fastrl faster).
    """

    op: str
    shape: str
    impls: dict[str, Callable[[], Any]]
    fastrl: str = "fastrl"
    note: str = ""
    repeats: int = 5
    min_seconds: float = 0.5


@dataclass
class BenchResult:
    op: str
    shape: str
    impl: str
    median_ms: float
    best_ms: float
    calls: int
    peak_mem_mb: float | None
    speedup_of_fastrl: float | None = None  # this impl's best time / fastrl's best time
    note: str = ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_one(fn: Callable[[], Any], device: torch.device, repeats: int, min_seconds: float) -> tuple[list[float], float | None]:
    fn()  # warm-up: compiles Triton kernels, fills caches
    _sync(device)
    peak = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    times: list[float] = []
    while len(times) < repeats or (sum(times) < min_seconds and len(times) < 1000):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return times, peak


def run_case(case: BenchCase, device: torch.device) -> list[BenchResult]:
    results = []
    for name, fn in case.impls.items():
        times, peak = _time_one(fn, device, case.repeats, case.min_seconds)
        results.append(
            BenchResult(case.op, case.shape, name, statistics.median(times) * 1e3, min(times) * 1e3, len(times), peak, note=case.note)
        )
    fast = next(r for r in results if r.impl == case.fastrl)
    for r in results:
        r.speedup_of_fastrl = r.best_ms / fast.best_ms if fast.best_ms > 0 else None
    return results


def run_cases(cases: list[BenchCase], device: torch.device, log: Callable[[str], None] | None = print) -> list[BenchResult]:
    out: list[BenchResult] = []
    for case in cases:
        rows = run_case(case, device)
        out.extend(rows)
        if log is not None:
            for r in rows:
                log(format_row(r))
    return out


def format_header() -> str:
    return f"{'op':<22} {'shape':<34} {'impl':<26} {'best ms':>10} {'median ms':>10} {'peak MB':>9} {'x fastrl':>9}"


def format_row(r: BenchResult) -> str:
    peak = f"{r.peak_mem_mb:9.1f}" if r.peak_mem_mb is not None else f"{'-':>9}"
    ratio = f"{r.speedup_of_fastrl:9.2f}" if r.speedup_of_fastrl is not None else f"{'-':>9}"
    return f"{r.op:<22} {r.shape:<34} {r.impl:<26} {r.best_ms:10.3f} {r.median_ms:10.3f} {peak} {ratio}"


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_threads": torch.get_num_threads(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env


def write_results(results: list[BenchResult], device: torch.device, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "environment": environment(device),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": [asdict(r) for r in results],
        **(extra or {}),
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
