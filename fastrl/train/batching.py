"""How a step's groups are batched for the model: one interface, one class per batching.

A batching splits whole groups into micro-batches of at most ``token_budget`` tokens, runs the
policy (``logprobs``) and the critic (``values``) on a micro-batch, and moves per-token
tensors between the experience's ``[B, T-1]`` grid and the form its loss takes
(``gather``: grid -> loss; ``scatter``: model output -> grid; a ``[B]`` tensor gathers
the micro-batch's rows). ``attention`` is the context the forward *and* backward run in
(checkpointed layers recompute their forward in the backward and must see the same
attention). The update never asks which batching it runs.

- ``PaddedBatching``: rows of the ``[B, T]`` batch, trimmed per micro-batch to its longest
  row and to the columns after its shortest prompt; the loss takes ``[R, k]`` rows.
- ``GroupPackedBatching`` (``shared_prefix=true``, the default): each group packed as
  ``[prompt | c_1 | ... | c_G]`` with shared-prefix attention (``fastrl.ops.hf_packed``),
  the prompt run once per group; the loss takes the model's ``[1, M]`` completion tokens
  as they come, one sequence per sample (``cu_seqlens``), with no padded round trip.

- ``TreePackedBatching`` (``prefix_tree=true``): the micro-batch's rows packed as the trie
  of their tokens with prefix-tree attention (``fastrl.ops.hf_tree``): every prefix two
  rows share runs once, however deep -- the prompt of a group, and all earlier turns of
  step-wise samples of one trajectory (sample k = turns 0..k), which the group layout
  would run k times. A scored token two rows share is computed once. The loss form is the
  group layout's (``[1, M]``, one sequence per sample).

- ``AutoTreeBatching`` (``prefix_tree=auto``, the default, with ``shared_prefix=true``): per
  experience, the trie when ``prefers_tree`` says its samples share enough beyond the prompt
  (tree rollouts, split agent trajectories), else the group layout; ``describe(exp)`` logs
  the choice (``layout/tree``) and its input (``layout/trie_saving``).

A new batching is another subclass: its ``cost`` of a set of groups, its ``make`` of a
micro-batch, and the four per-micro-batch methods. (``*Layout`` names are the ops' index
structures: ``fastrl.ops.PackedLayout``, the ``cu_seqlens`` descriptor, and
``fastrl.ops.SharedPrefixLayout`` / ``TreeLayout``, the attention metadata. The metrics and
options keep the word: ``layout/tree``, ``layout/trie_saving``; "the group layout" in the
options' help is ``GroupPackedBatching``.)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Sequence

import torch

from fastrl.ops import PackedLayout
from fastrl.ops.hf import causal_lm_logprobs
from fastrl.train.experience import Experience

__all__ = ["AutoTreeBatching", "GroupPackedBatching", "Batching", "MicroBatch", "PaddedBatching", "TREE_MIN_SAVING", "TreePackedBatching",
           "make_batching", "prefers_tree"]

TREE_MIN_SAVING = 0.1
"""``prefix_tree=auto`` runs the trie when it saves at least this share of the tokens the group
layout would run (the prompt once per group, every row's tokens after it): below that, the
samples share (almost) nothing beyond the prompt and the group layout's cheaper attention wins."""


def prefers_tree(*, trie_tokens: int, prompt_once_tokens: int, min_saving: float = TREE_MIN_SAVING) -> bool:
    """The ``prefix_tree=auto`` rule: the trie of the samples (``trie_tokens``, every shared prefix
    once) saves at least ``min_saving`` of ``prompt_once_tokens`` (each group's prompt once plus
    every row's tokens after it: what the group layout runs). The saving is the share of tokens
    that samples share beyond the prompt: 0 for independent samples, about half for a two-level
    tree split halfway, more for step-wise samples of long trajectories."""
    return prompt_once_tokens > 0 and prompt_once_tokens - trie_tokens >= min_saving * prompt_once_tokens


@dataclass
class MicroBatch:
    """The rows of one forward/backward (sample indices, batch order) and the batching's own data."""

    rows: torch.Tensor
    rows_device: torch.Tensor
    data: Any
    """Batching-specific: ``_Padded``, ``_Packed`` or ``_Tree``."""


@dataclass
class _Padded:
    cols: slice  # columns of the [B, T-1] grid the model scores
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    k: int


@dataclass
class _Packed:
    packed: Any  # fastrl.ops.shared_prefix_attention.PackedGroups
    tok_rows: torch.Tensor  # grid row of each packed completion token
    tok_cols: torch.Tensor  # grid column of each packed completion token
    cu_seqlens: PackedLayout


@dataclass
class _Tree:
    tree: Any  # fastrl.ops.tree_attention.PackedTree
    tok_rows: torch.Tensor  # grid row of each scored token
    tok_cols: torch.Tensor  # grid column of each scored token
    cu_seqlens: PackedLayout


class Batching:
    """Micro-batching by token budget over whole groups; subclasses say what a micro-batch is."""

    def __init__(self, *, token_budget: int, device: torch.device, temperature: float,
                 forward_context: Callable[[], ContextManager] = contextlib.nullcontext):
        self.token_budget = token_budget
        self.device = device
        self.temperature = temperature
        self.forward_context = forward_context
        """Entered around every model forward (autocast, activation offload)."""

    # ------------------------------------------------------------------ splitting
    def micro_batches(self, exp: Experience, groups: Sequence[int] | None = None) -> list[MicroBatch]:
        """Whole groups (all when None), in order, cut into micro-batches of at most
        ``token_budget`` tokens by ``cost`` (a group larger than the budget is one micro-batch)."""
        groups = range(exp.num_groups) if groups is None else groups
        out: list[MicroBatch] = []
        chunk: list[int] = []
        for g in groups:
            if chunk and self.cost(exp, [*chunk, g]) > self.token_budget:
                out.append(self.make(exp, chunk))
                chunk = []
            chunk.append(g)
        if chunk:
            out.append(self.make(exp, chunk))
        return out

    def cost(self, exp: Experience, groups: Sequence[int]) -> int:
        """Tokens one forward over ``groups`` runs."""
        raise NotImplementedError

    def make(self, exp: Experience, groups: Sequence[int]) -> MicroBatch:
        raise NotImplementedError

    # ------------------------------------------------------------------ per micro-batch
    def logprobs(self, model: torch.nn.Module, mb: MicroBatch, *, entropy: bool,
                 entropy_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 log-probs (and entropies) of the micro-batch's scored tokens, in loss form.
        ``entropy_rows`` (bool, loss form): the entropy of those tokens only, NaN at the
        others, not differentiable (``fastrl.ops.linear_logprobs``): a metric's subsample."""
        raise NotImplementedError

    def values(self, critic: Any, mb: MicroBatch) -> torch.Tensor:
        """fp32 critic values of the states before the scored tokens, in loss form."""
        raise NotImplementedError

    def gather(self, mb: MicroBatch, x: torch.Tensor) -> torch.Tensor:
        """A ``[B, T-1]`` grid tensor at the micro-batch's scored tokens (loss form), or a
        ``[B]`` tensor at its rows."""
        raise NotImplementedError

    def scatter(self, mb: MicroBatch, out: torch.Tensor, grid: torch.Tensor) -> None:
        """Write ``out`` (loss form) into ``grid`` at the micro-batch's scored tokens."""
        raise NotImplementedError

    def cu_seqlens(self, mb: MicroBatch) -> PackedLayout | None:
        """The loss's packed-sequence descriptor (None: padded rows)."""
        return None

    def attention(self, mb: MicroBatch, models: Iterable[torch.nn.Module]) -> ContextManager:
        return contextlib.nullcontext()

    def describe(self, exp: Experience) -> dict[str, float]:
        """Which batching this experience runs on: ``layout/tree`` 1 for the trie, else 0."""
        return {"layout/tree": 0.0}

    def _micro_batch(self, exp: Experience, groups: Sequence[int], data: Any) -> MicroBatch:
        rows = exp.rows(groups)
        return MicroBatch(rows=rows, rows_device=rows.to(self.device), data=data)


class PaddedBatching(Batching):
    """Rows of the ``[B, T]`` batch; a micro-batch costs its longest row times its rows."""

    def cost(self, exp: Experience, groups: Sequence[int]) -> int:
        lengths = exp.sequence_lengths
        rows = exp.rows(groups).tolist()
        return max(lengths[r] for r in rows) * len(rows)

    def make(self, exp: Experience, groups: Sequence[int]) -> MicroBatch:
        batch = exp.batch
        rows = exp.rows(groups)
        Tm = int(batch.attention_mask[rows].sum(1).max())
        k = max(1, Tm - min(len(batch.prompt_ids[g]) for g in groups))
        data = _Padded(cols=slice(Tm - 1 - k, Tm - 1), input_ids=batch.input_ids[rows, :Tm].to(self.device),
                       attention_mask=batch.attention_mask[rows, :Tm].to(self.device), k=k)
        return self._micro_batch(exp, groups, data)

    def logprobs(self, model, mb, *, entropy, entropy_rows=None):
        d: _Padded = mb.data
        with self.forward_context():
            out = causal_lm_logprobs(model, d.input_ids, d.attention_mask, temperature=self.temperature, logits_to_keep=d.k,
                                     return_entropy=entropy, entropy_rows=entropy_rows)
        if entropy:
            return out[0].float(), out[1].float()
        return out.float(), None

    def values(self, critic, mb):
        d: _Padded = mb.data
        with self.forward_context():
            return critic.values(d.input_ids, d.attention_mask, d.k)

    def gather(self, mb, x):
        if x.dim() == 1:
            return x[mb.rows_device]
        return x[mb.rows_device, mb.data.cols]

    def scatter(self, mb, out, grid):
        grid[mb.rows_device, mb.data.cols] = out


class GroupPackedBatching(Batching):
    """Groups packed as ``[prompt | c_1 | ... | c_G]``; a micro-batch costs ``P + sum(L_i)`` per group.

    An experience whose groups are not ``G`` rows sharing the prompt (``Experience.packable``
    is False: agent trajectories split into several samples, or a group with a failed
    environment) runs on padded rows instead (``PaddedBatching``), micro-batch by micro-batch."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.padded = PaddedBatching(**kwargs)

    def _of(self, mb: MicroBatch) -> Batching | None:
        return self.padded if isinstance(mb.data, _Padded) else None

    def micro_batches(self, exp: Experience, groups: Sequence[int] | None = None) -> list[MicroBatch]:
        if not exp.packable:
            return self.padded.micro_batches(exp, groups)
        return super().micro_batches(exp, groups)

    def cost(self, exp: Experience, groups: Sequence[int]) -> int:
        if not exp.packable:
            return self.padded.cost(exp, groups)
        batch = exp.batch
        return sum(len(batch.prompt_ids[g]) + sum(len(c) for c in batch.completion_ids[exp.group(g)]) for g in groups)

    def make(self, exp: Experience, groups: Sequence[int]) -> MicroBatch:
        from fastrl.ops.shared_prefix_attention import PackedGroups

        if not exp.packable:
            return self.padded.make(exp, groups)
        batch = exp.batch
        packed = PackedGroups.from_groups([(batch.prompt_ids[g], batch.completion_ids[exp.group(g)]) for g in groups],
                                          device=self.device)
        mb = self._micro_batch(exp, groups, None)
        mb.data = _Packed(packed=packed, tok_rows=mb.rows_device[packed.sample_index], tok_cols=packed.batch_pos - 1,
                          cu_seqlens=PackedLayout.from_lengths(packed.completion_lens, device=self.device))
        return mb

    def logprobs(self, model, mb, *, entropy, entropy_rows=None):
        from fastrl.ops.hf_packed import packed_causal_lm_logprobs

        if self._of(mb):
            return self.padded.logprobs(model, mb, entropy=entropy, entropy_rows=entropy_rows)
        with self.forward_context():
            out = packed_causal_lm_logprobs(model, mb.data.packed, temperature=self.temperature, return_entropy=entropy,
                                            entropy_rows=entropy_rows[0] if entropy_rows is not None else None)
        if entropy:
            return out[0].float()[None], out[1].float()[None]
        return out.float()[None], None

    def values(self, critic, mb):
        from fastrl.ops.hf_packed import packed_causal_lm_hidden_states

        if self._of(mb):
            return self.padded.values(critic, mb)
        with self.forward_context():
            hidden = packed_causal_lm_hidden_states(critic.body, mb.data.packed)
            return critic.head(hidden)[None]

    def gather(self, mb, x):
        if self._of(mb):
            return self.padded.gather(mb, x)
        if x.dim() == 1:
            return x[mb.rows_device]
        return x[mb.data.tok_rows, mb.data.tok_cols][None]

    def scatter(self, mb, out, grid):
        if self._of(mb):
            return self.padded.scatter(mb, out, grid)
        grid[mb.data.tok_rows, mb.data.tok_cols] = out[0]

    def cu_seqlens(self, mb):
        return None if self._of(mb) else mb.data.cu_seqlens

    def attention(self, mb, models):
        from fastrl.ops.hf_packed import shared_prefix_attention_enabled

        if self._of(mb):
            return contextlib.nullcontext()

        stack = contextlib.ExitStack()
        for m in models:
            stack.enter_context(shared_prefix_attention_enabled(m))
        return stack


class TreePackedBatching(GroupPackedBatching):
    """Rows packed as the trie of their tokens; a micro-batch costs its trie's tokens.

    Each row is ``prompt + completion`` (the grid's tokens); it scores its completion
    tokens, like the group layout, whose loss form, ``gather``/``scatter`` and attention
    context it shares."""

    _sizes: tuple[Any, dict[int, int]] | None = None  # (the batch, each group's trie tokens)

    def micro_batches(self, exp: Experience, groups: Sequence[int] | None = None) -> list[MicroBatch]:
        """The trie packs any experience, also one the group layout cannot (split samples)."""
        return Batching.micro_batches(self, exp, groups)

    @staticmethod
    def _sequences(exp: Experience, groups: Sequence[int]) -> tuple[list[list[int]], list[int]]:
        """Each row's tokens as they are in the grid (a split agent sample's own, re-rendered
        prompt included), scored from its group's ``prompt_ids`` on, as the padded layout scores
        them (single-turn: ``prompt + completion``, scored after the prompt)."""
        batch = exp.batch
        lengths = exp.sequence_lengths
        seqs, starts = [], []
        for g in groups:
            start = len(batch.prompt_ids[g])
            rows = exp.group(g)
            for r in range(rows.start, rows.stop):
                seqs.append(batch.input_ids[r, :lengths[r]].tolist())
                starts.append(start)
        return seqs, starts

    def describe(self, exp: Experience) -> dict[str, float]:
        return {"layout/tree": 1.0}

    def cost(self, exp: Experience, groups: Sequence[int]) -> int:
        """The sum of the groups' tries (each group's trie is computed once per batch): the
        packed row's length, or more when groups share a prefix (one trie merges it)."""
        from fastrl.ops.tree_attention import trie_size

        if self._sizes is None or self._sizes[0] is not exp.batch:
            self._sizes = (exp.batch, {})
        sizes = self._sizes[1]
        for g in groups:
            if g not in sizes:
                sizes[g] = trie_size(self._sequences(exp, [g])[0])
        return sum(sizes[g] for g in groups)

    def make(self, exp: Experience, groups: Sequence[int]) -> MicroBatch:
        from fastrl.ops.tree_attention import PackedTree

        seqs, starts = self._sequences(exp, groups)
        tree = PackedTree.from_sequences(seqs, score_start=starts, device=self.device)
        mb = self._micro_batch(exp, groups, None)
        mb.data = _Tree(tree=tree, tok_rows=mb.rows_device[tree.sample_index], tok_cols=tree.seq_pos - 1,
                        cu_seqlens=PackedLayout.from_lengths(tree.scored_lens, device=self.device))
        return mb

    def logprobs(self, model, mb, *, entropy, entropy_rows=None):
        """``entropy_rows`` is not used: the trie's scored tokens are shared between rows, so the
        full entropy is computed (the metric's subsample is then read from it)."""
        from fastrl.ops.hf_tree import tree_causal_lm_logprobs

        with self.forward_context():
            out = tree_causal_lm_logprobs(model, mb.data.tree, temperature=self.temperature, return_entropy=entropy)
        if entropy:
            return out[0].float()[None], out[1].float()[None]
        return out.float()[None], None

    def values(self, critic, mb):
        from fastrl.ops.hf_tree import tree_causal_lm_hidden_states

        tree = mb.data.tree
        with self.forward_context():
            hidden = tree_causal_lm_hidden_states(critic.body, tree)
            return critic.head(hidden)[tree.unique_of][None]


class AutoTreeBatching(TreePackedBatching):
    """``prefix_tree=auto``: each experience runs on the trie (``TreePackedBatching``) when
    ``prefers_tree`` holds for it, else on the group layout (``GroupPackedBatching``, padded rows
    for an experience it cannot pack). The choice is made once per experience (its batch),
    from the trie's tokens and the group layout's prompt-once tokens over all its groups;
    micro-batches carry their kind, so the per-micro-batch methods follow it."""

    def __init__(self, *, min_saving: float = TREE_MIN_SAVING, **kwargs: Any):
        super().__init__(**kwargs)
        self.group_batching = GroupPackedBatching(**kwargs)
        self.min_saving = min_saving
        self._choice: tuple[Any, bool, float] | None = None  # (the batch, tree?, saving)

    def _decide(self, exp: Experience) -> tuple[bool, float]:
        if self._choice is None or self._choice[0] is not exp.batch:
            groups = range(exp.num_groups)
            trie = super().cost(exp, groups)
            lengths = exp.sequence_lengths
            once = sum(len(exp.batch.prompt_ids[g]) + sum(lengths[r] - len(exp.batch.prompt_ids[g])
                                                           for r in range(exp.group(g).start, exp.group(g).stop)) for g in groups)
            tree = prefers_tree(trie_tokens=trie, prompt_once_tokens=once, min_saving=self.min_saving)
            self._choice = (exp.batch, tree, (once - trie) / once if once else 0.0)
        return self._choice[1], self._choice[2]

    def uses_tree(self, exp: Experience) -> bool:
        """Whether ``exp`` runs on the trie."""
        return self._decide(exp)[0]

    def micro_batches(self, exp: Experience, groups: Sequence[int] | None = None) -> list[MicroBatch]:
        if self.uses_tree(exp):
            return super().micro_batches(exp, groups)
        return self.group_batching.micro_batches(exp, groups)

    def cost(self, exp: Experience, groups: Sequence[int]) -> int:
        return super().cost(exp, groups) if self.uses_tree(exp) else self.group_batching.cost(exp, groups)

    def make(self, exp: Experience, groups: Sequence[int]) -> MicroBatch:
        return super().make(exp, groups) if self.uses_tree(exp) else self.group_batching.make(exp, groups)

    def logprobs(self, model, mb, *, entropy, entropy_rows=None):
        if isinstance(mb.data, _Tree):
            return super().logprobs(model, mb, entropy=entropy, entropy_rows=entropy_rows)
        return self.group_batching.logprobs(model, mb, entropy=entropy, entropy_rows=entropy_rows)

    def values(self, critic, mb):
        return super().values(critic, mb) if isinstance(mb.data, _Tree) else self.group_batching.values(critic, mb)

    def describe(self, exp: Experience) -> dict[str, float]:
        """``layout/tree`` (1: the trie ran) and ``layout/trie_saving`` (the rule's input: the
        share of the group layout's tokens the trie saves)."""
        tree, saving = self._decide(exp)
        return {"layout/tree": float(tree), "layout/trie_saving": saving}


def make_batching(*, shared_prefix: bool, prefix_tree: bool | str = False, **kwargs: Any) -> Batching:
    """The batching ``TrainConfig`` names: ``prefix_tree=True`` (the trie of the rows) over
    ``shared_prefix`` (one group per document) over padded rows; ``prefix_tree="auto"`` with
    ``shared_prefix``: ``AutoTreeBatching`` (the trie when an experience's samples share more
    than the prompt)."""
    if prefix_tree is True:
        return TreePackedBatching(**kwargs)
    if prefix_tree not in (False, "auto"):
        raise ValueError(f"prefix_tree must be true, false or 'auto', got {prefix_tree!r}")
    if not shared_prefix:
        return PaddedBatching(**kwargs)
    return AutoTreeBatching(**kwargs) if prefix_tree == "auto" else GroupPackedBatching(**kwargs)
