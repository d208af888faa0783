"""Device-event timing for the GPU benchmarks (bench_decode.py, bench_memory_bound.py).

``time_fn`` times a callable with CUDA events around each call (one warm-up call first), the L2
cache flushed before each timed call by writing ``L2_FLUSH_BYTES`` (outside the events, so a
memory-bound kernel is timed from HBM, not from a cache the previous call warmed), and returns
the median and best in milliseconds. On CPU (the scripts' dry runs) it uses ``perf_counter``.
``copy_bandwidth`` measures a device-to-device copy the same way: the bandwidth a memory-bound
kernel is compared with.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

L2_FLUSH_BYTES = 256 << 20
"""Written before each timed call: five times an H100/H200's 50 MB L2."""
COPY_BYTES = 1 << 30
"""Bytes of the measured device-to-device copy (read and written once each)."""


class DeviceTimer:
    def __init__(self, device: torch.device, repeats: int = 20):
        self.device, self.repeats = device, repeats
        self._flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.float32, device=device) if device.type == "cuda" else None

    def time_fn(self, fn: Callable[[], object]) -> dict[str, float]:
        fn()
        if self.device.type != "cuda":
            times = []
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        else:
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeats)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.repeats)]
            torch.cuda.synchronize(self.device)
            for s, e in zip(starts, ends):
                self._flush.zero_()
                s.record()
                fn()
                e.record()
            torch.cuda.synchronize(self.device)
            times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        return {"median_ms": statistics.median(times), "best_ms": min(times), "repeats": len(times)}

    def copy_bandwidth(self, nbytes: int = COPY_BYTES) -> dict[str, float]:
        """Bytes moved (read + written) per second by ``dst.copy_(src)`` over ``nbytes``."""
        n = nbytes // 4 if self.device.type == "cuda" else 1 << 20
        src = torch.randn(n, device=self.device)
        dst = torch.empty_like(src)
        t = self.time_fn(lambda: dst.copy_(src))
        moved = 2 * src.numel() * src.element_size()
        return {"bytes_moved": moved, "median_ms": t["median_ms"], "GBps": moved / (t["median_ms"] * 1e-3) / 1e9}
