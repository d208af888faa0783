"""Smoke test of ``benchmarks/bench_sft_layout.py`` at a tiny batch: both layouts run the
warm-up step on each built-in task's batches and give the same loss. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_sft_layout_benchmark_quick(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_sft_layout_smoke", os.path.join(ROOT, "benchmarks/bench_sft_layout.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "sft.json"
    bench.main(["--tasks", "default", "sql", "--batch-size", "4", "--batches", "1", "--rounds", "1", "--threads", "1", "--out", str(out)])
    record = json.loads(out.read_text())
    rows = {r["task"]: r for r in record["results"]}
    assert set(rows) == {"default", "sql"} and record["shapes"]["batch_size"] == 4
    for r in rows.values():
        assert r["max_loss_diff"] < 1e-4
        assert 0 < r["trie_tokens_mean"] <= r["real_tokens_mean"] <= r["padded_tokens_mean"]
        assert r["padded_step_s"] > 0 and r["trie_step_s"] > 0
    assert rows["sql"]["model"]["hidden"] == 128 and rows["sql"]["trie_saving"] > rows["default"]["trie_saving"]
