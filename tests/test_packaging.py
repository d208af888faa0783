"""fastrl and its kernels must work from an installed wheel, not only from the source tree."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    import fastrl, csrc_triton
    from fastrl import ops, PolicyLossConfig
    assert os.environ["WHEEL_DIR"] in fastrl.__file__, fastrl.__file__
    assert os.environ["WHEEL_DIR"] in csrc_triton.__file__, csrc_triton.__file__
    logp = torch.randn(2, 5)
    old = logp.detach() + 0.1 * torch.randn(2, 5)
    adv = torch.randn(2, 5)
    mask = torch.ones(2, 5)
    for backend in ("torch", "triton"):
        loss, metrics = ops.policy_loss(logp, old, adv, mask, config=PolicyLossConfig.preset("dapo"), backend=backend)
        print(backend, float(loss))
    """
)


def test_wheel_installs_and_runs_an_op(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)],
        check=True,
    )
    wheels = list(dist.glob("fastrl-*.whl"))
    assert len(wheels) == 1, wheels
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheels[0])],
        check=True,
    )
    env = {**os.environ, "PYTHONPATH": str(target), "WHEEL_DIR": str(target), "TRITON_INTERPRET": "1"}
    # Run from an empty folder so the source tree is not importable.
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split() for line in out.stdout.strip().splitlines())
    assert abs(float(lines["torch"]) - float(lines["triton"])) < 1e-5
