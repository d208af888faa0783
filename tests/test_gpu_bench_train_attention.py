"""benchmarks/gpu/bench_train_attention.py: its dry run checks every implementation before timing
it, and a wrong result fails its check (so it is not timed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

import bench_train_attention as bench  # noqa: E402


def test_layouts_hold_the_same_sequences():
    from fastrl.ops.tree_attention import TreeLayout

    for kind, (layout, seqs) in bench.layouts(256).items():  # P = L = 16
        assert len(seqs) == bench.GROUP_SIZE and all(len(s) == 32 for s in seqs)
        tree = layout if isinstance(layout, TreeLayout) else TreeLayout.from_shared_prefix(layout)
        mask = tree.dense_mask()
        for s in seqs:  # each sequence's last token attends exactly to the sequence
            assert torch.nonzero(mask[s[-1]]).flatten().tolist() == s
        assert bench.attended_pairs(layout) == int(mask.sum())
    assert bench.layouts(256)["shared_prefix"][0].num_tokens == 16 + 8 * 16
    assert bench.layouts(256)["tree"][0].num_tokens == 16 + 6 * 16


def test_check_close_fails_a_wrong_or_nan_result():
    ref = {"out": torch.randn(8, 4, dtype=torch.float64)}
    assert bench.check_close({"out": ref["out"].float()}, ref, 1e-3)["passed"]
    assert not bench.check_close({"out": ref["out"] * 1.01}, ref, 1e-3)["passed"]
    nan = ref["out"].clone()
    nan[3, 1] = float("nan")
    assert not bench.check_close({"out": nan}, ref, 1e-3)["passed"]


def test_dry_run_checks_then_times(tmp_path):
    out = tmp_path / "train_attention.json"
    assert bench.main(["--dry-run", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["layout"], r["tokens_per_group"]) for r in rows] == [("shared_prefix", 64), ("tree", 64)]
    for r in rows:
        for name in ("fastrl", "sdpa_repeated"):
            assert r["checks"][name]["passed"], r["checks"][name]
            assert r["times"][name]["calls"] >= 1 and r["times"][name]["median_ms"] > 0
        assert set(r["checks"]["fastrl"]["rel_err"]) == {"out", "dq", "dk", "dv"}
        assert max(r["checks"]["fastrl"]["rel_err"].values()) < 1e-5  # fp32 in the dry run


def test_a_wrong_kernel_is_not_timed(tmp_path, monkeypatch):
    import importlib

    ta = importlib.import_module("fastrl.ops.tree_attention")  # (fastrl.ops.tree_attention is also the op's name)
    spa = importlib.import_module("fastrl.ops.shared_prefix_attention")  # runs the same kernels (imported by name)

    real = ta.triton_tree_attention
    for module in (ta, spa):
        monkeypatch.setattr(module, "triton_tree_attention", lambda q, k, v, layout, scale: real(q, k, v, layout, scale) * 1.1)
    out = tmp_path / "train_attention.json"
    assert bench.main(["--dry-run", "--out", str(out)]) == 1
    for r in json.loads(out.read_text())["rows"]:
        assert not r["checks"]["fastrl"]["passed"] and "fastrl" not in r["times"]
        assert r["checks"]["sdpa_repeated"]["passed"] and "sdpa_repeated" in r["times"]
