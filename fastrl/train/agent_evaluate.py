"""Held-out evaluation of an agent run: one greedy episode per held-out row.

The structure of ``evaluate.HeldOutEvaluator`` (the run's sampler, a seed per row, each rank
a share of the rows, gathered in row order) with episodes instead of completions. A
trajectory succeeds when its outcome reward reaches ``evaluate.SUCCESS_THRESHOLD`` (one rule
for both). Metrics: ``eval/accuracy`` (the success rate), ``eval/reward_mean`` (outcome),
``eval/tool_call_rate`` (share of trajectories with at least one tool call),
``eval/turns_mean``, ``time/eval``.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from fastrl.agents.driver import AgentConfig
from fastrl.agents.render import ChatRenderer
from fastrl.rollout.base import SamplingConfig
from fastrl.train import seeds
from fastrl.train.agent_collect import play_episodes
from fastrl.train.evaluate import EVAL_SEED_OFFSET, succeeded

__all__ = ["AgentEvaluator", "EVAL_ROWS_PER_CALL"]

EVAL_ROWS_PER_CALL = 128
"""Held-out rows played together (one ``run_episodes`` call)."""


class AgentEvaluator:
    """``evaluator()`` -> the ``eval/...`` metrics of greedy episodes on ``rows`` (module docstring);
    ``success_rate(rows)`` for the warm-up's probe on training rows."""

    def __init__(self, *, sampler: Any, ranks: Any, rows: Sequence[dict], runtime: Any, renderer: ChatRenderer,
                 agent: AgentConfig, seed: int):
        self.sampler, self.ranks, self.rows = sampler, ranks, list(rows)
        self.runtime, self.renderer, self.agent = runtime, renderer, agent
        self.seed = seed + EVAL_SEED_OFFSET

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        if not self.rows:
            return {}
        t0 = time.perf_counter()
        share = self.ranks.share(len(self.rows))
        figures = self.ranks.gather(self.episodes(self.rows[share], first=share.start))
        outcome, tool_calls, turns = figures.unbind(1)
        return {"eval/accuracy": float(succeeded(outcome).float().mean()), "eval/reward_mean": float(outcome.mean()),
                "eval/tool_call_rate": float((tool_calls > 0).float().mean()), "eval/turns_mean": float(turns.mean()),
                "time/eval": time.perf_counter() - t0}

    @torch.no_grad()
    def success_rate(self, rows: Sequence[dict]) -> float:
        """Share of greedy episodes on ``rows`` that succeed (this process only)."""
        return float(succeeded(self.episodes(list(rows), first=0)[:, 0]).float().mean())

    def episodes(self, rows: list[dict], *, first: int) -> torch.Tensor:
        """``[len(rows), 3]``: outcome reward, tool calls and turns of one greedy episode per row."""
        out = [torch.zeros(0, 3)]
        greedy = SamplingConfig(greedy=True, max_new_tokens=self.agent.max_turn_tokens)
        for start in range(0, len(rows), EVAL_ROWS_PER_CALL):
            chunk = rows[start:start + EVAL_ROWS_PER_CALL]
            trajectories, _ = play_episodes(
                chunk, group_size=1, sampler=self.sampler, sampling=greedy, runtime=self.runtime, renderer=self.renderer,
                agent=self.agent, env_seeds=seeds.prompt_seeds(self.seed, first + start, len(chunk)),
            )
            out.append(torch.tensor([[t.outcome_reward, t.tool_calls, t.turns] for t in trajectories], dtype=torch.float32))
        return torch.cat(out)
