import json
import time

import torch

from fastrl.bench.harness import BenchCase, run_case, write_results


def test_ratios_use_best_times_and_results_are_written(tmp_path):
    calls = {"fast": 0, "slow": 0}

    def fast():
        calls["fast"] += 1
        time.sleep(0.002)

    def slow():
        calls["slow"] += 1
        time.sleep(0.010)

    case = BenchCase("op", "shape", {"fastrl": fast, "baseline": slow}, repeats=3, min_seconds=0.0)
    rows = run_case(case, torch.device("cpu"))
    by_impl = {r.impl: r for r in rows}
    assert calls == {"fast": 4, "slow": 4}  # warm-up + 3 timed calls each
    assert by_impl["fastrl"].speedup_of_fastrl == 1.0
    ratio = by_impl["baseline"].speedup_of_fastrl
    assert ratio == by_impl["baseline"].best_ms / by_impl["fastrl"].best_ms
    assert all(r.best_ms <= r.median_ms for r in rows)

    out = write_results(rows, torch.device("cpu"), tmp_path / "r.json", extra={"quick": True})
    payload = json.loads(out.read_text())
    assert payload["environment"]["device"] == "cpu" and payload["quick"] is True
    assert {r["impl"] for r in payload["results"]} == {"fastrl", "baseline"}


def test_min_seconds_keeps_calling_fast_functions():
    n = {"calls": 0}

    def f():
        n["calls"] += 1

    # min_seconds far above what two calls of a no-op can take even on a loaded machine: the
    # harness keeps calling (up to its cap of 1000 calls) whatever the machine's speed
    rows = run_case(BenchCase("op", "s", {"fastrl": f}, repeats=2, min_seconds=1.0), torch.device("cpu"))
    assert rows[0].calls > 2 and n["calls"] == rows[0].calls + 1


def test_within_noise_only_when_the_ratio_lies_inside_the_wider_spread():
    from fastrl.bench.harness import within_noise

    assert within_noise(1.3, 1.05, 1.5) is True  # 30% apart, but one side swings 50%
    assert within_noise(1 / 1.3, 1.5, 1.05) is True
    assert within_noise(1.3, 1.05, 1.1) is False  # both tight: the 30% gap ranks them
    assert within_noise(40.0, 3.0, 1.0) is False  # noisy, but far apart
    assert within_noise(None, 1.0, 1.0) is None


def test_noisy_rows_are_marked_in_the_table():
    from fastrl.bench.harness import BenchResult, format_row

    row = BenchResult("op", "s", "baseline", median_ms=3.0, best_ms=1.1, calls=5, peak_mem_mb=None,
                      speedup_of_fastrl=1.1, spread=3.0 / 1.1, within_noise=True)
    assert format_row(row).rstrip().endswith("1.10~")
    row.within_noise = False
    assert format_row(row).rstrip().endswith("1.10")


def test_spread_is_median_over_best():
    n = {"calls": 0}

    def f():
        n["calls"] += 1

    (row,) = run_case(BenchCase("op", "s", {"fastrl": f}, repeats=5, min_seconds=0.0), torch.device("cpu"))
    assert row.spread == row.median_ms / row.best_ms and row.spread >= 1.0
    assert row.within_noise is None  # fastrl's own row is compared with nothing


def test_cpu_peak_memory_of_the_fused_logprob_rows_comes_from_fresh_processes():
    # 1024 tokens x 16384 vocab: the naive path holds [tokens, vocab] fp32 logits (64 MiB) and
    # their log_softmax and gradients; the fused path never does.
    from fastrl.bench.cases_logprobs import build_grpo

    target = "fastrl.bench.cases_logprobs:build_grpo"
    shape = dict(tokens=1024, hidden=32, vocab=16384, seq_len=256)
    memory = {impl: (target, dict(impl=impl, **shape)) for impl in ("fastrl", "naive")}
    impls = {impl: build_grpo(impl, **shape) for impl in memory}
    case = BenchCase("grpo", "s", impls, repeats=1, min_seconds=0.0, memory=memory)
    rows = {r.impl: r for r in run_case(case, torch.device("cpu"))}
    logits_mb = 1024 * 16384 * 4 / 2**20
    assert rows["naive"].peak_mem_mb >= 2 * logits_mb, rows["naive"]
    assert 0 < rows["fastrl"].peak_mem_mb < rows["naive"].peak_mem_mb / 2, rows["fastrl"]
    assert all(r.peak_mem_method.startswith("fresh process") for r in rows.values())


def test_the_quick_cpu_logprob_case_declares_fresh_process_memory():
    from fastrl.bench.cases_logprobs import cases

    (case,) = cases(torch.device("cpu"), quick=True)
    assert set(case.memory) == set(case.impls)
    assert all(target == "fastrl.bench.cases_logprobs:build_grpo" for target, _ in case.memory.values())
