"""Step advantages over the branch points of tree rollouts: each segment's value against its siblings'.

``tree_step_advantages(rewards, node_of, parents, norm=, eps=)`` is the vectorised form of
``fastrl.reference.tree_advantages.tree_step_advantages_reference`` (the specification and
its formulas are there): node values by one scatter of the rows' outcomes into a ``[B, M]``
membership table, sibling statistics by ``index_add`` over the parents, one gather back
onto the tokens. No Python loop over nodes, rows or tokens and no host synchronisation
(the statistics come back as 0-dim tensors). The work is ``O(B * (T + M))`` on tensors of
nodes, tiny beside a forward, so there is no Triton kernel: the PyTorch path runs on any
device.
"""

from __future__ import annotations

import torch

from fastrl._checks import check_choice
from fastrl.reference.tree_advantages import NORMS

__all__ = ["tree_step_advantages"]


def _check(rewards: torch.Tensor, node_of: torch.Tensor, parents: torch.Tensor) -> None:
    for name, x in (("rewards", rewards), ("node_of", node_of), ("parents", parents)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if not rewards.is_floating_point() or rewards.dim() != 1:
        raise ValueError(f"rewards must be a float [B] tensor, got {rewards.dtype} {tuple(rewards.shape)}")
    if node_of.dim() != 2 or node_of.shape[0] != rewards.shape[0] or node_of.is_floating_point():
        raise ValueError(f"node_of must be an integer [B, T] tensor with B = {rewards.shape[0]}, got {node_of.dtype} "
                         f"{tuple(node_of.shape)}")
    if parents.dim() != 1 or parents.is_floating_point():
        raise ValueError(f"parents must be an integer [M] tensor, got {parents.dtype} {tuple(parents.shape)}")
    if node_of.device.type == "cpu" and parents.device.type == "cpu":  # value checks only where they cost no sync
        M = parents.numel()
        if node_of.numel() and int(node_of.max()) >= M:
            raise ValueError(f"node_of holds node {int(node_of.max())}, but parents has {M} nodes")
        if M and (int(parents.min()) < -1 or int(parents.max()) >= M):
            raise ValueError(f"parents must hold node indices in [-1, {M}), got [{int(parents.min())}, {int(parents.max())}]")


def tree_step_advantages(rewards: torch.Tensor, node_of: torch.Tensor, parents: torch.Tensor, *, norm: str = "std",
                         eps: float = 1e-6) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``[B, T]`` step advantages ``A^S[b, t]`` (fp32, fp64 for fp64 rewards) and the
    statistics ``branch_points`` / ``frac_all_equal_branch_points`` (0-dim tensors).

    ``rewards`` [B]: each row's outcome; ``node_of`` [B, T]: each token's node (< 0: none);
    ``parents`` [M]: each node's parent (-1: a root). ``norm``: ``"std"`` or ``"none"``."""
    check_choice("norm", norm, NORMS)
    _check(rewards, node_of, parents)
    dt = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    dev = rewards.device
    B, T = node_of.shape
    M = parents.numel()
    R = rewards.to(dt)
    node_of = node_of.to(dev, torch.long)
    parents = parents.to(dev, torch.long)
    on = node_of >= 0
    member = torch.zeros(B, M + 1, dtype=dt, device=dev)
    member.scatter_(1, torch.where(on, node_of, M), 1.0)  # slot M collects the tokens of no node
    member = member[:, :M]
    count = member.sum(0)
    has = count > 0
    value = (member * R[:, None]).sum(0) / count.clamp(min=1)  # V(n) [M]
    # step groups: the children with leaves of each parent (slot M: roots and empty nodes)
    group = torch.where(has & (parents >= 0), parents, M)
    size = torch.zeros(M + 1, dtype=dt, device=dev).index_add_(0, group, has.to(dt))
    total = torch.zeros(M + 1, dtype=dt, device=dev).index_add_(0, group, torch.where(has, value, 0.0))
    mean = total / size.clamp(min=1)
    dev_ = torch.where(has, value - mean[group], 0.0)
    sq = torch.zeros(M + 1, dtype=dt, device=dev).index_add_(0, group, dev_.square())
    std = (sq / (size - 1).clamp(min=1)).sqrt()
    step = dev_ / (std[group] + eps) if norm == "std" else dev_
    real = (size[group] >= 2) & (group < M)
    step = torch.where(real, step, 0.0)
    out = torch.where(on, step[node_of.clamp(min=0)], torch.zeros((), dtype=dt, device=dev))
    points = (size[:M] >= 2).to(dt)
    n_points = points.sum()
    hi = torch.full((M + 1,), -torch.inf, dtype=dt, device=dev).scatter_reduce_(0, group, torch.where(has, value, -torch.inf), "amax")
    lo = torch.full((M + 1,), torch.inf, dtype=dt, device=dev).scatter_reduce_(0, group, torch.where(has, value, torch.inf), "amin")
    all_equal = points * (hi[:M] == lo[:M]).to(dt)
    stats = {"branch_points": n_points, "frac_all_equal_branch_points": all_equal.sum() / n_points.clamp(min=1)}
    return out, stats
