"""Shared-prefix (cascade) decode attention for group sampling (inference only).

G samples of a group decode against one stored copy of their prompt's keys/values plus
their own suffix. The prefix part and the suffix part are attended separately and merged
with their log-sum-exps, which equals full attention over ``[prefix ; suffix]``
(``fastrl.reference.decode_attention`` is the oracle)::

    lse_p, o_p = attention over the prefix;  lse_s, o_s = attention over the suffix
    out = (e^{lse_p} o_p + e^{lse_s} o_s) / (e^{lse_p} + e^{lse_s})

Backends: ``triton`` (``csrc_triton.decode_attention``: the prefix of a group is read once
for all its samples and heads, split into chunks over the GPU's SMs; each suffix once per kv
head; one merge) and ``torch`` (the same cascade with batched matmuls, one per group for the
prefix). ``auto`` is Triton on CUDA (not yet measured against FlashInfer's cascade or
FlashAttention's ``flash_attn_with_kvcache``; ``benchmarks/gpu/bench_decode.py`` times them
where installed) and torch elsewhere. No autograd: rollouts run under ``torch.no_grad``.

A decode loop calls this once per layer and token: :func:`prepare_decode_attention` checks
the tensors and builds a :class:`DecodeAttentionPlan` once per rollout (tiles, grids, the
partials' workspace and the output buffer), whose call is two kernel launches with no checks,
no allocation and no host sync (a CUDA graph can capture it).
"""

from __future__ import annotations

import torch

from dataclasses import dataclass

from fastrl._checks import check_float, check_int, check_same_device, resolve_backend

__all__ = ["shared_prefix_decode_attention", "prepare_decode_attention", "DecodeAttentionPlan", "padded_prefix_attention", "PrefixRows"]


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


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def _torch_impl(q, prefix_k, prefix_v, prefix_start, prefix_len, suffix_k, suffix_v, suffix_len, group_size, scale, host_lengths=None):
    """The cascade in PyTorch, written as one softmax over the scores of both key sources.

    Prefix scores come from one batched matmul per group (all G samples x R query heads of
    a kv head are the query rows, so the prompt is read once per group, never copied per
    sample); suffix scores from one batched matmul for all samples. Normalising the
    concatenated scores is the single-pass form of the log-sum-exp merge and needs fewer
    small ops than merging two partial outputs (which matters for per-token decode on CPU).
    ``host_lengths`` = (prefix starts, prefix lengths, suffix lengths) as Python lists, when
    the caller already has them (otherwise they are copied from the tensors).
    """
    B, Hq, D = q.shape
    Hkv = prefix_k.shape[0]
    R = Hq // Hkv
    G = group_size
    if host_lengths is None:
        host_lengths = (prefix_start.tolist(), prefix_len.tolist(), suffix_len.tolist())
    starts, lens, s_lens = host_lengths
    S = min(max(s_lens), suffix_k.shape[2])  # slots past every sample's length are never read
    qs = _f32(q) * scale  # [B, Hq, D]
    # suffix: every sample against its own keys, all at once -> [B, Hkv, R, S]
    ks, vs = _f32(suffix_k[:, :, :S]), _f32(suffix_v[:, :, :S])
    ss = torch.matmul(qs.view(B, Hkv, R, D), ks.transpose(-1, -2))
    if min(s_lens) < S:  # unequal lengths: mask the scores, and zero the values (a stale slot may hold NaN)
        valid = torch.arange(S, device=q.device)[None, :] < suffix_len[:, None]  # [B, S]
        ss = ss.masked_fill(~valid[:, None, None, :], float("-inf"))
        vs = vs.masked_fill(~valid[:, None, :, None], 0.0)
    out = torch.empty(B, Hkv, R, D, dtype=torch.float32, device=q.device)
    for g, (a, n) in enumerate(zip(starts, lens)):
        rows = slice(g * G, (g + 1) * G)
        qg = qs[rows].view(G, Hkv, R, D).transpose(0, 1).reshape(Hkv, G * R, D)
        sp = torch.bmm(qg, _f32(prefix_k[:, a : a + n]).transpose(1, 2))  # [Hkv, G*R, n]
        ssg = ss[rows].transpose(0, 1).reshape(Hkv, G * R, S)
        p = torch.softmax(torch.cat([sp, ssg], dim=-1), dim=-1)
        o = torch.bmm(p[..., :n], _f32(prefix_v[:, a : a + n])).view(Hkv, G, R, D).transpose(0, 1)  # [G, Hkv, R, D]
        out[rows] = torch.matmul(p[..., n:].reshape(Hkv, G, R, S).transpose(0, 1), vs[rows]).add_(o)
    return out.view(B, Hq, D).to(q.dtype)


