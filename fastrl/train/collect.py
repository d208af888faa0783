"""Collection: the next prompts, sampled and scored into one step's ``GroupRollout``.

Each rank samples its contiguous share of the batch (``Ranks.shard``) with one seed per
prompt (``seeds.prompt_seeds``); with dynamic sampling (DAPO) groups whose rewards are all
equal carry no signal and are dropped, and further batches are drawn until the step has as
many informative groups as prompts (or ``max_resample_rounds`` is spent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from fastrl.rollout.base import GroupRollout, RolloutBatch, SamplingConfig, merge_rollouts
from fastrl.train import seeds
from fastrl.train.config import TrainConfig
from fastrl.train.experience import Experience
from fastrl.train.run.metrics import best_and_worst, rollout_metrics

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from fastrl.rollout.base import GroupSampler
    from fastrl.train.data import PromptBatcher
    from fastrl.train.run.metrics import StageTimer
    from fastrl.train.ranks import Ranks
    from fastrl.train.score import GroupScorer


__all__ = ["GroupCollector", "RolloutRequest", "rollout_sampling"]


def rollout_sampling(cfg: TrainConfig, *, step: int, salt: int) -> SamplingConfig:
    """The sampling settings of step ``step``'s rollout round ``salt``."""
    return SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_new_tokens,
                          seed=seeds.rollout_seed(cfg.seed, step, salt))


@dataclass
class RolloutRequest:
    """One rollout round to sample: this rank's prompts and how (``GroupCollector.draw``)."""

    prompt_batch: Any
    """This rank's share of the prompt batch (``PromptBatch``: rows, prompt ids, indices)."""
    sampling: SamplingConfig
    prompt_seeds: list[int] | None
    """One sampling seed per prompt (``seeds.prompt_seeds``), or None."""

    def generate(self, sampler: GroupSampler, *, group_size: int) -> RolloutBatch:
        extra = {"prompt_seeds": self.prompt_seeds} if self.prompt_seeds is not None else {}
        return sampler.generate(self.prompt_batch.prompt_ids, group_size=group_size, sampling=self.sampling, **extra)


class GroupCollector:
    """The single-turn ``contracts.Collector``: ``collect(sampler=, step=, timer=)``, one step's
    groups of completions and its ``dynamic/...`` metrics; ``experience``, ``step_metrics`` and
    ``samples`` of it for the loop, ``checkpoint_extra()`` (this rank's objects for the
    checkpoint) and ``close()``. ``draw``, ``score`` and ``refill`` are the stages
    ``async_collect.AsyncCollector`` reuses."""

    def __init__(self, *, cfg: TrainConfig, batcher: PromptBatcher, ranks: Ranks, scorer: GroupScorer):
        self.cfg, self.batcher, self.ranks, self.scorer = cfg, batcher, ranks, scorer

    def collect(self, *, sampler: GroupSampler, step: int, timer: StageTimer) -> tuple[GroupRollout, dict[str, float]]:
        first = self.rollout(sampler=sampler, step=step, salt=0, timer=timer)
        if not self.cfg.dynamic_sampling:
            return first, {"dynamic/rounds": 0.0, "dynamic/dropped_groups": 0.0}
        return self.refill(first, more=lambda salt: self.rollout(sampler=sampler, step=step, salt=salt, timer=timer),
                           pad_token_id=sampler.pad_token_id)

    def refill(self, first: GroupRollout, *, more: Callable[[int], GroupRollout],
               pad_token_id: int) -> tuple[GroupRollout, dict[str, float]]:
        """Dynamic sampling: ``first`` without its all-equal groups, topped up from further
        rounds ``more(salt)`` (salt 1, 2, ...: the step's next prompts, sampled and scored)
        to as many groups as ``first`` has, or what ``max_resample_rounds`` found; with its
        ``dynamic/...`` metrics."""
        cfg, ranks = self.cfg, self.ranks
        G = cfg.group_size
        info = {"dynamic/rounds": 0.0, "dynamic/dropped_groups": 0.0}
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
            current = more(round_ + 1)
        info["dynamic/dropped_groups"] = float(ranks.sum(dropped))
        if n_kept == 0:
            # nothing informative: train on the first batch (all advantages are 0; the step only logs)
            return first, info
        return merge_rollouts(kept, group_size=G, limit=target, pad_token_id=pad_token_id), info

    def experience(self, rollout: GroupRollout, *, device: torch.device) -> Experience:
        """The step's ``Experience`` of a collected rollout."""
        return Experience.from_rollout(rollout.batch, group_size=self.cfg.group_size, rewards=rollout.rewards, device=device)

    def step_metrics(self, rollout: GroupRollout, exp: Experience) -> tuple[dict[str, float], dict[str, list[float]]]:
        """Reward, length and rollout metrics, and the rewards' histogram (``metrics.rollout_metrics``)."""
        return rollout_metrics(rollout, self.ranks)

    def samples(self, rollout: GroupRollout, tokenizer: PreTrainedTokenizerBase) -> tuple[tuple[str, str, float], tuple[str,
                str, float]]:
        """``(prompt, completion, reward)`` of the best and worst sample (``samples.txt``)."""
        return best_and_worst(rollout, tokenizer, self.cfg.group_size)

    def rollout(self, *, sampler: GroupSampler, step: int, salt: int, timer: StageTimer) -> GroupRollout:
        """Sample and score this rank's share of the next prompt batch."""
        request = self.draw(step=step, salt=salt)
        with timer("generate"):
            batch = request.generate(sampler, group_size=self.cfg.group_size)
        with timer("reward"):
            return self.score(request, batch)

    def draw(self, *, step: int, salt: int) -> RolloutRequest:
        """This rank's share of the next prompt batch and its sampling settings (advances the batcher)."""
        prompt_batch, first = self.ranks.shard(next(self.batcher))
        sampling = rollout_sampling(self.cfg, step=step, salt=salt)
        return RolloutRequest(prompt_batch=prompt_batch, sampling=sampling,
                              prompt_seeds=seeds.prompt_seeds(sampling.seed, first, len(prompt_batch.prompt_ids)))

    def score(self, request: RolloutRequest, batch: RolloutBatch) -> GroupRollout:
        """The request's sampled batch, scored by the reward pool."""
        rows = request.prompt_batch.rows
        completions, result = self.scorer.score(rows, batch, self.cfg.group_size)
        return GroupRollout(batch=batch, rows=rows, completions=completions, rewards=result.rewards.float(),
                            reward_metrics=dict(result.metrics), per_function=dict(result.per_function))

    def checkpoint_extra(self) -> dict[str, Any]:
        """What a checkpoint must hold beyond the batcher's position (nothing: no rollout in flight)."""
        return {}

    def close(self) -> None:
        """Nothing to release (a collector with a process of its own stops it here)."""
