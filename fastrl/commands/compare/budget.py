"""A comparison's budget: what every run may spend (RL steps, seconds of RL steps or generated
tokens), parsed from ``--budget``, checked to hold one step, and turned into ``TrainConfig`` fields."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fastrl.commands.compare.defaults import HYBRID, CompareError
from fastrl.train.config import TrainConfig

STEP_CAP = 1_000_000
"""``steps`` of a run whose budget is seconds or tokens (the budget stops it): the cosine
schedule over this many steps keeps the learning rate at its peak for the whole run."""
MIN_SECONDS = 5.0
"""Shortest time budget accepted: every run takes at least one step (the budget is checked
after each step), and a budget under a few seconds cannot hold one step on any machine."""


@dataclass(frozen=True)
class Budget:
    """What every run may spend: RL ``steps``, ``seconds`` of RL steps, or generated ``tokens``."""

    kind: str
    """``steps``, ``seconds`` or ``tokens``."""
    amount: float
    """How many steps, seconds or generated completion tokens."""
    text: str
    """As the user wrote it."""

    def describe(self) -> str:
        if self.kind == "steps":
            return f"{int(self.amount)} RL steps per run"
        if self.kind == "tokens":
            return f"{int(self.amount):,} generated tokens per run"
        return f"{self.amount:g} s of RL steps per run (evaluation not counted)"

    def split(self, fraction: float) -> tuple["Budget", "Budget"]:
        """Two budgets summing to this one: ``fraction`` of it, then the rest (whole steps/tokens)."""
        if self.kind == "seconds":
            first = self.amount * fraction
        else:
            first = float(max(1, min(int(self.amount) - 1, round(self.amount * fraction))))
        return Budget(self.kind, first, self.text), Budget(self.kind, self.amount - first, self.text)

    def train_fields(self, *, steps_cap: int | None) -> dict[str, Any]:
        """The ``TrainConfig`` fields that make a run spend exactly this budget."""
        if self.kind == "steps":
            return {"steps": int(self.amount)}
        cap = steps_cap if steps_cap is not None else STEP_CAP
        if self.kind == "tokens":
            return {"steps": cap, "max_generated_tokens": int(self.amount)}
        return {"steps": cap, "max_seconds": float(self.amount)}


_TIME_UNITS = {"h": 3600.0, "m": 60.0, "min": 60.0, "s": 1.0, "sec": 1.0}
_SIZE_SUFFIX = {"": 1, "k": 1_000, "m": 1_000_000}


def parse_budget(text: str) -> Budget:
    """``200-steps`` | ``50k-tokens`` (also ``1.5M-tokens``, ``50000-tokens``) | ``10m``,
    ``90s``, ``1h30m``, ``2.5min`` -> ``Budget``; anything else is a ``CompareError``."""
    s = str(text).strip().lower()
    m = re.fullmatch(r"(\d+)\s*-?\s*steps?", s)
    if m:
        return Budget("steps", float(int(m.group(1))), text)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([km]?)\s*-?\s*tokens?", s)
    if m:
        amount = float(m.group(1)) * _SIZE_SUFFIX[m.group(2)]
        if amount != int(amount):
            raise CompareError(f"--budget {text!r}: a token budget is a whole number of tokens")
        return Budget("tokens", amount, text)
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*(min|sec|h|m|s)", s)
    if parts and re.fullmatch(r"(?:\d+(?:\.\d+)?\s*(?:min|sec|h|m|s)\s*)+", s):
        return Budget("seconds", sum(float(n) * _TIME_UNITS[u] for n, u in parts), text)
    raise CompareError(
        f"--budget {text!r} is not a budget: write N-steps (200-steps), N-tokens (50k-tokens, 1.5M-tokens) "
        "or a wall time (10m, 90s, 1h30m)"
    )


def tokens_per_step(cfg: TrainConfig) -> int:
    """Most completion tokens one step generates (one sampling round; DAPO may add rounds)."""
    if cfg.prompt_token_budget is not None:
        # the batcher packs (prompt + max_new_tokens) x group_size per prompt up to the budget
        return int(cfg.prompt_token_budget)
    return cfg.prompts_per_step * cfg.group_size * cfg.max_new_tokens


def check_budget_fits(budget: Budget, cfg: TrainConfig | None, *, phases: int = 1) -> None:
    """CompareError when ``budget`` cannot hold one step in each of ``phases`` phases
    (``grpo_then_ppo`` has two); ``cfg`` is a resolved run configuration (needed for a token
    budget only)."""
    per = f" ({phases} phases of {HYBRID} need one step each)" if phases > 1 else ""
    if budget.kind == "steps" and budget.amount < phases:
        raise CompareError(f"--budget {budget.text!r} is too small for one step{per}")
    if budget.kind == "tokens" and cfg is not None:
        one = tokens_per_step(cfg)
        if budget.amount < phases * one:
            raise CompareError(
                f"--budget {budget.text!r} is too small for one step{per}: one step generates up to {one:,} tokens "
                f"(prompts_per_step {cfg.prompts_per_step} x group_size {cfg.group_size} x max_new_tokens "
                f"{cfg.max_new_tokens}); give at least {phases * one:,} tokens"
            )
    if budget.kind == "seconds" and budget.amount < phases * MIN_SECONDS:
        raise CompareError(f"--budget {budget.text!r} is too small for one step{per}: give at least {phases * MIN_SECONDS:g} s")
