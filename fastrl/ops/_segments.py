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
    rank_sorted: torch.Tensor  # [N] int64: dense group index of the i-th sorted element
    is_first: torch.Tensor  # [N] bool: sorted element starts a new group
    num_groups: torch.Tensor  # 0-dim int64

    def rank(self) -> torch.Tensor:
        """[N] int64 dense group index of each element, in the original order."""
        return torch.empty_like(self.rank_sorted).scatter_(0, self.perm, self.rank_sorted)

    def counts_starts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[N] int64 member count of group g and its offset in the sorted order (0 and N
        for the slots past the last group)."""
        counts = torch.zeros_like(self.rank_sorted).index_add_(0, self.rank_sorted, torch.ones_like(self.rank_sorted))
        return counts, torch.cumsum(counts, 0) - counts


def dense_groups(group_ids: torch.Tensor) -> DenseGroups:
    """Group structure of a 1-D integer id tensor, computed on its device without a sync."""
    ids = group_ids.reshape(-1).to(torch.int64)
    N = ids.numel()
    sorted_ids, perm = torch.sort(ids, stable=True)
    is_first = torch.empty(N, dtype=torch.bool, device=ids.device)
    is_first[:1] = True
    torch.ne(sorted_ids[1:], sorted_ids[:-1], out=is_first[1:])
    rank_sorted = torch.cumsum(is_first, 0) - 1
    return DenseGroups(perm, rank_sorted, is_first, is_first.sum())


def kernel_mask(mask: torch.Tensor) -> torch.Tensor:
    """A flat contiguous mask a Triton kernel can load and compare with 0 (bool -> uint8 view)."""
    mask = mask.contiguous()
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    return mask
