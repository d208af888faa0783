"""Prose figures come from results files like the tables do (benchmarks/render_tables.py's
``<!-- figure:NAME -->`` markers), so a sentence of figures cannot drift from its JSON."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def render_tables():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import render_tables
    finally:
        sys.path.pop(0)
    return render_tables


def test_a_stale_figure_is_rewritten_and_rendering_is_idempotent(render_tables):
    page = "Before. <!-- figure:calculator_seed0 -->180 steps, 0.27 -> 0.83, 140 s<!-- /figure --> After.\n"
    rendered = render_tables.render(page)
    assert "180 steps" not in rendered and rendered.startswith("Before. <!-- figure:calculator_seed0 -->")
    assert rendered.endswith("<!-- /figure --> After.\n") and render_tables.render(rendered) == rendered
    with pytest.raises(KeyError):
        render_tables.render("<!-- figure:no_such --><!-- /figure -->")


def test_the_calculator_account_is_the_readme_tables_run(render_tables):
    """docs/agents.md's seed-0 sentence and the README table read the same run."""
    text = render_tables.calculator_seed0()
    run = render_tables._load(render_tables.ENV_SEED_FILES[0])["runs"]["0"]
    assert f"after {run['sft_steps']:.0f} steps" in text and f"**{run['eval'][0]['accuracy']:.2f} after the warm-up" in text
    assert f"{run['wall_seconds']:.0f} s wall" in (ROOT / "docs" / "agents.md").read_text()
