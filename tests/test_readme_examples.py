"""The README's Python examples (the policy-loss tour, `fastrl train`, the TRL adapter, agent episodes) run verbatim (each in a
fresh interpreter, from an empty working directory)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _blocks(marker: str) -> str:
    text = (REPO / "README.md").read_text()
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        if marker in block:
            return block
    raise AssertionError(f"no README python block contains {marker!r}")


@pytest.mark.parametrize("marker", ["from fastrl.ops import kl_penalty, policy_loss", "from fastrl.train import TrainConfig, Trainer", "def correct(completions, answer, **kwargs)", "from fastrl.agents.driver import"])
def test_readme_example_runs(marker, tmp_path):
    if "correct" in marker:
        pytest.importorskip("trl", reason="TRL is not installed (pip install 'trl>=1.16,<1.17')")
    code = _blocks(marker)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    if "correct" in marker:
        assert proc.stdout.strip().splitlines()[-1] == "None"
