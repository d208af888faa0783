"""fastrl and its kernels must work from an installed wheel, not only from the source tree;
the wheel's metadata must say what the README promises; fastrl must run without Triton."""

import os
import re
import subprocess
import sys
import textwrap
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import fastrl

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTION = "fastrl-kernels"

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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)],
        check=True,
    )
    wheels = list(dist.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def wheel_metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(zf.read(name).decode())


def test_wheel_installs_and_runs_an_op(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
    )
    env = {**os.environ, "PYTHONPATH": str(target), "WHEEL_DIR": str(target), "TRITON_INTERPRET": "1"}
    # Run from an empty folder so the source tree is not importable.
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split() for line in out.stdout.strip().splitlines())
    assert abs(float(lines["torch"]) - float(lines["triton"])) < 1e-5


def test_wheel_metadata_name_license_and_triton_only_as_an_extra(wheel):
    meta = wheel_metadata(wheel)
    assert meta["Name"] == DISTRIBUTION and meta["Version"] == fastrl.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    requires = meta.get_all("Requires-Dist")
    triton = [r for r in requires if re.match(r"triton\b", r)]
    # Never a base requirement: a CPU-only install does not pull Triton.
    assert triton and all('extra == "triton"' in r for r in triton), triton
    assert any(re.search(r"triton<3\.\d+,>=3\.\d+|triton>=3\.\d+,<3\.\d+", r) for r in triton), triton
    for extra in ("test", "bench"):
        assert any(r.startswith(f"{DISTRIBUTION}[triton]") and f'extra == "{extra}"' in r for r in requires), extra


def test_version_is_declared_once():
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python >= 3.11")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["version"] == fastrl.__version__
    assert pyproject["project"]["name"] == DISTRIBUTION


# Hides triton as if it were not installed (also from modules that probe for it).
NO_TRITON = textwrap.dedent(
    """
    import importlib.abc, sys

    class NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoTriton())
    """
)

WITHOUT_TRITON = NO_TRITON + textwrap.dedent(
    """
    import torch
    import fastrl
    from fastrl import PolicyLossConfig
    from fastrl.ops import gae, group_advantages, kl_penalty, linear_logprobs, policy_loss, value_loss
    from fastrl._checks import resolve_backend

    torch.manual_seed(0)
    logp = (-torch.rand(2, 6)).requires_grad_()
    mask = torch.ones(2, 6)
    loss, _ = policy_loss(logp, logp.detach() - 0.1, torch.randn(2), mask, ref_logp=logp.detach() + 0.1,
                          config=PolicyLossConfig.preset("grpo"))
    loss.backward()
    kl_penalty(logp, logp.detach() + 0.1, estimator="k3").sum().backward()
    adv, _ = group_advantages(torch.rand(8), torch.arange(8) // 4, mode="grpo")
    gae(torch.rand(2, 6), torch.rand(2, 6), mask, gamma=1.0, lam=0.95)
    h = torch.randn(2, 6, 8, requires_grad=True)
    linear_logprobs(h, torch.randn(40, 8), torch.randint(0, 40, (2, 6))).sum().backward()
    value_loss(torch.randn(2, 6, requires_grad=True), torch.randn(2, 6), torch.randn(2, 6), mask)[0].backward()
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("auto", torch.device("cuda")) == "torch"  # a GPU without triton: the torch path
    try:
        resolve_backend("triton", torch.device("cpu"))
    except ValueError as e:
        assert "triton" in str(e)
    else:
        raise AssertionError("backend='triton' without triton must raise")
    from fastrl.cli import main
    assert main(["env"]) == 0
    assert "triton" not in sys.modules
    print("ran without triton", float(loss), h.grad.abs().sum().item() > 0)
    """
)


def test_fastrl_imports_and_runs_its_torch_paths_without_triton(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ran without triton" in out.stdout and out.stdout.strip().endswith("True")
    triton_line = next(line for line in out.stdout.splitlines() if line.startswith("triton "))
    assert "not installed" in triton_line or "does not import" in triton_line, triton_line


def test_the_blocker_really_hides_triton(tmp_path):
    # Guards the test above: with the blocker in place, `import triton` must fail.
    code = NO_TRITON + "\ntry:\n    import triton\nexcept ModuleNotFoundError:\n    print('hidden')\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "hidden", out.stderr


def _install_hints() -> list[tuple[str, str]]:
    hints = []
    files = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("fastrl/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("benchmarks/*.py")]
    for path in files:
        if path.resolve() == Path(__file__).resolve():
            continue
        for line in path.read_text().splitlines():
            if "pip install" in line:
                hints.append((str(path.relative_to(ROOT)), line))
    return hints


def test_install_hints_name_this_distribution():
    hints = _install_hints()
    assert hints  # the README and the ImportErrors carry hints
    for where, line in hints:
        # `fastrl` on PyPI is an unrelated project: no hint may ask pip for it.
        for command in re.findall(r"pip install([^&;|`]*)", line):
            assert not re.search(r"""(?<![\w.-])fastrl(\[|['"\s]|$)""", command + " "), (where, line)
