"""Shared-prefix training attention over a packed row (the oracle).

A packed row of ``N`` tokens holds documents one after another. Document ``d`` is its
shared prefix of ``P_d >= 0`` tokens followed by its segments (lengths ``L_{d,0}, L_{d,1},
...``, each >= 1). Token ``i`` may attend to token ``j`` iff they are in the same document,
``j <= i`` and either ``j`` is in the prefix or ``i`` and ``j`` are in the same segment::

    allowed(i, j) = doc(i) == doc(j)  and  j <= i  and  (j in prefix(doc(i))  or  seg(i) == seg(j))

(prefix tokens count as one more "segment" of their document, so the prefix is causal
within itself and never sees the segments). With ``Hq`` query heads and ``Hkv`` key/value
heads (grouped-query attention: query head ``h`` reads kv head ``h // (Hq // Hkv)``)::

    S[h, i, j] = scale * q[i, h] . k[j, h // R]        for allowed (i, j), -inf otherwise
    out[i, h]  = sum_j softmax_j(S[h, i, :]) v[j, h // R]

computed in fp32 (fp64 for fp64 inputs) and returned in ``q.dtype``. Every token attends
at least to itself, so no row is empty. A group ``[prompt | c_1 | ... | c_G]`` is one
document: prefix = the prompt, one segment per completion; plain padding-free packing is
prefix 0 with one segment per document. This builds the dense ``[N, N]`` mask from the
lengths alone; it is meant for tests and tiny inputs.
"""

from __future__ import annotations

from typing import Sequence

import torch


def shared_prefix_mask_reference(prefix_lens: Sequence[int], segment_lens: Sequence[Sequence[int]], *, device=None) -> torch.Tensor:
    """The ``[N, N]`` boolean mask ``allowed(i, j)`` of the module docstring."""
    doc_ids, seg_ids, in_prefix = [], [], []
    seg = 0
    for d, (p, segs) in enumerate(zip(prefix_lens, segment_lens)):
        doc_ids += [d] * p
        seg_ids += [-1] * p
        in_prefix += [True] * p
        for n in segs:
            doc_ids += [d] * n
            seg_ids += [seg] * n
            in_prefix += [False] * n
            seg += 1
    doc = torch.tensor(doc_ids, dtype=torch.long, device=device)
    sid = torch.tensor(seg_ids, dtype=torch.long, device=device)
    pre = torch.tensor(in_prefix, dtype=torch.bool, device=device)
    n = doc.numel()
    idx = torch.arange(n, device=device)
    same_doc = doc[:, None] == doc[None, :]
    causal = idx[None, :] <= idx[:, None]
    # a prefix query (seg -1) matches prefix keys (seg -1) of its document through "same segment" too
    same_seg = sid[:, None] == sid[None, :]
    return same_doc & causal & (pre[None, :] | same_seg)


def shared_prefix_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    prefix_lens: Sequence[int],
    segment_lens: Sequence[Sequence[int]],
    scale: float,
) -> torch.Tensor:
    """``q [N, Hq, D]``, ``k/v [N, Hkv, D]`` -> ``[N, Hq, D]`` (see the module docstring)."""
    N, Hq, D = q.shape
    Hkv = k.shape[1]
    rep = Hq // Hkv
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    mask = shared_prefix_mask_reference(prefix_lens, segment_lens, device=q.device)
    if mask.shape != (N, N):
        raise ValueError(f"the lengths describe {mask.shape[0]} tokens, q has {N}")
    qf = q.to(work).transpose(0, 1)  # [Hq, N, D]
    kf = k.to(work).transpose(0, 1).repeat_interleave(rep, dim=0)  # [Hq, N, D]
    vf = v.to(work).transpose(0, 1).repeat_interleave(rep, dim=0)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vf)  # [Hq, N, D]
    return out.transpose(0, 1).to(q.dtype)
