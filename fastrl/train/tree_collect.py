"""``TreeCollector`` (``rollout=tree``): the collector whose groups are grown as trees.

The same interface and stages as ``collect.GroupCollector`` (draw this rank's prompts and seeds,
sample, score); the sampling is ``fastrl.rollout.branch.sample_tree`` with the run's
``BranchSchedule`` (``TrainConfig.tree_schedule``) instead of ``generate``, and the
experience carries the trees (``Experience.tree_nodes`` / ``tree_parents``) for the
advantages' step groups. The equal-budget figures: ``rollout/generated_tokens`` counts each
sampled token once (a shared segment once, however many leaves it is in), and
``rollout/tree_leaf_tokens`` is what ``group_size`` independent samples of the leaves'
lengths would have generated; ``fastrl compare`` reports the generated tokens (and, for
agents, environment calls) of every run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fastrl.rollout import metric_names as names
from fastrl.rollout.base import GroupRollout
from fastrl.rollout.branch import sample_tree
from fastrl.train.collect import GroupCollector
from fastrl.train.experience import Experience

if TYPE_CHECKING:
    from fastrl.rollout.base import GroupSampler
    from fastrl.train.run.metrics import StageTimer


__all__ = ["TreeCollector"]


class TreeCollector(GroupCollector):
    """``GroupCollector`` over tree rollouts (see the module docstring)."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.schedule = self.cfg.tree_schedule()
        self.schedule.check(group_size=self.cfg.group_size, max_new_tokens=self.cfg.max_new_tokens)

    def rollout(self, *, sampler: GroupSampler, step: int, salt: int, timer: StageTimer) -> GroupRollout:
        request = self.draw(step=step, salt=salt)
        with timer("generate"):
            batch = sample_tree(sampler, request.prompt_batch.prompt_ids, schedule=self.schedule, sampling=request.sampling,
                                prompt_seeds=request.prompt_seeds)
        with timer("reward"):
            return self.score(request, batch)

    def experience(self, rollout: GroupRollout, *, device: torch.device) -> Experience:
        exp = super().experience(rollout, device=device)
        batch, G = rollout.batch, self.cfg.group_size
        prompt_lengths = [len(batch.prompt_ids[b // G]) for b in range(exp.num_samples)]
        exp.tree_nodes = batch.tree.node_grid(prompt_lengths, columns=exp.loss_mask.shape[1]).to(device)
        exp.tree_parents = torch.tensor(batch.tree.parents, dtype=torch.long, device=device)
        return exp

    def step_metrics(self, rollout: GroupRollout, exp: Experience) -> tuple[dict[str, float], dict[str, list[float]]]:
        metrics, hist = super().step_metrics(rollout, exp)
        tree = rollout.batch.tree
        metrics[names.TREE_LEAF_TOKENS] = float(self.ranks.sum(tree.leaf_tokens))
        metrics[names.TREE_BRANCH_POINTS] = float(self.ranks.sum(tree.branch_points))
        return metrics, hist
