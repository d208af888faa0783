"""Shared-prefix attention for the training forward: each prompt runs once per group.

A group of G completions of one prompt becomes one packed document
``[prompt | c_1 | c_2 | ... | c_G]``: every completion token attends to the whole prompt
and causally to its own completion, never to another completion, and its position (RoPE)
continues from ``P``. The prompt's keys/values receive gradient from all G completions,
so loss and gradients equal those of the repeated-prefix ``[G, P + L]`` batch while the
work scales with ``P + G * L``. ``fastrl.reference.shared_prefix_attention`` is the
oracle (mask formula there).

General form (``SharedPrefixLayout``): a packed row holds documents; a document is a
shared prefix (length >= 0) plus segments (none only if the prefix is not empty; an
empty completion has no segment). Padding-free packing is
"prefix 0, one segment per document". The layout is int32 metadata built once per
micro-batch on the host; the kernels never derive it. ``PackedGroups.from_groups`` also
builds ``input_ids``/``position_ids`` and the index maps between packed tokens and the
usual ``[B, T]`` padded rows.

Backends of ``shared_prefix_attention`` (``backend=``):

- ``triton``: the prefix-tree kernels of ``csrc_triton.tree_attention`` over this layout's
  depth-2 tree (FlashAttention-2 shaped forward and backward; see ``triton_tree_attention``).
  Not yet timed on a GPU: ``auto`` runs ``flex`` on CUDA until it is (``CUDA_AUTO_BACKEND``).
- ``torch`` (default on CPU): ``sdpa`` up to ``DENSE_MAX_TOKENS`` tokens, ``segments``
  above (measured: see the constant in ``fastrl.ops._packed_attention``).
- ``sdpa``: one ``scaled_dot_product_attention`` call with the dense ``[N, N]`` boolean
  mask (memory ``N^2`` bytes for the mask).
- ``segments``: per document, the prefix with causal SDPA and each segment with SDPA over
  ``[prefix ; segment]`` keys (a ``[L, P + L]`` mask): no ``N^2`` buffer at all.
- ``flex``: ``torch.nn.attention.flex_attention`` with a block mask. In torch 2.13 it has
  no backward on CPU (``NotImplementedError``), its CPU forward needs ``torch.compile``
  to be fast (~30 s compile) and has no fp64, so it is opt-in: meant for CUDA.
- ``flash_attn``: one ``flash_attn_varlen_func`` call of the ``flash-attn`` package
  (fp16/bf16, CUDA). UNTESTED on a GPU here: flash-attn cannot be installed on the CPU
  machines this is developed on; only its index metadata is tested (against an emulation
  of flash-attn's documented varlen semantics).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from fastrl.ops._packed_attention import (
    DENSE_MAX_TOKENS,
    check_packed_attention_inputs,
    resolve_packed_backend,
    run_flex,
    sdpa_after_context,
    sdpa_dense,
)
from fastrl.ops._packed_attention import CUDA_AUTO_BACKEND, cuda_auto_backend  # noqa: F401  (their home is _packed_attention; named here as before)
from fastrl.ops.tree_attention import TreeLayout, triton_tree_attention

__all__ = ["SharedPrefixLayout", "PackedGroups", "shared_prefix_attention", "DENSE_MAX_TOKENS"]

BACKENDS = ("auto", "triton", "torch", "sdpa", "segments", "flex", "flash_attn")


def _as_lengths(name: str, values: object, *, minimum: int) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in values)  # type: ignore[union-attr]
    except TypeError as e:
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}") from e
    for x, raw in zip(out, values):  # type: ignore[call-overload]
        if isinstance(raw, bool) or x != raw or x < minimum:
            raise ValueError(f"{name} must hold ints >= {minimum}, got {raw!r}")
    return out


@dataclass(frozen=True, eq=False)
class SharedPrefixLayout:
    """Where documents, prefixes and segments lie in one packed row of ``num_tokens`` tokens.

    Token order: document 0 (its prefix, then its segments in order), document 1, ...
    All tensors are on ``device``; the int32 ones are what the kernels read.
    """

    prefix_lens: tuple[int, ...]
    """Prefix length of each document (>= 0)."""
    segment_lens: tuple[tuple[int, ...], ...]
    """Lengths of each document's segments (each >= 1; a document may have none if its
    prefix is not empty)."""
    num_tokens: int
    """N = sum of all prefix and segment lengths."""
    doc_cu_seqlens: torch.Tensor
    """int32 [num_docs + 1]: document boundaries (cu_seqlens style)."""
    seg_cu_seqlens: torch.Tensor
    """int32 [num_segments + 1]: start of every segment in the row, then N. Segments of
    one document are contiguous; the prefix sits between its document's start and its
    first segment."""
    seg_doc: torch.Tensor
    """int32 [num_segments]: the document of each segment."""
    position_ids: torch.Tensor
    """int64 [N]: 0..P-1 over a prefix, then P, P+1, ... again in every segment."""
    q_doc_start: torch.Tensor
    """int32 [N]: first token of the query's document."""
    q_prefix_end: torch.Tensor
    """int32 [N]: one past the last prefix token of the query's document."""
    q_seg_start: torch.Tensor
    """int32 [N]: first token of the query's segment (its document start for a prefix
    token). Query i attends to j iff j <= i and (doc_start <= j < prefix_end or
    j >= seg_start)."""
    k_query_end: torch.Tensor
    """int32 [N]: one past the last query that attends this key (its document's end for a
    prefix key, its segment's end for a segment key): the backward's query range."""
    host_doc_cu: tuple[int, ...]
    """Host copy of ``doc_cu_seqlens``."""
    host_seg_cu: tuple[int, ...]
    """Host copy of ``seg_cu_seqlens``."""
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_docs(self) -> int:
        return len(self.prefix_lens)

    @property
    def num_segments(self) -> int:
        return len(self.host_seg_cu) - 1

    @property
    def device(self) -> torch.device:
        return self.q_doc_start.device

    @classmethod
    def from_lengths(
        cls, prefix_lens: Sequence[int], segment_lens: Sequence[Sequence[int]], *, device: torch.device | str | None = None
    ) -> "SharedPrefixLayout":
        """A layout from per-document prefix lengths and per-document segment lengths."""
        prefix = _as_lengths("prefix_lens", prefix_lens, minimum=0)
        if not isinstance(segment_lens, Sequence) or len(segment_lens) != len(prefix):
            raise ValueError(f"segment_lens must be a sequence of {len(prefix)} per-document sequences (one per prefix length)")
        segs = tuple(_as_lengths(f"segment_lens[{d}]", s, minimum=1) for d, s in enumerate(segment_lens))
        if not prefix:
            raise ValueError("a layout needs at least one document")
        for d, (p, s) in enumerate(zip(prefix, segs)):
            if p + sum(s) == 0:
                raise ValueError(f"document {d} is empty (prefix 0 and no segment)")
        doc_cu, seg_cu, seg_doc = [0], [], []
        pos: list[int] = []
        q_doc_start: list[int] = []
        q_prefix_end: list[int] = []
        q_seg_start: list[int] = []
        k_query_end: list[int] = []
        for d, (p, lens) in enumerate(zip(prefix, segs)):
            start = doc_cu[-1]
            end = start + p + sum(lens)
            pos += list(range(p))
            q_doc_start += [start] * (end - start)
            q_prefix_end += [start + p] * (end - start)
            q_seg_start += [start] * p
            k_query_end += [end] * p
            a = start + p
            for n in lens:
                seg_cu.append(a)
                seg_doc.append(d)
                pos += list(range(p, p + n))
                q_seg_start += [a] * n
                k_query_end += [a + n] * n
                a += n
            doc_cu.append(end)
        seg_cu.append(doc_cu[-1])
        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            prefix_lens=prefix,
            segment_lens=segs,
            num_tokens=doc_cu[-1],
            doc_cu_seqlens=torch.tensor(doc_cu, **i32),
            seg_cu_seqlens=torch.tensor(seg_cu, **i32),
            seg_doc=torch.tensor(seg_doc, **i32),
            position_ids=torch.tensor(pos, dtype=torch.long, device=device),
            q_doc_start=torch.tensor(q_doc_start, **i32),
            q_prefix_end=torch.tensor(q_prefix_end, **i32),
            q_seg_start=torch.tensor(q_seg_start, **i32),
            k_query_end=torch.tensor(k_query_end, **i32),
            host_doc_cu=tuple(doc_cu),
            host_seg_cu=tuple(seg_cu),
        )

    @classmethod
    def packed(cls, seq_lens: Sequence[int], *, device: torch.device | str | None = None) -> "SharedPrefixLayout":
        """Plain padding-free packing: each sequence is a document with prefix 0 and one segment."""
        lens = _as_lengths("seq_lens", seq_lens, minimum=1)
        return cls.from_lengths([0] * len(lens), [[n] for n in lens], device=device)

    def to(self, device: torch.device | str) -> "SharedPrefixLayout":
        """The same layout with its tensors on ``device``."""
        return SharedPrefixLayout.from_lengths(self.prefix_lens, self.segment_lens, device=device)

    def dense_mask(self) -> torch.Tensor:
        """``[N, N]`` bool, ``True`` where query i may attend key j (cached on the layout)."""
        mask = self._cache.get("dense_mask")
        if mask is None:
            idx = torch.arange(self.num_tokens, device=self.device, dtype=torch.int32)
            j = idx[None, :]
            mask = (j <= idx[:, None]) & (
                ((j >= self.q_doc_start[:, None]) & (j < self.q_prefix_end[:, None])) | (j >= self.q_seg_start[:, None])
            )
            self._cache["dense_mask"] = mask
        return mask


