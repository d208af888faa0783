"""Decode attention over a shared prompt prefix plus a per-sample suffix (the oracle).

Sample ``b`` belongs to group ``g = b // group_size``; its keys/values are the group's
prompt (``prefix_k[:, prefix_start[g] : prefix_start[g] + prefix_len[g]]``) followed by
its own suffix (``suffix_k[b, :, :suffix_len[b]]``). Query head ``h`` reads kv head
``h // (Hq // Hkv)`` (grouped-query attention). For each sample and head::

    K = [K_prefix ; K_suffix],  V = [V_prefix ; V_suffix]
    out = softmax(scale * q K^T) V

computed in fp32 and returned in ``q.dtype``. This is plain full attention over the
concatenated keys: no log-sum-exp merge, no tiling.
"""

from __future__ import annotations

import torch


def shared_prefix_decode_attention_reference(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    prefix_start: torch.Tensor,
    prefix_len: torch.Tensor,
    suffix_k: torch.Tensor,
    suffix_v: torch.Tensor,
    suffix_len: torch.Tensor,
    *,
    group_size: int,
    scale: float,
) -> torch.Tensor:
    """``q [B, Hq, D]``, ``prefix_k/v [Hkv, N, D]``, ``prefix_start/len [B // group_size]``,
    ``suffix_k/v [B, Hkv, S, D]``, ``suffix_len [B]`` -> ``[B, Hq, D]``."""
    B, Hq, D = q.shape
    Hkv = prefix_k.shape[0]
    rep = Hq // Hkv
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        g = b // group_size
        a = int(prefix_start[g])
        n = int(prefix_len[g])
        s = int(suffix_len[b])
        k = torch.cat([prefix_k[:, a : a + n], suffix_k[b, :, :s]], dim=1).float()  # [Hkv, n + s, D]
        v = torch.cat([prefix_v[:, a : a + n], suffix_v[b, :, :s]], dim=1).float()
        k = k.repeat_interleave(rep, dim=0)  # [Hq, n + s, D]
        v = v.repeat_interleave(rep, dim=0)
        scores = torch.einsum("hd,hkd->hk", q[b].float(), k) * scale
        out[b] = torch.einsum("hk,hkd->hd", torch.softmax(scores, dim=-1), v)
    return out.to(q.dtype)
