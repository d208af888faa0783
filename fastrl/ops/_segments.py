"""Helpers shared by the advantage ops: dense group ranks without a host sync.

``torch.unique`` synchronises with the host on CUDA (its output size depends on the
data). Instead the ids are sorted, group boundaries are marked and a cumulative sum
turns them into a dense rank in [0, N). Every per-group buffer has N slots; the slots
past the last group stay empty, so no shape ever depends on tensor values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DenseGroups:
    perm: torch.Tensor  # [N] int64: indices that sort the ids (stable)
    rank: torch.Tensor  # [N] int64: dense group index of each element, original order
    rank_sorted: torch.Tensor  # [N] int64: rank[perm]
    is_first: torch.Tensor  # [N] bool: sorted element starts a new group
    counts: torch.Tensor  # [N] int64: members of group g (0 past the last group)
    starts: torch.Tensor  # [N] int64: offset of group g in the sorted order
    num_groups: torch.Tensor  # 0-dim int64


def dense_groups(group_ids: torch.Tensor) -> DenseGroups:
    """Group structure of a 1-D integer id tensor, computed on its device without a sync."""
    ids = group_ids.reshape(-1).to(torch.int64)
    N = ids.numel()
    sorted_ids, perm = torch.sort(ids, stable=True)
    is_first = torch.ones(N, dtype=torch.bool, device=ids.device)
    if N > 1:
        is_first[1:] = sorted_ids[1:] != sorted_ids[:-1]
    rank_sorted = torch.cumsum(is_first, 0) - 1
    rank = torch.empty_like(rank_sorted).scatter_(0, perm, rank_sorted)
    counts = torch.zeros(N, dtype=torch.int64, device=ids.device)
    counts.index_add_(0, rank_sorted, torch.ones_like(rank_sorted))
    starts = torch.cumsum(counts, 0) - counts
    return DenseGroups(perm, rank, rank_sorted, is_first, counts, starts, is_first.sum())


def kernel_mask(mask: torch.Tensor) -> torch.Tensor:
    """A flat contiguous mask a Triton kernel can load and compare with 0 (bool -> uint8 view)."""
    mask = mask.contiguous()
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    return mask