class DecodeAttentionPlan:
    """One rollout's decode attention, prepared once (:func:`prepare_decode_attention`) and
    called per layer and step with tensors laid out like the ones it was prepared with
    (same shapes, dtypes, device and last-dim contiguity; other strides and the lengths'
    values are free). Nothing is checked per call.

    On the Triton backend a call launches the two cascade kernels and returns the plan's
    output buffer, overwritten by the next call (consume or copy it first); on the torch
    backend it returns a fresh tensor.
    """

    def __init__(self, backend: str, group_size: int, scale: float, cascade=None):
        self.backend, self.group_size, self.scale = backend, group_size, scale
        self.splits: int | None = None if cascade is None else cascade.splits  # prefix chunks per group (Triton)
        self._launch = None if cascade is None else cascade.run  # csrc_triton CascadePlan.run; None: torch

    def __call__(self, q, prefix_k, prefix_v, prefix_start, prefix_len, suffix_k, suffix_v, suffix_len, host_lengths=None):
        if self._launch is not None:
            return self._launch(q, prefix_k, prefix_v, prefix_start, prefix_len, suffix_k, suffix_v, suffix_len, self.scale)
        return _torch_impl(q, prefix_k, prefix_v, prefix_start, prefix_len, suffix_k, suffix_v, suffix_len, self.group_size,
                           self.scale, host_lengths)


def prepare_decode_attention(
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
    max_prefix_len: int | None = None,
    splits: int | None = None,
) -> DecodeAttentionPlan:
    """Check one step's tensors (as :func:`shared_prefix_decode_attention` documents them) and
    build the plan that runs every later step like them.

    ``max_prefix_len``: an upper bound on ``prefix_len`` (the store's padded prompt length;
    default: the store's whole length ``N``), which caps the prefix split at the prompt's key blocks; ``splits``: the number of prefix
    chunks per group (default: enough programs to fill the device's SMs twice). A rollout
    that narrows its batch passes the split of its full batch, so a row's result does not
    depend on which other rows run.
    """
    _check(q, prefix_k, prefix_v, prefix_start, prefix_len, suffix_k, suffix_v, suffix_len, group_size, scale)
    backend = resolve_backend(backend, q.device)
    if backend != "triton":
        return DecodeAttentionPlan(backend, group_size, float(scale))
    from csrc_triton.decode_attention import CascadePlan

    B, Hq, D = q.shape
    kv_dtypes = {prefix_k.dtype, prefix_v.dtype, suffix_k.dtype, suffix_v.dtype}
    plan = CascadePlan(batch=B, q_heads=Hq, kv_heads=prefix_k.shape[0], head_dim=D, group_size=group_size, dtype=q.dtype,
                       kv_dtype=kv_dtypes.pop() if len(kv_dtypes) == 1 else torch.float64, device=q.device,
                       max_prefix_len=prefix_k.shape[1] if max_prefix_len is None else max_prefix_len, splits=splits)
    return DecodeAttentionPlan(backend, group_size, float(scale), plan)


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
    max_prefix_len: int | None = None,
) -> torch.Tensor:
    """One decode step of attention for groups of samples sharing a prompt (checked, then run
    by a fresh :class:`DecodeAttentionPlan`; a decode loop prepares its plan once instead).

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
        max_prefix_len: optional upper bound on ``prefix_len`` (see :func:`prepare_decode_attention`).

    Returns:
        ``[B, Hq, D]`` in ``q.dtype`` (fp32 accumulation; a fresh tensor). The torch backend
        reads ``prefix_start``/``prefix_len`` on the host (a sync on CUDA); the Triton one does not.
    """
    plan = prepare_decode_attention(q, prefix_k, prefix_v, prefix_start, prefix_len, suffix_k, suffix_v, suffix_len,
                                    group_size=group_size, scale=scale, backend=backend, max_prefix_len=max_prefix_len)
    return plan(q, prefix_k, prefix_v, prefix_start, prefix_len, suffix_k, suffix_v, suffix_len)


@dataclass(frozen=True)
class PrefixRows:
    """Which stored prompt each sample reads, laid out for one batched matmul per layer.

    ``prefix_of[b]`` is sample ``b``'s prompt. The query rows of prompt ``u`` are its samples,
    padded to the largest count ``per_prefix`` (``gather[u * per_prefix + m]``: a sample
    index, repeated for padding); ``position[b]`` is sample ``b``'s row in that layout.
    ``identity`` (sample ``b`` reads prompt ``b // per_prefix``, no padding) skips both
    gathers.
    """

    gather: torch.Tensor
    position: torch.Tensor
    per_prefix: int
    num_prefixes: int
    identity: bool

    @classmethod
    def build(cls, prefix_of: list[int], num_prefixes: int, device: torch.device) -> "PrefixRows":
        members: list[list[int]] = [[] for _ in range(num_prefixes)]
        for b, u in enumerate(prefix_of):
            members[u].append(b)
        M = max(1, max(len(m) for m in members))
        gather, position = [], [0] * len(prefix_of)
        for u, m in enumerate(members):
            pad = m[0] if m else 0
            for i in range(M):
                if i < len(m):
                    position[m[i]] = u * M + i
                gather.append(m[i] if i < len(m) else pad)
        identity = gather == list(range(len(prefix_of))) and len(gather) == len(prefix_of)
        as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        return cls(as_long(gather), as_long(position), M, num_prefixes, identity)