@dataclass(frozen=True, eq=False)
class PackedGroups:
    """Groups ``(prompt, [completion_1, ..., completion_G])`` packed into one row, plus the
    maps between packed tokens and the usual padded layouts.

    Samples ``b = 0 .. B-1`` are the completions in group order (group 0's first), as in
    ``RolloutBatch``. The ``M`` scored tokens are every completion token, in sample order.
    Two padded layouts are addressed:

    - completion layout ``[B, L_max]``: column ``t`` is completion token ``t`` (TRL's
      ``logits_to_keep`` layout);
    - batch layout ``[B, T]``: the row ``prompt + completion`` right-padded, the token at
      column ``P_g + t`` (``RolloutBatch``'s layout, where ``sampler_logp[b, c]`` is the
      log-prob of ``input_ids[b, c]``).
    """

    layout: SharedPrefixLayout
    """One document per group: prefix = prompt, one segment per completion."""
    input_ids: torch.Tensor
    """int64 [1, N] packed tokens."""
    position_ids: torch.Tensor
    """int64 [1, N]: positions continue from P in every completion."""
    target_ids: torch.Tensor
    """int64 [M]: the completion tokens (what is scored)."""
    target_index: torch.Tensor
    """int64 [M]: packed position of each completion token."""
    predictor_index: torch.Tensor
    """int64 [M]: packed position whose output predicts it (the prompt's last token for
    the first token of every completion, else the previous completion token)."""
    sample_index: torch.Tensor
    """int64 [M]: the sample (row b) of each completion token."""
    completion_pos: torch.Tensor
    """int64 [M]: column in the completion layout (t)."""
    batch_pos: torch.Tensor
    """int64 [M]: column in the batch layout (P_g + t)."""
    group_sizes: tuple[int, ...]
    """G of each group."""
    prompt_lens: tuple[int, ...]
    completion_lens: tuple[int, ...]
    """Per sample, in sample order."""

    @property
    def num_samples(self) -> int:
        return len(self.completion_lens)

    @property
    def max_completion_len(self) -> int:
        return max(self.completion_lens)

    @property
    def max_seq_len(self) -> int:
        """T of the batch layout: the longest prompt + completion."""
        per_sample_prompt = [p for p, g in zip(self.prompt_lens, self.group_sizes) for _ in range(g)]
        return max(p + c for p, c in zip(per_sample_prompt, self.completion_lens))

    @classmethod
    def from_groups(
        cls, groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]], *, device: torch.device | str | None = None
    ) -> "PackedGroups":
        """Pack ``[(prompt_ids, [completion_ids, ...]), ...]``. Every prompt needs at least
        one token (the first completion token is predicted by the prompt's last one); an
        empty completion is a sample with no scored token (its rows stay ``fill``)."""
        if not isinstance(groups, Sequence) or len(groups) == 0:
            raise ValueError("groups must be a non-empty sequence of (prompt_ids, [completion_ids, ...]) pairs")
        ids: list[int] = []
        prompt_lens, seg_lens, group_sizes, completion_lens = [], [], [], []
        target_index, predictor_index, sample_index, completion_pos, batch_pos = [], [], [], [], []
        b = 0
        for g, item in enumerate(groups):
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise ValueError(f"groups[{g}] must be a (prompt_ids, [completion_ids, ...]) pair")
            prompt = _as_lengths(f"groups[{g}] prompt ids", item[0], minimum=0)
            completions = [_as_lengths(f"groups[{g}] completion {c} ids", c_ids, minimum=0) for c, c_ids in enumerate(item[1])]
            if len(prompt) == 0:
                raise ValueError(f"groups[{g}] has an empty prompt; the first completion token needs a token to predict it")
            if len(completions) == 0:
                raise ValueError(f"groups[{g}] has no completion")
            P = len(prompt)
            start = len(ids)
            ids += prompt
            prompt_lens.append(P)
            group_sizes.append(len(completions))
            seg_lens.append([len(c) for c in completions if c])  # an empty completion: a sample with no segment
            for comp in completions:
                a = len(ids)
                ids += comp
                L = len(comp)
                completion_lens.append(L)
                if L == 0:
                    b += 1
                    continue
                target_index += range(a, a + L)
                predictor_index += [start + P - 1] + list(range(a, a + L - 1))
                sample_index += [b] * L
                completion_pos += range(L)
                batch_pos += range(P, P + L)
                b += 1
        layout = SharedPrefixLayout.from_lengths(prompt_lens, seg_lens, device=device)
        long = dict(dtype=torch.long, device=device)
        input_ids = torch.tensor(ids, **long)
        t_index = torch.tensor(target_index, **long)
        return cls(
            layout=layout,
            input_ids=input_ids[None],
            position_ids=layout.position_ids[None],
            target_ids=input_ids[t_index],
            target_index=t_index,
            predictor_index=torch.tensor(predictor_index, **long),
            sample_index=torch.tensor(sample_index, **long),
            completion_pos=torch.tensor(completion_pos, **long),
            batch_pos=torch.tensor(batch_pos, **long),
            group_sizes=tuple(group_sizes),
            prompt_lens=tuple(prompt_lens),
            completion_lens=tuple(completion_lens),
        )

    @classmethod
    def from_samples(
        cls,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        *,
        group_size: int,
        device: torch.device | str | None = None,
    ) -> "PackedGroups":
        """From ``RolloutBatch``'s fields: one prompt per group and the flat completions in
        group order (sample b belongs to prompt ``b // group_size``)."""
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
        if len(completion_ids) != len(prompt_ids) * group_size:
            raise ValueError(
                f"completion_ids has {len(completion_ids)} samples, expected len(prompt_ids) * group_size = "
                f"{len(prompt_ids)} * {group_size}"
            )
        G = group_size
        return cls.from_groups([(p, completion_ids[g * G : (g + 1) * G]) for g, p in enumerate(prompt_ids)], device=device)

    def to_completion_layout(self, values: torch.Tensor, *, fill: float = 0.0) -> torch.Tensor:
        """``[M, ...]`` per completion token -> ``[B, L_max, ...]`` (``fill`` elsewhere);
        differentiable."""
        return self._scatter(values, self.max_completion_len, self.completion_pos, fill)

    def to_batch_layout(self, values: torch.Tensor, *, seq_len: int | None = None, shift: int = 0, fill: float = 0.0) -> torch.Tensor:
        """``[M, ...]`` -> ``[B, T, ...]`` at the tokens' columns ``P_g + t - shift``
        (``shift=1``: the ``[B, T-1]`` convention of ``causal_lm_logprobs``, where column c
        scores token c + 1). ``seq_len`` defaults to ``max_seq_len - shift``."""
        width = self.max_seq_len - shift if seq_len is None else seq_len
        return self._scatter(values, width, self.batch_pos - shift, fill)

    def from_completion_layout(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, L_max, ...]`` -> ``[M, ...]`` (the inverse gather)."""
        return x[self.sample_index.to(x.device), self.completion_pos.to(x.device)]

    def from_batch_layout(self, x: torch.Tensor, *, shift: int = 0) -> torch.Tensor:
        """``[B, T, ...]`` -> ``[M, ...]`` from columns ``P_g + t - shift``."""
        return x[self.sample_index.to(x.device), (self.batch_pos - shift).to(x.device)]

    def _scatter(self, values: torch.Tensor, width: int, cols: torch.Tensor, fill: float) -> torch.Tensor:
        M = self.target_ids.shape[0]
        if values.shape[:1] != (M,):
            raise ValueError(f"values must have {M} rows (one per completion token), got shape {tuple(values.shape)}")
        out = values.new_full((self.num_samples, width, *values.shape[1:]), fill)
        return out.index_put((self.sample_index.to(values.device), cols.to(values.device)), values)


# ---------------------------------------------------------------------------------------
# torch backends


def _sdpa_segments(q, k, v, layout: SharedPrefixLayout, scale: float) -> torch.Tensor:
    """Per document: causal SDPA over the prefix; per segment: SDPA over [prefix ; segment]
    keys with the bottom-right-aligned causal mask (all prefix keys, causal in the segment).

    The row is cut with one ``torch.split`` per tensor (its backward is one concatenation;
    slicing the full row per piece would make every piece's backward allocate and add a
    zero-filled row-sized gradient)."""
    sizes = []
    for p, lens in zip(layout.prefix_lens, layout.segment_lens):
        sizes.append(p)
        sizes.extend(lens)
    qs, ks, vs = (torch.split(t.transpose(0, 1), sizes, dim=1) for t in (q, k, v))  # pieces [H, n, D]
    outs = []
    masks: dict[tuple[int, int], torch.Tensor] = {}
    i = 0
    for p, lens in zip(layout.prefix_lens, layout.segment_lens):
        kp, vp = ks[i], vs[i]
        if p:
            outs.append(sdpa_after_context(qs[i], kp, vp, 0, scale, masks))
        i += 1
        for _ in lens:
            if p == 0:
                outs.append(sdpa_after_context(qs[i], ks[i], vs[i], 0, scale, masks))
            else:
                kc, vc = torch.cat([kp, ks[i]], dim=1), torch.cat([vp, vs[i]], dim=1)
                outs.append(sdpa_after_context(qs[i], kc, vc, p, scale, masks))
            i += 1
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out.transpose(0, 1)


def _flex(q, k, v, layout: SharedPrefixLayout, scale: float) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask

    key = ("block_mask", q.device)
    block_mask = layout._cache.get(key)
    if block_mask is None:
        doc_start, prefix_end, seg_start = layout.q_doc_start, layout.q_prefix_end, layout.q_seg_start

        def mask_mod(b, h, qi, kj):
            return (kj <= qi) & (((kj >= doc_start[qi]) & (kj < prefix_end[qi])) | (kj >= seg_start[qi]))

        N = layout.num_tokens
        block_mask = create_block_mask(mask_mod, None, None, N, N, device=q.device)
        layout._cache[key] = block_mask
    return run_flex(q, k, v, block_mask, scale)


def _flash_metadata(layout: SharedPrefixLayout, device: torch.device) -> dict:
    """Varlen metadata: one attention "sequence" per prefix and per segment. A prefix's
    keys are itself; a segment's keys are its document's prefix followed by itself.
    Queries stay in packed order (prefix, then segments), so q and the output need no
    gather; k/v are gathered along ``kv_index`` (the prefix once per segment)."""
    key = ("flash", device)
    meta = layout._cache.get(key)
    if meta is None:
        kv_index: list[int] = []
        cu_q, cu_k = [0], [0]
        seg = 0
        for d, (p, lens) in enumerate(zip(layout.prefix_lens, layout.segment_lens)):
            a = layout.host_doc_cu[d]
            if p:
                kv_index += range(a, a + p)
                cu_q.append(cu_q[-1] + p)
                cu_k.append(cu_k[-1] + p)
            for n in lens:
                s = layout.host_seg_cu[seg]
                seg += 1
                kv_index += range(a, a + p)
                kv_index += range(s, s + n)
                cu_q.append(cu_q[-1] + n)
                cu_k.append(cu_k[-1] + p + n)
        qlens = [b - a for a, b in zip(cu_q[:-1], cu_q[1:])]
        klens = [b - a for a, b in zip(cu_k[:-1], cu_k[1:])]
        meta = dict(
            kv_index=torch.tensor(kv_index, dtype=torch.long, device=device),
            cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
            cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32, device=device),
            max_seqlen_q=max(qlens),
            max_seqlen_k=max(klens),
        )
        layout._cache[key] = meta
    return meta


def _flash_attn(q, k, v, layout: SharedPrefixLayout, scale: float) -> torch.Tensor:
    """flash-attn's causal mask is aligned to the bottom right when a sequence has more
    keys than queries, so a segment's query t sees all P prefix keys and segment keys
    <= t: exactly the shared-prefix mask, in one call, with exact gradients (autograd
    sums the gathered prefix keys' gradients over the segments). This avoids merging two
    calls by their log-sum-exps, whose gradient flash-attn's autograd does not propagate."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError as e:
        raise ValueError("backend='flash_attn' needs the flash-attn package (pip install flash-attn)") from e
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"backend='flash_attn' needs fp16/bf16 inputs, got {q.dtype}")
    meta = _flash_metadata(layout, q.device)
    idx = meta["kv_index"]
    return flash_attn_varlen_func(
        q, k.index_select(0, idx), v.index_select(0, idx),
        meta["cu_seqlens_q"], meta["cu_seqlens_k"], meta["max_seqlen_q"], meta["max_seqlen_k"],
        dropout_p=0.0, softmax_scale=scale, causal=True,
    )


