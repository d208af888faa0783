"""Held-out evaluation of an agent run: one greedy episode per held-out row.

The structure of ``evaluate.HeldOutEvaluator`` (the run's sampler, a seed per row, each rank
a share of the rows, gathered in row order) with episodes instead of completions. A
trajectory succeeds when its outcome reward reaches ``evaluate.SUCCESS_THRESHOLD`` (one rule
for both). Metrics: ``eval/accuracy`` (the success rate), ``eval/reward_mean`` (outcome),
``eval/tool_call_rate`` (share of trajectories with at least one tool call),
``eval/turns_mean``, ``time/eval``, and with a ``scorer`` that has reward functions (``--rewards``)
``eval/reward/<name>``: each function's mean over the held-out trajectories (its raw value, as
``agent.score.TrajectoryScorer`` gives it: 0 where it failed or the environment did). Success
stays the environment's outcome; the functions only add figures.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import torch

from fastrl.agents.driver import AgentConfig
from fastrl.agents.render import ChatRenderer
from fastrl.rollout.base import SamplingConfig
from fastrl.train import seeds
from fastrl.train.agent.collect import play_episodes
from fastrl.train.evaluate import EVAL_SEED_OFFSET, succeeded

if TYPE_CHECKING:
    from fastrl.agents.runtime import EnvRuntime
    from fastrl.rollout.base import GroupSampler
    from fastrl.train.agent.score import TrajectoryScorer
    from fastrl.train.ranks import Ranks


__all__ = ["AgentEvaluator", "EVAL_ROWS_PER_CALL"]

EVAL_ROWS_PER_CALL = 128
"""Held-out rows played together (one ``run_episodes`` call)."""


class AgentEvaluator:
    """``evaluator()`` -> the ``eval/...`` metrics of greedy episodes on ``rows`` (module docstring);
    ``success_rate(rows)`` for the warm-up's probe on training rows."""

    def __init__(self, *, sampler: GroupSampler, ranks: Ranks, rows: Sequence[dict], runtime: EnvRuntime, renderer: ChatRenderer,
                 agent: AgentConfig, seed: int, scorer: TrajectoryScorer | None = None):
        self.sampler, self.ranks, self.rows = sampler, ranks, list(rows)
        self.scorer = scorer
        pool = getattr(scorer, "rewards", None)
        self.reward_names: list[str] = list(pool.names) if pool is not None else []
        """The functions whose held-out means are logged (``eval/reward/<name>``); none without a pool."""
        self.runtime, self.renderer, self.agent = runtime, renderer, agent
        self.seed = seed + EVAL_SEED_OFFSET
        self.last_row_success: list[int] | None = None
        """The last evaluation's success (0/1) per held-out row, in row order (``fastrl.commands.paired``)."""

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        if not self.rows:
            return {}
        t0 = time.perf_counter()
        share = self.ranks.share(len(self.rows))
        figures = self.ranks.gather(self.episodes(self.rows[share], first=share.start, rewards=True))
        outcome, tool_calls, turns = figures[:, :3].unbind(1)
        ok = succeeded(outcome)
        self.last_row_success = ok.int().tolist()
        metrics = {"eval/accuracy": float(ok.float().mean()), "eval/reward_mean": float(outcome.mean()),
                   "eval/tool_call_rate": float((tool_calls > 0).float().mean()), "eval/turns_mean": float(turns.mean())}
        for k, name in enumerate(self.reward_names):
            metrics[f"eval/reward/{name}"] = float(figures[:, 3 + k].mean())
        metrics["time/eval"] = time.perf_counter() - t0
        return metrics

    @torch.no_grad()
    def success_rate(self, rows: Sequence[dict]) -> float:
        """Share of greedy episodes on ``rows`` that succeed (this process only)."""
        return float(succeeded(self.episodes(list(rows), first=0)[:, 0]).float().mean())

    def episodes(self, rows: list[dict], *, first: int, rewards: bool = False) -> torch.Tensor:
        """``[len(rows), 3]``: outcome reward, tool calls and turns of one greedy episode per row;
        ``rewards``: then one column per reward function (``reward_names``' order), its value."""
        names = self.reward_names if rewards else []
        out = [torch.zeros(0, 3 + len(names))]
        greedy = SamplingConfig(greedy=True, max_new_tokens=self.agent.max_turn_tokens)
        for start in range(0, len(rows), EVAL_ROWS_PER_CALL):
            chunk = rows[start:start + EVAL_ROWS_PER_CALL]
            trajectories, _ = play_episodes(
                chunk, group_size=1, sampler=self.sampler, sampling=greedy, runtime=self.runtime, renderer=self.renderer,
                agent=self.agent, env_seeds=seeds.prompt_seeds(self.seed, first + start, len(chunk)),
            )
            figures = torch.tensor([[t.outcome_reward, t.tool_calls, t.turns] for t in trajectories], dtype=torch.float32)
            if names:
                per_function = self.scorer.score(trajectories).per_function
                zeros = torch.zeros(len(trajectories))
                figures = torch.cat([figures, torch.stack([per_function.get(n, zeros).float() for n in names], 1)], 1)
            out.append(figures)
        return torch.cat(out)
