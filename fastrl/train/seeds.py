"""How every random stream of a run is seeded, from ``TrainConfig.seed`` and the step.

Each stream's seed is a fixed function of the run's seed, the step and a salt, so a resumed
run draws exactly what the uninterrupted run drew, and (through one seed per prompt) a
prompt's samples do not depend on the world size or on which prompts share a request.
"""

from __future__ import annotations

__all__ = ["prompt_seeds", "rollout_seed", "shuffle_seed"]

RUN_STRIDE = 1_000_003
"""Rollout seeds of runs with neighbouring seeds are this far apart (a prime)."""
STEP_STRIDE = 101
"""... and of neighbouring steps of one run; the salt (dynamic-sampling round) adds 1 per round."""
PROMPT_STRIDE = 65_537
"""A call's per-prompt seeds are ``call_seed * PROMPT_STRIDE + index of the prompt in the whole batch``."""
SHUFFLE_STRIDE = 7919
"""The update's mini-batch shuffle of step ``s``: ``seed * SHUFFLE_STRIDE + s``."""
SEED_MODULUS = 2**31
"""Sampler seeds are kept below this (engines take 32-bit seeds)."""


def rollout_seed(seed: int, step: int, salt: int) -> int:
    """The sampling seed of step ``step``'s rollout round ``salt``."""
    return (seed * RUN_STRIDE + step * STEP_STRIDE + salt) % SEED_MODULUS


def prompt_seeds(call_seed: int | None, first: int, count: int) -> list[int] | None:
    """One seed per prompt of a call whose first prompt is number ``first`` of the whole
    (all-rank) batch; None when the call is unseeded."""
    if call_seed is None:
        return None
    return [call_seed * PROMPT_STRIDE + first + i for i in range(count)]


def shuffle_seed(seed: int, step: int) -> int:
    return seed * SHUFFLE_STRIDE + step
