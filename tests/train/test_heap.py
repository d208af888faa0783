"""mmap_large_blocks: blocks above the threshold get their own mapping (glibc), a no-op elsewhere."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest
import torch

from fastrl.train.heap import MMAP_THRESHOLD_BYTES, mmap_large_blocks


def _mapped_bytes():
    """glibc's bytes in mapped blocks (``mallinfo2().hblkhd``), or None without ``mallinfo2``."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2"):
        return None

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                    "uordblks", "fordblks", "keepcost")]

    libc.mallinfo2.restype = MallInfo2
    return libc.mallinfo2().hblkhd


def test_blocks_above_the_threshold_are_mapped_and_unmapped_when_freed():
    if mmap_large_blocks() is None or _mapped_bytes() is None:
        pytest.skip("not glibc (no mallopt / mallinfo2)")
    before = _mapped_bytes()
    x = torch.ones(3 * MMAP_THRESHOLD_BYTES // 2 // 4)  # 1.5 MiB of fp32: over the threshold, under glibc's default 32 MiB cap
    during = _mapped_bytes()
    assert during - before >= x.numel() * 4  # its own mapping, not a heap block
    del x
    assert _mapped_bytes() <= during - 3 * MMAP_THRESHOLD_BYTES // 2  # unmapped on free: it left the process