# ---------------------------------------------------------------------------------------
# Triton backend: the prefix-tree kernels (this layout is the depth-2 tree)


def _triton(q, k, v, layout: SharedPrefixLayout, scale: float) -> torch.Tensor:
    tree = layout._cache.get("tree")
    if tree is None:  # built once per layout; its block lists and dK/dV items are cached on it
        tree = TreeLayout.from_shared_prefix(layout)
        layout._cache["tree"] = tree
    return triton_tree_attention(q, k, v, tree, scale)


def _resolve(backend: str, q: torch.Tensor, layout: SharedPrefixLayout) -> str:
    return resolve_packed_backend(backend, BACKENDS, q, layout.num_tokens)


_IMPLS = {"sdpa": sdpa_dense, "segments": _sdpa_segments, "flex": _flex, "flash_attn": _flash_attn, "triton": _triton}


def shared_prefix_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SharedPrefixLayout,
    *,
    scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention over a packed row with shared prefixes (differentiable wrt q, k, v).

    Args:
        q: ``[N, Hq, D]`` queries of the packed row (token-major; any strides with a
            contiguous last dim).
        k, v: ``[N, Hkv, D]``; ``Hq`` must be a multiple of ``Hkv`` (GQA).
        layout: where documents, prefixes and segments lie (``N = layout.num_tokens``),
            on q's device.
        scale: softmax scale (usually ``D ** -0.5``).
        backend: ``auto`` (``CUDA_AUTO_BACKEND`` on CUDA, ``torch`` otherwise) | ``triton`` | ``torch``
            (``sdpa`` up to ``DENSE_MAX_TOKENS`` tokens, ``segments`` above) | ``sdpa`` |
            ``segments`` | ``flex`` | ``flash_attn`` (see the module docstring).

    Returns:
        ``[N, Hq, D]`` in ``q.dtype``. Query i attends key j iff same document, j <= i, and
        j in the prefix or in i's own segment.
    """
    _check(q, k, v, layout, scale)
    impl = _resolve(backend, q, layout)
    return _IMPLS[impl](q, k, v, layout, float(scale))


def _check(q, k, v, layout, scale) -> None:
    check_packed_attention_inputs(q, k, v, layout, scale, layout_type=SharedPrefixLayout)
