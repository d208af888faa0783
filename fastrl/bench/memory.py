"""Peak memory of one call, measured in a fresh process.

CPU: a new Python process imports a *builder* (``"package.module:function"``), calls it
with keyword arguments to create the inputs and get a zero-argument callable, then runs
that callable ``repeats`` times. The peak resident memory above what was resident just
before the first call is the "peak extra memory" of the implementation:

- ``ru_maxrss`` (the kernel's exact high-water mark) when it rose during the calls;
- otherwise a sampling thread's maximum of ``/proc/self/statm`` RSS (every 1 ms), since
  ``ru_maxrss`` cannot be reset and the setup may already have peaked higher.

With ``cpu_method="allocator"`` the CPU peak is instead torch's own accounting of its
allocations: every tensor allocation and free is recorded (``torch.profiler`` with
``profile_memory``) and the peak is the highest running sum of those bytes above what was
allocated before the first call. That is exact and independent of sampling, page reuse and
machine load, but counts only torch tensors (not GEMM packing buffers or Python objects).

CUDA: ``torch.cuda.max_memory_allocated`` above the allocation before the first call
(also in a fresh process so caches of other cases do not interfere).

An optional address-space limit (``mem_limit_gb``) makes an allocation that would exceed
it fail inside the child (reported as ``oom``) instead of waking the OOM killer on a
shared machine.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import subprocess
import sys
import threading
import time
from typing import Any

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:  # not Linux: fall back to the high-water mark
        return max_rss_bytes()


def max_rss_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


class RssSampler:
    """Background thread keeping the maximum RSS seen while active."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss_bytes())
            time.sleep(self.interval_s)

    def __enter__(self) -> "RssSampler":
        self.peak = current_rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss_bytes())


def _resolve(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


CPU_METHODS = ("rss", "allocator")


def allocator_peak_bytes(fn: Any, repeats: int) -> tuple[int, list[float]]:
    """Peak of torch's CPU tensor allocations (running sum of allocated - freed bytes, in
    allocation order) while calling ``fn`` ``repeats`` times, above the level at the start."""
    from torch.profiler import ProfilerActivity, profile

    times = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    events = [event for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"]
    events.sort(key=lambda event: event.start_ns())
    level = peak = 0
    for event in events:
        level += event.nbytes()
        peak = max(peak, level)
    return peak, times


def measure_here(target: str, kwargs: dict[str, Any], *, repeats: int = 1, cpu_method: str = "rss") -> dict[str, Any]:
    """Build with ``target(**kwargs)`` and measure its callable in *this* process.

    Use through ``measure_in_subprocess`` so that the process is fresh. ``cpu_method``:
    ``"rss"`` (resident memory) or ``"allocator"`` (torch's tensor allocations).
    """
    if cpu_method not in CPU_METHODS:
        raise ValueError(f"cpu_method must be one of {CPU_METHODS}, got {cpu_method!r}")
    import gc

    import torch

    fn = _resolve(target)(**kwargs)
    device = getattr(fn, "device", None) or torch.device("cpu")
    gc.collect()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        peak_extra = torch.cuda.max_memory_allocated(device) - base
        how = "cuda.max_memory_allocated"
    elif cpu_method == "allocator":
        peak_extra, times = allocator_peak_bytes(fn, repeats)
        how = "torch allocator (profile_memory)"
    else:
        base = current_rss_bytes()
        ru_before = max_rss_bytes()
        with RssSampler() as sampler:
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        ru_after = max_rss_bytes()
        if ru_after > ru_before:
            peak, how = ru_after, "ru_maxrss"
        else:
            peak, how = sampler.peak, "rss sampler (1 ms)"
        peak_extra = peak - base
    return {
        "peak_extra_mb": peak_extra / 2**20,
        "times_s": times,
        "min_time_s": min(times),
        "method": how,
        "device": str(device),
    }


def measure_in_subprocess(
    target: str,
    kwargs: dict[str, Any],
    *,
    repeats: int = 1,
    timeout_s: float | None = None,
    mem_limit_gb: float | None = None,
    env: dict[str, str] | None = None,
    cpu_method: str = "rss",
) -> dict[str, Any]:
    """Run ``measure_here`` in a fresh Python process and return its result dict.

    On failure the dict has ``error`` (and ``oom: True`` for an allocation failure).
    """
    cmd = [sys.executable, "-m", "fastrl.bench.memory", "--target", target, "--kwargs", json.dumps(kwargs),
           "--repeats", str(repeats), "--cpu-method", cpu_method]
    if mem_limit_gb is not None:
        cmd += ["--mem-limit-gb", str(mem_limit_gb)]
    child_env = {**os.environ, **(env or {})}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child_env["PYTHONPATH"] = root + os.pathsep + child_env.get("PYTHONPATH", "")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=child_env)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout_s} s"}
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr or proc.stdout)[-2000:]
    oom = "can't allocate memory" in tail or "MemoryError" in tail or "out of memory" in tail.lower()
    return {"error": tail.strip().splitlines()[-1] if tail.strip() else f"exit code {proc.returncode}", "oom": oom,
            "returncode": proc.returncode}


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="measure one builder's call in this (fresh) process; prints JSON")
    p.add_argument("--target", required=True, help="module:function returning a zero-argument callable")
    p.add_argument("--kwargs", default="{}", help="JSON keyword arguments for the builder")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--cpu-method", choices=CPU_METHODS, default="rss", help="rss (resident memory) or allocator (torch's)")
    p.add_argument("--mem-limit-gb", type=float, default=None, help="address-space limit (RLIMIT_AS) for this process")
    args = p.parse_args(argv)
    if args.mem_limit_gb is not None:
        lim = int(args.mem_limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    try:
        result = measure_here(args.target, json.loads(args.kwargs), repeats=args.repeats, cpu_method=args.cpu_method)
    except (MemoryError, RuntimeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        oom = isinstance(e, MemoryError) or "allocate" in msg or "out of memory" in msg.lower()
        print(json.dumps({"error": msg[:500], "oom": oom}))
        return 0
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
