"""The names of the metrics every rollout logs, single-turn or agent: what a run spends
(``rollout/generated_tokens``) and a tree rollout's equal-budget figures.

They live below both writers (``fastrl.rollout``'s tree sampling and the trainer's
collectors, and ``fastrl.agents``' driver and branching), so neither the trainer nor the
rollout reads them from the agents' package; ``fastrl.agents.metric_names`` lists them with
the agent figures (the one list users' dashboards key on). A name is a published key:
renaming one is a breaking change.
"""

from __future__ import annotations

__all__ = ["GENERATED_TOKENS", "KV_FORKS", "PREFIX_CACHE_HIT_RATE", "TREE_BRANCH_POINTS", "TREE_COPIES", "TREE_LEAF_TOKENS"]

GENERATED_TOKENS = "rollout/generated_tokens"
"""Completion tokens sampled: a tree's shared segment counted once (the budget a run spends)."""
TREE_LEAF_TOKENS = "rollout/tree_leaf_tokens"
"""The leaves' completion tokens: what independent samples of those lengths would have generated."""
TREE_BRANCH_POINTS = "rollout/tree_branch_points"
TREE_COPIES = "rollout/tree_copies"
KV_FORKS = "rollout/kv_forks"
PREFIX_CACHE_HIT_RATE = "rollout/prefix_cache_hit_rate"
