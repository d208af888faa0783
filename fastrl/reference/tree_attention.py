"""Prefix-tree (trie) training attention over a packed row (the oracle).

A packed row of ``N`` tokens holds the segments of a forest one after another. Segment
``s`` has ``lens[s] >= 0`` tokens and a parent ``parents[s]`` (``-1`` for a root). Each
root-to-node path is one sequence: the tokens of the path's segments in order. Token ``i``
(in segment ``seg(i)``) may attend to token ``j`` iff ``j``'s segment is a proper ancestor
of ``seg(i)``, or it is ``seg(i)`` itself and ``j <= i``::

    allowed(i, j) = seg(j) in ancestors(seg(i))  or  (seg(j) == seg(i) and j <= i)

so every token sees exactly what it would see in its own root-to-leaf sequence, and its
position (RoPE) is its depth in that sequence::

    position(i) = sum(lens[a] for a in ancestors(seg(i))) + (i - start(seg(i)))

With ``Hq`` query heads and ``Hkv`` key/value heads (query head ``h`` reads kv head
``h // (Hq // Hkv)``)::

    S[h, i, j] = scale * q[i, h] . k[j, h // R]        for allowed (i, j), -inf otherwise
    out[i, h]  = sum_j softmax_j(S[h, i, :]) v[j, h // R]

computed in fp32 (fp64 for fp64 inputs) and returned in ``q.dtype``. The shared-prefix
group ``[prompt | c_1 | ... | c_G]`` is the depth-2 tree (the prompt a root, each
completion its child). This walks the parents explicitly (no ordering assumption) and
builds the dense ``[N, N]`` mask: it is meant for tests and tiny inputs.
"""

from __future__ import annotations

from typing import Sequence

import torch


def _ancestors(parents: Sequence[int], s: int) -> list[int]:
    out = []
    a = parents[s]
    while a >= 0:
        out.append(a)
        a = parents[a]
    return out


def tree_mask_reference(lens: Sequence[int], parents: Sequence[int], *, device=None) -> torch.Tensor:
    """The ``[N, N]`` boolean mask ``allowed(i, j)`` of the module docstring."""
    seg = [s for s, n in enumerate(lens) for _ in range(n)]
    N = len(seg)
    mask = torch.zeros(N, N, dtype=torch.bool)
    for i in range(N):
        anc = set(_ancestors(parents, seg[i]))
        for j in range(N):
            mask[i, j] = seg[j] in anc or (seg[j] == seg[i] and j <= i)
    return mask.to(device)


def tree_positions_reference(lens: Sequence[int], parents: Sequence[int]) -> list[int]:
    """``position(i)`` of the module docstring: the token's index in its root-to-node sequence."""
    out = []
    for s, n in enumerate(lens):
        depth = sum(lens[a] for a in _ancestors(parents, s))
        out += range(depth, depth + n)
    return out


def tree_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    lens: Sequence[int],
    parents: Sequence[int],
    scale: float,
) -> torch.Tensor:
    """``q [N, Hq, D]``, ``k/v [N, Hkv, D]`` -> ``[N, Hq, D]`` (see the module docstring)."""
    N, Hq, D = q.shape
    rep = Hq // k.shape[1]
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    mask = tree_mask_reference(lens, parents, device=q.device)
    if mask.shape != (N, N):
        raise ValueError(f"the lengths describe {mask.shape[0]} tokens, q has {N}")
    qf = q.to(work).transpose(0, 1)
    kf = k.to(work).transpose(0, 1).repeat_interleave(rep, dim=0)
    vf = v.to(work).transpose(0, 1).repeat_interleave(rep, dim=0)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)
    return out.transpose(0, 1).to(q.dtype)
