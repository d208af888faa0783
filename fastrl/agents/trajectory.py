"""``Trajectory``: one multi-turn episode as exact token ids, ready for a training forward.

A trajectory has one or more *samples* (training rows). Each sample is a token sequence
with a segment table and per-token arrays of equal length:

- ``token_ids``: the prompt, then alternating policy turns (the sampler's exact ids) and
  environment deltas (``fastrl.agents.render``). Nothing sampled is ever re-encoded.
- ``segments``: ``Segment(role, turn, start, end)`` with ``role`` in ``ROLES``:
  ``"prompt"`` (turn -1: the first observation, or a split sample's re-rendered context),
  ``"policy"`` (turn k: what the policy sampled at turn k), ``"env"`` (turn k: what the
  environment answered to turn k). Segments tile ``[0, len(token_ids))`` in order.
- ``loss_mask``: 1 exactly on ``"policy"`` tokens, 0 elsewhere (environment tokens are
  attended to and never trained on).
- ``sampler_logp``: the sampler's log-prob of each policy token, 0.0 elsewhere.

Normally a trajectory is one sample. When the chat template is not prefix-preserving for a
turn (``ChatRenderer``), the driver (``split_on_mismatch``) starts a new sample whose prompt
segment is the template's rendering of the conversation so far, and later turns continue
that sample: one sample per such turn, each trained on its own policy tokens.

Per-trajectory data: ``turn_rewards[k]`` (the environment's reward for turn k),
``outcome_reward`` (the final step's reward; 0.0 when a limit or a failure stopped it),
``state_keys[k]`` (the state after turn k: the environment's ``info["state_key"]``, else
``fastrl.agents.env.default_state_key`` of the observation's delta tokens; ``None`` for a
terminal step without a key and for a failed environment call), ``stop_reason``, tool call/failure
counts, ``excluded`` (True when a failed environment's trajectory is to be masked out of
training: ``AgentConfig.failed_trajectories="mask"``), and the transcript as messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from fastrl.agents.env import Message

__all__ = ["ROLES", "Segment", "TrajectorySample", "Trajectory", "format_trajectory"]

ROLES = ("prompt", "policy", "env")
"""Segment roles; only ``"policy"`` tokens carry loss."""
POLICY = ROLES[1]


@dataclass(frozen=True)
class Segment:
    role: str
    """One of ``ROLES``."""
    turn: int
    """Turn index (-1 for a prompt segment)."""
    start: int
    """First token (inclusive)."""
    end: int
    """Last token (exclusive)."""


@dataclass
class TrajectorySample:
    """One training row of a trajectory (see the module docstring)."""

    token_ids: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    sampler_logp: list[float] = field(default_factory=list)

    def append(self, role: str, turn: int, ids: list[int], logp: list[float] | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if not ids:
            return
        if (role == POLICY) != (logp is not None) or (logp is not None and len(logp) != len(ids)):
            raise ValueError("log-probs are given exactly for policy tokens, one per token")
        start = len(self.token_ids)
        self.token_ids.extend(int(t) for t in ids)
        self.segments.append(Segment(role, turn, start, len(self.token_ids)))
        self.loss_mask.extend([1 if role == POLICY else 0] * len(ids))
        self.sampler_logp.extend(float(x) for x in logp) if logp is not None else self.sampler_logp.extend([0.0] * len(ids))

    @property
    def prompt_length(self) -> int:
        """Tokens of the leading prompt segment (shared by a group's trajectories in sample 0)."""
        return self.segments[0].end if self.segments and self.segments[0].role == "prompt" else 0

    def tensors(self) -> dict[str, torch.Tensor]:
        """``input_ids`` (int64), ``loss_mask`` (int64), ``sampler_logp`` (fp32), all ``[T]``."""
        return {
            "input_ids": torch.tensor(self.token_ids, dtype=torch.long),
            "loss_mask": torch.tensor(self.loss_mask, dtype=torch.long),
            "sampler_logp": torch.tensor(self.sampler_logp, dtype=torch.float32),
        }

    def check(self) -> None:
        """Invariants: segments tile the ids in order; mask 1 exactly on policy segments."""
        position = 0
        for segment in self.segments:
            assert segment.start == position and segment.end > segment.start, self.segments
            position = segment.end
        assert position == len(self.token_ids) == len(self.loss_mask) == len(self.sampler_logp)
        for segment in self.segments:
            want = 1 if segment.role == POLICY else 0
            assert all(m == want for m in self.loss_mask[segment.start:segment.end])


@dataclass
class Trajectory:
    """One episode (see the module docstring)."""

    group: int
    """Index of the prompt (row) in the batch."""
    index: int
    """Index within the group."""
    row: dict
    env_seed: int
    samples: list[TrajectorySample] = field(default_factory=lambda: [TrajectorySample()])
    messages: list[Message] = field(default_factory=list)
    """The transcript: first observation, then assistant turns (decoded) and observations."""
    turn_rewards: list[float] = field(default_factory=list)
    outcome_reward: float = 0.0
    state_keys: list[Any] = field(default_factory=list)
    stop_reason: str = ""
    turns: int = 0
    """Policy turns sampled."""
    tool_calls: int = 0
    tool_failures: dict[str, int] = field(default_factory=dict)
    mismatched_turns: int = 0
    checked_turns: int = 0
    context_text: str = ""
    """The template text the current sample stands for (prompt, policy turns as their
    content and the template's end of turn, deltas): what ``ChatRenderer.matches_template``
    compares with the template's rendering of ``messages``."""
    env_seconds: float = 0.0
    excluded: bool = False
    """Masked out of training (a failed environment with ``failed_trajectories="mask"``)."""
    error: str = ""
    """Why the environment failed (empty if it did not)."""

    @property
    def done(self) -> bool:
        return bool(self.stop_reason)

    @property
    def current(self) -> TrajectorySample:
        return self.samples[-1]

    @property
    def num_tokens(self) -> int:
        """Tokens of the current sample (what the model sees next turn)."""
        return len(self.current.token_ids)

    def count(self, role: str) -> int:
        """Tokens of a role over all samples."""
        return sum(s.end - s.start for sample in self.samples for s in sample.segments if s.role == role)


def format_trajectory(trajectory: Trajectory, decode: Callable[[list[int]], str]) -> str:
    """A whole trajectory as text with its roles, for ``samples.txt``: one block per segment,
    ``[role turn]`` then the decoded tokens (``decode``: e.g. ``tokenizer.decode``), and a
    header with the rewards and the stop reason."""
    head = (f"trajectory {trajectory.group}.{trajectory.index}: outcome {trajectory.outcome_reward:g}, "
            f"turn rewards {trajectory.turn_rewards}, {trajectory.turns} turns, stop {trajectory.stop_reason}"
            + (f" ({trajectory.error.splitlines()[0]})" if trajectory.error else ""))
    lines = [head]
    for number, sample in enumerate(trajectory.samples):
        if len(trajectory.samples) > 1:
            lines.append(f"-- sample {number}")
        for s in sample.segments:
            label = s.role if s.turn < 0 else f"{s.role} {s.turn}"
            lines.append(f"[{label}] {decode(sample.token_ids[s.start:s.end])}")
    return "\n".join(lines)
