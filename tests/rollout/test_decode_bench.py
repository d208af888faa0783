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


def test_the_sampler_bench_says_where_and_why_modes_diverge(bench):
    from types import SimpleNamespace as Batch

    import bench_sampler
    from fastrl.bench.rollout_cases import qwen2_bench_model

    model = qwen2_bench_model(vocab=64, hidden=32, layers=1)
    eager = Batch(completion_ids=[[1, 2, 3], [4, 5, 6]], completion_logp=[torch.zeros(3), torch.zeros(3)])
    assert bench_sampler.divergence(model, [[7, 8]], 2, eager, eager) is None
    other = Batch(completion_ids=[[1, 2, 3], [4, 9, 6]], completion_logp=[torch.zeros(3), torch.tensor([1e-3, 0.0, 0.0])])
    d = bench_sampler.divergence(model, [[7, 8]], 2, eager, other)
    assert (d["row"], d["step"], d["eager_token"], d["mode_token"]) == (1, 1, 5, 9)
    assert d["max_logp_diff_before"] == pytest.approx(1e-3)
    with torch.no_grad():  # the gap is the fp32 forward's at that step, teacher-forced on eager's tokens
        top = torch.topk(model(input_ids=torch.tensor([[7, 8, 4]])).logits[0, -1].float(), 2).values
    assert d["top2_logit_gap_fp32"] == pytest.approx(float(top[0] - top[1]))
    assert d["cause"].startswith("rounding" if d["top2_logit_gap_fp32"] < bench_sampler.NEAR_TIE else "the modes")
