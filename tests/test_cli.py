import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastrl
from fastrl._checks import resolve_backend
from fastrl.cli import BENCH_CASES, BENCH_MODULES, build_parser, main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick_scans(tmp_path_factory):
    """One `fastrl bench --quick --only scans` run with no --out, from a scratch working
    folder and with FASTRL_HOME set: (printed text, JSON payload, home, working folder)."""
    home = tmp_path_factory.mktemp("home")
    cwd = tmp_path_factory.mktemp("cwd")
    threads = torch.get_num_threads()
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FASTRL_HOME", str(home))
        mp.chdir(cwd)
        with contextlib.redirect_stdout(printed):
            rc = main(["bench", "--quick", "--device", "cpu", "--only", "scans"])
    pinned = torch.get_num_threads()
    torch.set_num_threads(threads)
    assert rc == 0
    written = list((home / "bench").glob("bench-cpu-quick-*.json"))
    assert len(written) == 1, written
    return printed.getvalue(), json.loads(written[0].read_text()), home, cwd, written[0], pinned


def test_bench_quick_prints_the_table_and_writes_json(quick_scans):
    printed, payload, *_ = quick_scans
    assert "x fastrl" in printed and "gae" in printed
    assert payload["quick"] is True and payload["modules"] == ["cases_scans"]
    impls = {(r["op"], r["impl"]) for r in payload["results"]}
    assert ("gae", "fastrl") in impls and any(op == "gae" and impl != "fastrl" for op, impl in impls)
    assert all(r["speedup_of_fastrl"] > 0 for r in payload["results"])
    assert all(r["spread"] >= 1.0 for r in payload["results"])
    versions = payload["environment"]["versions"]
    assert versions["torch"] == torch.__version__ and versions["fastrl"] == fastrl.__version__


def test_bench_writes_to_fastrl_home_prints_the_path_and_leaves_the_working_folder_alone(quick_scans):
    printed, _, home, cwd, written, _ = quick_scans
    assert written.parent == home / "bench"
    assert printed.strip().splitlines()[-1] == f"results written to {written.resolve()}"
    assert list(cwd.iterdir()) == []


def test_quick_mode_pins_one_thread_on_cpu_and_says_so(quick_scans):
    printed, payload, *_, pinned = quick_scans
    assert pinned == 1
    assert payload["threads"] == 1 and payload["threads_pinned"] is True
    assert "1 intra-op thread(s), pinned" in printed.splitlines()[0]
    noisy = sum(bool(r["within_noise"]) for r in payload["results"])
    assert printed.strip().splitlines()[-2].startswith("noise check: " + (f"{noisy} of" if noisy else "all"))
    assert (noisy > 0) == ("~ " in printed or "~\n" in printed)


def test_results_dir_defaults_to_the_user_cache(monkeypatch, tmp_path):
    from fastrl.cli import bench_results_dir

    monkeypatch.delenv("FASTRL_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert bench_results_dir() == tmp_path / "fastrl" / "bench"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert bench_results_dir() == Path("~/.cache/fastrl/bench").expanduser()


def test_unknown_only_name_exits_2_and_lists_the_valid_names(tmp_path, capsys):
    out = tmp_path / "never.json"
    assert main(["bench", "--quick", "--only", "scans", "no_such_case", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "'no_such_case'" in err
    assert all(name in err for name in BENCH_CASES)
    assert not out.exists() and "written" not in captured.out


def test_unavailable_cuda_device_is_a_one_line_error(capsys):
    # Without CUDA, `cuda` itself is unavailable; with it, an index past the last device is.
    device = f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
    assert main(["bench", "--quick", "--device", device, "--only", "scans"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("fastrl bench: error: --device cuda")
    assert main(["bench", "--device", "gpu0"]) == 2
    assert "not a device" in capsys.readouterr().err


def test_only_selects_by_name_and_substring():
    from fastrl.cli import select_bench_cases

    assert select_bench_cases(None) == list(BENCH_CASES)
    assert select_bench_cases(["scans", "logprobs"]) == ["scans", "logprobs"]
    assert select_bench_cases(["policy"]) == ["policy_loss"]


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"fastrl {fastrl.__version__} (distribution fastrl-kernels)"


def test_help_lists_case_names_and_has_no_rst_markup():
    parser = build_parser()
    top = parser.format_help()
    bench_help = next(a for a in parser._subparsers._group_actions).choices["bench"].format_help()
    for name, (_, what) in BENCH_CASES.items():
        assert f"  {name:<12} {what}" in bench_help
    assert "~/.cache/fastrl/bench" in bench_help and "$FASTRL_HOME" in bench_help
    assert "``" not in top + bench_help
    assert "bench" in top and "env" in top


def test_python_m_fastrl_runs_the_cli():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = lambda *args: subprocess.run([sys.executable, "-m", "fastrl", *args], cwd=ROOT, env=env,  # noqa: E731
                                       capture_output=True, text=True, timeout=120)
    version = run("--version")
    assert version.returncode == 0 and version.stdout.strip().startswith(f"fastrl {fastrl.__version__}")
    bad = run("bench", "--only", "nope")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "valid names" in bad.stderr


def test_every_bench_module_exposes_cases():
    import importlib

    for name in BENCH_MODULES:
        assert callable(importlib.import_module(f"fastrl.bench.{name}").cases), name


def test_env_prints_versions_backend_and_threads(capsys):
    assert main(["env"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert fastrl.__version__ in lines["fastrl"]
    assert torch.__version__ in lines["torch"]
    for name in ("triton", "transformers", "trl", "vllm", "liger-kernel", "device", "backend", "threads"):
        assert name in lines, name
    assert f"intra-op {torch.get_num_threads()}" in lines["threads"]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert lines["backend"].split()[2] == resolve_backend("auto", device)

    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["versions"]["torch"] == torch.__version__
    assert report["backend_auto"].startswith(resolve_backend("auto", device))
    assert report["threads"]["intra_op"] == torch.get_num_threads()


def test_env_judges_the_triton_version_against_the_tested_range():
    from fastrl.cli import _triton_status, tested_triton_range

    from packaging.specifiers import SpecifierSet

    tested = tested_triton_range()
    assert tested is not None
    low = next(s.version for s in SpecifierSet(tested) if s.operator == ">=")
    assert "inside" in _triton_status(low, tested)
    assert "OUTSIDE" in _triton_status("2.0.0", tested)
    assert "not installed" in _triton_status(None, tested)


def test_a_missing_baseline_package_skips_its_cases_but_a_missing_fastrl_module_is_a_bug():
    from fastrl.cli import _missing_optional_package

    assert _missing_optional_package(ModuleNotFoundError("x", name="transformers.models")) == "transformers"
    assert _missing_optional_package(ModuleNotFoundError("x", name="fastrl.bench.nope")) is None
    assert _missing_optional_package(ModuleNotFoundError("x", name="csrc_triton.kl")) is None
