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
from fastrl.train.run.heap import mmap_large_blocks
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


def _parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_the_trainer_maps_large_blocks_for_the_real_shape_and_not_for_the_built_in_tiny_models():
    """The rule's inputs at the two ends: issue 20's real shape (a Qwen2 with a 151,936-token
    vocabulary, built on the meta device) is mapped, the built-in tiny models are not, and a CUDA
    run never is (glibc's heap holds no CUDA tensors)."""
    import torch

    from fastrl.bench.rollout_cases import qwen2_bench_model
    from fastrl.train.run.heap import MMAP_MIN_POLICY_BYTES, maps_large_blocks_for
    from fastrl.train.task import DefaultTask, char_tokenizer, tiny_model

    with torch.device("meta"):
        real = _parameter_bytes(qwen2_bench_model())
    tok, default = char_tokenizer(), DefaultTask()
    largest_tiny = _parameter_bytes(tiny_model(tok, hidden_size=256, layers=4, heads=default.heads, arch=default.arch,
                                               max_position_embeddings=1024, seed=0))
    assert real > MMAP_MIN_POLICY_BYTES > largest_tiny
    assert maps_large_blocks_for(device_type="cpu", parameter_bytes=real)
    assert not maps_large_blocks_for(device_type="cpu", parameter_bytes=largest_tiny)
    assert not maps_large_blocks_for(device_type="cuda", parameter_bytes=real)
    assert maps_large_blocks_for(device_type="cpu", parameter_bytes=MMAP_MIN_POLICY_BYTES)  # the bound is inclusive
