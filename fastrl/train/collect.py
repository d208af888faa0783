"""Collection: the next prompts, sampled and scored into one step's ``GroupRollout``.

Each rank samples its contiguous share of the batch (``Ranks.shard``) with one seed per
prompt (``seeds.prompt_seeds``); with dynamic sampling (DAPO) groups whose rewards are all
equal carry no signal and are dropped, and further batches are drawn until the step has as
many informative groups as prompts (or ``max_resample_rounds`` is spent).
"""

from __future__ import annotations

from typing import Any

from fastrl.rollout.base import GroupRollout, SamplingConfig, merge_rollouts
from fastrl.train import seeds
from fastrl.train.config import TrainConfig
from fastrl.train.experience import Experience
from fastrl.train.metrics import best_and_worst, rollout_metrics

__all__ = ["Collector", "rollout_sampling"]


def rollout_sampling(cfg: TrainConfig, *, step: int, salt: int) -> SamplingConfig:
    """The sampling settings of step ``step``'s rollout round ``salt``."""
    return SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_new_tokens,
                          seed=seeds.rollout_seed(cfg.seed, step, salt))


class Collector:
    """``collect(sampler=, step=, timer=)``: one step's rollout and its ``dynamic/...`` metrics;
    ``experience``, ``step_metrics`` and ``samples`` of it for the loop (the interface
    ``agent_collect.AgentCollector`` shares)."""

    def __init__(self, *, cfg: TrainConfig, batcher: Any, ranks: Any, scorer: Any):
        self.cfg, self.batcher, self.ranks, self.scorer = cfg, batcher, ranks, scorer

    def collect(self, *, sampler: Any, step: int, timer: Any) -> tuple[GroupRollout, dict[str, float]]:
        cfg, ranks = self.cfg, self.ranks
        G = cfg.group_size
        first = self.rollout(sampler=sampler, step=step, salt=0, timer=timer)
        info = {"dynamic/rounds": 0.0, "dynamic/dropped_groups": 0.0}
        if not cfg.dynamic_sampling:
            return first, info
        target = len(first.rows)
        kept: list[tuple[GroupRollout, list[int]]] = []
        n_kept = dropped = 0
        current = first
        for round_ in range(cfg.max_resample_rounds + 1):
            r = current.rewards.view(-1, G)
            informative = [g for g in range(r.shape[0]) if bool((r[g] != r[g, 0]).any())]
            dropped += r.shape[0] - len(informative)
            kept.append((current, informative))
            n_kept += len(informative)
            info["dynamic/rounds"] = float(round_)
            # under torchrun every rank takes the same decision (the batcher stays in step)
            if ranks.sum(n_kept) >= ranks.sum(target) or round_ == cfg.max_resample_rounds:
                break
            current = self.rollout(sampler=sampler, step=step, salt=round_ + 1, timer=timer)
        info["dynamic/dropped_groups"] = float(ranks.sum(dropped))
        if n_kept == 0:
            # nothing informative: train on the first batch (all advantages are 0; the step only logs)
            return first, info
        return merge_rollouts(kept, group_size=G, limit=target, pad_token_id=sampler.pad_token_id), info

    needs_old_logp = False
    """Whether the trainer must compute old log-probs for this collector's metrics (no)."""

    def experience(self, rollout: GroupRollout, *, device: Any) -> Experience:
        """The step's ``Experience`` of a collected rollout."""
        return Experience.from_rollout(rollout.batch, group_size=self.cfg.group_size, rewards=rollout.rewards, device=device)

    def step_metrics(self, rollout: GroupRollout, exp: Experience) -> tuple[dict[str, float], dict[str, list[float]]]:
        """Reward, length and rollout metrics, and the rewards' histogram (``metrics.rollout_metrics``)."""
        return rollout_metrics(rollout, self.ranks)

    def samples(self, rollout: GroupRollout, tokenizer: Any) -> tuple[tuple[str, str, float], tuple[str, str, float]]:
        """``(prompt, completion, reward)`` of the best and worst sample (``samples.txt``)."""
        return best_and_worst(rollout, tokenizer, self.cfg.group_size)

    def rollout(self, *, sampler: Any, step: int, salt: int, timer: Any) -> GroupRollout:
        """Sample and score this rank's share of the next prompt batch."""
        G = self.cfg.group_size
        prompt_batch, first = self.ranks.shard(next(self.batcher))
        with timer("generate"):
            sampling = rollout_sampling(self.cfg, step=step, salt=salt)
            prompt_seeds = seeds.prompt_seeds(sampling.seed, first, len(prompt_batch.prompt_ids))
            extra = {"prompt_seeds": prompt_seeds} if prompt_seeds is not None else {}
            batch = sampler.generate(prompt_batch.prompt_ids, group_size=G, sampling=sampling, **extra)
        with timer("reward"):
            completions, result = self.scorer.score(prompt_batch.rows, batch, G)
        return GroupRollout(batch=batch, rows=prompt_batch.rows, completions=completions, rewards=result.rewards.float(),
                            reward_metrics=dict(result.metrics), per_function=dict(result.per_function))
