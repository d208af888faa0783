"""The paired change between two evaluations of the same held-out rows (fastrl.commands.paired),
against hand-computed exact McNemar p-values."""

from __future__ import annotations

from math import comb

import pytest

from fastrl.commands.paired import paired_change


def test_counts_only_the_rows_that_changed():
    before = [0, 0, 1, 1, 0, 1]
    after = [1, 0, 1, 0, 1, 1]
    c = paired_change(before, after)
    assert (c.gained, c.lost, c.rows) == (2, 1, 6)
    assert c.change == pytest.approx(1 / 6)
    # 2 vs 1 of 3 changed rows: P(X <= 1) = (1 + 3) / 8, two-sided 1.0
    assert c.p_value == 1.0


@pytest.mark.parametrize(("gained", "lost", "p"), [
    (5, 0, 2 / 2**5),                                            # 0.0625: five of five is not enough at 0.05
    (10, 2, 2 * (comb(12, 0) + comb(12, 1) + comb(12, 2)) / 2**12),  # 158 / 4096 = 0.0386
    (0, 10, 2 / 2**10),                                          # symmetric: a loss is as surprising
    (7, 7, 1.0),
    (0, 0, 1.0),                                                 # nothing changed: no evidence of change
])
def test_exact_two_sided_p_values(gained, lost, p):
    before = [0] * gained + [1] * lost + [1] * 3 + [0] * 4  # 7 rows that did not change
    after = [1] * gained + [0] * lost + [1] * 3 + [0] * 4
    c = paired_change(before, after)
    assert (c.gained, c.lost) == (gained, lost)
    assert c.p_value == pytest.approx(p, rel=1e-12)


def test_many_rows_that_stay_put_do_not_dilute_the_evidence():
    # the same 12 flips among 12 or 1000 rows: the same p-value (the unpaired view would not say so)
    small = paired_change([0] * 10 + [1] * 2, [1] * 10 + [0] * 2)
    large = paired_change([0] * 10 + [1] * 2 + [1] * 500 + [0] * 488, [1] * 10 + [0] * 2 + [1] * 500 + [0] * 488)
    assert small.p_value == large.p_value < 0.05


def test_bools_count_like_ints():
    assert paired_change([False, True], [True, True]) == paired_change([0, 1], [1, 1])


def test_different_row_counts_are_an_error():
    with pytest.raises(ValueError, match="same rows: 3 vs 2"):
        paired_change([0, 1, 1], [1, 1])
