"""Large CPU tensors in their own memory mappings, so freed ones leave the process (glibc).

PyTorch's CPU tensors come from ``malloc``. glibc serves a block from its heap arenas unless
it is at least the mmap threshold, which starts at 128 KiB and rises (up to 32 MiB) each
time a larger mapped block is freed; after the first multi-MiB free, every activation of a
training step (2-10 MiB at issue 20's real shape) lives in the heap, and the holes the
forward's freed tensors leave stay resident while the backward allocates gradients elsewhere.
At that shape (V = 151,936, H = 256, 16 x 384 tokens) 300-360 MiB of freed heap was resident
at the update's peak. ``mmap_large_blocks()`` fixes the threshold at ``MMAP_THRESHOLD_BYTES``
(``mallopt(M_MMAP_THRESHOLD)``, which also stops its adjustment): each block of at least
1 MiB is its own mapping and goes back to the OS when freed; the cost is a page fault per
page a new block touches (no measurable change in the step's CPU time there). It changes no
value. Process-wide, and for blocks the heap cannot already serve from its free chunks (glibc
maps only what would grow the heap).

It pays only where a step's blocks are large enough for the resident holes to matter. On a
built-in tiny model (frozenlake, H = 64, under 1 MiB of weights) the same setting made page
faults 42% of the run's CPU system time (a 4-step run: 72.8 CPU-s with it, 53.0 without,
identical metrics) while the holes it frees are a few MiB. ``maps_large_blocks_for`` is the
rule the trainer applies after loading its policy: CPU, and at least
``MMAP_MIN_POLICY_BYTES`` of parameters (the real shape holds 150+ MiB in its embedding alone).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["MMAP_MIN_POLICY_BYTES", "MMAP_THRESHOLD_BYTES", "maps_large_blocks_for", "mmap_large_blocks"]

MMAP_THRESHOLD_BYTES = 1 << 20
"""Blocks of at least this many bytes get their own mapping (1 MiB: the step's activations
and gradients; small tensors stay in the heap, where allocation is cheapest)."""

MMAP_MIN_POLICY_BYTES = 64 << 20
"""A policy with at least this many bytes of parameters gets ``mmap_large_blocks`` on CPU
(64 MiB: issue 20's real shape, V = 151,936 x H = 256, holds ~150 MiB in its embedding and
its step's freed heap reached 300-360 MiB; the built-in tiny models hold 0.5-16 MiB, where
the page faults cost a quarter of the CPU time and the heap holes are a few MiB)."""

_M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number of the mmap threshold (malloc.h)."""


@functools.lru_cache(maxsize=1)
def _mallopt():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    fn = getattr(libc, "mallopt", None) if libc is not None else None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return fn


def maps_large_blocks_for(*, device_type: str, parameter_bytes: int) -> bool:
    """Whether a run on ``device_type`` whose policy holds ``parameter_bytes`` of parameters
    should call ``mmap_large_blocks``: a CPU run with at least ``MMAP_MIN_POLICY_BYTES``."""
    return device_type == "cpu" and parameter_bytes >= MMAP_MIN_POLICY_BYTES


def mmap_large_blocks(threshold: int = MMAP_THRESHOLD_BYTES) -> bool | None:
    """Serve every ``malloc`` of at least ``threshold`` bytes by its own mapping: True when
    set, False when the C library refused, None without glibc's ``mallopt`` (nothing to do)."""
    fn = _mallopt()
    if fn is None:
        return None
    return bool(fn(_M_MMAP_THRESHOLD, int(threshold)))
