"""Prefix-tree attention for the training forward: every shared prefix runs once, at any depth.

Sequences that share prefixes -- the G completions of one prompt, the step-wise samples of
one agent trajectory (sample k = turns 0..k), the branches of a tree rollout -- are packed
as the segments of a trie (a forest: one tree per distinct first token path) in one row.
Each segment attends to all of its ancestors' segments and causally to itself, and its
positions (RoPE) continue from its depth, so every token's output equals the one it has
in its own root-to-node sequence; a shared segment's keys/values collect the gradient of
every sequence through it. ``fastrl.reference.tree_attention`` is the oracle (mask
formula there). The shared-prefix layout ``[prompt | c_1 | ... | c_G]``
(``fastrl.ops.shared_prefix_attention``) is the depth-2 case.

``TreeLayout`` describes the segments (lengths and parents, in depth-first pre-order); it
is int32 metadata built once per micro-batch on the host. In pre-order a segment's subtree
is a contiguous token range, so the mask is one interval test per key: query ``i`` sees
key ``j`` iff ``j <= i < key_end[j]``. ``PackedTree.from_sequences`` builds the trie of
token sequences (merging every common prefix), the packed ``input_ids``/``position_ids``,
and the maps between packed tokens and the sequences' scored tokens.

Backends of ``tree_attention`` (``backend=``):

- ``triton``: ``csrc_triton.tree_attention`` (FlashAttention-2 shaped forward and backward,
  block-sparse over the key blocks each query tile needs, dK/dV split over (key tile, query
  chunk, query head)). Tested under the CPU interpreter and compiled for sm_90 here; not yet
  timed on a GPU, so ``auto`` runs ``flex`` on CUDA until it is
  (``fastrl.ops._packed_attention.CUDA_AUTO_BACKEND``).
- ``torch`` (default on CPU): ``sdpa`` up to ``DENSE_MAX_TOKENS`` tokens, ``segments`` above.
- ``sdpa``: one ``scaled_dot_product_attention`` with the dense ``[N, N]`` boolean mask.
- ``segments``: per segment, SDPA over ``[ancestors ; segment]`` keys (the ancestors'
  keys gathered once for all segments): no ``N^2`` buffer.
- ``flex``: ``torch.nn.attention.flex_attention`` with the interval mask as a block mask
  (opt-in, meant for CUDA: in torch 2.13 its CPU path has no backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from fastrl.ops._packed_attention import (
    DENSE_MAX_TOKENS,  # noqa: F401  (named in the docstrings; fastrl.ops.tree_attention.DENSE_MAX_TOKENS as before)
    check_packed_attention_inputs,
    resolve_packed_backend,
    run_flex,
    sdpa_after_context,
    sdpa_dense,
)

__all__ = ["TreeLayout", "PackedTree", "tree_attention", "trie_size"]

BACKENDS = ("auto", "triton", "torch", "sdpa", "segments", "flex")


class Depth2Layout(Protocol):
    """What ``TreeLayout.from_shared_prefix`` reads of a depth-2 layout
    (``fastrl.ops.SharedPrefixLayout``; declared here because the shared-prefix module imports
    this one for its Triton path, so this one does not import it)."""

    @property
    def prefix_lens(self) -> tuple[int, ...]: ...
    @property
    def segment_lens(self) -> tuple[tuple[int, ...], ...]: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def q_doc_start(self) -> torch.Tensor: ...
    @property
    def q_prefix_end(self) -> torch.Tensor: ...
    @property
    def q_seg_start(self) -> torch.Tensor: ...


def _int_tuple(name: str, values: object, *, minimum: int) -> tuple[int, ...]:
    try:
        raw = list(values)  # type: ignore[call-overload]
    except TypeError as e:
        raise TypeError(f"{name} must be a sequence of ints, got {type(values).__name__}") from e
    out = []
    for x in raw:
        if isinstance(x, bool) or not isinstance(x, int) and not hasattr(x, "__index__"):
            raise ValueError(f"{name} must hold ints >= {minimum}, got {x!r}")
        x = int(x)
        if x < minimum:
            raise ValueError(f"{name} must hold ints >= {minimum}, got {x!r}")
        out.append(x)
    return tuple(out)


@dataclass(frozen=True, eq=False)
class TreeLayout:
    """Segments of a forest packed in one row of ``num_tokens`` tokens, in depth-first pre-order.

    Segment ``s`` holds tokens ``[seg_cu[s], seg_cu[s + 1])``; its parent ``parents[s]`` is an
    earlier segment (``-1``: a root) on the path from the root to segment ``s - 1``
    (pre-order), so a segment's subtree is the token range ``[seg_cu[s], subtree_end[s])``.
    Segments may be empty (their children then continue their parent). Tensors live on
    ``device``; the int32 ones are what the kernels read.
    """

    lens: tuple[int, ...]
    """Tokens of each segment (>= 0)."""
    parents: tuple[int, ...]
    """Parent segment of each segment (-1 for a root)."""
    num_tokens: int
    """N = sum(lens)."""
    seg_cu_seqlens: torch.Tensor
    """int32 [S + 1]: first token of every segment, then N."""
    position_ids: torch.Tensor
    """int64 [N]: each token's index in its root-to-node sequence (its depth)."""
    key_end: torch.Tensor
    """int32 [N]: one past the last query that attends this key (the end of its segment's
    subtree). Query i attends key j iff j <= i < key_end[j]."""
    host_seg_cu: tuple[int, ...]
    host_subtree_end: tuple[int, ...]
    """Per segment: one past the last token of its subtree."""
    host_depth: tuple[int, ...]
    """Per segment: the tokens of its ancestors (its first token's position)."""
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_segments(self) -> int:
        return len(self.lens)

    @property
    def device(self) -> torch.device:
        return self.key_end.device

    @classmethod
    def from_parents(cls, lens: Sequence[int], parents: Sequence[int], *,
                     device: torch.device | str | None = None) -> "TreeLayout":
        """A layout from per-segment lengths and parents (pre-order: see the class docstring)."""
        lens_t = _int_tuple("lens", lens, minimum=0)
        par = _int_tuple("parents", parents, minimum=-1)
        S = len(lens_t)
        if len(par) != S:
            raise ValueError(f"parents has {len(par)} entries, lens has {S}: one parent per segment")
        if S == 0 or sum(lens_t) == 0:
            raise ValueError("a tree layout needs at least one token")
        path: list[int] = []  # the root-to-(s-1) path, for the pre-order check
        for s, p in enumerate(par):
            while path and path[-1] != p:
                path.pop()
            if p != -1 and not path:
                raise ValueError(
                    f"parents[{s}] = {p} is not on the path from a root to segment {s - 1}: segments must be in "
                    "depth-first pre-order (each parent before its children, a subtree contiguous)")
            path.append(s)
        seg_cu = [0]
        for n in lens_t:
            seg_cu.append(seg_cu[-1] + n)
        N = seg_cu[-1]
        depth = [0] * S
        for s, p in enumerate(par):
            depth[s] = 0 if p < 0 else depth[p] + lens_t[p]
        sub_end = list(seg_cu[1:])
        for s in range(S - 1, -1, -1):  # children come after their parent: a reverse pass folds subtrees up
            if par[s] >= 0:
                sub_end[par[s]] = max(sub_end[par[s]], sub_end[s])
        pos: list[int] = []
        key_end: list[int] = []
        for s, n in enumerate(lens_t):
            pos += range(depth[s], depth[s] + n)
            key_end += [sub_end[s]] * n
        return cls(
            lens=lens_t, parents=par, num_tokens=N,
            seg_cu_seqlens=torch.tensor(seg_cu, dtype=torch.int32, device=device),
            position_ids=torch.tensor(pos, dtype=torch.long, device=device),
            key_end=torch.tensor(key_end, dtype=torch.int32, device=device),
            host_seg_cu=tuple(seg_cu), host_subtree_end=tuple(sub_end), host_depth=tuple(depth),
        )

    @classmethod
    def from_shared_prefix(cls, layout: Depth2Layout, *, device: torch.device | str | None = None) -> "TreeLayout":
        """The depth-2 tree of a shared-prefix layout: each document's prefix a root, its
        segments the root's children (a document without prefix: its segments are roots)."""
        lens: list[int] = []
        parents: list[int] = []
        for p, segs in zip(layout.prefix_lens, layout.segment_lens):
            root = len(lens)
            lens.append(p)
            parents.append(-1)
            for n in segs:
                lens.append(n)
                parents.append(root if p else -1)
        tree = cls.from_parents(lens, parents, device=layout.device if device is None else device)
        if tree.device == layout.device:  # block_lists can then build on the device, from these bounds
            tree._cache["depth2_bounds"] = (layout.q_doc_start, layout.q_prefix_end, layout.q_seg_start)
        return tree

    def to(self, device: torch.device | str) -> "TreeLayout":
        """The same layout with its tensors on ``device``."""
        return TreeLayout.from_parents(self.lens, self.parents, device=device)

    def ancestors(self, s: int) -> list[int]:
        """Proper ancestors of segment ``s``, root first."""
        out = []
        a = self.parents[s]
        while a >= 0:
            out.append(a)
            a = self.parents[a]
        return out[::-1]

    def dense_mask(self) -> torch.Tensor:
        """``[N, N]`` bool, ``True`` where query i may attend key j (cached on the layout)."""
        mask = self._cache.get("dense_mask")
        if mask is None:
            idx = torch.arange(self.num_tokens, device=self.device, dtype=torch.int32)
            mask = (idx[None, :] <= idx[:, None]) & (idx[:, None] < self.key_end[None, :])
            self._cache["dense_mask"] = mask
        return mask

    def block_lists(self, block_m: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For the Triton kernels: per query tile of ``block_m`` tokens, the key blocks of
        ``block_n`` tokens holding any key it attends (its segments' ancestors and the
        segments themselves, up to the tile's last token), ascending, as CSR int32
        ``(ptr [tiles + 1], blocks)`` on the layout's device (cached per tile shape; entries
        of ``blocks`` past ``ptr[-1]`` are unused)."""
        key = ("blocks", block_m, block_n)
        out = self._cache.get(key)
        if out is None and "depth2_bounds" in self._cache:
            # a shared-prefix layout's tree (from_shared_prefix): the same lists from its per-token
            # bounds, on the device, without the Python loop below (~20 ms at 18K tokens); the
            # blocks tensor may run past ptr[-1]
            from csrc_triton.shared_prefix_attention import depth2_block_lists

            out = depth2_block_lists(*self._cache["depth2_bounds"], block_m, block_n)
            self._cache[key] = out
        if out is None:
            N, cu = self.num_tokens, self.host_seg_cu
            ptr, blocks = [0], []
            seg = 0
            for m0 in range(0, N, block_m):
                m1 = min(m0 + block_m, N)
                while cu[seg + 1] <= m0:
                    seg += 1
                mine: set[int] = set()
                s = seg
                while s < self.num_segments and cu[s] < m1:
                    if cu[s + 1] > cu[s]:
                        for a in [*self.ancestors(s), s]:
                            lo, hi = cu[a], min(cu[a + 1], m1)
                            if hi > lo:
                                mine.update(range(lo // block_n, (hi - 1) // block_n + 1))
                    s += 1
                blocks += sorted(mine)
                ptr.append(len(blocks))
            i32 = dict(dtype=torch.int32, device=self.device)
            out = (torch.tensor(ptr, **i32), torch.tensor(blocks, **i32))
            self._cache[key] = out
        return out

    def dkdv_items(self, block_n: int, q_chunk: int) -> torch.Tensor:
        """For the Triton dK/dV kernel: its work items, int32 ``[items, 2]`` (key tile, chunk)
        on the layout's device (cached). The queries that attend key tile ``t`` of ``block_n``
        keys are ``[t * block_n, max key_end)`` (its keys' subtrees); they are cut into
        chunks of ``q_chunk``, one program each, so a prefix tile's long range (every
        descendant's queries) spreads over programs instead of making the critical path."""
        key = ("dkdv", block_n, q_chunk)
        out = self._cache.get(key)
        if out is None:
            N, cu = self.num_tokens, self.host_seg_cu
            tiles = -(-N // block_n)
            q_hi = [0] * tiles  # max key_end over each tile's keys
            for s, end in enumerate(self.host_subtree_end):
                if cu[s + 1] > cu[s]:
                    for t in range(cu[s] // block_n, (cu[s + 1] - 1) // block_n + 1):
                        q_hi[t] = max(q_hi[t], end)
            items = [(t, c) for t in range(tiles) for c in range(-(-(q_hi[t] - t * block_n) // q_chunk))]
            out = torch.tensor(items, dtype=torch.int32, device=self.device).reshape(-1, 2)
            self._cache[key] = out
        return out


def trie_size(sequences: Sequence[Sequence[int]]) -> int:
    """Tokens of the trie of ``sequences`` (each common prefix counted once): the packed
    row's length ``PackedTree.from_sequences`` would build, without building it."""
    seqs = sorted(tuple(s) for s in sequences)
    total, prev = 0, ()
    for s in seqs:
        total += len(s) - _lcp(prev, s)
        prev = s
    return total


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True, eq=False)
class PackedTree:
    """Token sequences packed as a trie in one row, plus the maps to their scored tokens.

    Sequence ``b`` scores its tokens ``t = score_start[b] .. len_b - 1`` (each predicted by
    the hidden state of its token ``t - 1``); the ``M`` scored tokens are listed in sequence
    order, ``t`` ascending. Sequences sharing a prefix share its packed tokens, so a scored
    token two sequences have in common is computed once: the ``U`` distinct scored packed
    tokens are ``target_index`` and ``unique_of [M]`` maps each scored token to its row.
    """

    layout: TreeLayout
    input_ids: torch.Tensor
    """int64 [1, N] packed tokens."""
    position_ids: torch.Tensor
    """int64 [1, N]: each token's position in its sequences."""
    target_ids: torch.Tensor
    """int64 [U]: the distinct scored tokens."""
    target_index: torch.Tensor
    """int64 [U]: their packed positions (ascending)."""
    predictor_index: torch.Tensor
    """int64 [U]: the packed position whose output predicts each (its parent token)."""
    unique_of: torch.Tensor
    """int64 [M]: the row of ``target_*`` of each scored token."""
    sample_index: torch.Tensor
    """int64 [M]: the sequence of each scored token."""
    seq_pos: torch.Tensor
    """int64 [M]: its position t in that sequence."""
    seq_lens: tuple[int, ...]
    score_start: tuple[int, ...]

    @property
    def num_samples(self) -> int:
        return len(self.seq_lens)

    @property
    def scored_lens(self) -> tuple[int, ...]:
        """Scored tokens per sequence (the loss's packed-sequence lengths)."""
        return tuple(max(0, n - s) for n, s in zip(self.seq_lens, self.score_start))

    @classmethod
    def from_sequences(cls, sequences: Sequence[Sequence[int]], *, score_start: Sequence[int],
                       device: torch.device | str | None = None) -> "PackedTree":
        """The trie of ``sequences`` (token id lists, each non-empty). ``score_start[b] >= 1``
        is sequence b's first scored token (its prompt length); a sequence no longer than
        that scores nothing."""
        if not isinstance(sequences, Sequence) or len(sequences) == 0:
            raise ValueError("sequences must be a non-empty sequence of token id sequences")
        seqs = [_int_tuple(f"sequences[{b}]", s, minimum=0) for b, s in enumerate(sequences)]
        starts = _int_tuple("score_start", score_start, minimum=1)
        if len(starts) != len(seqs):
            raise ValueError(f"score_start has {len(starts)} entries, expected one per sequence ({len(seqs)})")
        for b, s in enumerate(seqs):
            if not s:
                raise ValueError(f"sequences[{b}] is empty")
        ids: list[int] = []
        parent_tok: list[int] = []
        paths: list[list[int]] = [[] for _ in seqs]
        prev_path: list[int] = []
        prev: tuple[int, ...] = ()
        # lexicographic order writes the trie depth first: a new sequence shares its
        # longest common prefix with the one before it and hangs its rest off that path
        for b in sorted(range(len(seqs)), key=lambda b: seqs[b]):
            s = seqs[b]
            L = _lcp(prev, s)
            path = prev_path[:L]
            for t in range(L, len(s)):
                parent_tok.append(path[-1] if path else -1)
                path.append(len(ids))
                ids.append(s[t])
            paths[b], prev_path, prev = path, path, s
        N = len(ids)
        children = [0] * N
        for p in parent_tok:
            if p >= 0:
                children[p] += 1
        # a token continues the segment of the token before it iff it is that token's only child
        seg_of = [0] * N
        lens: list[int] = []
        parents: list[int] = []
        for t in range(N):
            p = parent_tok[t]
            if t > 0 and p == t - 1 and children[p] == 1:
                seg_of[t] = seg_of[t - 1]
                lens[-1] += 1
            else:
                seg_of[t] = len(lens)
                lens.append(1)
                parents.append(seg_of[p] if p >= 0 else -1)
        layout = TreeLayout.from_parents(lens, parents, device=device)
        sample_index, seq_pos, scored = [], [], []
        for b, (s, a) in enumerate(zip(seqs, starts)):
            for t in range(a, len(s)):
                sample_index.append(b)
                seq_pos.append(t)
                scored.append(paths[b][t])
        long = dict(dtype=torch.long, device=device)
        scored_t = torch.tensor(scored, dtype=torch.long)
        target_index, unique_of = torch.unique(scored_t, sorted=True, return_inverse=True)
        input_ids = torch.tensor(ids, **long)
        parent_t = torch.tensor(parent_tok, dtype=torch.long)
        return cls(
            layout=layout,
            input_ids=input_ids[None],
            position_ids=layout.position_ids[None],
            target_ids=input_ids[target_index.to(input_ids.device)],
            target_index=target_index.to(device),
            predictor_index=parent_t[target_index].to(device),
            unique_of=unique_of.to(device),
            sample_index=torch.tensor(sample_index, **long),
            seq_pos=torch.tensor(seq_pos, **long),
            seq_lens=tuple(len(s) for s in seqs),
            score_start=starts,
        )

    def to_batch_layout(self, values: torch.Tensor, *, seq_len: int | None = None, shift: int = 0,
                        fill: float = 0.0) -> torch.Tensor:
        """``[M, ...]`` per scored token -> ``[B, T, ...]`` at the tokens' columns ``t - shift``
        (``shift=1``: the ``[B, T-1]`` grid of ``causal_lm_logprobs``); differentiable."""
        M = self.sample_index.shape[0]
        if values.shape[:1] != (M,):
            raise ValueError(f"values must have {M} rows (one per scored token), got shape {tuple(values.shape)}")
        width = max(self.seq_lens) - shift if seq_len is None else seq_len
        out = values.new_full((self.num_samples, width, *values.shape[1:]), fill)
        return out.index_put((self.sample_index.to(values.device), (self.seq_pos - shift).to(values.device)), values)

    def from_batch_layout(self, x: torch.Tensor, *, shift: int = 0) -> torch.Tensor:
        """``[B, T, ...]`` -> ``[M, ...]`` from columns ``t - shift``."""
        return x[self.sample_index.to(x.device), (self.seq_pos - shift).to(x.device)]


# ---------------------------------------------------------------------------------------
# torch backends


def _segment_plan(layout: TreeLayout) -> dict:
    """Per non-empty segment: its ancestors' token count; and one index that gathers every
    segment's ``[ancestors ; segment]`` keys back to back (one gather, one backward scatter)."""
    plan = layout._cache.get("segments")
    if plan is None:
        cu = layout.host_seg_cu
        index: list[int] = []
        pieces = []  # (n queries, ancestor keys)
        for s, n in enumerate(layout.lens):
            if n == 0:
                continue
            anc = [t for a in layout.ancestors(s) for t in range(cu[a], cu[a + 1])]
            index += anc
            index += range(cu[s], cu[s + 1])
            pieces.append((n, len(anc)))
        plan = dict(index=torch.tensor(index, dtype=torch.long, device=layout.device), pieces=pieces)
        layout._cache["segments"] = plan
    return plan


def _sdpa_segments(q, k, v, layout: TreeLayout, scale: float) -> torch.Tensor:
    plan = _segment_plan(layout)
    pieces = plan["pieces"]
    qs = torch.split(q.transpose(0, 1), [n for n, _ in pieces], dim=1)
    kv_sizes = [n + a for n, a in pieces]
    ks = torch.split(k.index_select(0, plan["index"]).transpose(0, 1), kv_sizes, dim=1)
    vs = torch.split(v.index_select(0, plan["index"]).transpose(0, 1), kv_sizes, dim=1)
    masks: dict[tuple[int, int], torch.Tensor] = {}
    outs = [sdpa_after_context(qi, ki, vi, a, scale, masks) for qi, ki, vi, (_, a) in zip(qs, ks, vs, pieces)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out.transpose(0, 1)


def _flex(q, k, v, layout: TreeLayout, scale: float) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask

    key = ("block_mask", q.device)
    block_mask = layout._cache.get(key)
    if block_mask is None:
        key_end = layout.key_end

        def mask_mod(b, h, qi, kj):
            return (kj <= qi) & (qi < key_end[kj])

        N = layout.num_tokens
        block_mask = create_block_mask(mask_mod, None, None, N, N, device=q.device)
        layout._cache[key] = block_mask
    return run_flex(q, k, v, block_mask, scale)


# ---------------------------------------------------------------------------------------
# Triton backend


class _TritonTreeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: TreeLayout, scale: float):
        from csrc_triton.tree_attention import tiles_for, tree_attention_fwd

        t = tiles_for(q.device)["fwd"]
        ptr, blocks = layout.block_lists(t["BLOCK_M"], t["BLOCK_N"])
        out, lse = tree_attention_fwd(q, k, v, layout.key_end, ptr, blocks, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout = layout
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from csrc_triton.tree_attention import tiles_for, tree_attention_bwd

        q, k, v, out, lse = ctx.saved_tensors
        layout = ctx.layout
        tiles = tiles_for(q.device)
        ptr, blocks = layout.block_lists(tiles["dq"]["BLOCK_M"], tiles["dq"]["BLOCK_N"])
        items = layout.dkdv_items(tiles["dkdv"]["BLOCK_N"], tiles["q_chunk"])
        dq, dk, dv = tree_attention_bwd(grad_out, q, k, v, out, lse, layout.key_end, ptr, blocks, ctx.scale,
                                        dkdv_items=items, q_chunk=tiles["q_chunk"])
        return dq, dk, dv, None, None


def triton_tree_attention(q, k, v, layout: TreeLayout, scale: float) -> torch.Tensor:
    """The Triton kernels over ``layout`` (differentiable; no input checks: ``tree_attention``
    and ``shared_prefix_attention`` make them)."""
    return _TritonTreeAttention.apply(q, k, v, layout, float(scale))


_IMPLS = {"sdpa": sdpa_dense, "segments": _sdpa_segments, "flex": _flex}


def _resolve(backend: str, q: torch.Tensor, layout: TreeLayout) -> str:
    return resolve_packed_backend(backend, BACKENDS, q, layout.num_tokens)


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: TreeLayout,
    *,
    scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention over a packed prefix tree (differentiable wrt q, k, v).

    Args:
        q: ``[N, Hq, D]`` queries of the packed row (token-major, contiguous last dim).
        k, v: ``[N, Hkv, D]``; ``Hq`` a multiple of ``Hkv`` (GQA).
        layout: the segments (``N = layout.num_tokens``), on q's device.
        scale: softmax scale (usually ``D ** -0.5``).
        backend: ``auto`` (``CUDA_AUTO_BACKEND`` on CUDA, ``torch`` otherwise) | ``triton`` | ``torch``
            (``sdpa`` up to ``DENSE_MAX_TOKENS`` tokens, ``segments`` above) | ``sdpa`` |
            ``segments`` | ``flex`` (see the module docstring).

    Returns:
        ``[N, Hq, D]`` in ``q.dtype``: query i attends key j iff j's segment is an ancestor
        of i's, or the same segment and j <= i.
    """
    _check(q, k, v, layout, scale)
    impl = _resolve(backend, q, layout)
    if impl == "triton":
        return triton_tree_attention(q, k, v, layout, scale)
    return _IMPLS[impl](q, k, v, layout, float(scale))


def _check(q, k, v, layout, scale) -> None:
    check_packed_attention_inputs(q, k, v, layout, scale, layout_type=TreeLayout)
