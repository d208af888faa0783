"""The token-native multi-turn driver: prompts -> environments -> trajectories.

``run_episodes(rows, group_size=G, ...)`` plays ``G`` trajectories per row: the environment's
first observation is rendered as the prompt; then, turn after turn, all active trajectories
are continued by the sampler *together* (one ``TokenSampler.continue_sequences`` call per
turn), their environments step *concurrently* (``EnvRuntime.step``), and each
environment's answer is appended as a token delta (``ChatRenderer.delta_ids``). The
sampled ids are kept exactly; nothing sampled is decoded and encoded again (the decoded
text goes to the environment and the transcript only).

The ``G`` trajectories of one row share its environment seed (the row's seed), so they share
the prompt (GRPO's group); they differ by their sampling seeds: turn ``k`` of trajectory
``j`` of a row with seed ``s`` samples with seed ``((s * G + j) * TURN_SEED_STRIDE + k)``.

Stop reasons (``Trajectory.stop_reason``; counted as ``agent/stop/<reason>``): the
environment's own (``info["stop_reason"]`` when done, e.g. ``answer``, ``repeated_call``,
``goal``, ``hole``; ``done`` when it gives none) or one of ``DRIVER_STOPS``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal, Protocol, Sequence

from fastrl.agents import metric_names as names
from fastrl.agents.env import default_state_key
from fastrl.agents.render import CONTROL_TEXT_MODES, ChatRenderer, ControlTextError, DeltaError
from fastrl.agents.tools import FAILURE_KINDS
from fastrl.agents.trajectory import Trajectory, TrajectorySample
from fastrl.errors import InputError
from fastrl.rollout.hf import TURN_SEED_STRIDE  # one stride for the driver and the sampler's own sessions
from fastrl.rollout.token_sampler import GroupSamplerTokens  # noqa: F401 (the token samplers' one home; its import path here)
from fastrl.rollout.token_sampler import TurnOutput as Continuation
from fastrl.workers import CRASHED, OK, RAISED, TIMEOUT

__all__ = [
    "AgentConfig",
    "Continuation",
    "TokenSampler",
    "GroupSamplerTokens",
    "run_episodes",
    "agent_metrics",
    "truncate_text",
    "DRIVER_STOPS",
    "TURN_SEED_STRIDE",
]

STOP_MAX_TURNS = "max_turns"
STOP_MAX_TOKENS = "max_trajectory_tokens"
STOP_TURN_LENGTH = "turn_length"
STOP_ENV = {TIMEOUT: "env_timeout", CRASHED: "env_crashed", RAISED: "env_error"}
STOP_CONTROL_TEXT = "control_text"
"""An environment message held a control token's text and ``control_text="refuse"``."""
DRIVER_STOPS = (STOP_MAX_TURNS, STOP_MAX_TOKENS, STOP_TURN_LENGTH, *STOP_ENV.values(), STOP_CONTROL_TEXT)
"""Stop reasons the driver sets (the environment sets the others)."""


