"""The metric names agent rollouts log (``fastrl.agents.metric_names``): the list is the one users'
dashboards key on (a rename fails here), and every figure a real rollout logs is named in it."""

from fastrl.agents import metric_names as names
from fastrl.agents.driver import DRIVER_STOPS, AgentConfig, run_episodes
from fastrl.agents.envs.calculator import CalculatorEnv, calculator_rows
from fastrl.agents.render import ChatRenderer
from fastrl.agents.runtime import InProcessRuntime
from fastrl.agents.tools import FAILURE_KINDS
from fastrl.train.task import char_tokenizer
from scripted import ScriptedSampler

PUBLISHED = {
    "agent/turns_mean", "agent/turns_max", "agent/tool_calls_per_trajectory", "agent/tool_call_rate", "agent/env_calls",
    "agent/outcome_reward_mean", "agent/excluded", "agent/samples_per_trajectory", "agent/env_token_share",
    "agent/slowest_env_seconds", "agent/slowest_turns", "tokenization/mismatch_rate", "agent/tool_failures/", "agent/stop/",
    "time/env_seconds", "time/generation_seconds", "env/replays", "agent/trajectory_tokens_mean", "agent/env_time_share",
    "rollout/generated_tokens", "rollout/tree_leaf_tokens", "rollout/tree_branch_points", "rollout/tree_copies",
    "agent/tree_leaf_env_calls", "env/forks_native", "env/forks_replayed", "env/fork_failures", "rollout/kv_forks",
    "rollout/prefix_cache_hit_rate",
    # issue 38: the turns the template check counted (the rate is absent when it counted none)
    "tokenization/checked_turns", "tokenization/mismatched_turns",
}
"""Written out once, by hand: what runs before this list existed logged under these names
(and, marked, what was added since)."""


def declared() -> set[str]:
    return {value for key, value in vars(names).items() if key.isupper() and isinstance(value, str)}


def unnamed(metrics: dict) -> list[str]:
    """The keys of ``metrics`` that the names module does not declare (a per-kind or per-reason
    figure counts as declared by its prefix)."""
    exact = declared() - {names.STOP_PREFIX, names.TOOL_FAILURES_PREFIX}
    return sorted(k for k in metrics if k not in exact and not k.startswith((names.STOP_PREFIX, names.TOOL_FAILURES_PREFIX)))


def test_the_declared_names_are_the_published_ones():
    assert declared() == PUBLISHED
    assert names.stop("max_turns") == "agent/stop/max_turns"
    assert names.tool_failures("timeout") == "agent/tool_failures/timeout"


def test_every_figure_a_rollout_logs_is_named():
    tokenizer = char_tokenizer()
    rows, _ = calculator_rows(num_train=2, num_heldout=0, seed=0)
    script = ["calc(1+2)", "calc(", "3"]  # a call, a malformed call, an answer
    sampler = ScriptedSampler(tokenizer, lambda trajectory, turn: script[turn])
    with InProcessRuntime(CalculatorEnv) as runtime:
        _, metrics = run_episodes(rows, group_size=2, runtime=runtime, renderer=ChatRenderer(tokenizer), sampler=sampler,
                                  config=AgentConfig(max_turns=3, max_turn_tokens=32), seeds=[0, 1])
    assert unnamed(metrics) == []
    assert {names.stop(reason) for reason in DRIVER_STOPS} | {names.tool_failures(kind) for kind in FAILURE_KINDS} <= set(metrics)
    assert metrics[names.TOOL_CALL_RATE] == 1.0 and metrics[names.ENV_CALLS] == 4 * (1 + 3)  # a reset and three steps each
