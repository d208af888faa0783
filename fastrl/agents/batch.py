"""Trajectories -> the training tensors of one step (what ``Experience`` will carry).

``AgentBatch.from_trajectories(trajectories, group_size=G, pad_token_id=...)`` lays out one
row per trajectory *sample* (normally one per trajectory, so rows ``g*G .. g*G+G-1`` are
group ``g``'s, in order), right-padded ``[R, T]`` in token positions:

- ``input_ids``, ``attention_mask`` (1 on every real token: prompt, policy and environment
  tokens are all attended to);
- ``loss_mask``: 1 exactly on policy tokens (``Trajectory`` segments of role ``policy``);
- ``sampler_logp``: the sampler's log-probs at policy tokens, 0 elsewhere;
- ``turn_rewards``: the environment's reward of turn k placed on the *last* token of policy
  turn k (0 elsewhere): the token-level input of per-turn credit and ``token_rewards``;
- ``rewards [R]``: the trajectory's outcome reward (repeated on each of its samples),
  ``group_ids [R]``, ``trajectory_ids [R]``, ``excluded [R]`` (bool: leave out of the loss
  and the group baseline, ``AgentConfig.failed_trajectories="mask"``);
- ``segments [S, 4]`` int64 ``(row, start, end, turn)``: the policy spans (several per row);
  ``state_keys[s]``: the state reached after segment ``s``'s turn.

A split trajectory's later sample that ended before any policy turn carries nothing to
train and is left out; a trajectory whose environment failed at ``reset`` has no tokens
and no row.

``as_rollout_batch()`` gives the same rows as a ``RolloutBatch`` (prompt once per group:
the group's shared prompt; ``completion_ids`` = everything after it; ``response_mask`` =
the loss mask), for the trainer's existing group layouts; it needs exactly G single-sample
rows per group sharing the prompt (raises ValueError otherwise, e.g. after a split).
Columns here are token positions; the trainer's ``[B, T-1]`` log-prob grid is column
``c`` = token ``c + 1`` (``loss_mask[:, 1:]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from fastrl.agents.trajectory import POLICY, Trajectory, TrajectorySample
from fastrl.rollout.base import RolloutBatch, RolloutStats

__all__ = ["AgentBatch", "collate_samples"]


@dataclass
class AgentBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    sampler_logp: torch.Tensor
    turn_rewards: torch.Tensor
    rewards: torch.Tensor
    group_ids: torch.Tensor
    trajectory_ids: torch.Tensor
    excluded: torch.Tensor
    segments: torch.Tensor
    state_keys: list[Any]
    prompt_lengths: list[int]
    group_size: int
    pad_token_id: int

    @classmethod
    def from_trajectories(cls, trajectories: Sequence[Trajectory], *, group_size: int, pad_token_id: int) -> "AgentBatch":
        # every trajectory's first sample (if it has tokens), and later samples with policy tokens
        rows = [(t_id, t, sample) for t_id, t in enumerate(trajectories) for k, sample in enumerate(t.samples)
                if sample.token_ids and (k == 0 or any(sample.loss_mask))]
        if not rows:
            raise ValueError("no trajectory has any tokens")
        R, T = len(rows), max(len(sample.token_ids) for _, _, sample in rows)
        input_ids = torch.full((R, T), int(pad_token_id), dtype=torch.long)
        attention_mask = torch.zeros(R, T, dtype=torch.long)
        loss_mask = torch.zeros(R, T, dtype=torch.long)
        sampler_logp = torch.zeros(R, T, dtype=torch.float32)
        turn_rewards = torch.zeros(R, T, dtype=torch.float32)
        segments, state_keys = [], []
        for r, (t_id, t, sample) in enumerate(rows):
            n = len(sample.token_ids)
            input_ids[r, :n] = torch.tensor(sample.token_ids, dtype=torch.long)
            attention_mask[r, :n] = 1
            loss_mask[r, :n] = torch.tensor(sample.loss_mask, dtype=torch.long)
            sampler_logp[r, :n] = torch.tensor(sample.sampler_logp, dtype=torch.float32)
            for s in sample.segments:
                if s.role != "policy":
                    continue
                segments.append((r, s.start, s.end, s.turn))
                if s.turn < len(t.turn_rewards):
                    turn_rewards[r, s.end - 1] = float(t.turn_rewards[s.turn])
                state_keys.append(t.state_keys[s.turn] if s.turn < len(t.state_keys) else None)
        return cls(
            input_ids=input_ids,
            attention_mask=attention_mask,
            loss_mask=loss_mask,
            sampler_logp=sampler_logp,
            turn_rewards=turn_rewards,
            rewards=torch.tensor([t.outcome_reward for _, t, _ in rows], dtype=torch.float32),
            group_ids=torch.tensor([t.group for _, t, _ in rows], dtype=torch.long),
            trajectory_ids=torch.tensor([t_id for t_id, _, _ in rows], dtype=torch.long),
            excluded=torch.tensor([t.excluded for _, t, _ in rows], dtype=torch.bool),
            segments=torch.tensor(segments, dtype=torch.long).reshape(-1, 4),
            state_keys=state_keys,
            prompt_lengths=[sample.prompt_length for _, _, sample in rows],
            group_size=group_size,
            pad_token_id=int(pad_token_id),
        )

    def as_rollout_batch(self) -> RolloutBatch:
        """The rows as a ``RolloutBatch`` with one shared prompt per group (see the module docstring)."""
        R, G = self.input_ids.shape[0], self.group_size
        if R % G or not torch.equal(self.group_ids, torch.arange(R // G).repeat_interleave(G)):
            raise ValueError("as_rollout_batch needs exactly group_size single-sample rows per group, in group order")
        lengths = self.attention_mask.sum(1).tolist()
        prompts, completions, logps = [], [], []
        for g in range(R // G):
            first = g * G
            prompt = self.input_ids[first, : self.prompt_lengths[first]].tolist()
            for r in range(first, first + G):
                if self.input_ids[r, : len(prompt)].tolist() != prompt or self.prompt_lengths[r] != len(prompt):
                    raise ValueError(f"the trajectories of group {g} do not share their prompt")
            prompts.append(prompt)
        for r in range(R):
            start = self.prompt_lengths[r]
            completions.append(self.input_ids[r, start: lengths[r]].tolist())
            logps.append(self.sampler_logp[r, start: lengths[r]].clone())
        batch = RolloutBatch.from_samples(
            prompts, completions, logps, ["stop"] * R, group_size=G, pad_token_id=self.pad_token_id,
            stats=RolloutStats(prompts=len(prompts), samples=R),
        )
        batch.input_ids = self.input_ids.clone()
        batch.attention_mask = self.attention_mask.clone()
        batch.response_mask = self.loss_mask.clone()
        batch.sampler_logp = self.sampler_logp.clone()
        return batch


def collate_samples(samples: Sequence[TrajectorySample], *, pad_token_id: int,
                    answer_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` ``[B, T]`` and the loss mask ``[B, T-1]``
    (column ``c`` scores token ``c + 1``: 1 on policy tokens, ``answer_weight`` on those of
    each sample's last policy turn, 0 elsewhere) of trajectory samples -- the inputs of
    ``fastrl.train.sft.sft_loss``, for a warm-up on ``demonstration_sample``s."""
    if not answer_weight > 0:
        raise ValueError(f"answer_weight must be > 0, got {answer_weight}")
    if not samples:
        raise ValueError("collate_samples needs at least one sample")
    B, T = len(samples), max(len(s.token_ids) for s in samples)
    input_ids = torch.full((B, T), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros(B, T, dtype=torch.long)
    loss_mask = torch.zeros(B, T, dtype=torch.float32)
    for b, sample in enumerate(samples):
        n = len(sample.token_ids)
        input_ids[b, :n] = torch.tensor(sample.token_ids, dtype=torch.long)
        attention_mask[b, :n] = 1
        loss_mask[b, :n] = torch.tensor(sample.loss_mask, dtype=torch.float32)
        policy_turns = [s for s in sample.segments if s.role == POLICY]
        if policy_turns and answer_weight != 1.0:
            last = policy_turns[-1].turn
            for segment in policy_turns:
                if segment.turn == last:
                    loss_mask[b, segment.start : segment.end] = answer_weight
    return input_ids, attention_mask, loss_mask[:, 1:]
