"""Every code block of README.md and docs/*.md is executed or checked:

- every ```python block runs verbatim, each in a fresh interpreter from an empty working
  directory (a block whose top-level imports need a package that is not installed is
  skipped, naming it; CI installs them all); the examples that train assert that their
  printed number moved;
- every `fastrl ...` command line of a ```bash block (and `torchrun ... -m fastrl.cli ...`)
  parses with today's command line (options, spelling, values), without running it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _blocks(language: str) -> list[tuple[str, int, str]]:
    out = []
    for page in PAGES:
        for i, block in enumerate(re.findall(rf"```{language}\n(.*?)```", page.read_text(), flags=re.S)):
            out.append((str(page.relative_to(REPO)), i, block))
    return out


PYTHON_BLOCKS = _blocks("python")
BASH_BLOCKS = _blocks("bash")


def _missing_imports(code: str) -> list[str]:
    names = re.findall(r"^(?:from|import) ([A-Za-z_][\w]*)", code, flags=re.M)
    return sorted({n for n in names if importlib.util.find_spec(n) is None})


def _learning_figures(stdout: str) -> tuple[float, float] | None:
    """(before, after) of a line `... A -> ... B` that a training example prints."""
    match = re.search(r"(\d+\.\d+)\s*->\D*?(\d+\.\d+)", stdout)
    return (float(match.group(1)), float(match.group(2))) if match else None


@pytest.mark.parametrize("page, index, code", PYTHON_BLOCKS, ids=[f"{p}#{i}" for p, i, _ in PYTHON_BLOCKS])
def test_python_block_runs(page, index, code, tmp_path):
    missing = _missing_imports(code)
    if missing:
        pytest.skip(f"{page} block {index} needs {', '.join(missing)}, not installed here")
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    if ".train()" in code:  # an example that trains shows a number moving, and the right way
        figures = _learning_figures(proc.stdout)
        assert figures is not None, f"{page} block {index} trains but prints no 'before -> after' figure:\n{proc.stdout}"
        before, after = figures
        assert after > before, f"{page} block {index}: {before} -> {after} did not improve"
    if "fastrl_fallback_reason" in code:
        assert proc.stdout.strip().splitlines()[-1] == "None"


def _command_lines(block: str) -> list[list[str]]:
    """The fastrl command lines of a bash block (continuations joined, comments and `&&` tails cut)."""
    text = block.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        for part in re.split(r"&&|\|", line):
            words = shlex.split(part, comments=True)
            if not words:
                continue
            if words[0] == "fastrl":
                out.append(words[1:])
            elif words[0] == "torchrun" and "fastrl.cli" in words:
                out.append(words[words.index("fastrl.cli") + 1:])
    return out


COMMANDS = [(page, i, argv) for page, i, block in BASH_BLOCKS for argv in _command_lines(block)]


def test_the_pages_show_commands():
    assert len(COMMANDS) >= 20 and any(argv[:1] == ["plan"] for _, _, argv in COMMANDS)


@pytest.mark.parametrize("page, index, argv", COMMANDS, ids=[f"{p}#{i}:{' '.join(a)[:40]}" for p, i, a in COMMANDS])
def test_every_documented_command_line_parses(page, index, argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text("steps: 10\n")  # the pages' `--config run.yaml`
    from fastrl.cli import build_parser
    from fastrl.train.cli import build_train_parser, expand_sampler_url
    from fastrl.commands.compare import build_compare_parser

    if "--help" in argv or "--version" in argv:  # these print and exit: that they exit 0 is checked
        with pytest.raises(SystemExit) as e:
            from fastrl.cli import main

            main(argv)
        assert e.value.code == 0
    elif argv and argv[0] == "train":
        build_train_parser().parse_args(expand_sampler_url(argv[1:]))
    elif argv and argv[0] == "compare":
        build_compare_parser().parse_known_args(argv[1:])
    else:
        build_parser().parse_args(argv)


# The README's `fastrl train` commands run in the order it shows them, each made tiny by the
# same overrides (a 1-layer, 32-wide model, a 2-step warm-up, 1 RL step of 2 prompts, no
# evaluation, small row sets: the sequence is about where each run writes, not what it learns).
# Skipped: the lines that need the user's own files (--model ./my-model, --config run.yaml)
# and --help (checked above).
README_SEQUENCE_OVERRIDES = ["--model_hidden_size", "32", "--model_layers", "1", "--sft_steps", "2", "--steps", "1",
                             "--eval_every", "0", "--prompts_per_step", "2", "--task_train_size", "40", "--task_eval_size", "8",
                             "--progress", "false", "--tensorboard", "false", "--reward_workers", "0"]


def _readme_train_sequence() -> list[list[str]]:
    lines = [argv for page, _, argv in COMMANDS if page == "README.md" and argv[:1] == ["train"]]
    return [argv for argv in lines if not {"--help", "--model", "--config"} & set(argv)]


def test_the_readme_train_commands_run_one_after_another(tmp_path, monkeypatch):
    """Each README `fastrl train` command, in order, from one working directory: none collides
    with the output folder of one before it (issue 39: `fastrl train --env calculator` after
    `fastrl train` used to find runs/fastrl taken)."""
    from fastrl.cli import main

    monkeypatch.chdir(tmp_path)
    sequence = _readme_train_sequence()
    assert ["train"] in sequence and ["train", "--env", "calculator"] in sequence, sequence
    for argv in sequence:
        assert main([*argv, *README_SEQUENCE_OVERRIDES]) == 0, argv
    folders = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert "default" in folders and "calculator" in folders, folders