@dataclass(frozen=True)
class AgentConfig:
    """Limits and policies of multi-turn rollouts."""

    max_turns: int = 4
    """Policy turns per trajectory at most (the environment still scores the last one)."""
    max_turn_tokens: int = 64
    """Tokens one policy turn may sample; a turn that reaches it without a stop token ends
    the trajectory (``turn_length``)."""
    max_trajectory_tokens: int = 512
    """Tokens of a trajectory sample in all: prompt, policy and environment tokens together.
    A turn samples at most what is left; an observation that would pass it ends the
    trajectory (``max_trajectory_tokens``)."""
    max_observation_tokens: int = 128
    """Tokens of each observation message's content (the template's own tokens come on
    top); longer contents are cut on a token boundary that splits no character, to a text
    that encodes to at most this many tokens (``truncate_text``: environment text, never sampled)."""
    truncate_side: Literal["end", "start"] = "end"
    """Which part of a long observation is cut: ``end`` keeps the beginning, ``start`` the end."""
    split_on_mismatch: bool = True
    """Where the template's rendering of the conversation differs from the appended ids,
    start a new training sample from the template's rendering (one sample per such turn);
    False keeps appending (the mismatch is still counted)."""
    check_tokenization: bool = True
    """Compare the appended ids' context text with the template's rendering after every
    environment turn (``fastrl.agents.render``; ``tokenization/mismatch_rate`` over
    ``tokenization/checked_turns``); costs one rendering of the conversation per turn."""
    control_text: Literal["escape", "refuse", "allow"] = "escape"
    """A control token's text (``<|im_end|>``...) in an environment message: ``escape`` it so it
    encodes as plain text, ``refuse`` it (the trajectory ends, ``agent/stop/control_text``,
    as a failed environment), or ``allow`` it (a trusted environment that emits structure
    on purpose; tool output can then end its turn and open others)."""
    failed_trajectories: Literal["zero", "mask"] = "zero"
    """A trajectory whose environment hung, crashed or raised: ``zero`` keeps it with outcome
    reward 0 (the policy learns that what it did led nowhere); ``mask`` marks it
    ``excluded`` so the trainer leaves it out of the loss and the group baseline (an
    infrastructure failure says nothing about the policy)."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_turn_tokens", "max_trajectory_tokens", "max_observation_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be an int >= 1, got {value!r}")
        if self.truncate_side not in ("end", "start"):
            raise InputError(f"truncate_side must be 'end' or 'start', got {self.truncate_side!r}")
        if self.control_text not in CONTROL_TEXT_MODES:
            raise InputError(f"control_text must be one of {CONTROL_TEXT_MODES}, got {self.control_text!r}")
        if self.failed_trajectories not in ("zero", "mask"):
            raise InputError(f"failed_trajectories must be 'zero' or 'mask', got {self.failed_trajectories!r}")


class TokenSampler(Protocol):
    """"Continue these token sequences by up to n tokens": the driver's only sampler need."""

    def continue_sequences(self, sequences: Sequence[Sequence[int]], *, max_new_tokens: Sequence[int],
                           seeds: Sequence[int]) -> list[Continuation]: ...


