"""benchmarks/gpu/bench_decode.py on CPU (interpreter, a tiny shape): every implementation is
checked against the reference before it is timed, and the byte counts are the layouts' sizes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

GPU = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(GPU))
    try:
        import bench_decode
        import device_timer

        yield bench_decode, device_timer
    finally:
        sys.path.remove(str(GPU))


def test_each_implementation_is_checked_then_timed(bench):
    bench_decode, device_timer = bench
    shape = bench_decode.DRY_SHAPES[1]  # 2 prompts x G=3, GQA 7
    case = bench_decode.decode_case(shape, torch.device("cpu"), torch.float32, device_timer.DeviceTimer(torch.device("cpu"), repeats=1))
    assert set(case["checks"]) == {"fastrl_plan", "fastrl_call", "sdpa_expanded"}
    assert all(c["passed"] and c["max_abs_err"] < 1e-5 for c in case["checks"].values()), case["checks"]
    assert set(case["times"]) == set(case["checks"])
    assert case["speed_vs_sdpa_expanded"]["sdpa_expanded"] == 1.0


def test_byte_counts_at_the_issue_shape(bench):
    bench_decode, _ = bench
    b = bench_decode.byte_counts(bench_decode.SHAPES[0], 2)
    # issue 37: the expanded prefix is 335 MB of K/V a step; the prefix once plus the suffixes 101 MB
    assert b["expanded"] - b["floor"] + b["prefix_kv"] + b["suffix_kv"] == 128 * 4 * 1280 * 128 * 2 * 2
    assert round((b["prefix_kv"] + b["suffix_kv"]) / 1e6) == 101
    assert round((128 * 4 * 1280 * 128 * 2 * 2) / 1e6) == 336
