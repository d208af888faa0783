"""The scripts of benchmarks/gpu/ that run.sh calls on the device, exercised on CPU.

``kernels.py`` must check a kernel against the reference before timing it and must not time
a kernel that fails; ``tests_passed.py`` gates the benchmark modules on their tests' JUnit
results or on the outcomes ``stream_outcomes.py`` writes test by test. (The Triton kernels run in the interpreter here: tiny shapes.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", ROOT / "benchmarks" / "gpu" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SHAPE = dict(groups=2, G=2, Hq=4, Hkv=2, D=16, prefix=9, suffix=3)


def test_decode_attention_is_checked_then_timed():
    kernels = _load("kernels")
    case, check = kernels.attention_case(SHAPE, torch.device("cpu"), torch.float32, flex=False, repeats=1)
    assert check["passed"] and check["max_abs_err_vs_reference"] < 1e-5, check
    assert set(case.impls) == {"fastrl", "sdpa_expanded"}
    # the baseline really is the same attention (expanded prefix)
    torch.testing.assert_close(case.impls["fastrl"]().float(), case.impls["sdpa_expanded"]().float(), atol=1e-5, rtol=0)


def test_a_wrong_kernel_is_not_timed(monkeypatch):
    kernels = _load("kernels")
    import fastrl.ops as ops

    real = ops.shared_prefix_decode_attention
    monkeypatch.setattr(ops, "shared_prefix_decode_attention", lambda **kw: real(**kw) * 1.01)
    case, check = kernels.attention_case(SHAPE, torch.device("cpu"), torch.float32, flex=False, repeats=1)
    assert case is None and not check["passed"]



def _load_loss_bench():
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))  # its sibling logprob_floor.py
    return _load("bench_logprob_loss")


def test_a_wrong_loss_is_not_timed(monkeypatch, tmp_path):
    bench = _load_loss_bench()
    import fastrl.ops as ops

    real_loss = ops.fused_linear_policy_loss
    monkeypatch.setattr(ops, "fused_linear_policy_loss", lambda *a, **kw: (real_loss(*a, **kw)[0] * 1.01, {}))
    check = bench.check("fastrl_torch", "fwd_bwd", 8, 40, torch.float32, torch.device("cpu"))
    assert not check["passed"] and check["rel_err_vs_fp32_logits"]["loss"] > 5e-3
    out = tmp_path / "loss.json"
    assert bench.main(["--dry-run", "--impls", "fastrl_torch", "--shapes", "32:8:40", "--out", str(out)]) == 1
    rows = json.loads(out.read_text())["rows"]
    fwd_bwd = [r for r in rows if r["mode"] == "fwd_bwd"]
    assert fwd_bwd and all(r["median_ms"] is None and not r["check"]["passed"] for r in fwd_bwd)


def test_loss_stage_checks_then_times_each_path_and_writes_the_floor(tmp_path):
    """The loss stage's dry run: the chunked path (row kernels in the interpreter) and the naive
    baseline, both modes, each checked then timed; the rows carry the path, the floor and the
    share of it, and the JSON the model's predictions."""
    bench = _load_loss_bench()
    out = tmp_path / "loss.json"
    rc = bench.main(["--dry-run", "--impls", "fastrl_chunked,naive,cce", "--shapes", "32:8:40", "--out", str(out)])
    assert rc == 0
    payload = json.loads(out.read_text())
    rows = {(r["impl"], r["mode"]): r for r in payload["rows"]}
    assert rows["fastrl_chunked", "fwd_bwd"]["path"] == "chunked/one-pass"
    assert rows["fastrl_chunked", "no_grad"]["path"] == "chunked/forward"
    for key in (("fastrl_chunked", "fwd_bwd"), ("fastrl_chunked", "no_grad"), ("naive", "fwd_bwd"), ("naive", "no_grad")):
        r = rows[key]
        assert r["check"]["passed"] and r["median_ms"] > 0 and r["share_of_floor"] > 0, r
    assert rows["cce", "fwd_bwd"]["skipped"] == "CUDA only"
    assert payload["predicted"][0]["N"] == 32 and payload["predicted"][0]["floor_ms"] > 0


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.ops.test_policy_loss" name="test_a" />
<testcase classname="tests.ops.test_scans.TestBig" name="test_b"><failure message="x">boom</failure></testcase>
<testcase classname="tests.ops.test_advantages" name="test_c"><skipped message="no" /></testcase>
</testsuite></testsuites>"""


def test_bench_modules_are_gated_on_their_tests(tmp_path):
    xml = tmp_path / "tests.xml"
    xml.write_text(JUNIT)
    script = ROOT / "benchmarks" / "gpu" / "tests_passed.py"

    def gate(module: str, path: Path = xml) -> int:
        return subprocess.run([sys.executable, str(script), str(path), module], capture_output=True).returncode

    assert gate("policy_loss") == 0
    assert gate("advantages") == 0  # skipped is not failed
    assert gate("scans") == 1
    assert gate("rollout") == 0  # its tests did not run (a dry run): not held against it
    assert gate("policy_loss", tmp_path / "missing.xml") == 1


def test_streamed_outcomes_gate_like_the_junit_report(tmp_path):
    # what stream_outcomes.py writes, test by test: a stage cut at its timeout keeps it
    tsv = tmp_path / "tests_outcomes.tsv"
    tsv.write_text("collected\ttests/ops/test_policy_loss.py::test_a\ncollected\ttests/ops/test_scans.py::TestBig::test_b\n"
                   "collected\ttests/ops/test_advantages.py::test_c\ncollected\ttests/ops/test_kl.py::test_d\n"
                   "passed\ttests/ops/test_policy_loss.py::test_a\nfailed\ttests/ops/test_scans.py::TestBig::test_b\n"
                   "skipped\ttests/ops/test_advantages.py::test_c\n")
    script = ROOT / "benchmarks" / "gpu" / "tests_passed.py"

    def gate(module: str, path: Path = tsv) -> int:
        return subprocess.run([sys.executable, str(script), str(path), module], capture_output=True).returncode

    assert gate("policy_loss") == 1  # test_kl.py's test was collected and never reached (a timeout)
    assert gate("advantages") == 0  # skipped is not failed
    assert gate("scans") == 1
    assert gate("rollout") == 0  # its tests were not in the run: not held against it
    tsv.write_text(tsv.read_text() + "passed\ttests/ops/test_kl.py::test_d\n")
    assert gate("policy_loss") == 0
    assert gate("policy_loss", tmp_path / "missing.tsv") == 1


def test_stream_outcomes_writes_each_report_as_it_arrives(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "import pytest\n\n"
        "def test_ok():\n    pass\n\n"
        "def test_bad():\n    assert 1 == 2, 'the values'\n\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('setup broke')\n\n"
        "def test_setup_error(broken):\n    pass\n\n"
        "@pytest.mark.skip(reason='no')\ndef test_skipped():\n    pass\n")
    outcomes, failures = tmp_path / "o.tsv", tmp_path / "f.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "benchmarks" / "gpu"), "FASTRL_OUTCOMES": str(outcomes),
           "FASTRL_FAILURES": str(failures)}
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "stream_outcomes", "-p", "no:cacheprovider", "test_x.py"],
                   cwd=tmp_path, env=env, capture_output=True)
    lines = outcomes.read_text().splitlines()
    ids = ["test_x.py::test_ok", "test_x.py::test_bad", "test_x.py::test_setup_error", "test_x.py::test_skipped"]
    assert lines[:4] == [f"collected\t{i}" for i in ids]  # the whole list first, then each outcome as it ends
    assert sorted(lines[4:]) == sorted(["passed\ttest_x.py::test_ok", "failed\ttest_x.py::test_bad",
                                        "failed\ttest_x.py::test_setup_error", "skipped\ttest_x.py::test_skipped"])
    text = failures.read_text()
    assert "=== test_x.py::test_bad (call)" in text and "the values" in text
    assert "=== test_x.py::test_setup_error (setup)" in text and "setup broke" in text
