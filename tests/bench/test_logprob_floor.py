"""benchmarks/gpu/logprob_floor.py: the budget model of the log-prob loss (hand-checked
numbers at the issue's shape, and the results reader)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("logprob_floor", ROOT / "benchmarks" / "gpu" / "logprob_floor.py")
floor = importlib.util.module_from_spec(_spec)
sys.modules["logprob_floor"] = floor  # dataclasses look their module up there
_spec.loader.exec_module(floor)


def test_floor_at_the_issue_shape():
    # one GEMM of the 7,168 scored rows: 2 * 7168 * 151936 * 3584 = 7.81 TFLOP; three at 790 TF/s: 29.6 ms
    assert floor._gemm(7168, 3584, 151936) == pytest.approx(7.806e12, rel=1e-3)
    assert floor.floor_ms(8192, 3584, 151936, scored=7168) == pytest.approx(29.64, abs=0.01)
    assert floor.floor_ms(8192, 3584, 151936, scored=7168, forward_only=True) == pytest.approx(9.88, abs=0.01)


def test_paths_count_their_gemms_and_traffic():
    n, h, v = 8192, 3584, 151936
    g = floor._gemm(7168, h, v)
    flops = {p: sum(lc.flops for lc in floor.launches(p, n, h, v, scored=7168))
             for p in ("chunked_one_pass", "chunked_two_pass", "chunked_forward", "triton")}
    assert flops == pytest.approx({"chunked_one_pass": 3 * g, "chunked_two_pass": 4 * g, "chunked_forward": g,
                                   "triton": 5 * g})
    # the fused kernels' fp32 weight-gradient RMW: 488 GB (the audit's count)
    rmw = floor.launches("triton", n, h, v, scored=7168)[2].bytes
    assert rmw == pytest.approx(488e9, rel=0.01)
    # fp32 inputs: the gradient pass writes in place (reads and writes 4 bytes a logit)
    one = {lc.name: lc.bytes for lc in floor.launches("chunked_one_pass", 64, 8, 100, "float32", chunk=16)}
    assert one["row_grad (reads fp32 logits, writes g)"] == 8.0 * 64 * 100
    t = floor.predict_ms(floor.launches("chunked_one_pass", n, h, v, scored=7168))
    assert floor.floor_ms(n, h, v, scored=7168) < t < 1.35 * floor.floor_ms(n, h, v, scored=7168)


def test_achieved_reads_a_results_file(tmp_path, capsys):
    rows = [{"N": 8192, "scored": 7168, "H": 3584, "V": 151936, "impl": "fastrl_chunked", "mode": "fwd_bwd",
             "median_ms": 59.28}, {"N": 8192, "scored": 7168, "H": 3584, "V": 151936, "impl": "naive",
                                   "mode": "no_grad", "median_ms": None}]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"gpu_kind": "h200", "rows": rows}))
    (got,) = floor.achieved(json.loads(path.read_text()))
    assert got["share_of_floor"] == pytest.approx(0.5, abs=1e-3)
    assert got["achieved_tflops"] == pytest.approx(3 * 7.806e12 / 59.28e-3 / 1e12, rel=1e-3)
    assert floor.main(["--results", str(path)]) == 0
    assert "0.50 of the floor" in capsys.readouterr().out
    assert floor.main(["--n", "64", "--h", "8", "--v", "100"]) == 0
    assert "PREDICTED" in capsys.readouterr().out
