"""The documentation site builds with `mkdocs build --strict` (every page, every link, the API
reference generated from the docstrings), its tables agree with benchmarks/results/*.json,
and what the pages say about the install matches pyproject.toml."""

from __future__ import annotations

import re
import subprocess
import sys

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    pytest.importorskip("mkdocstrings_handlers.python", reason="mkdocstrings-python is not installed")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={"NO_MKDOCS_2_WARNING": "1",
                                                                                        **__import__("os").environ})
    assert proc.returncode == 0, proc.stderr[-4000:]
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    assert "fused_linear_policy_loss" in reference and "TrainConfig" in reference  # generated from the code
    assert "digits" in (tmp_path / "site" / "integrations" / "index.html").read_text()  # the README's TRL example


def test_tables_agree_with_the_results_json():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "render_tables.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    names = {m for p in pages for m in re.findall(r"<!-- table:([a-z_]+) -->", p.read_text())}
    assert {"headline", "default_train_seeds", "compare_default", "benchmarks_cpu"} <= names


def test_a_changed_result_makes_the_check_fail(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import render_tables
    finally:
        sys.path.pop(0)
    page = "<!-- table:default_train_seeds -->\n| stale |\n<!-- /table -->\n"
    rendered = render_tables.render(page)
    assert rendered != page and "| stale |" not in rendered
    assert render_tables.render(rendered) == rendered  # rendering is idempotent
    with pytest.raises(KeyError):
        render_tables.render("<!-- table:no_such -->\n<!-- /table -->")


def test_the_dev_extra_is_described_as_pyproject_defines_it():
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python >= 3.11")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dev = extras["dev"]
    included = re.match(r"fastrl-kernels\[(.*)\]", dev[0]).group(1)
    described = re.search(r"<!-- dev-extra -->(.*?)<!-- /dev-extra -->", (ROOT / "docs" / "install.md").read_text()).group(1)
    assert f"`dev` (= `{included}`" in described
    assert all(f"`{pkg}`" in described for pkg in dev[1:])


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
