"""mmap_large_blocks: blocks above the threshold get their own mapping (glibc), a no-op elsewhere.

Checked in a fresh process (a test process's heap may hold free chunks that serve any request):
after a 20 MiB mapped block is freed glibc's dynamic threshold is 20 MiB, so a 1.5 MiB block comes from
the heap, unless ``mmap_large_blocks()`` fixed the threshold at 1 MiB."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, ctypes.util, sys
from fastrl.train.heap import mmap_large_blocks
libc = ctypes.CDLL(ctypes.util.find_library("c"))
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(20 << 20))  # a freed 20 MiB mapped block: the dynamic threshold rises to 20 MiB
if sys.argv[1] == "set":
    assert mmap_large_blocks() is True
before = libc.mallinfo2().hblkhd
p = libc.malloc(3 << 19)  # 1.5 MiB
during = libc.mallinfo2().hblkhd
libc.free(p)
after = libc.mallinfo2().hblkhd
print(during - before, during - after)
"""


@pytest.mark.skipif(not ctypes.util.find_library("c") or not hasattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallinfo2"),
                    reason="not glibc >= 2.33 (no mallinfo2)")
def test_blocks_above_the_threshold_are_mapped_and_unmapped_when_freed():
    def run(mode):
        out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True).stdout
        return [int(x) for x in out.split()]

    mapped, unmapped = run("set")
    assert mapped >= 3 << 19 and unmapped >= 3 << 19  # its own mapping, gone when freed
    assert run("default") == [0, 0]  # without it: a heap block (the check is not vacuous)
