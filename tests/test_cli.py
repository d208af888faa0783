import json

from fastrl.cli import BENCH_MODULES, main


def test_bench_quick_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--device", "cpu", "--only", "scans", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "x fastrl" in printed and "gae" in printed
    payload = json.loads(out.read_text())
    assert payload["quick"] is True and payload["modules"] == ["cases_scans"]
    impls = {(r["op"], r["impl"]) for r in payload["results"]}
    assert ("gae", "fastrl") in impls and any(op == "gae" and impl != "fastrl" for op, impl in impls)
    assert all(r["speedup_of_fastrl"] > 0 for r in payload["results"])


def test_every_bench_module_exposes_cases():
    import importlib

    for name in BENCH_MODULES:
        assert callable(importlib.import_module(f"fastrl.bench.{name}").cases), name


def test_env_prints_versions(capsys):
    assert main(["env"]) == 0
    assert '"torch"' in capsys.readouterr().out
