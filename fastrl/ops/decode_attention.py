"""Shared-prefix (cascade) decode attention for group sampling (inference only).

G samples of a group decode against one stored copy of their prompt's keys/values plus
their own suffix. The prefix part and the suffix part are attended separately and merged
with their log-sum-exps, which equals full attention over ``[prefix ; suffix]``
(``fastrl.reference.decode_attention`` is the oracle)::

    lse_p, o_p = attention over the prefix;  lse_s, o_s = attention over the suffix
    out = (e^{lse_p} o_p + e^{lse_s} o_s) / (e^{lse_p} + e^{lse_s})

Backends: ``triton`` (``csrc_triton.decode_attention``: the prefix of a group is read once
for all its samples and heads) and ``torch`` (the same cascade with batched matmuls, one
per group for the prefix). No autograd: rollouts run under ``torch.no_grad``.
"""

from __future__ import annotations

import torch

from fastrl._checks import check_float, check_int, check_same_device, resolve_backend

__all__ = ["shared_prefix_decode_attention"]


def _check(q, prefix_k, prefix_v, prefix_start, prefix_len, suffix_k, suffix_v, suffix_len, group_size, scale):
    check_float("q", q, ndim=3)
    B, Hq, D = q.shape
    check_float("prefix_k", prefix_k, ndim=3)
    check_float("prefix_v", prefix_v, shape=tuple(prefix_k.shape))
    Hkv = prefix_k.shape[0]
    if prefix_k.shape[2] != D:
        raise ValueError(f"prefix_k must have head dim {D} like q, got shape {tuple(prefix_k.shape)}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"q has {Hq} heads, which is not a multiple of prefix_k's {Hkv} kv heads")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if B == 0 or B % group_size != 0:
        raise ValueError(f"q has {B} samples, which is not a positive multiple of group_size={group_size}")
    n_groups = B // group_size
    check_int("prefix_start", prefix_start, shape=(n_groups,))
    check_int("prefix_len", prefix_len, shape=(n_groups,))
    check_float("suffix_k", suffix_k, ndim=4)
    if suffix_k.shape[0] != B or suffix_k.shape[1] != Hkv or suffix_k.shape[3] != D:
        raise ValueError(f"suffix_k must have shape ({B}, {Hkv}, S, {D}), got {tuple(suffix_k.shape)}")
    check_float("suffix_v", suffix_v, shape=tuple(suffix_k.shape))
    check_int("suffix_len", suffix_len, shape=(B,))
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive number, got {scale!r}")
    for name, t in (("q", q), ("prefix_k", prefix_k), ("prefix_v", prefix_v), ("suffix_k", suffix_k), ("suffix_v", suffix_v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head) dimension")
    check_same_device(
        q=q, prefix_k=prefix_k, prefix_v=prefix_v, prefix_start=prefix_start, prefix_len=prefix_len,
        suffix_k=suffix_k, suffix_v=suffix_v, suffix_len=suffix_len,
    )


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, key_mask: torch.Tensor | None = None):
    """fp32 attention of ``q [..., M, D]`` over ``k/v [..., N, D]``; returns (out, lse)."""
    s = torch.matmul(q, k.transpose(-1, -2).float()) * scale
    if key_mask is not None:
        s = s.masked_fill(~key_mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(0.0)  # an all-masked row contributes nothing
    if key_mask is not None:  # masked slots may hold anything (even NaN): never multiply them in
        v = v.masked_fill(~key_mask.transpose(-1, -2), 0.0)
    return torch.matmul(p, v.float()), lse


def _torch_impl(q, prefix_k, prefix_v, prefix_start, prefix_len, suffix_k, suffix_v, suffix_len, group_size, scale):
    B, Hq, D = q.shape
    Hkv = prefix_k.shape[0]
    R = Hq // Hkv
    G = group_size
    qf = q.float()
    # prefix: one batched matmul per group, all G samples x R heads of a kv head as query rows
    o_p = torch.empty(B, Hkv, R, D, dtype=torch.float32, device=q.device)
    lse_p = torch.empty(B, Hkv, R, dtype=torch.float32, device=q.device)
    starts = prefix_start.tolist()  # host copy: the torch path loops over groups
    lens = prefix_len.tolist()
    for g, (a, n) in enumerate(zip(starts, lens)):
        qg = qf[g * G : (g + 1) * G].view(G, Hkv, R, D).transpose(0, 1).reshape(Hkv, G * R, D)
        o, lse = _attend(qg, prefix_k[:, a : a + n], prefix_v[:, a : a + n], scale)
        o_p[g * G : (g + 1) * G] = o.view(Hkv, G, R, D).transpose(0, 1)
        lse_p[g * G : (g + 1) * G] = lse.view(Hkv, G, R).transpose(0, 1)
    # suffix: every sample against its own keys, all at once
    s_lens = suffix_len.tolist()
    S = min(max(s_lens), suffix_k.shape[2])  # slots past every sample's length are never read
    mask = None
    if min(s_lens) < S:
        mask = (torch.arange(S, device=q.device)[None, :] < suffix_len[:, None])[:, None, None, :]  # [B, 1, 1, S]
    o_s, lse_s = _attend(qf.view(B, Hkv, R, D), suffix_k[:, :, :S], suffix_v[:, :, :S], scale, mask)
    # merge with the log-sum-exps
    mx = torch.maximum(lse_p, lse_s)
    w_p = torch.exp(lse_p - mx).unsqueeze(-1)
    w_s = torch.exp(lse_s - mx).unsqueeze(-1)
    out = (w_p * o_p + w_s * o_s) / (w_p + w_s)
    return out.view(B, Hq, D).to(q.dtype)


def shared_prefix_decode_attention(
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
    backend: str = "auto",
) -> torch.Tensor:
    """One decode step of attention for groups of samples sharing a prompt.

    Args:
        q: ``[B, Hq, D]`` queries of the current token; samples in group order
            (sample ``b`` belongs to group ``b // group_size``).
        prefix_k, prefix_v: ``[Hkv, N, D]`` prompt keys/values, prompts packed along ``N``
            (any strides with a contiguous last dim). ``Hq`` must be a multiple of ``Hkv``.
        prefix_start, prefix_len: ``[B // group_size]`` int: where each group's prompt
            lies in ``prefix_k`` (groups may share one stored prompt).
        suffix_k, suffix_v: ``[B, Hkv, S, D]`` each sample's own keys/values (generated
            tokens); only the first ``suffix_len[b]`` slots are read.
        suffix_len: ``[B]`` int.
        group_size: samples per group.
        scale: softmax scale (usually ``D ** -0.5``).
        backend: ``auto`` | ``triton`` | ``torch``.

    Returns:
        ``[B, Hq, D]`` in ``q.dtype`` (fp32 accumulation). The torch backend reads
        ``prefix_start``/``prefix_len`` on the host (a sync on CUDA); the Triton one does not.
    """
    _check(q, prefix_k, prefix_v, prefix_start, prefix_len, suffix_k, suffix_v, suffix_len, group_size, scale)
    if resolve_backend(backend, q.device) == "triton":
        from csrc_triton.decode_attention import shared_prefix_decode_attention_triton

        return shared_prefix_decode_attention_triton(
            q, prefix_k, prefix_v, prefix_start, prefix_len, suffix_k, suffix_v, suffix_len, group_size, float(scale)
        )
    return _torch_impl(q, prefix_k, prefix_v, prefix_start, prefix_len, suffix_k, suffix_v, suffix_len, group_size, float(scale))
