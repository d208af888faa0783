"""Scoring an agent run's trajectories (``fastrl train --env X --rewards f1 f2``): the
environment's outcome reward combined with the run's reward functions, each given the whole
trajectory -- the agent counterpart of ``score.GroupScorer``.

**What a reward function receives.** TRL's signature, one entry per trajectory; the functions
run in the reward pool's worker processes (``rewards.RewardPool``: time limits, failures
counted, never raising into the step), on chunks of the step's trajectories:

- ``prompts[i]``: the trajectory's prompt, the environment's first observation: a list of
  ``{"role", "content"}`` messages (TRL's conversational prompt);
- ``completions[i]``: the rest of its transcript in order (``trajectory_completion``): each
  policy turn as ``{"role": "assistant", "content": <its decoded text>}`` and the
  environment's observation messages between them, as the model saw them (cut to
  ``max_observation_tokens``) -- TRL's conversational completion of a multi-turn rollout.
  The built-in rewards read its last assistant message (``rewards.completion_text``);
- ``completion_ids[i]``: the trajectory's policy tokens, every turn's sampled ids in order
  (no prompt or environment tokens);
- the row's fields, as a dataset's columns (every key of the trajectory's row; ``prompt`` is
  dropped, as TRL does), and ``TRAJECTORY_COLUMNS``: ``env_reward`` (the environment's outcome
  reward), ``turn_rewards`` (its per-turn rewards, a list) and ``stop_reason``. A row field of
  one of those names is an ``InputError`` before the first step.

**The rule.** A trajectory's reward (what the advantages see, ``reward/mean``) is

    env_reward_weight * outcome + sum_i reward_weights[i] * f_i(trajectory)

taken in float64 (a failed or ``None`` value counts 0, the pool's rule; a total beyond
float32's range is 0 and counted in ``reward/non_finite_total``). Without ``--rewards`` it is
``env_reward_weight * outcome`` (the outcome itself by default). A trajectory whose environment
failed (hung, crashed, raised: ``Trajectory.error``) scores 0 and the functions are not called
on it: its text says nothing about the policy (with ``failed_trajectories=mask`` it leaves the
loss anyway).

**Metrics** (``score``): ``reward/env/mean`` and ``/std`` (the environment's outcome over the
step's trajectories), the pool's ``reward/<function>/mean``, ``/std``, failure counts and
``reward/seconds`` (over the trajectories the functions scored). A function named ``env`` is
logged as ``env_2``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

from fastrl.agents.trajectory import Trajectory
from fastrl.errors import InputError

if TYPE_CHECKING:
    from fastrl.train.rewards.pool import RewardPool


__all__ = ["ENV_REWARD", "TRAJECTORY_COLUMNS", "TrajectoryScores", "TrajectoryScorer", "policy_ids", "reward_names",
           "trajectory_prompt", "trajectory_completion"]

ENV_REWARD = "env"
"""The environment's outcome reward's name in the metrics (``reward/env/mean``)."""
TRAJECTORY_COLUMNS = ("env_reward", "turn_rewards", "stop_reason")
"""Keyword arguments a reward function gets about the trajectory itself (beyond the row's fields)."""
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_NON_FINITE = "reward/non_finite_total"


def _first_policy_message(trajectory: Trajectory) -> int:
    """Index in ``trajectory.messages`` of its first policy turn: the driver appends one
    assistant message per policy turn (``turns`` of them, after the first observation), so it
    is the ``turns``-th assistant message from the end (a first observation may hold assistant
    messages of its own, e.g. few-shot turns)."""
    assistant = [k for k, m in enumerate(trajectory.messages) if m.get("role") == "assistant"]
    if trajectory.turns == 0:
        return len(trajectory.messages)
    return assistant[len(assistant) - trajectory.turns]


def trajectory_prompt(trajectory: Trajectory) -> list[dict]:
    """The messages of the trajectory's first observation."""
    return [dict(m) for m in trajectory.messages[: _first_policy_message(trajectory)]]


def trajectory_completion(trajectory: Trajectory) -> list[dict]:
    """Its policy turns (assistant messages) and the observations between them, in order."""
    return [dict(m) for m in trajectory.messages[_first_policy_message(trajectory):]]


def policy_ids(trajectory: Trajectory) -> list[int]:
    """Every policy turn's sampled ids, in order (over all samples of a split trajectory)."""
    return [token for sample in trajectory.samples for s in sample.segments if s.role == "policy"
            for token in sample.token_ids[s.start:s.end]]


def reward_names(specs: Sequence[Any]) -> list[str]:
    """The functions' metric names (``rewards.resolve_reward``'s), ``env`` kept for the environment."""
    from fastrl.train.rewards import resolve_reward

    names = [resolve_reward(spec)[0] for spec in specs]
    return [f"{ENV_REWARD}_2" if name == ENV_REWARD else name for name in names]


@dataclass
class TrajectoryScores:
    """One step's rewards, one per trajectory (in the step's trajectory order)."""

    rewards: torch.Tensor
    """``[N]`` float32: the combined reward (module docstring)."""
    env_rewards: torch.Tensor
    """``[N]`` float32: the environment's outcome rewards."""
    per_function: dict[str, torch.Tensor] = field(default_factory=dict)
    """name -> ``[N]`` float32 raw values of that function (0 where it failed, gave ``None``
    or was not called: a failed environment)."""
    metrics: dict[str, float] = field(default_factory=dict)


class TrajectoryScorer:
    """``score(trajectories)``: the combined rewards (module docstring). ``rewards``: the run's
    ``RewardPool``, or None (no ``--rewards``: the environment's outcome alone)."""

    def __init__(self, *, rewards: RewardPool | None, env_weight: float):
        self.rewards = rewards
        self.env_weight = float(env_weight)

    def columns(self, rows: Sequence[dict], extra: dict[str, list]) -> dict[str, list]:
        """The rows' fields (every key any row has; ``None`` where a row lacks it) and ``extra``."""
        keys = list(dict.fromkeys(k for row in rows for k in row))
        clash = [k for k in keys if k in TRAJECTORY_COLUMNS]
        if clash:
            raise InputError(f"the environment's rows have a field {clash[0]!r}, which the agent reward functions get "
                             f"about the trajectory itself ({', '.join(TRAJECTORY_COLUMNS)}): rename it")
        return {**{k: [row.get(k) for row in rows] for k in keys}, **extra}

    def validate(self, *, prompt: list[dict], row: dict) -> None:
        """Check every function on a real row's first observation with a stand-in trajectory
        (one empty policy turn) before the first step (``RewardPool.validate``)."""
        if self.rewards is None:
            return
        extra = {"env_reward": [0.0], "turn_rewards": [[0.0]], "stop_reason": ["answer"]}
        self.rewards.validate([prompt], [[{"role": "assistant", "content": ""}]], self.columns([row], extra),
                              completion_ids=[[]])

    def score(self, trajectories: Sequence[Trajectory]) -> TrajectoryScores:
        n = len(trajectories)
        env = torch.tensor([t.outcome_reward for t in trajectories], dtype=torch.float64)
        total = self.env_weight * env
        metrics: dict[str, float] = {f"reward/{ENV_REWARD}/mean": float(env.mean()) if n else 0.0,
                                     f"reward/{ENV_REWARD}/std": float(env.std(unbiased=False)) if n else 0.0}
        per_function: dict[str, torch.Tensor] = {}
        failed = torch.tensor([bool(t.error) for t in trajectories], dtype=torch.bool)
        if self.rewards is not None:
            scored = [t for t in trajectories if not t.error]
            extra = {"env_reward": [t.outcome_reward for t in scored], "turn_rewards": [list(t.turn_rewards) for t in scored],
                     "stop_reason": [t.stop_reason for t in scored]}
            result = self.rewards.score([trajectory_prompt(t) for t in scored], [trajectory_completion(t) for t in scored],
                                        completion_ids=[policy_ids(t) for t in scored],
                                        columns=self.columns([t.row for t in scored], extra))
            where = (~failed).nonzero().flatten()
            summed = torch.zeros(n, dtype=torch.float64)
            summed[where] = result.rewards.double()  # the pool's weighted sum (0 where every function failed)
            total = total + summed
            for name, values in result.per_function.items():
                per_function[name] = torch.zeros(n, dtype=torch.float32).index_copy_(0, where, values.float())
            metrics.update({k: v for k, v in result.metrics.items() if k != _NON_FINITE})
            metrics[_NON_FINITE] = result.metrics.get(_NON_FINITE, 0.0)
        total[failed] = 0.0
        overflow = ~(torch.isfinite(total) & (total.abs() <= _FLOAT32_MAX))
        total[overflow] = 0.0
        metrics[_NON_FINITE] = metrics.get(_NON_FINITE, 0.0) + float(overflow.sum())
        return TrajectoryScores(rewards=total.float(), env_rewards=env.float(), per_function=per_function, metrics=metrics)
