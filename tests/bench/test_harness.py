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

    rows = run_case(BenchCase("op", "s", {"fastrl": f}, repeats=2, min_seconds=0.05), torch.device("cpu"))
    assert rows[0].calls > 2 and n["calls"] == rows[0].calls + 1
