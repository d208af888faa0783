"""The defaults of ``fastrl train --env NAME``: what each built-in environment brings (the
agent counterpart of ``task.DefaultTask``).

``ENV_TASKS`` has one ``EnvTask`` per built-in environment (its keys are
``fastrl.agents.envs.BUILTIN_ENVS``'s): its rows, the limits of its trajectories, the tiny
model and the supervised warm-up on synthetic transcripts (``synthetic_transcripts``) that
make a random model able to call its tool, and the RL settings. ``fastrl.train.config.apply_env_defaults(cfg)``
fills the fields a ``TrainConfig`` left at ``None`` from them; a user's environment
(``module:Class``) gets ``AgentConfig``'s limits and no warm-up.

How the calculator's and sql's values were chosen is in ``docs/agents.md`` (the figures of the runs
behind them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastrl.agents.driver import AgentConfig



__all__ = ["EnvTask", "ENV_TASKS", "USER_ENV_ROWS"]

USER_ENV_ROWS = (256, 32)
"""``(train, held-out)`` rows ``{"index": i}`` of a user's environment run without a ``dataset``."""


@dataclass(frozen=True)
class EnvTask:
    """Defaults of ``fastrl train --env NAME`` for one built-in environment."""

    agent: dict[str, Any]
    """``AgentConfig`` fields that differ from its defaults (the trajectory limits)."""
    num_train: int
    """Training rows (from the environment's seeded row builder)."""
    num_heldout: int
    """Held-out rows (disjoint from the training ones), all evaluated."""
    hidden_size: int = 64
    """Width of the built-in tiny model."""
    layers: int = 4
    """Decoder layers of the built-in tiny model."""
    heads: int = 4
    """Attention heads of the built-in tiny model."""
    sft_max_steps: int = 600
    """Most warm-up steps on the oracle's transcripts (teacher-forced on the policy turns)."""
    sft_target_accuracy: float = 0.3
    """The warm-up stops once greedy episodes on training rows succeed this often: GRPO needs
    groups that are sometimes right, and the rise after it is RL's."""
    sft_check_every: int = 10
    """Warm-up steps between probes: the success rate climbs fast once the tool call is learnt
    (calculator: from under 0.3 to 0.78 within 50 steps), so a coarse check overshoots the target
    (``TrainConfig.sft_probe_sooner`` probes sooner near it; measured in docs/agents.md)."""
    sft_lr: float = 3e-3
    """Warm-up AdamW learning rate."""
    sft_batch_size: int = 64
    """Transcripts per warm-up step."""
    sft_warmup_steps: int = 20
    """Linear learning-rate warm-up of the supervised stage."""
    sft_answer_weight: float = 1.0
    """Loss weight of a transcript's answer turn relative to its tool calls (``TrainConfig.sft_answer_weight``)."""
    lr: float = 5e-4
    """RL AdamW learning rate."""


ENV_TASKS: dict[str, EnvTask] = {
    # 59 tokens for an oracle transcript (prompt, calc call, result, answer) in the character tokenizer
    "calculator": EnvTask(agent=dict(max_turns=3, max_turn_tokens=24, max_trajectory_tokens=128, max_observation_tokens=16),
                          num_train=2000, num_heldout=100),
    # ~180 tokens for an oracle transcript (the schema line and question, one query of up to 84
    # characters, its result, the answer); the default 150 RL steps (~2 s each on two threads, the query's
    # ~60-85 decode steps per trajectory): 456-490 s wall a run over 3 seeds, the warm-up's batches run as tries (662-685 s
    # padded, docs/agents.md). The warm-up stops at 0.5, so that GRPO's groups of 8 sampled queries are right often
    # enough to learn from: at 0.4 one seed in three (seed 1) started from a policy RL did not move, with GRPO and
    # with GiGPO; at 0.5 held-out success rose on seeds 1 and 2 (+35/-2, +22/-1) and seed 0 (from 0.80) by +9/-2,
    # and on three fresh seeds, 3-5, by +16/-1, +13/-1, +33/-1 (460-528 s).
    # Width 128 (head dimension 32): at 64 the policy copied the query's result with a wrong last digit
    # (14 -> 15, 324 -> 325) and RL hardly moved it (docs/agents.md)
    "sql": EnvTask(agent=dict(max_turns=3, max_turn_tokens=96, max_trajectory_tokens=256, max_observation_tokens=48),
                   num_train=1000, num_heldout=100, sft_target_accuracy=0.5, hidden_size=128),
    # a 4x4 grid per observation; up to 6 moves
    "frozenlake": EnvTask(agent=dict(max_turns=6, max_turn_tokens=8, max_trajectory_tokens=320, max_observation_tokens=48),
                          num_train=1000, num_heldout=50),
}
