"""Did a run's held-out success change, row by row? The paired view of two evaluations.

Two evaluations of one run score the same held-out rows, so their difference is read from the
rows that changed: ``gained`` (failed before, succeed after) and ``lost`` (the reverse). Under
"no change" each changed row is a fair coin, so the exact two-sided McNemar test is a binomial
test on ``gained`` of ``gained + lost`` rows at 1/2. Rows that stayed the same carry no
information on the change, which is why this is sharper than comparing two success rates as
independent samples (a difference of two rates near 0.5 on 100 rows has a standard error of
0.07 however few rows moved).

The trainer logs each evaluation's per-row success (``row_success`` in ``metrics.jsonl``'s
eval records); ``benchmarks/env_train_seeds.py`` compares a run's first and last.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb
from typing import Sequence

__all__ = ["PairedChange", "paired_change"]


@dataclass(frozen=True)
class PairedChange:
    """Rows that flipped between two evaluations of the same rows, and how surprising that is."""

    gained: int
    """Rows that failed in the first evaluation and succeed in the second."""
    lost: int
    """Rows that succeeded in the first and fail in the second."""
    rows: int
    """Rows evaluated (both times)."""
    p_value: float
    """Exact two-sided McNemar p-value: the chance of a split at least this uneven among
    ``gained + lost`` changed rows if each were a fair coin (1.0 when none changed)."""

    @property
    def change(self) -> float:
        """The change in the success rate, ``(gained - lost) / rows``."""
        return (self.gained - self.lost) / self.rows if self.rows else 0.0


def paired_change(before: Sequence[int], after: Sequence[int]) -> PairedChange:
    """The paired change from ``before`` to ``after``: per-row successes (0/1 or bools) of the
    same rows in the same order."""
    if len(before) != len(after):
        raise ValueError(f"before and after must score the same rows: {len(before)} vs {len(after)} rows")
    gained = sum(1 for b, a in zip(before, after) if not b and a)
    lost = sum(1 for b, a in zip(before, after) if b and not a)
    return PairedChange(gained=gained, lost=lost, rows=len(before), p_value=_mcnemar_exact(gained, lost))


def _mcnemar_exact(gained: int, lost: int) -> float:
    n = gained + lost
    if n == 0:
        return 1.0
    tail = sum(comb(n, k) for k in range(min(gained, lost) + 1)) / 2**n  # P(X <= min), X ~ Binomial(n, 1/2)
    return min(1.0, 2 * tail)
