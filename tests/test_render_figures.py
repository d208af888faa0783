"""Prose figures come from results files like the tables do (benchmarks/render_tables.py's
``<!-- figure:NAME -->`` markers, rendered by benchmarks/figures.py), so a sentence of figures
cannot drift from its JSON."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def modules():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import figures
        import render_tables
    finally:
        sys.path.pop(0)
    return render_tables, figures


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_a_stale_figure_is_rewritten_and_rendering_is_idempotent(modules):
    render_tables, _ = modules
    page = "Before. <!-- figure:calculator_seed0 -->180 steps, 0.27 -> 0.83, 140 s<!-- /figure --> After.\n"
    rendered = render_tables.render(page)
    assert "180 steps" not in rendered and rendered.startswith("Before. <!-- figure:calculator_seed0 -->")
    assert rendered.endswith("<!-- /figure --> After.\n") and render_tables.render(rendered) == rendered
    with pytest.raises(KeyError):
        render_tables.render("<!-- figure:no_such --><!-- /figure -->")


def test_every_marker_in_the_docs_names_a_known_table_or_figure_and_every_figure_is_used(modules):
    render_tables, figures = modules
    text = "\n".join(page.read_text() for page in _pages())
    tables = re.findall(r"<!-- table:([a-z_0-9]+) -->", text)
    shown = re.findall(r"<!-- figure:([a-z_0-9]+) -->", text)
    assert tables and shown
    assert set(tables) <= set(render_tables.TABLES), set(tables) - set(render_tables.TABLES)
    assert set(shown) <= set(figures.FIGURES), set(shown) - set(figures.FIGURES)
    assert set(figures.FIGURES) <= set(shown), f"figures no page shows: {set(figures.FIGURES) - set(shown)}"
    assert text.count("<!-- /figure -->") == len(shown)  # every figure is closed, none nested
    # every marker is one the renderer finds (a name it cannot parse would be left as written, unchecked)
    assert len(render_tables.MARKER.findall(text)) == len(tables) == text.count("<!-- /table -->")
    assert len(render_tables.FIGURE.findall(text)) == len(shown)


def test_the_calculator_account_is_the_readme_tables_run(modules):
    """docs/agents.md's seed-0 sentence and the README table read the same run."""
    render_tables, figures = modules
    text = figures.calculator_seed0()
    run = render_tables._load(render_tables.ENV_SEED_FILES[0])["runs"]["0"]
    assert f"after {run['sft_steps']:.0f} steps" in text and f"**{run['eval'][0]['accuracy']:.2f} after the warm-up" in text
    assert f"{run['wall_seconds']:.0f} s wall" in (ROOT / "docs" / "agents.md").read_text()


def test_the_pooled_mcnemar_p_value_is_the_exact_binomial_one(modules):
    _, figures = modules
    # +9 / -2: 2 * (C(11,0) + C(11,1) + C(11,2)) / 2**11 = 2 * 67 / 2048, as fastrl.commands.paired logged for sql seed 0
    assert figures._mcnemar(9, 2) == pytest.approx(134 / 2048)
    assert figures._mcnemar(0, 2) == pytest.approx(0.5) and figures._mcnemar(5, 5) == 1.0 and figures._mcnemar(0, 0) == 1.0


def test_a_span_collapses_when_its_ends_agree(modules):
    _, figures = modules
    assert figures._span([456.1, 489.6, 470.3], unit=" s") == "456-490 s"
    assert figures._span([2.03, 2.04], ".1f", " s") == "2.0 s"
