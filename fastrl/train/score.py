"""Scoring sampled groups against their dataset rows with the run's reward pool.

One place turns a sampler's batch into what the reward functions are called with (the
decoded completions, TRL's conversational form for chat prompts, every other dataset
column repeated per sample), for the training rollout, held-out evaluation and the
warm-up's accuracy probe alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from fastrl.rollout.base import RolloutBatch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from fastrl.train.rewards.pool import RewardPool


__all__ = ["GroupScorer"]


class GroupScorer:
    """``score(rows, batch, k)``: the reward pool's result for ``k`` samples per row."""

    def __init__(self, *, tokenizer: PreTrainedTokenizerBase, rewards: RewardPool, prompt_column: str):
        self.tokenizer = tokenizer
        self.rewards = rewards
        self.prompt_column = prompt_column

    def columns(self, rows: Sequence[dict[str, Any]], repeat: int = 1) -> dict[str, list]:
        """Every column but the prompt, each value repeated ``repeat`` times (one per sample)."""
        keys = [k for k in rows[0] if k != self.prompt_column] if rows else []
        return {k: [r.get(k) for r in rows for _ in range(repeat)] for k in keys}

    def score(self, rows: Sequence[dict[str, Any]], batch: RolloutBatch, k: int) -> tuple[list[str], Any]:
        """``(decoded completions, RewardResult)`` of ``batch``'s ``k`` samples per row."""
        completions = self.tokenizer.batch_decode(batch.completion_ids, skip_special_tokens=True)
        prompt_values = [r[self.prompt_column] for r in rows for _ in range(k)]
        if prompt_values and isinstance(prompt_values[0], list):  # chat prompts: TRL's conversational form
            completions_arg: list = [[{"role": "assistant", "content": c}] for c in completions]
        else:
            completions_arg = completions
        result = self.rewards.score(prompt_values, completions_arg, completion_ids=batch.completion_ids, columns=self.columns(rows, k))
        return completions, result

    def answer_score(self, prompts: list, completions: list[str], answers: list) -> list[float]:
        """The run's rewards with only the answer column (the warm-up's accuracy probe)."""
        return self.rewards.score(prompts, completions, columns={"answer": list(answers)}).rewards.tolist()