def truncate_text(tokenizer: Any, text: str, limit: int, side: str = "end") -> str:
    """``text`` cut to at most ``limit`` tokens on a token boundary that splits no character:
    ``end`` keeps the beginning, ``start`` the end. The cut is a character position (the
    tokenizer's offsets), so the kept text is a piece of ``text`` itself (no U+FFFD from a
    multi-byte character cut between its byte tokens), and it is checked to encode to at most
    ``limit`` tokens (one token fewer is kept until it does). A tokenizer without offsets
    (a slow one) cuts by decoding the kept tokens."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=_has_offsets(tokenizer))
    ids = encoded["input_ids"]
    if len(ids) <= limit:
        return text
    if "offset_mapping" not in encoded:
        kept = ids[:limit] if side == "end" else ids[len(ids) - limit:]
        return tokenizer.decode(kept, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    offsets = encoded["offset_mapping"]
    for n in range(limit, 0, -1):
        if side == "end":  # keep tokens [0, n): the cut is where token n-1 ends; token n must start there
            cut = offsets[n - 1][1]
            if offsets[n][0] < cut:
                continue
            piece = text[:cut]
        else:  # keep tokens [len - n, len): the cut is where that token starts; the one before must end there
            cut = offsets[len(ids) - n][0]
            if offsets[len(ids) - n - 1][1] > cut:
                continue
            piece = text[cut:]
        if len(tokenizer(piece, add_special_tokens=False)["input_ids"]) <= limit:
            return piece
    return ""


def _has_offsets(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "is_fast", False))


def _finish(trajectory: Trajectory, reason: str, config: AgentConfig, *, error: str = "") -> None:
    trajectory.stop_reason = reason
    if error:
        trajectory.error = error
        trajectory.outcome_reward = 0.0
        trajectory.excluded = config.failed_trajectories == "mask"


def run_episodes(
    rows: Sequence[dict],
    *,
    group_size: int,
    runtime: Any,
    renderer: ChatRenderer,
    sampler: TokenSampler,
    config: AgentConfig,
    seeds: Sequence[int],
    tree: Any = None,
) -> tuple[list[Trajectory], dict[str, float]]:
    """``G`` trajectories per row (row ``i``'s are ``[i*G, (i+1)*G)``), and the rollout's metrics
    (:func:`agent_metrics`, plus ``time/env_seconds``, ``time/generation_seconds``).
    ``tree``: a ``fastrl.agents.branching.TurnTree`` grows the ``G`` as the leaves of a tree
    (one trajectory per row, forked at its branch points; its equal-budget metrics added)."""
    if len(seeds) != len(rows):
        raise ValueError(f"seeds must have one entry per row ({len(rows)}), got {len(seeds)}")
    G = group_size
    if tree is not None:
        trajectories = tree.start(rows, seeds)
    else:
        trajectories = [Trajectory(group=i, index=j, row=row, env_seed=int(seeds[i])) for i, row in enumerate(rows) for j in range(G)]
    env_seconds = generation_seconds = 0.0
    replays = 0
    model_limit = getattr(sampler, "max_length", None)
    limit = config.max_trajectory_tokens if model_limit is None else min(config.max_trajectory_tokens, int(model_limit))
    try:
        # the first observation, in every trajectory's environment
        started = time.perf_counter()
        replies = runtime.reset([(t_id, t.row, t.env_seed) for t_id, t in enumerate(trajectories)])
        env_seconds += time.perf_counter() - started
        for trajectory, reply in zip(trajectories, replies):
            trajectory.env_seconds += reply.seconds
            if reply.status != OK:
                _finish(trajectory, STOP_ENV.get(reply.status, "env_error"), config, error=reply.message or reply.status)
                continue
            try:
                first = renderer.guard_messages(reply.value, config.control_text)
            except ControlTextError as error:
                _finish(trajectory, STOP_CONTROL_TEXT, config, error=str(error))
                continue
            trajectory.messages = first
            trajectory.context_text = renderer.render_text(first, add_generation_prompt=True)
            trajectory.current.append("prompt", -1, renderer.encode(trajectory.context_text))
        for turn in range(config.max_turns):
            if tree is not None:  # a branch point: the running trajectories forked, environments too
                started = time.perf_counter()
                forks = tree.branch(turn, trajectories, runtime)
                env_seconds += time.perf_counter() - started
                for t_id, reply in forks:
                    trajectories[t_id].env_seconds += reply.seconds
                    if reply.status != OK:
                        _finish(trajectories[t_id], STOP_ENV.get(reply.status, "env_error"), config,
                                error=reply.message or reply.status)
            active = [t_id for t_id, t in enumerate(trajectories) if not t.done]
            if not active:
                break
            budgets = []
            for t_id in list(active):
                t = trajectories[t_id]
                left = limit - t.num_tokens
                if left < 1:
                    _finish(t, STOP_MAX_TOKENS, config)
                    active.remove(t_id)
                    continue
                budgets.append(min(config.max_turn_tokens, left))
            if not active:
                break
            started = time.perf_counter()
            continuations = sampler.continue_sequences(
                [trajectories[t_id].current.token_ids for t_id in active], max_new_tokens=budgets,
                seeds=[((trajectories[t_id].env_seed * G + trajectories[t_id].index) * TURN_SEED_STRIDE + turn) for t_id in active],
            )
            generation_seconds += time.perf_counter() - started
            stepping: list[tuple[int, str]] = []
            for t_id, continuation in zip(active, continuations):
                t = trajectories[t_id]
                t.current.append("policy", turn, continuation.token_ids, continuation.logprobs)
                t.turns += 1
                text = renderer.decode_turn(continuation.token_ids, stopped=continuation.stopped)
                t.messages.append({"role": "assistant", "content": text})
                t.context_text += renderer.turn_text(continuation.token_ids, stopped=continuation.stopped)
                if not continuation.stopped:
                    _finish(t, STOP_TURN_LENGTH if len(continuation.token_ids) >= config.max_turn_tokens else STOP_MAX_TOKENS, config)
                    continue
                stepping.append((t_id, text))
            if not stepping:
                continue
            started = time.perf_counter()
            replies = runtime.step(stepping)
            env_seconds += time.perf_counter() - started
            for (t_id, _), reply in zip(stepping, replies):
                t = trajectories[t_id]
                t.env_seconds += reply.seconds
                if reply.status != OK:
                    if reply.status == TIMEOUT:  # a tool (or the environment) that never returned
                        t.tool_failures[TIMEOUT] = t.tool_failures.get(TIMEOUT, 0) + 1
                    t.turn_rewards.append(0.0)
                    t.state_keys.append(None)
                    _finish(t, STOP_ENV.get(reply.status, "env_error"), config, error=reply.message or reply.status)
                    continue
                replays += reply.replayed
                result = reply.value
                t.turn_rewards.append(result.reward)
                t.tool_calls += int(result.info.get("tool_calls", 0))
                for kind, number in (result.info.get("tool_failures") or {}).items():
                    t.tool_failures[kind] = t.tool_failures.get(kind, 0) + int(number)
                if result.done:
                    t.state_keys.append(result.info.get("state_key"))  # terminal: None unless the environment names it
                    t.outcome_reward = result.reward
                    _finish(t, str(result.info.get("stop_reason", "done")), config)
                    continue
                try:  # control-token text escaped (or refused) first, so the cut counts what the model will see
                    observation = renderer.guard_messages(result.observation, config.control_text)
                except ControlTextError as error:
                    t.state_keys.append(None)
                    _finish(t, STOP_CONTROL_TEXT, config, error=str(error))
                    continue
                observation = [
                    {**m, "content": truncate_text(renderer.tokenizer, m["content"], config.max_observation_tokens, config.truncate_side)}
                    for m in observation
                ]
                if turn + 1 >= config.max_turns:
                    t.state_keys.append(_state_key(result.info, renderer, observation))
                    _finish(t, STOP_MAX_TURNS, config)
                    continue
                _append_observation(t, observation, result.info, renderer, config, turn, limit)
    finally:
        runtime.release(list(range(len(trajectories))))
    for t in trajectories:
        if not t.done:
            _finish(t, STOP_MAX_TURNS, config)
    if tree is not None:
        trajectories = tree.leaves(trajectories)
    metrics = agent_metrics(trajectories)
    if tree is not None:
        metrics.update(tree.metrics(trajectories))
    metrics[names.ENV_SECONDS] = env_seconds
    metrics[names.GENERATION_SECONDS] = generation_seconds
    metrics[names.ENV_REPLAYS] = float(replays)
    return trajectories, metrics


def _state_key(info: dict, renderer: ChatRenderer, observation: list[dict], delta: list[int] | None = None) -> Any:
    """The environment's ``info["state_key"]``, else the default: a hash of the observation's
    tokens (its delta, or its plain rendering where no delta exists)."""
    if "state_key" in info:
        return info["state_key"]
    if delta is None:
        try:
            delta = renderer.delta_ids(observation)
        except DeltaError:
            delta = renderer.render(observation, add_generation_prompt=False)
    return default_state_key(delta)


def _append_observation(t: Trajectory, observation: list[dict], info: dict, renderer: ChatRenderer,
                        config: AgentConfig, turn: int, limit: int) -> None:
    """Append an observation's delta (or start a new sample from the template), check the
    sample's context text against the template's rendering (``fastrl.agents.render``)."""
    try:
        delta_text = renderer.delta_text(observation)
        delta = renderer.encode(delta_text)
    except DeltaError:
        delta_text, delta = "", None
    messages = t.messages + observation
    if delta is not None and t.num_tokens + len(delta) >= limit:
        t.state_keys.append(_state_key(info, renderer, observation, delta))
        _finish(t, STOP_MAX_TOKENS, config)
        return
    if delta is not None:
        t.current.append("env", turn, delta)
        t.context_text += delta_text
    t.messages = messages
    t.state_keys.append(_state_key(info, renderer, observation, delta))
    matches = True
    if delta is None or config.check_tokenization:
        t.checked_turns += 1
        matches = delta is not None and renderer.matches_template(t.context_text, messages)
        t.mismatched_turns += not matches
    if delta is None or (not matches and config.split_on_mismatch):
        # a new training sample from the template's rendering (always when no delta exists)
        context_text = renderer.render_text(messages, add_generation_prompt=True)
        context = renderer.encode(context_text)
        if len(context) >= limit:
            _finish(t, STOP_MAX_TOKENS, config)
            return
        sample = TrajectorySample()
        sample.append("prompt", -1, context)
        t.samples.append(sample)
        t.context_text = context_text


def agent_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Per-rollout figures: turns (mean/max), tool calls per trajectory, the share of
    trajectories with a tool call, environment calls (resets + steps: the cost axis of
    ``fastrl compare``), tool failures by kind,
    stops by reason, environment-token share, the turns checked against the template, those
    that mismatched and their rate (the rate only when a turn was checked), the slowest
    trajectory's environment seconds and turns, outcome reward and success rate."""
    n = max(len(trajectories), 1)
    metrics: dict[str, float] = {
        names.TURNS_MEAN: sum(t.turns for t in trajectories) / n,
        names.TURNS_MAX: float(max((t.turns for t in trajectories), default=0)),
        names.TOOL_CALLS_PER_TRAJECTORY: sum(t.tool_calls for t in trajectories) / n,
        names.TOOL_CALL_RATE: sum(t.tool_calls > 0 for t in trajectories) / n,
        names.ENV_CALLS: float(sum(len(t.turn_rewards) for t in trajectories) + sum(bool(t.messages) for t in trajectories)),
        names.OUTCOME_REWARD_MEAN: sum(t.outcome_reward for t in trajectories) / n,
        names.EXCLUDED: float(sum(t.excluded for t in trajectories)),
        names.SAMPLES_PER_TRAJECTORY: sum(len(t.samples) for t in trajectories) / n,
    }
    for kind in FAILURE_KINDS:
        metrics[names.tool_failures(kind)] = float(sum(t.tool_failures.get(kind, 0) for t in trajectories))
    reasons = sorted({t.stop_reason for t in trajectories} | set(DRIVER_STOPS))
    for reason in reasons:
        metrics[names.stop(reason)] = float(sum(t.stop_reason == reason for t in trajectories))
    policy = sum(t.count("policy") for t in trajectories)
    env = sum(t.count("env") for t in trajectories)
    metrics[names.ENV_TOKEN_SHARE] = env / max(policy + env, 1)
    checked = sum(t.checked_turns for t in trajectories)
    mismatched = sum(t.mismatched_turns for t in trajectories)
    metrics[names.TOKENIZATION_CHECKED_TURNS] = float(checked)
    metrics[names.TOKENIZATION_MISMATCHED_TURNS] = float(mismatched)
    if checked:  # absent when no turn was checked: 0 would read as a clean result
        metrics[names.TOKENIZATION_MISMATCH_RATE] = mismatched / checked
    slowest = max(trajectories, key=lambda t: t.env_seconds, default=None)
    metrics[names.SLOWEST_ENV_SECONDS] = slowest.env_seconds if slowest else 0.0
    metrics[names.SLOWEST_TURNS] = float(slowest.turns) if slowest else 0.0
    return metrics
