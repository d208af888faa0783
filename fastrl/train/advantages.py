"""Advantages of a step's ``Experience``: a group estimator, a turn mode, or PPO's critic and GAE.

``estimate(exp, ...)`` fills ``exp.token_kl`` (with a reference policy), ``exp.advantages``
and, for PPO, ``exp.token_rewards``, ``exp.values`` and ``exp.returns``; it returns the
step's ``kl/...``, ``advantage/...`` and ``groups/...`` metrics. Every formula is a fastrl
op (``kl_penalty``, ``token_rewards``/``sequence_rewards``, ``gae``, ``group_advantages``,
``turn_advantages``, ``place_turn_rewards``, ``masked_mean_std``); batch-level statistics go
through ``Ranks`` so they are the whole batch's under torchrun.

KL in the reward (``kl_in_reward``): per token ``-beta * KL_t`` (PPO), or
``outcome - beta * sum_t KL_t`` for group estimators and turn modes; ``KL_t`` is the chosen
estimator between the behaviour policy (old log-probs, or the sampler's) and the reference.

Agent trajectories (``exp.segment_turns`` set, ``fastrl train --env``)
-------------------------------------------------------------------
``turn_tables(exp)`` turns the Experience's agent fields into turn tables
(``TurnTables``): per row on the ``[B, T-1]`` grid (column ``c`` = token ``c + 1``, so the
policy span ``[start, end)`` in token positions is columns ``[start - 1, end - 1)``) the turn
index of each policy column, and per *trajectory* ``[N, K]`` the turn rewards (the sum of
``exp.turn_rewards`` over each turn's columns: its value on the turn's last policy token) and
the GiGPO anchor keys. Scatters and cumulative sums: no loop over turns or groups (the state
keys are Python objects, hashed once per span). The turn modes run ``turn_advantages`` on the
``[N, K]`` turn grid (one row per trajectory, one column per turn) and gather ``A[n, k]``
onto each row's policy columns; group modes give each trajectory one advantage, on all its
rows.

- Rows and trajectories: the samples of one trajectory are consecutive rows
  (``AgentBatch.from_trajectories``) and only its first sample starts at turn 0, so a row
  whose first policy turn is > 0 continues the row before it (a trajectory split where the
  chat template is not prefix-preserving). A trajectory's outcome, group and exclusion are
  its first row's; group statistics count trajectories, not rows. A turn without policy
  tokens is a present turn with an empty span.
- GiGPO's step group is the state a turn *acted in* (its anchor state, arXiv:2505.10978:
  the step groups of identical states): for turn k >= 1 that is the state reached after turn k - 1
  (``exp.state_keys`` holds the state reached after each span's turn), for turn 0 the first
  observation, which all G trajectories of a group share (one row and one environment seed
  per group). The first observation has no key of its own, so turn 0 gets the key
  ``INITIAL_STATE``: a later return to the start state is a different step group.
- State keys are hashed to int64 by ``state_key_hash`` (BLAKE2b of the key's type name and
  ``repr``: the same in every process and run, unlike Python's salted ``hash``). ``str``,
  ``int``, ``bytes`` and tuples of them are stable; an object whose ``repr`` shows its address
  is not.
- Excluded trajectories (``exp.excluded``) get advantage 0 and stay out of every group
  statistic: the estimators run on the other trajectories only (group and turn modes alike);
  for PPO their tokens are left out of GAE and of the whitening.
- ``broadcast`` (GRPO's episode advantage on every policy token) is a group mode here:
  ``advantage_mode grpo`` (or ``dr_grpo``) on agent trajectories.
- PPO (``gae``) on agents: per-turn rewards on each turn's last policy token
  (``place_turn_rewards``), plus ``-beta * KL_t`` on policy tokens with ``kl_in_reward``, then
  GAE over the policy tokens only (``gae`` with the loss mask; ``turn_gae`` is exactly this
  composition): the recursion steps from one policy token to the next *policy* token,
  skipping environment tokens, whose values and rewards are never read. This is verl's
  convention (``compute_gae_advantage_return`` skips observation tokens); SkyRL steps
  through every token, environment tokens included, which fastrl does not implement. The
  outcome is not added again: the environment's final step reward is the last turn's reward
  (``fastrl.agents.env``). GAE runs per row: a split trajectory's earlier sample does not
  bootstrap from its later sample's first value.

Metrics of the turn modes: ``advantage/turn_groups`` (step groups for ``gigpo``, (group, turn
index) groups for ``turn_discounted``), ``advantage/frac_singleton_turn_groups`` (their share
with one member: step advantage 0), ``advantage/frac_all_equal_turn_groups`` and
``advantage/frac_rows_turn_varying`` (the share of rows whose policy tokens get more than one
value: 0 under broadcast); on agents also ``advantage/excluded`` (trajectories left out).

A new advantage estimator is a mode of ``group_advantages`` (``fastrl/ops/advantages.py``,
its specification in ``fastrl/reference/advantages.py``) or of ``turn_advantages``
(``fastrl/ops/turn_advantages.py``, ``fastrl/reference/turn_advantages.py``) that
``TrainConfig.advantage_mode`` and the algorithm presets name; nothing here changes.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from fastrl.ops import gae, kl_penalty
from fastrl.ops.shaping import sequence_rewards, token_rewards
from fastrl.ops.turn_advantages import place_turn_rewards, turn_advantages, turn_index_from_spans
from fastrl.train.config import TrainConfig
from fastrl.train.experience import Experience

__all__ = ["INITIAL_STATE", "MONITOR_ADVANTAGE_MODE", "TurnTables", "estimate", "state_key_hash", "turn_tables"]

MONITOR_ADVANTAGE_MODE = "dr_grpo"
"""PPO and the turn modes log group statistics (how many prompts carry signal) from this group estimator."""

INITIAL_STATE = "fastrl:initial-state"
"""The anchor key of every trajectory's turn 0 (the group's shared first observation)."""

_HASH_BYTES = 8  # int64 keys


def state_key_hash(key: Any) -> int:
    """A deterministic int64 of a state key: BLAKE2b of ``(type name, repr(key))``."""
    digest = hashlib.blake2b(f"{type(key).__qualname__}:{key!r}".encode(), digest_size=_HASH_BYTES).digest()
    return int.from_bytes(digest, "little", signed=True)


@dataclass
class TurnTables:
    """The turns of a batch of agent trajectories: per row on the ``[B, T-1]`` grid, and per
    trajectory (``N`` trajectories; a split trajectory has several rows)."""

    turn_index: torch.Tensor
    """``[B, T-1]`` int64: the (trajectory's) turn of each policy column, -1 outside every span."""
    row_turns: torch.Tensor
    """``[B]`` int64: 1 + the row's last turn (0 for a row without policy spans)."""
    row_turn_rewards: torch.Tensor
    """``[B, K]`` float64: the reward of each turn whose span is in the row (0 elsewhere)."""
    trajectory: torch.Tensor
    """``[B]`` int64: the trajectory of each row, in [0, N)."""
    first_row: torch.Tensor
    """``[N]`` int64: each trajectory's first row (its outcome, group and exclusion)."""
    num_turns: torch.Tensor
    """``[N]`` int64: trajectory n has turns 0 .. num_turns[n] - 1."""
    turn_rewards: torch.Tensor
    """``[N, K]`` float64: the environment's reward of each turn (0 at k >= num_turns)."""
    anchor_keys: torch.Tensor
    """``[N, K]`` int64: hash of the state each turn acted in (GiGPO's step-group key)."""


def turn_tables(exp: Experience) -> TurnTables:
    """The turn tables of ``exp``'s agent fields (see the module docstring)."""
    device = exp.device
    B, C = exp.loss_mask.shape
    seg = exp.segments.to(torch.long).reshape(-1, 3).cpu()
    turns = exp.segment_turns.to(torch.long).reshape(-1).cpu()
    if turns.numel() != seg.shape[0]:
        raise ValueError(f"segment_turns has {turns.numel()} entries for {seg.shape[0]} segments")
    if exp.turn_rewards is None:
        raise ValueError("agent Experience without turn_rewards ([B, T-1], each turn's reward on its last policy token)")
    rows, start, end = seg[:, 0], seg[:, 1], seg[:, 2]
    S = rows.numel()
    K = int(turns.max()) + 1 if S else 1
    row_turns = torch.zeros(B, dtype=torch.long).scatter_reduce(0, rows, turns + 1, reduce="amax")
    first = torch.full((B,), K, dtype=torch.long).scatter_reduce(0, rows, turns, reduce="amin")
    continues = (row_turns > 0) & (first > 0)  # a split trajectory's later sample: the row before is the same trajectory
    if B and bool(continues[0]):
        raise ValueError(f"row 0's first policy turn is {int(first[0])}: a trajectory's first row starts at turn 0")
    trajectory = torch.cumsum((~continues).to(torch.long), 0) - 1
    first_row = (~continues).nonzero().reshape(-1)
    N = first_row.numel()
    num_turns = torch.zeros(N, dtype=torch.long).scatter_reduce(0, trajectory, row_turns, reduce="amax")
    # grid columns of each span; a turn not in the row gets the empty span at the previous end
    ends = torch.full((B, K), -1, dtype=torch.long).index_put_((rows, turns), (end - 1).clamp(min=0))
    starts = torch.full((B, K), -1, dtype=torch.long).index_put_((rows, turns), (start - 1).clamp(min=0))
    prev_end = torch.cummax(ends, dim=1).values.clamp(min=0)
    turn_end = torch.where(ends >= 0, ends, prev_end)
    turn_start = torch.where(starts >= 0, starts, prev_end)
    turn_index, in_turn = turn_index_from_spans(turn_start.to(device), turn_end.to(device), row_turns.to(device),
                                                seq_len=C)
    per_column = torch.where(in_turn, exp.turn_rewards.to(device=device, dtype=torch.float64), 0.0)
    row_rewards = torch.zeros(B, K, dtype=torch.float64, device=device).scatter_add_(1, turn_index.clamp(min=0),
                                                                                     per_column)
    trajectory_d = trajectory.to(device)
    rewards = torch.zeros(N, K, dtype=torch.float64, device=device).index_add_(0, trajectory_d, row_rewards)
    keys = exp.state_keys if exp.state_keys is not None else [None] * S
    if len(keys) != S:
        raise ValueError(f"state_keys has {len(keys)} entries for {S} segments")
    after = torch.full((N, K), state_key_hash(None), dtype=torch.long)
    after.index_put_((trajectory[rows], turns), torch.tensor([state_key_hash(k) for k in keys], dtype=torch.long))
    anchor = torch.cat([torch.full((N, 1), state_key_hash(INITIAL_STATE), dtype=torch.long), after[:, :-1]], dim=1)
    return TurnTables(turn_index=turn_index, row_turns=row_turns.to(device), row_turn_rewards=row_rewards,
                      trajectory=trajectory_d, first_row=first_row.to(device), num_turns=num_turns.to(device),
                      turn_rewards=rewards, anchor_keys=anchor.to(device))


def _take(x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    return x if keep is None else x[keep]


def _put(values: torch.Tensor, keep: torch.Tensor | None, n: int) -> torch.Tensor:
    """An ``[n, ...]`` zero tensor whose entries ``keep`` are ``values`` (``values`` itself when None)."""
    if keep is None:
        return values
    out = values.new_zeros((n, *values.shape[1:]))
    out[keep] = values
    return out


def _group_advantages(ranks, values: torch.Tensor, group_ids: torch.Tensor, mode: str):
    """``ranks.gather_groups``; in one process, nothing to compute when every trajectory is excluded."""
    if values.numel() == 0 and ranks.whole_batch:
        return values.float(), {"frac_all_equal_groups": 0.0, "effective_group_ratio": 0.0}
    return ranks.gather_groups(values, group_ids, mode=mode)


@dataclass
class _Trajectories:
    """The trajectory view of an agent Experience: its turn tables, the kept (not excluded)
    trajectories and their group ids and (shaped) outcomes."""

    tables: TurnTables
    keep: torch.Tensor | None
    """``[N_kept]`` indices of the trajectories not excluded (None: all)."""
    group_ids: torch.Tensor
    outcome: torch.Tensor
    """``[N_kept]``: outcome, minus ``beta * sum_t KL_t`` over all its rows with ``kl_in_reward``."""


def _trajectories(exp: Experience, token_kl: torch.Tensor | None, kl_coef: float) -> _Trajectories:
    tables = turn_tables(exp)
    N = tables.first_row.numel()
    keep = None
    if exp.excluded is not None:
        excluded = exp.excluded.to(torch.bool)[tables.first_row].cpu()
        if bool(excluded.any()):
            keep = (~excluded).nonzero().reshape(-1).to(exp.device)
    kl = None
    if token_kl is not None:
        kl = torch.zeros(N, dtype=token_kl.dtype, device=exp.device).index_add_(0, tables.trajectory, token_kl.sum(1))[:, None]
    outcome = sequence_rewards(exp.rewards[tables.first_row], token_kl=kl, kl_coef=kl_coef)
    return _Trajectories(tables, keep, _take(exp.group_ids[tables.first_row], keep), _take(outcome, keep))


def _turn_mode(exp: Experience, tr: _Trajectories, *, cfg: TrainConfig, ranks) -> tuple[torch.Tensor, dict[str, float]]:
    """``turn_advantages`` (``cfg.advantage_mode``) over the kept trajectories' turns
    (``[N, K]``: one row per trajectory, one column per turn), gathered onto each row's policy
    columns: ``[B, T-1]`` advantages and the turn-group metrics."""
    tables, mode = tr.tables, cfg.advantage_mode
    N, K = tables.turn_rewards.shape
    n_turns = _take(tables.num_turns, tr.keep)
    if n_turns.numel() == 0:  # every trajectory excluded (the collectives below still run)
        adv = torch.zeros_like(exp.loss_mask)
        zero = torch.zeros((), dtype=torch.float64, device=exp.device)
        stats = {"turn_groups": zero, "frac_singleton_turn_groups": zero, "frac_all_equal_turn_groups": zero}
    else:
        columns = torch.arange(K, device=exp.device).expand(n_turns.numel(), K)
        per_turn, stats = turn_advantages(
            columns, columns < n_turns[:, None], _take(tables.turn_rewards, tr.keep), n_turns, tr.outcome, tr.group_ids,
            mode=mode, state_keys=_take(tables.anchor_keys, tr.keep) if mode == "gigpo" else None,
            gamma=cfg.turn_gamma, step_coef=cfg.step_coef, turn_coef=cfg.turn_coef, outcome_coef=cfg.outcome_coef,
            final_turn_coef=cfg.final_turn_coef if mode == "turn_discounted" else None, norm=cfg.turn_norm,
        )  # [N_kept, K]: A[n, k]
        per_turn = _put(per_turn, tr.keep, N)[tables.trajectory]  # [B, K]
        on = (exp.loss_mask > 0) & (tables.turn_index >= 0)
        adv = torch.where(on, torch.gather(per_turn, 1, tables.turn_index.clamp(min=0)), 0.0)
    groups = stats["turn_groups"].double()
    total = float(ranks.sum(groups))
    metrics = {"advantage/turn_groups": total}
    for name in ("frac_singleton_turn_groups", "frac_all_equal_turn_groups"):
        metrics[f"advantage/{name}"] = float(ranks.sum(stats[name].double() * groups)) / max(total, 1.0)
    # rows whose policy tokens do not all get one value (0 under broadcast): the share the turn credit reached
    on = exp.loss_mask > 0
    if exp.excluded is not None:
        on = on & ~exp.excluded.to(torch.bool)[:, None]
    varies = torch.where(on, adv, -math.inf).amax(1) > torch.where(on, adv, math.inf).amin(1)
    rows = float(ranks.sum(on.any(1).sum()))
    metrics["advantage/frac_rows_turn_varying"] = float(ranks.sum(varies.sum())) / max(rows, 1.0)
    return adv, metrics


def estimate(exp: Experience, *, cfg: TrainConfig, ranks, kl_coef: float,
             critic_values: Callable[[Experience], torch.Tensor] | None = None) -> dict[str, float]:
    """Fill ``exp``'s advantages (see the module docstring). ``critic_values(exp)``: the
    critic's ``[B, T-1]`` values (PPO, ``cfg.uses_critic``)."""
    metrics: dict[str, float] = {}
    if exp.ref_logp is not None:
        behaviour = exp.old_logp if exp.old_logp is not None else exp.sampler_logp
        exp.token_kl = torch.where(exp.loss_mask > 0, kl_penalty(behaviour, exp.ref_logp, estimator=cfg.kl_estimator), 0.0)
        metrics["kl/ref_seq"] = float(ranks.sum(exp.token_kl.sum(1).sum()) / ranks.sum(exp.num_samples))
        metrics["kl/coef"] = kl_coef
    shaping_kl = exp.token_kl if cfg.kl_in_reward else None
    agent = exp.segment_turns is not None
    if cfg.uses_turns and not agent:
        raise ValueError(f"advantage_mode {cfg.advantage_mode} needs agent trajectories (Experience.segment_turns)")
    mask = exp.loss_mask
    tr = None
    if agent:
        tr = _trajectories(exp, None if cfg.uses_critic else shaping_kl, kl_coef)
        N = tr.tables.first_row.numel()
        metrics["advantage/excluded"] = float(ranks.sum(0 if tr.keep is None else N - tr.keep.numel()))
        if exp.excluded is not None:
            mask = exp.loss_mask * (~exp.excluded.to(torch.bool)).to(exp.loss_mask.dtype)[:, None]
    if cfg.uses_critic:
        if agent:
            tables = tr.tables
            kl_part = None if shaping_kl is None else -kl_coef * shaping_kl
            exp.token_rewards = place_turn_rewards(tables.turn_index, mask, tables.row_turn_rewards, tables.row_turns,
                                                   token_rewards=kl_part)
        else:
            exp.token_rewards = token_rewards(exp.rewards, exp.loss_mask, token_kl=shaping_kl, kl_coef=kl_coef)
        exp.values = critic_values(exp)
        whiten_here = cfg.whiten_advantages and ranks.whole_batch
        exp.advantages, exp.returns = gae(exp.token_rewards, exp.values, mask, gamma=cfg.gamma, lam=cfg.lam,
                                          whiten=whiten_here)
        if cfg.whiten_advantages and not whiten_here:
            exp.advantages = ranks.whiten(exp.advantages, mask)
        if agent:
            outcome = _take(exp.rewards[tr.tables.first_row], tr.keep)
            adv_stats = _group_advantages(ranks, outcome, tr.group_ids, MONITOR_ADVANTAGE_MODE)[1]  # monitoring only
        else:
            adv_stats = ranks.gather_groups(exp.rewards, exp.group_ids, mode=MONITOR_ADVANTAGE_MODE)[1]
    elif agent:
        if cfg.uses_turns:
            exp.advantages, turn_metrics = _turn_mode(exp, tr, cfg=cfg, ranks=ranks)
            metrics.update(turn_metrics)
            adv_stats = _group_advantages(ranks, tr.outcome, tr.group_ids, MONITOR_ADVANTAGE_MODE)[1]
        else:  # a group mode: one advantage per trajectory, on each of its rows (the op's "broadcast")
            adv, adv_stats = _group_advantages(ranks, tr.outcome, tr.group_ids, cfg.advantage_mode)
            exp.advantages = _put(adv, tr.keep, tr.tables.first_row.numel())[tr.tables.trajectory]
            if exp.tree_nodes is not None:  # branching trajectories: each branch point's children against their siblings
                metrics.update(tree_step_credit(exp, cfg=cfg, ranks=ranks))
    else:
        shaped = sequence_rewards(exp.rewards, token_kl=shaping_kl, kl_coef=kl_coef)
        exp.advantages, adv_stats = ranks.gather_groups(shaped, exp.group_ids, mode=cfg.advantage_mode)
        if exp.tree_nodes is not None:  # a tree rollout: each branch point's children against their siblings
            metrics.update(tree_step_credit(exp, cfg=cfg, ranks=ranks))
    adv = exp.advantages
    per_token = adv if adv.dim() == 2 else adv[:, None].expand_as(exp.loss_mask)
    metrics["advantage/mean"], metrics["advantage/std"] = ranks.masked_mean_std(per_token, mask)
    metrics["groups/frac_all_equal"] = float(adv_stats["frac_all_equal_groups"])
    metrics["groups/effective_ratio"] = float(adv_stats["effective_group_ratio"])
    return metrics


def tree_step_credit(exp: Experience, *, cfg: TrainConfig, ranks) -> dict[str, float]:
    """Tree rollouts (``rollout=tree``, ``exp.tree_nodes`` set; single-turn, or agent trajectories
    branching at turns, ``agent.tree_collect``), group modes: the leaves' group
    advantage ``A^E_b`` (already in ``exp.advantages``, ``[B]``) plus ``step_coef`` times each
    token's step advantage among the siblings of its segment (``tree_step_advantages`` over the
    outcome rewards, F_norm ``turn_norm``; the formulas are in ``fastrl.reference.tree_advantages``):

        A[b, t] = A^E_b + step_coef * A^S[b, t]      ([B, T-1], on the loss mask)

    The step groups lie inside one prompt's tree, so each rank's are whole (groups are
    sharded whole). KL-in-reward shaping enters the episode term only. Metrics:
    ``advantage/tree_branch_points`` (step groups of two or more siblings, all ranks) and
    ``advantage/frac_all_equal_branch_points`` (their share with one value: no step signal)."""
    from fastrl.ops.tree_advantages import tree_step_advantages

    nodes = torch.where(exp.loss_mask > 0, exp.tree_nodes.to(exp.device), -1)
    step, stats = tree_step_advantages(exp.rewards.float(), nodes, exp.tree_parents.to(exp.device), norm=cfg.turn_norm)
    base = exp.advantages if exp.advantages.dim() == 2 else exp.advantages[:, None].expand_as(exp.loss_mask)
    exp.advantages = base + cfg.step_coef * step.to(base.dtype)
    points = stats["branch_points"].double()
    total = float(ranks.sum(points))
    return {"advantage/tree_branch_points": total,
            "advantage/frac_all_equal_branch_points": float(ranks.sum(stats["frac_all_equal_branch_points"].double() * points))
            / max(total, 1.0)}
