"""``AgentTreeCollector`` (``--env`` with ``rollout=tree``): agent trajectories grown as trees.

The ``AgentCollector``'s stages with the driver's tree hook: each row's ``group_size``
trajectories are the leaves of a tree that branches at the start of the policy turns of the
run's ``TurnSchedule`` (``TrainConfig.turn_schedule``: ``--tree_turns`` /
``--tree_branches``; ``fastrl.agents.branching``), the siblings' environments forked
(``EnvRuntime.fork``) and, with the HF sampler, their keys/values forked
(``ForkingTokenSampler``); vLLM and the server get the siblings' histories as token ids and
share the prefix through prefix caching.

The experience carries the tree (``Experience.tree_nodes``: each policy token's node on the
``[R, T-1]`` grid, ``tree_parents``), so the group modes add each segment's step advantage
among its siblings (``advantages.tree_step_credit``, as for single-turn trees), and the
leaves share their partial trajectories token for token, so ``prefix_tree=auto`` trains them
on the trie (``layout/tree``, ``layout/trie_saving``): each shared span runs once.

Equal-budget figures (summed over ranks): ``rollout/generated_tokens`` (each sampled policy
token once), ``rollout/tree_leaf_tokens`` (what ``group_size`` independent trajectories of
the leaves' lengths would sample), ``rollout/tree_branch_points``, ``rollout/tree_copies``
(leaves that copy a trajectory which ended before a branch point), ``agent/env_calls`` (the
calls made: resets, steps, replays), ``agent/tree_leaf_env_calls`` (the independent count),
``env/forks_native`` / ``env/forks_replayed`` / ``env/fork_failures``; ``rollout/kv_forks`` (HF:
trajectories forked in the multi-turn state) or ``rollout/prefix_cache_hit_rate`` (vLLM: the mean
hit rate of the turns' calls).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from fastrl.agents import metric_names as names
from fastrl.agents.branching import TurnTree, tree_token_sampler
from fastrl.agents.driver import run_episodes
from fastrl.agents.trajectory import Trajectory
from fastrl.rollout.base import SamplingConfig
from fastrl.train.agent.collect import AgentCollector, AgentRollout, sampler_renderer, turn_sampling
from fastrl.train.experience import Experience

if TYPE_CHECKING:
    from fastrl.rollout.base import GroupSampler


__all__ = ["AgentTreeCollector", "TREE_SUMMED_METRICS"]

TREE_SUMMED_METRICS = (names.GENERATED_TOKENS, names.TREE_LEAF_TOKENS, names.TREE_BRANCH_POINTS, names.TREE_COPIES)
"""The tree's figures summed over ranks (each rank grows the trees of its own rows)."""


class AgentTreeCollector(AgentCollector):
    """``AgentCollector`` over branching trajectories (see the module docstring)."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.schedule = self.cfg.turn_schedule()
        self.schedule.check(group_size=self.cfg.group_size, max_turns=self.agent.max_turns)

    def play(self, rows: list[dict], *, sampler: GroupSampler, sampling: SamplingConfig,
             env_seeds: Sequence[int]) -> tuple[list[Trajectory], dict[str, float], TurnTree]:
        tree = TurnTree(self.schedule, group_size=self.cfg.group_size)
        renderer = sampler_renderer(self.renderer, sampler)
        tokens = tree_token_sampler(sampler, turn_sampling(sampling, agent=self.agent, renderer=renderer))
        try:
            trajectories, metrics = run_episodes(rows, group_size=self.cfg.group_size, runtime=self.runtime,
                                                 renderer=renderer, sampler=tokens, config=self.agent,
                                                 seeds=list(env_seeds), tree=tree)
        finally:
            close = getattr(tokens, "close", None)
            if callable(close):
                close()
        metrics[names.KV_FORKS] = float(getattr(tokens, "forked", 0))
        hits = getattr(tokens, "prefix_hits", None)
        if hits:  # vLLM: the share of prompt blocks its prefix cache served (the siblings' shared history)
            metrics[names.PREFIX_CACHE_HIT_RATE] = sum(hits) / len(hits)
        return trajectories, metrics, tree

    def experience(self, rollout: AgentRollout, *, device: torch.device) -> Experience:
        exp = super().experience(rollout, device=device)
        batch = rollout.batch
        exp.tree_nodes = rollout.tree.node_grid(batch.segments, batch.trajectory_ids, batch.excluded,
                                                shape=tuple(exp.loss_mask.shape)).to(device)
        exp.tree_parents = torch.tensor(rollout.tree.parents, dtype=torch.long, device=device)
        return exp

    def step_metrics(self, rollout: AgentRollout, exp: Experience) -> tuple[dict[str, float], dict[str, list[float]]]:
        metrics, hist = super().step_metrics(rollout, exp)
        for name in TREE_SUMMED_METRICS:  # the tree's own counts (the base counted every leaf's tokens)
            metrics[name] = float(self.ranks.sum(rollout.metrics[name]))
        return metrics, hist