def padded_prefix_attention(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    prefix_bias: torch.Tensor | None,
    rows: PrefixRows,
    suffix_k: torch.Tensor,
    suffix_v: torch.Tensor,
    suffix_bias: torch.Tensor | None,
    *,
    scale: float,
) -> torch.Tensor:
    """Attention of ``T`` new tokens per sample over its stored prompt and its own suffix
    (PyTorch; a fixed number of batched ops, no loop over groups or samples).

    Args:
        q: ``[B, Hq, T, D]`` queries (the attention-interface layout).
        prefix_k, prefix_v: ``[Hkv, U, P, D]`` the ``U`` distinct prompts, right-padded to ``P``.
        prefix_bias: ``[U, P]`` additive mask (0 on prompt tokens, ``-inf`` on padding), or
            None when no prompt is padded.
        rows: sample -> prompt layout (:class:`PrefixRows`).
        suffix_k, suffix_v: ``[B, Hkv, S, D]`` each sample's own keys/values (the new tokens'
            already written); slots masked by ``suffix_bias`` are never used (zero them if
            they may hold non-finite values).
        suffix_bias: ``[B, T, S]`` additive mask (causal within the new tokens, per-sample
            lengths), or None when every query sees all ``S`` slots.
        scale: softmax scale.

    Returns ``[B, T, Hq, D]`` in ``q.dtype``: full softmax attention over
    ``[prompt ; suffix]`` in fp32. Every query must see at least one prompt token (prompts are
    never empty).

    Ten-odd ops whatever the shape: the prompt scores of each prompt's rows (one batched
    matmul per layer, the prompt read once for its samples), each sample's suffix scores
    (one batched matmul), one softmax over both concatenated in the prompts' row layout,
    and the two value matmuls; no separate maxima, sums or log-sum-exp merge (the oracle's
    cascade gives the same result).
    """
    B, Hq, T, D = q.shape
    Hkv, U, P, _ = prefix_k.shape
    R = Hq // Hkv
    M = rows.per_prefix
    RT = R * T
    S = suffix_k.shape[2]
    qs = (_f32(q) * scale).reshape(B, Hkv, RT, D)  # rows of a kv head: (query head, token)
    # prompt scores: the rows of every sample of prompt u against prompt u, one matmul for all
    qp = qs if rows.identity else qs.index_select(0, rows.gather)
    qp = qp.view(U, M, Hkv, RT, D).permute(2, 0, 1, 3, 4).reshape(Hkv, U, M * RT, D)
    sp = torch.matmul(qp, _f32(prefix_k).transpose(-1, -2))  # [Hkv, U, M*RT, P]
    if prefix_bias is not None:
        sp = sp.add_(prefix_bias[None, :, None, :])
    # suffix scores: every sample against its own slots, then in the prompts' row layout
    ss = torch.matmul(qs, _f32(suffix_k).transpose(-1, -2))  # [B, Hkv, RT, S]
    if suffix_bias is not None:
        ss = ss.view(B, Hkv, R, T, S).add_(suffix_bias[:, None, None]).view(B, Hkv, RT, S)
    if not rows.identity:
        ss = ss.index_select(0, rows.gather)
    ss = ss.view(U, M, Hkv, RT, S).permute(2, 0, 1, 3, 4).reshape(Hkv, U, M * RT, S)
    probs = torch.softmax(torch.cat((sp, ss), dim=-1), dim=-1)  # [Hkv, U, M*RT, P + S]
    o = torch.matmul(probs[..., :P], _f32(prefix_v)).view(Hkv, U * M, RT, D).transpose(0, 1)  # [U*M, Hkv, RT, D]
    ps = probs[..., P:].reshape(Hkv, U * M, RT, S).transpose(0, 1)
    if not rows.identity:
        o, ps = o.index_select(0, rows.position), ps.index_select(0, rows.position)
    out = torch.matmul(ps, _f32(suffix_v)).add_(o)  # [B, Hkv, RT, D]
    return out.view(B, Hq, T, D).transpose(1, 2).to(q.dtype)
