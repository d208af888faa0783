"""The names of the metrics an agent rollout logs: the one list that the code writing a figure
(``driver``, ``branching``, the trainer's agent collectors) and the code reading it (``fastrl
compare``, the tests) both name it from. A name is what users' dashboards key on: renaming one
is a breaking change, so a new figure gets a new name here rather than an old one reused.

The figures every rollout logs (``rollout/generated_tokens`` and a tree's ``rollout/...``) have
their home in ``fastrl.rollout.metric_names``, below the trainer and the agents; they are
listed here too, so this module stays the whole list of what an agent rollout logs."""

from __future__ import annotations

from fastrl.rollout.metric_names import (  # noqa: F401  (listed with the agent figures)
    GENERATED_TOKENS, KV_FORKS, PREFIX_CACHE_HIT_RATE, TREE_BRANCH_POINTS, TREE_COPIES, TREE_LEAF_TOKENS,
)

# ---------------------------------------------------------------- per rollout (driver.agent_metrics)
TURNS_MEAN = "agent/turns_mean"
TURNS_MAX = "agent/turns_max"
TOOL_CALLS_PER_TRAJECTORY = "agent/tool_calls_per_trajectory"
TOOL_CALL_RATE = "agent/tool_call_rate"
ENV_CALLS = "agent/env_calls"
"""Environment calls made (resets, steps, a fork's replayed calls): the cost axis of ``fastrl compare``."""
OUTCOME_REWARD_MEAN = "agent/outcome_reward_mean"
EXCLUDED = "agent/excluded"
SAMPLES_PER_TRAJECTORY = "agent/samples_per_trajectory"
ENV_TOKEN_SHARE = "agent/env_token_share"
SLOWEST_ENV_SECONDS = "agent/slowest_env_seconds"
SLOWEST_TURNS = "agent/slowest_turns"
TOKENIZATION_MISMATCH_RATE = "tokenization/mismatch_rate"
"""Mismatched / checked turns; absent from a rollout that checked no turn."""
TOKENIZATION_CHECKED_TURNS = "tokenization/checked_turns"
"""Turns whose context was compared with the template's rendering (``fastrl.agents.render``)."""
TOKENIZATION_MISMATCHED_TURNS = "tokenization/mismatched_turns"
"""Checked turns whose context differed from the template's rendering (a split, by default)."""
TOOL_FAILURES_PREFIX = "agent/tool_failures/"
"""One figure per failure kind (``tools.FAILURE_KINDS``): ``tool_failures(kind)``."""
STOP_PREFIX = "agent/stop/"
"""One figure per stop reason (``driver.DRIVER_STOPS`` and whatever an environment reports): ``stop(reason)``."""

# ---------------------------------------------------------------- per rollout (driver.run_episodes)
ENV_SECONDS = "time/env_seconds"
GENERATION_SECONDS = "time/generation_seconds"
ENV_REPLAYS = "env/replays"

# ---------------------------------------------------------------- per step (the trainer's agent collect)
TRAJECTORY_TOKENS_MEAN = "agent/trajectory_tokens_mean"
ENV_TIME_SHARE = "agent/env_time_share"

# ---------------------------------------------------------------- tree rollouts (branching.TurnTree.metrics;
# its rollout/... names are fastrl.rollout.metric_names's)
TREE_LEAF_ENV_CALLS = "agent/tree_leaf_env_calls"
"""The environment calls the leaves would have made independently (``ENV_CALLS`` counts those made)."""
FORKS_NATIVE = "env/forks_native"
FORKS_REPLAYED = "env/forks_replayed"
FORK_FAILURES = "env/fork_failures"


def tool_failures(kind: str) -> str:
    """The count of tool failures of ``kind`` (``agent/tool_failures/<kind>``)."""
    return TOOL_FAILURES_PREFIX + kind


def stop(reason: str) -> str:
    """The count of trajectories stopped for ``reason`` (``agent/stop/<reason>``)."""
    return STOP_PREFIX + reason
