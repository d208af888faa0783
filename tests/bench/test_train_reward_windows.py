"""benchmarks/train_reward_windows.py: first/last-window means of a run's sampled reward, evaluations
and steps without the keys left out, and a run too short for two windows refused."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("train_reward_windows", ROOT / "benchmarks" / "train_reward_windows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_run(directory: Path, rewards: list[float]) -> Path:
    directory.mkdir()
    lines = []
    for step, reward in enumerate(rewards, start=1):
        lines.append({"step": step, "reward/mean": reward, "groups/frac_all_equal": 1.0 - reward})
        if step % 2 == 0:  # an evaluation between steps: its accuracy must not count as a step
            lines.append({"step": step, "event": "eval", "eval/accuracy": 0.99, "reward/mean": 5.0})
    lines.insert(0, {"step": 0, "time": 0.0})  # a row without the keys (e.g. a warm-up record)
    (directory / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return directory


def test_windows_are_the_first_and_last_steps_means(tmp_path):
    windows = _module().windows
    run = _write_run(tmp_path / "seed0", [0.0, 0.2, 0.4, 0.5, 0.6, 1.0])
    got = windows(run, window=2)
    assert got["rl_steps"] == 6
    assert got["reward/mean"] == pytest.approx([0.1, 0.8])
    assert got["groups/frac_all_equal"] == pytest.approx([0.9, 0.2])


def test_a_run_shorter_than_two_windows_is_refused(tmp_path):
    run = _write_run(tmp_path / "short", [0.1, 0.2, 0.3])
    with pytest.raises(SystemExit, match="fewer than two windows"):
        _module().windows(run, window=2)


def test_main_writes_its_command_and_each_run(tmp_path):
    module = _module()
    runs = [_write_run(tmp_path / f"seed{s}", [0.1 * s] * 4) for s in range(2)]
    out = tmp_path / "out.json"
    assert module.main([*map(str, runs), "--window", "2", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["window"] == 2 and set(payload["runs"]) == {"seed0", "seed1"}
    assert payload["command"].startswith("python benchmarks/train_reward_windows.py ") and "--window 2" in payload["command"]
    assert payload["runs"]["seed1"]["reward/mean"] == pytest.approx([0.1, 0.1])
