"""benchmarks/gpu/bench_memory_bound.py exercised on CPU (Triton in the interpreter, tiny shapes):
every op is checked against the reference before it is timed, a wrong kernel is reported and not
timed, and the script writes its JSON with the copy bandwidth and each case's bytes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "benchmarks" / "gpu"

pytestmark = pytest.mark.usefixtures("one_thread")


def _load(name: str):
    if str(GPU) not in sys.path:
        sys.path.insert(0, str(GPU))  # the script imports device_timer beside it
    spec = importlib.util.spec_from_file_location(f"gpu_{name}", GPU / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass looks its module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    return _load("bench_memory_bound")


@pytest.fixture(scope="module")
def timer():
    return _load("device_timer").DeviceTimer(torch.device("cpu"), repeats=1)


@pytest.mark.parametrize("index", range(7))
def test_every_op_is_checked_against_the_reference_then_timed(bench, timer, index):
    op = bench.OPS[index]
    case = bench.op_case(op, 2, 32, torch.device("cpu"), timer, against_reference=True, compile_=False)
    assert case["checked_against"] == "reference"
    assert set(case["checks"]) == {"fastrl_triton", "torch"}
    assert all(c["passed"] for c in case["checks"].values()), case["checks"]
    assert set(case["times"]) == {"fastrl_triton", "torch"}
    # the bytes are the inputs read once and the outputs written once: at least one fp32 [2, 32] tensor each way
    assert case["bytes"] >= 2 * 2 * 32 * 4


def test_a_wrong_kernel_is_reported_and_not_timed(bench, timer):
    op = bench.OPS[1]  # KL
    wrong = bench.Op(op.name, op.make, lambda x, backend: tuple(t * (1.01 if backend == "triton" else 1.0) for t in op.run(x, backend)),
                     op.reference, op.grad)
    case = bench.op_case(wrong, 2, 32, torch.device("cpu"), timer, against_reference=True, compile_=False)
    assert not case["checks"]["fastrl_triton"]["passed"] and case["checks"]["torch"]["passed"]
    assert "fastrl_triton" not in case["times"] and "torch" in case["times"]


def test_the_script_writes_its_results(bench, tmp_path):
    out = tmp_path / "mb.json"
    assert bench.main(["--dry-run", "--no-compile", "--ops", "kl_penalty", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["copy"]["GBps"] > 0 and data["target_share_of_copy"] == 0.6
    assert [(c["B"], c["T"], c["checked_against"]) for c in data["cases"]] == [(2, 32, "reference"), (4, 16, "torch path")]
    for c in data["cases"]:
        assert {"fastrl_triton", "torch"} <= set(c["times"])
        assert all(t["share_of_copy"] > 0 for t in c["times"].values())
