"""Shared-prefix attention for training: the depth-2 case of the prefix-tree kernels.

Layout (built on the host by ``fastrl.ops.shared_prefix_attention.SharedPrefixLayout``):
``q [N, Hq, D]``, ``k/v [N, Hkv, D]`` and, per token, int32 ``doc_start``, ``prefix_end``,
``seg_start`` (query side) and ``query_end`` (key side). Query i attends key j iff::

    j <= i  and  (doc_start[i] <= j < prefix_end[i]  or  j >= seg_start[i])

which is the tree mask ``j <= i < key_end[j]`` with ``key_end = query_end`` (a prompt key's
subtree is its document, a completion key's its completion). So there are no kernels here:
these launchers derive the tree kernels' inputs from the per-token bounds on the device (no
host sync, no Python loop over tokens) and run ``csrc_triton.tree_attention``. A special
case would not pay: the tree forward visits the same key blocks a two-range kernel visits
(its block list is exactly the prefix blocks plus the own-segment blocks of each query
tile), reads one int32 ``key_end`` per key instead of three bounds per query, and tests one
interval per score instead of two ranges.

* The forward's block list: query tile ``[m0, m1]`` needs the key blocks of
  ``[doc_start[m0], min(prefix_end[m0], seg_start[m0]))`` (the prefix of its first token's
  document, when that token is a completion's) and of ``[seg_start[m0], m1]`` (from its first
  token's segment on: a later document's prefix and segments lie in it), a shared boundary
  block once.
* ``key_end`` for the forward (which gets no ``query_end``): a prompt key's document end, a
  completion key's segment end, by binary search in the non-decreasing ``doc_start`` and
  ``seg_start``.
* The backward without a host layout runs one dK/dV item per key tile (no split of the
  prompt tiles' long query ranges); ``fastrl.ops.shared_prefix_attention`` passes the split
  work items of its ``TreeLayout``.
"""

from __future__ import annotations

import torch
import triton

from csrc_triton.tree_attention import tiles_for, tree_attention_bwd, tree_attention_fwd

__all__ = ["depth2_block_lists", "depth2_key_end", "shared_prefix_attention_fwd", "shared_prefix_attention_bwd"]


def depth2_key_end(doc_start: torch.Tensor, prefix_end: torch.Tensor, seg_start: torch.Tensor) -> torch.Tensor:
    """int32 ``[N]``: one past the last query that attends each key (``query_end``)."""
    j = torch.arange(doc_start.shape[0], device=doc_start.device, dtype=doc_start.dtype)
    doc_end = torch.searchsorted(doc_start, doc_start, right=True)
    seg_end = torch.searchsorted(seg_start, seg_start, right=True)
    return torch.where(j < prefix_end, doc_end, seg_end).to(torch.int32)


def depth2_block_lists(
    doc_start: torch.Tensor, prefix_end: torch.Tensor, seg_start: torch.Tensor, block_m: int, block_n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query tile of ``block_m`` tokens, the key blocks of ``block_n`` tokens it needs,
    ascending, as CSR int32 ``(ptr [tiles + 1], blocks)``. Built on the device without a
    sync: ``blocks`` has room for ``tiles * cdiv(N, block_n)`` entries, of which the first
    ``ptr[-1]`` are used."""
    N = doc_start.shape[0]
    dev = doc_start.device
    tiles, width = triton.cdiv(N, block_m), triton.cdiv(N, block_n)
    first = torch.arange(tiles, device=dev, dtype=torch.int64) * block_m
    last = torch.clamp(first + block_m, max=N) - 1
    seg_lo = seg_start[first].long()
    pre_lo = doc_start[first].long()
    pre_hi = torch.minimum(prefix_end[first].long(), seg_lo)  # a later document's prefix lies in [seg_lo, last]
    n_pre = torch.where(pre_hi > pre_lo, (pre_hi + block_n - 1) // block_n - pre_lo // block_n, 0)
    pb_lo = pre_lo // block_n
    sb_lo = torch.maximum(seg_lo // block_n, pb_lo + n_pre)  # a block the prefix range ends in: once
    n_seg = torch.clamp(last // block_n + 1 - sb_lo, min=0)
    count = n_pre + n_seg
    ptr = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), torch.cumsum(count, 0)])
    i = torch.arange(width, device=dev, dtype=torch.int64)[None, :]
    value = torch.where(i < n_pre[:, None], pb_lo[:, None] + i, sb_lo[:, None] + i - n_pre[:, None])
    spare = tiles * width  # where the unused (tile, i) pairs write
    dest = torch.where(i < count[:, None], ptr[:-1, None] + i, spare)
    blocks = torch.zeros(spare + 1, dtype=torch.int32, device=dev)
    blocks.scatter_(0, dest.reshape(-1), value.reshape(-1).to(torch.int32))
    return ptr.to(torch.int32), blocks


def shared_prefix_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_start: torch.Tensor,
    prefix_end: torch.Tensor,
    seg_start: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [N, Hq, D]``, ``k/v [N, Hkv, D]``, per-query int32 bounds ``[N]`` ->
    ``(out [N, Hq, D] in q.dtype, lse [N, Hq] fp32 (fp64 for fp64 inputs))``."""
    t = tiles_for(q.device)["fwd"]
    ptr, blocks = depth2_block_lists(doc_start, prefix_end, seg_start, t["BLOCK_M"], t["BLOCK_N"])
    return tree_attention_fwd(q, k, v, depth2_key_end(doc_start, prefix_end, seg_start), ptr, blocks, scale)


def shared_prefix_attention_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    doc_start: torch.Tensor,
    prefix_end: torch.Tensor,
    seg_start: torch.Tensor,
    query_end: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` in the dtypes of ``q, k, v``; ``lse [N, Hq]`` from the forward."""
    t = tiles_for(q.device)["dq"]
    ptr, blocks = depth2_block_lists(doc_start, prefix_end, seg_start, t["BLOCK_M"], t["BLOCK_N"])
    return tree_attention_bwd(grad_out, q, k, v, out, lse, query_end, ptr, blocks, scale)
