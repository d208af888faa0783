"""``Experience``: one step's tensors, carried by name from rollout to update.

The contract (every stage of ``trainer.py`` reads and fills these fields; nothing travels
as a positional list):

- The token grid is the rollout's right-padded ``[B, T]`` batch (``input_ids``,
  ``attention_mask``), samples flat in group order: the samples of prompt ``g`` are
  consecutive rows (``group(g)``, ``rows(groups)``; by ``batch.group_ids``): ``group_size``
  of them for single-turn rollouts, and for agent trajectories as many as the group's
  trajectories have training samples (a trajectory split where the chat template is not
  prefix-preserving has several; one whose environment failed at ``reset`` has none).
- ``packable``: every group is ``group_size`` rows ``prompt_ids[g] + completion_ids[r]``
  (the rows share the prompt), so a layout may pack it as ``[prompt | c_1 | ... | c_G]``;
  otherwise the layouts use padded rows.
- Per-token tensors are ``[B, T-1]`` fp32 on the training device, where column ``c``
  scores token ``c + 1`` (the convention of ``causal_lm_logprobs``): ``loss_mask``,
  ``sampler_logp``, ``old_logp``, ``ref_logp``, ``token_kl``, ``values``,
  ``token_rewards``, ``returns`` and, for GAE, ``advantages``. The advantage ops (KL,
  shaping, ``gae``, whitening) run on this grid; a batching (``batching.py``) gathers a
  micro-batch's inputs from it in the form its loss takes.
- ``loss_mask`` says which tokens are trained on; it is distinct from ``attention_mask``
  (which tokens are attended to): a multi-turn trajectory attends to tool outputs it does
  not train on. Today it is the completion tokens.
- Per-sequence tensors are ``[B]``: ``rewards`` (outcome), ``group_ids`` (the baseline
  groups: the prompt's index; an ``excluded`` row has a group of its own, so it moves no
  other sample's baseline and its own advantage is 0), and, for group estimators,
  ``advantages``.
- ``segments`` are the generated spans: ``[S, 3]`` int64 rows ``(sequence, start, end)`` in
  token positions of the grid: one span per sample for single-turn rollouts (its
  completion), one per policy turn for agent trajectories.
- Agent trajectories (``fastrl train --env``) add ``segment_turns [S]`` (the trajectory's
  turn index of each span), ``state_keys`` (per span: the environment state reached after
  that turn, GiGPO's step-group key), ``turn_rewards [B, T-1]`` (the environment's reward of
  each turn on the turn's last policy token, 0 elsewhere) and ``excluded [B]`` (trajectories
  left out of the loss and the baselines: their ``loss_mask`` rows are 0 and their
  ``group_ids`` their own). Single-turn experience leaves them None. ``from_agent_batch``
  builds it from a ``fastrl.agents.batch.AgentBatch``.
- Tree rollouts (``rollout=tree``) add ``tree_nodes [B, T-1]`` (each scored token's tree node)
  and ``tree_parents [M]`` (``fastrl.train.tree_collect``); the advantages' step groups are
  the children of each branch point.

Fields a stage has not computed are None (``old_logp`` when the update is exactly
on-policy, ``ref_logp`` without a KL term, ``values``/``returns`` without a critic).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Sequence

import torch

from fastrl.ops.aggregation import GlobalCounts
from fastrl.rollout.base import RolloutBatch, RolloutStats

if TYPE_CHECKING:
    from fastrl.agents.batch import AgentBatch

__all__ = ["Experience"]


@dataclass
class Experience:
    """One step's batch and everything computed on it (see the module docstring)."""

    batch: RolloutBatch
    """The sampler's batch: token ids as lists (``prompt_ids``, ``completion_ids``) and the ``[B, T]`` grid."""
    group_size: int
    loss_mask: torch.Tensor
    """``[B, T-1]`` fp32: 1 where a token is trained on."""
    sampler_logp: torch.Tensor
    """``[B, T-1]``: the sampler's log-probs of the sampled tokens."""
    rewards: torch.Tensor
    """``[B]`` fp32 outcome rewards."""
    group_ids: torch.Tensor
    """``[B]`` int64: the prompt each sample belongs to."""
    segments: torch.Tensor
    """``[S, 3]`` int64 ``(sequence, start, end)``: the generated spans."""
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    token_kl: torch.Tensor | None = None
    """``[B, T-1]`` KL estimate between the behaviour and reference policies (0 off the mask)."""
    values: torch.Tensor | None = None
    """``[B, T-1]`` the critic's values of the state before each token."""
    token_rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    """``[B]`` (group estimators) or ``[B, T-1]`` (GAE)."""
    returns: torch.Tensor | None = None
    segment_turns: torch.Tensor | None = None
    """``[S]`` int64: the turn index of each span of ``segments`` (agent trajectories)."""
    state_keys: list | None = None
    """Per span of ``segments``: the environment state reached after its turn (hashable)."""
    turn_rewards: torch.Tensor | None = None
    """``[B, T-1]`` fp32: each turn's environment reward on its last policy token."""
    excluded: torch.Tensor | None = None
    """``[B]`` bool: trajectories left out of the loss and the group baselines."""
    tree_nodes: torch.Tensor | None = None
    """Tree rollouts (``rollout=tree``): ``[B, T-1]`` int64, the tree node (segment) of each
    scored token, -1 off the completions (``fastrl.rollout.branch.TreeSpans.node_grid``)."""
    tree_parents: torch.Tensor | None = None
    """Tree rollouts: ``[M]`` int64, the parent of each node (-1: a group's root, its prompt)."""

    @classmethod
    def from_rollout(cls, batch: RolloutBatch, *, group_size: int, rewards: torch.Tensor | None = None,
                     device: torch.device) -> "Experience":
        """The experience of a sampled batch, per-token tensors on ``device``."""
        B = batch.input_ids.shape[0]
        starts = [len(batch.prompt_ids[b // group_size]) for b in range(B)]
        segments = torch.tensor([[b, s, s + len(batch.completion_ids[b])] for b, s in enumerate(starts)], dtype=torch.long)
        return cls(
            batch=batch,
            group_size=group_size,
            loss_mask=batch.response_mask[:, 1:].to(device).float(),
            sampler_logp=batch.sampler_logp[:, 1:].to(device),
            rewards=(rewards if rewards is not None else torch.zeros(B)).to(device),
            group_ids=batch.group_ids.to(device),
            segments=segments.reshape(-1, 3),
        )

    @classmethod
    def from_agent_batch(cls, agent: "AgentBatch", *, device: torch.device) -> "Experience":
        """The experience of a step's agent trajectories (``fastrl.agents.batch.AgentBatch``):
        the rows as a ``RolloutBatch`` (``as_rollout_batch`` when the groups can be packed,
        else padded rows with each row's own prompt), the loss mask 1 exactly on policy tokens
        of rows that are not ``excluded``, the policy spans with their turns and state keys,
        and the per-turn rewards. A trajectory split into several samples has one row per
        sample, each repeating the trajectory's outcome reward and group id; the estimator
        (``advantages.turn_tables``) finds the rows that continue a trajectory (their first
        policy turn is > 0) and counts each trajectory once in the group statistics."""
        try:
            batch = agent.as_rollout_batch()
        except ValueError:  # split samples, a failed reset, prompts that differ: padded rows
            batch = _padded_rollout_batch(agent)
        excluded = agent.excluded.clone()
        loss_mask = agent.loss_mask[:, 1:].float() * (~excluded).float()[:, None]
        n_groups = len(batch.prompt_ids)
        group_ids = batch.group_ids.clone()
        group_ids[excluded] = n_groups + torch.arange(int(excluded.sum()), dtype=torch.long)
        return cls(
            batch=batch,
            group_size=agent.group_size,
            loss_mask=loss_mask.to(device),
            sampler_logp=agent.sampler_logp[:, 1:].to(device),
            rewards=agent.rewards.float().to(device),
            group_ids=group_ids.to(device),
            segments=agent.segments[:, :3].clone(),
            segment_turns=agent.segments[:, 3].clone(),
            state_keys=list(agent.state_keys),
            turn_rewards=agent.turn_rewards[:, 1:].to(device),
            excluded=excluded.to(device),
        )

    # ------------------------------------------------------------------ shape
    @property
    def num_samples(self) -> int:
        return self.batch.input_ids.shape[0]

    @property
    def num_groups(self) -> int:
        return len(self.batch.prompt_ids)

    @property
    def device(self) -> torch.device:
        return self.loss_mask.device

    @cached_property
    def sequence_lengths(self) -> list[int]:
        """Tokens of each row (prompt + completion)."""
        return self.batch.attention_mask.sum(1).tolist()

    @cached_property
    def _group_starts(self) -> list[int]:
        """First row of each group, then the number of rows (groups are consecutive rows)."""
        counts = torch.bincount(self.batch.group_ids.cpu(), minlength=self.num_groups).tolist()
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + int(c))
        return starts

    def group(self, g: int) -> slice:
        """The rows of group ``g``."""
        return slice(self._group_starts[g], self._group_starts[g + 1])

    def rows(self, groups: Sequence[int] | None = None) -> torch.Tensor:
        """``[R]`` int64 row indices of ``groups`` (all groups when None), in batch order."""
        groups = range(self.num_groups) if groups is None else groups
        starts = self._group_starts
        return torch.tensor([r for g in groups for r in range(starts[g], starts[g + 1])], dtype=torch.long)

    @cached_property
    def packable(self) -> bool:
        """Every group is ``group_size`` rows ``prompt_ids[g] + completion_ids[r]`` (see the module docstring)."""
        batch, G = self.batch, self.group_size
        if self.num_samples != self.num_groups * G or self._group_starts != [g * G for g in range(self.num_groups + 1)]:
            return False
        lengths = self.sequence_lengths
        for r in range(self.num_samples):
            prompt = batch.prompt_ids[r // G]
            if len(prompt) + len(batch.completion_ids[r]) != lengths[r]:
                return False
        return True

    def spans(self, b: int) -> list[tuple[int, int]]:
        """The generated ``(start, end)`` token spans of sample ``b``."""
        mine = self.segments[self.segments[:, 0] == b]
        return [(int(s), int(e)) for _, s, e in mine.tolist()]

    def counts(self, rows: torch.Tensor) -> GlobalCounts:
        """Tokens and sequences trained on among ``rows`` (0-dim, on the device): this
        rank's part of a mini-batch's global counts (``Ranks.global_counts``)."""
        mask = self.loss_mask[rows.to(self.device)]
        return GlobalCounts(tokens=mask.sum(), sequences=(mask.sum(1) > 0).sum())

    @property
    def trained_tokens(self) -> torch.Tensor:
        """Tokens of the grid the model runs on (attention mask), for throughput."""
        return self.batch.attention_mask.sum()


def _padded_rollout_batch(agent: "AgentBatch") -> RolloutBatch:
    """An agent batch's rows as a ``RolloutBatch`` of padded rows: ``prompt_ids[g]`` the
    shortest prompt of group ``g``'s rows (the padded layout trims to the columns after
    it), ``completion_ids[r]`` what follows row ``r``'s own prompt."""
    lengths = agent.attention_mask.sum(1).tolist()
    # groups numbered 0..n-1 over the groups that have rows (all of a group's resets may have failed)
    group_ids = torch.unique(agent.group_ids, return_inverse=True)[1]
    groups = group_ids.tolist()
    n_groups = max(groups) + 1 if groups else 0
    prompts: list[list[int] | None] = [None] * n_groups
    completions, logps = [], []
    for r, g in enumerate(groups):
        start = agent.prompt_lengths[r]
        prompt = agent.input_ids[r, :start].tolist()
        if prompts[g] is None or len(prompt) < len(prompts[g]):
            prompts[g] = prompt
        completions.append(agent.input_ids[r, start:lengths[r]].tolist())
        logps.append(agent.sampler_logp[r, start:lengths[r]].clone())
    return RolloutBatch(
        prompt_ids=prompts, completion_ids=completions, group_ids=group_ids,
        finish_reasons=["stop"] * len(groups), completion_logp=logps, input_ids=agent.input_ids.clone(),
        attention_mask=agent.attention_mask.clone(), response_mask=agent.loss_mask.clone(),
        sampler_logp=agent.sampler_logp.clone(), stats=RolloutStats(prompts=n_groups, samples=len(groups)),
    )
