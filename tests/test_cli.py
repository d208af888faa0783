import contextlib
import io
import json
import os
import re
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
    # fastrl train's thread rule, as it stands on this machine now: the free cores on a CPU (one at least)
    assert lines["train"].startswith("train threads ") and "--threads N overrides" in lines["train"]
    if device.type == "cpu":
        # each call reads the machine once; the two calls may see different neighbours, so each is checked on its own
        usable = report["threads"]["usable_cores"]
        assert 1 <= report["threads"]["train_threads_now"] <= usable
        said = re.match(r"train threads (\d+) now \(", lines["train"])
        assert said and 1 <= int(said.group(1)) <= usable, lines["train"]


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


# ---------------------------------------------------------------- one CLI convention (fastrl/cli_style.py)


def _error_of(capsys, argv):
    """(exit status, stderr) of a command line that fails while parsing."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("argv, wrong, meant", [
    (["bench", "--quik"], "--quik", "--quick"),
    (["plan", "--group_sise", "4"], "--group_sise", "--group_size"),
    (["plan", "--prompt", "5"], "--prompt", "--prompt_len"),  # a prefix is not taken as the option
    (["vllm-server", "--model", "m", "--weights-dri", "/tmp"], "--weights-dri", "--weights_dir"),
    (["env", "--jsn"], "--jsn", "--json"),
])
def test_a_parse_error_is_the_usage_line_and_one_error_line_with_the_closest_option(capsys, argv, wrong, meant):
    code, err = _error_of(capsys, argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 2, err
    assert lines[0].startswith(f"usage: fastrl {argv[0]} ")
    assert lines[1].startswith(f"fastrl {argv[0]}: error: unknown option {wrong}") and f"did you mean {meant}" in lines[1]


@pytest.mark.parametrize("argv, line", [
    (["--lr", "inf"], "--lr: expected a finite number (or null), got 'inf'"),  # Optional[float]
    (["--entropy_coef", "nan"], "--entropy_coef: expected a finite number, got 'nan'"),  # float
    (["--group_size", "abc"], "--group_size: expected an integer, got 'abc'"),  # int
    (["--group_size=1.5"], "--group_size: expected an integer, got '1.5'"),
    (["--steps", "abc"], "--steps: expected an integer (or null), got 'abc'"),  # Optional[int]: null, the env's own
    (["--overwrite", "maybe"], "--overwrite: expected true or false, got 'maybe'"),  # bool
    (["--algorithm", "foo"], "--algorithm: expected one of grpo, dr_grpo, dapo, gspo, rloo, reinforce_pp, ppo, gigpo, "
                             "mt_grpo, got 'foo'"),  # Literal
    (["--surrogate", "foo"], "--surrogate: expected one of ppo_clip, cispo, sapo, vespo (or null), got 'foo'"),
    (["--adam-betas", "[0.9,x]"], "--adam_betas: expected a list of finite numbers (e.g. [a, b]), got '[0.9,x]'"),
])
def test_a_train_type_error_is_one_line_naming_the_option_value_and_what_is_accepted(capsys, argv, line):
    code, err = _error_of(capsys, ["train", *argv])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 2, err
    assert lines[0].startswith("usage: fastrl train ")
    assert lines[1] == f"fastrl train: error: {line}"


def test_a_train_type_error_from_a_config_file_names_the_parser_value(capsys, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("group_size: many\n")
    code, err = _error_of(capsys, ["train", "--config", str(config)])
    assert code == 2 and err.strip().splitlines()[1] == "fastrl train: error: --group_size: expected an integer, got 'many'"


def test_an_unknown_command_suggests_the_closest(capsys):
    code, err = _error_of(capsys, ["bnch"])
    assert code == 2 and "did you mean bench?" in err and len(err.strip().splitlines()) == 2


def test_every_command_takes_the_dashed_spelling_as_an_alias():
    from fastrl.cli_style import normalize_spelling

    parser = build_parser()
    plan = parser.parse_args(["plan", "--group-size", "4", "--max-new-tokens", "9", "--memory-gb=3"])
    assert (plan.group_size, plan.max_new_tokens, plan.memory_gb) == (4, 9, 3.0)
    assert parser.parse_args(["vllm-server", "--model", "m", "--weights-dir", "/x"]).weights_dir == "/x"
    # values and unknown names are left alone; nothing after `--`
    assert normalize_spelling(["--model", "my-model", "--no-such", "--group-size", "--", "--group-size"],
                              ["--model", "--group_size"]) == ["--model", "my-model", "--no-such", "--group_size", "--",
                                                               "--group-size"]


def test_every_option_is_spelled_with_underscores():
    parser = build_parser()
    subcommands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    for name, sub in subcommands.items():
        for option in sub._option_string_actions:
            assert "-" not in option.lstrip("-"), (name, option)


def test_plan_uses_train_option_names_and_defaults(capsys):
    from fastrl.train.config import TrainConfig

    assert main(["plan", "--json"]) == 0  # no --model: fastrl train's built-in model, as `fastrl train`
    plan = json.loads(capsys.readouterr().out)
    resolved = TrainConfig().resolved()
    options = plan["options"]
    assert options["group_size"] == resolved.group_size and plan["options"]["response_len"] == resolved.max_new_tokens
    assert options["shared_prefix"] is True and resolved.shared_prefix is True      # train's default, not "off"
    assert options["device"] == ("cuda" if torch.cuda.is_available() else "cpu")    # train's `auto`, not `cuda`
    assert options["algorithm"] == "grpo"                                           # grpo's preset: a reference (kl 0.04)
    assert main(["plan", "--json", "--kl_coef", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["options"]["algorithm"] == "grpo_noref"
    assert main(["plan", "--json", "--algorithm", "ppo", "--shared_prefix", "false"]) == 0
    ppo = json.loads(capsys.readouterr().out)["options"]
    assert ppo["algorithm"] == "ppo" and ppo["shared_prefix"] is False


def test_plan_reads_the_train_config_yaml_and_the_command_line_overrides_it(tmp_path, capsys):
    run = tmp_path / "run.yaml"
    run.write_text("model: qwen2.5-0.5b\nmax_new_tokens: 1024\nlr: 1.0e-6\nshared_prefix: false\ngroup_size: 4\n")
    assert main(["plan", "--config", str(run), "--group_size", "16", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"] == "qwen2.5-0.5b" and plan["options"]["response_len"] == 1024
    assert plan["options"]["shared_prefix"] is False and plan["options"]["group_size"] == 16
    # fastrl train reads the same file
    from fastrl.train.cli import parse_train_args

    assert parse_train_args(["--config", str(run)]).max_new_tokens == 1024
    bad = tmp_path / "bad.yaml"
    bad.write_text("modle: qwen2.5-0.5b\n")
    assert main(["plan", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"fastrl plan: error: --config {str(bad)!r}: modle is not a fastrl train option (fastrl train --help)"


def test_an_input_error_is_one_line_and_debug_shows_the_traceback(capsys, monkeypatch):
    from fastrl.errors import InputError

    assert main(["plan", "--model", str(ROOT / "no-such-config.json"), "--group_size", "0"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("fastrl plan: error: ")
    with pytest.raises(InputError):
        main(["--debug", "plan", "--group_size", "0"])
    monkeypatch.setenv("FASTRL_DEBUG", "1")
    with pytest.raises(InputError):
        main(["plan", "--group_size", "0"])


def test_fastrl_bench_run_says_which_baseline_rows_are_missing_and_records_them(monkeypatch, capsys, tmp_path):
    """The whole ``fastrl bench`` path on its smallest case (logprobs, --quick) with TRL and
    Liger-Kernel not importable (``None`` in ``sys.modules``: Python's own way to block an
    import, so it holds whether or not they are installed): the line naming the missing rows,
    the rows absent, the JSON recording why."""
    from fastrl.bench import cases_logprobs

    for package in set(cases_logprobs.OPTIONAL_BASELINES.values()):
        monkeypatch.setitem(sys.modules, package, None)
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--only", "logprobs", "--device", "cpu", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    said = [line for line in lines if line.startswith("-- logprobs: without the baseline rows")]
    assert said == ["-- logprobs: without the baseline rows trl_selective (trl is not installed), liger (liger_kernel "
                    "is not installed); pip install -e '.[dev]' adds them"], lines
    report = json.loads(out.read_text())
    assert report["missing_baselines"] == {"logprobs": {"trl_selective": "trl", "liger": "liger_kernel"}}
    impls = {row["impl"] for row in report["results"]}
    assert impls == set(cases_logprobs.IMPLS) - {"trl_selective", "liger"} and impls


def test_bench_says_which_baseline_rows_are_missing_and_why(monkeypatch, capsys, tmp_path):
    import importlib.util

    from fastrl.bench import cases_logprobs

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("trl", "liger_kernel") else real(name, *a))
    assert cases_logprobs.missing_baselines() == {"trl_selective": "trl", "liger": "liger_kernel"}
    assert "trl_selective" not in cases_logprobs.available_impls()
