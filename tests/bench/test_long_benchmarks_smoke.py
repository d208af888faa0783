"""Smoke tests of the long-trajectory benchmarks at tiny shapes: each script runs its
fresh-process children end to end and writes the JSON fields the reports rely on.
No timing is asserted; the shared-prefix gradients must equal the repeated-prefix ones."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(relpath: str, name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relpath))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_environment(record: dict) -> None:
    assert record["device"] == "cpu"
    assert {"torch", "transformers"} <= set(record["versions"])
    assert isinstance(record["shapes"], dict)


def test_long_trajectory_quick(tmp_path):
    bench = _load("benchmarks/bench_long_trajectory.py", "bench_long_trajectory_smoke")
    out = tmp_path / "long.json"
    bench.main(["--quick", "--tokens", "128", "--repeats", "1", "--threads", "1", "--mem-cap-gb", "8", "--out", str(out)])
    record = json.loads(out.read_text())
    _check_environment(record)
    assert "trl" in record["versions"]
    assert record["shapes"]["vocab"] == 1024 and record["shapes"]["group_size"] == 8
    rows = {r["impl"]: r for r in record["results"]}
    assert set(rows) == {"fastrl", "naive", "trl"}
    for impl, r in rows.items():
        assert r["ok"], (impl, r.get("error"))
        assert r["trajectory_tokens"] == 128 == r["group_size"] * (r["prompt_len"] + r["completion_len"])
        assert r["peak_extra_mib"] >= 0 and r["step_s"] > 0 and r["tokens_per_s"] > 0
    # each implementation ran the way its name says
    assert rows["fastrl"]["setup"]["checkpointing"] is True
    assert rows["fastrl"]["setup"]["packed_tokens"] == rows["fastrl"]["prompt_len"] + 8 * rows["fastrl"]["completion_len"]
    assert rows["naive"]["setup"]["checkpointing"] is False
    assert rows["trl"]["setup"]["trl_gradient_checkpointing"] is True  # GRPOConfig's default
    assert set(record["summary"]) == {"fastrl", "naive", "trl"}
    assert all(s["max_trajectory_tokens"] == 128 for s in record["summary"].values())


def test_long_trajectory_fit_slope():
    bench = _load("benchmarks/bench_long_trajectory.py", "bench_long_trajectory_fit")
    assert bench.fit_slope([(1, 10.0), (2, 12.0), (4, 16.0)]) == pytest.approx(2.0)
    assert bench.fit_slope([(1, 10.0)]) is None


def test_shared_prefix_quick(tmp_path):
    bench = _load("benchmarks/bench_shared_prefix.py", "bench_shared_prefix_smoke")
    out = tmp_path / "sp.json"
    bench.main(["--quick", "--shapes", "24x6", "--repeats", "1", "--threads", "1", "--mem-cap-gb", "8",
                "--interleaved-rounds", "1", "--out", str(out)])
    record = json.loads(out.read_text())
    _check_environment(record)
    (row,) = record["results"]
    assert set(row["interleaved"]["min_time_s"]) == {"shared", "repeated"}
    assert (row["prompt_len"], row["completion_len"], row["group_size"]) == (24, 6, 8)
    assert row["tokens"] == {"shared": 24 + 8 * 6, "repeated": 8 * 30}
    for mode in ("shared", "repeated"):
        assert "error" not in row[mode], row[mode]
        assert row[mode]["peak_extra_mb"] >= 0
    assert row["speedup_time"] > 0
    # fp32: the packed forward's gradients equal the repeated-prefix batch's
    assert row["grad_max_rel_diff"] < 1e-4, (row["grad_max_rel_diff"], row["grad_max_rel_diff_param"])


def test_gpu_long_grpo_dry_run(tmp_path):
    bench = _load("benchmarks/gpu/bench_long_grpo.py", "bench_long_grpo_smoke")
    out = tmp_path / "gpu.json"
    bench.main(["--dry-run", "--tokens", "128", "--modes", "repeated,shared:sdpa", "--out", str(out)])
    record = json.loads(out.read_text())
    _check_environment(record)
    assert record["dry_run"] is True and record["shapes"]["config"] == "tiny"
    rows = {r["mode"]: r for r in record["results"]}
    assert set(rows) == {"repeated", "shared:sdpa"}
    for mode, r in rows.items():
        assert r["ok"], (mode, r.get("error"))
        assert r["tokens_per_group"] == 128
    assert rows["repeated"]["setup"]["tokens_run"] == 128
    assert rows["shared:sdpa"]["setup"]["tokens_run"] == rows["shared:sdpa"]["prompt_len"] + 8 * rows["shared:sdpa"]["completion_len"]
