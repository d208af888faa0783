"""Branching (tree) rollouts: k continuations at chosen token depths instead of G independent samples.

A ``BranchSchedule`` ``(branches=(k_0, ..., k_m), depths=(0 = d_0 < d_1 < ... < d_m))``
grows one tree per prompt, level by level (TreePO, arXiv 2508.17445, segment-wise tree
sampling; TreeRL, arXiv 2506.11902): the prompt branches into ``k_0`` children; a level-``l``
node samples the completion tokens ``[d_l, d_{l+1})`` of its path (``d_{m+1}`` is
``max_new_tokens``), and, unless it ended on a stop token, branches into ``k_{l+1}`` children
at depth ``d_{l+1}``. Each prompt gets ``G = k_0 * ... * k_m`` leaves, the rows of its group,
in depth-first order. A node that stops before the last level ends every path below it:
the leaves under it are copies of its sequence, so every leaf is still marginally one
sample of the policy (the tree correlates the samples; it does not change their
distribution) and a group always has ``G`` rows.

The shared part of a path is sampled once:

- a sampler that declares the multi-turn capability (``supports_multi_turn``: ``HFGroupSampler``;
  the fork path): one multi-turn state (``start`` / ``continue_``),
  each node a trajectory of it; at a branch point the node's trajectory is *forked*
  (:func:`fork_trajectories`: its suffix keys/values copied into new rows, the prompt's
  stored once for all) and each child continues from that copy, so no token of a shared
  segment is recomputed (each child runs only the parent's last sampled token, whose
  keys/values are not stored yet, before sampling its own).
- any other sampler (vLLM, the vLLM server, the sampler process): each level is one
  ``generate`` call whose prompts are ``prompt + path so far`` (``group_size = k_l``);
  vLLM's automatic prefix caching (``enable_prefix_caching``, on by default in
  ``fastrl.rollout.vllm``) finds the shared path's KV blocks, so its prefill is not redone
  (``RolloutStats.prefix_cache_hit_rate`` reports the hits).

Seeds: node ``n`` at level ``l`` of prompt ``i`` draws from ``(s_i * G + f_n) *
LEVEL_SEED_STRIDE + l`` where ``s_i`` is the prompt's seed and ``f_n`` the index of the first
leaf under ``n``: a tree depends on its prompt's seed alone, not on the batch.

``sample_tree`` returns a ``TreeRolloutBatch``: the ``RolloutBatch`` of the leaves (what
the trainer trains on) plus ``tree`` (``TreeSpans``: each node's parent and each row's
spans per node), from which the trainer builds the tree's step groups
(``fastrl.ops.tree_advantages``). ``stats.generated_tokens`` counts every distinct sampled
token once (the equal-budget figure); ``tree.leaf_tokens`` is what ``G`` independent samples
of the same lengths would have generated.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from fastrl.errors import InputError
from fastrl.rollout.base import RolloutBatch, RolloutStats, SamplingConfig, supports_multi_turn, validate_prompt_seeds

__all__ = ["BranchSchedule", "TreeRolloutBatch", "TreeSpans", "fork_trajectories", "sample_tree", "LEVEL_SEED_STRIDE"]

LEVEL_SEED_STRIDE = 1009
"""Seeds of a node's level and of its first leaf are this far apart (see the module docstring)."""
SEED_OF_SAMPLING_SEED = 1_000_003
"""Without per-prompt seeds, prompt ``i``'s seed is ``sampling.seed * SEED_OF_SAMPLING_SEED + i``."""


class BranchCounts:
    """Leaf arithmetic of a branching schedule with ``branches[l]`` children at branch point
    ``l`` (``BranchSchedule`` over token depths, ``fastrl.agents.branching.TurnSchedule`` over turns)."""

    branches: tuple[int, ...]

    def validate_points(self, points: str, *, children: str, one_per: str, order: str, first_zero: bool) -> None:
        """Normalise ``branches`` and the branch points (field ``points``: ``depths`` or ``turns``)
        to tuples of ints and check them: one or more branches, each >= 1 (``children``: what
        one is); one point per branch (``one_per``); the points strictly increasing from 0
        (``first_zero``) or from any point >= 0 (``order``: how the message says so). The
        config names ``tree_branches`` / ``tree_<points>`` are those of the messages."""
        branches = tuple(int(k) for k in self.branches)
        at = tuple(int(x) for x in getattr(self, points))
        object.__setattr__(self, "branches", branches)
        object.__setattr__(self, points, at)
        if not branches or any(k < 1 for k in branches):
            raise InputError(f"tree_branches must be one or more ints >= 1 ({children}), got {list(branches)}")
        if len(at) != len(branches):
            raise InputError(f"tree_{points} must give {one_per} of tree_branches ({len(branches)}), got {list(at)}")
        if (at[0] != 0 if first_zero else at[0] < 0) or any(b <= a for a, b in zip(at, at[1:])):
            raise InputError(f"tree_{points} must {order}, got {list(at)}")

    def check_leaves(self, group_size: int, *, per: str) -> None:
        """The leaves per ``per`` (prompt, row) are ``group_size``."""
        if self.leaves != group_size:
            raise InputError(f"tree_branches {list(self.branches)} give {self.leaves} leaves per {per}; "
                             f"their product must be group_size ({group_size})")

    @property
    def leaves(self) -> int:
        """Leaves per prompt (row): the product of ``branches``."""
        return math.prod(self.branches)

    def span(self, level: int) -> int:
        """Leaves under one child of branch point ``level``."""
        return math.prod(self.branches[level + 1:])


@dataclass(frozen=True)
class BranchSchedule(BranchCounts):
    """Where a tree rollout branches and how wide: ``branches[l]`` children at completion
    depth ``depths[l]`` (``depths[0] == 0``: the prompt's children)."""

    branches: tuple[int, ...]
    """Children per node at each level (each >= 1); their product is the group size G."""
    depths: tuple[int, ...]
    """Completion depth (tokens) of each level's branch point: 0, then strictly increasing."""

    def __post_init__(self) -> None:
        self.validate_points("depths", children="children per level", one_per="one depth per level",
                           order="start at 0 and increase strictly (token depths of the branch points)", first_zero=True)

    def check(self, *, group_size: int, max_new_tokens: int) -> None:
        """The schedule fits a run: ``group_size`` leaves, every branch point inside the completion."""
        self.check_leaves(group_size, per="prompt")
        if self.depths[-1] >= max_new_tokens:
            raise InputError(f"tree_depths {list(self.depths)}: every branch point must lie before max_new_tokens "
                             f"({max_new_tokens})")

    @classmethod
    def default(cls, *, group_size: int, max_new_tokens: int) -> "BranchSchedule":
        """Two levels: 2 children of the prompt, each branching into ``G/2`` at half the
        completion (one level of ``G`` when ``G`` is odd or the completion has one token)."""
        if group_size % 2 or group_size < 4 or max_new_tokens < 2:
            return cls(branches=(group_size,), depths=(0,))
        return cls(branches=(2, group_size // 2), depths=(0, max_new_tokens // 2))


@dataclass
class TreeSpans:
    """The trees of one rollout. Nodes ``0 .. N-1`` are the groups' roots (the prompts, no
    tokens); the others are the sampled segments."""

    parents: list[int]
    """Parent node of each node (-1 for a root)."""
    groups: list[int]
    """The prompt (group) of each node."""
    levels: list[int]
    """Level of each node (-1 for a root)."""
    row_spans: list[list[tuple[int, int, int]]]
    """Per row of the batch: ``(node, start, end)`` of each segment on its path, in completion offsets."""
    leaf_tokens: int = 0
    """Sum of the rows' completion lengths (the tokens G independent samples of those lengths generate)."""

    @property
    def branch_points(self) -> int:
        """Nodes with two or more children (each a step group of siblings)."""
        counts: dict[int, int] = {}
        for p in self.parents:
            if p >= 0:
                counts[p] = counts.get(p, 0) + 1
        return sum(1 for c in counts.values() if c >= 2)

    def node_grid(self, prompt_lengths: Sequence[int], *, columns: int) -> torch.Tensor:
        """``[B, columns]`` int64 node of each token on the ``[B, T-1]`` grid (column ``c`` scores
        token ``c + 1``; -1 off the completions). ``prompt_lengths[b]``: row ``b``'s prompt length."""
        grid = torch.full((len(self.row_spans), columns), -1, dtype=torch.long)
        for b, spans in enumerate(self.row_spans):
            P = prompt_lengths[b]
            for node, start, end in spans:
                grid[b, P + start - 1:P + end - 1] = node
        return grid


@dataclass
class TreeRolloutBatch(RolloutBatch):
    """A ``RolloutBatch`` of a tree rollout's leaves, with the trees (``TreeSpans``)."""

    tree: TreeSpans | None = None


@dataclass
class _Node:
    parent: int
    group: int
    level: int
    first_leaf: int
    tokens: list[int] = field(default_factory=list)
    logp: list[torch.Tensor] = field(default_factory=list)
    stopped: bool = False
    children: list[int] = field(default_factory=list)


def fork_trajectories(state: Any, parents: Sequence[int]) -> list[int]:
    """Fork live trajectories of an ``HFGroupSampler`` multi-turn state (opened with
    ``group_size=1`` and no ``prompt_seeds``): one new trajectory per entry of ``parents``, a
    copy of that trajectory (its history, its pending token, its suffix keys/values; the
    prompt's stored keys/values stay shared). Returns the new trajectory ids; the next
    ``continue_`` may name them like any live trajectory."""
    if state.closed:
        raise ValueError("fork_trajectories: this multi-turn state was closed")
    if state.group_size != 1 or state.prompt_seeds is not None:
        raise ValueError("fork_trajectories: the state must be opened with group_size=1 and no prompt_seeds (seeds per call)")
    live = list(state.live)
    rows = list(range(len(live)))
    for t in parents:
        if t not in live:
            raise ValueError(f"fork_trajectories: {t} is not a live trajectory (live: {live})")
        rows.append(live.index(t))
    state.kv.keep(rows)  # a repeated row is an index_select copy of the parent's suffix
    new = list(range(len(state.prompts), len(state.prompts) + len(parents)))
    for t in parents:
        state.prompts.append(state.prompts[t])
        state.history.append(list(state.history[t]))
        state.pending.append(list(state.pending[t]))
    state.live = live + new
    if state.first_logits is not None:
        state.first_logits = state.first_logits[torch.tensor(rows, device=state.first_logits.device)]
    return new


def _prompt_seeds(prompt_seeds: Sequence[int] | None, sampling: SamplingConfig, n: int) -> list[int] | None:
    if prompt_seeds is not None:
        return validate_prompt_seeds(prompt_seeds, n)
    if sampling.seed is not None:
        return [sampling.seed * SEED_OF_SAMPLING_SEED + i for i in range(n)]
    return None


def _node_seed(seeds: list[int] | None, node: _Node, G: int) -> int | None:
    return None if seeds is None else (seeds[node.group] * G + node.first_leaf) * LEVEL_SEED_STRIDE + node.level


def _children(nodes: list[_Node], parent: int, schedule: BranchSchedule, level: int) -> list[int]:
    p = nodes[parent]
    span = schedule.span(level)
    out = []
    for c in range(schedule.branches[level]):
        nodes.append(_Node(parent=parent, group=p.group, level=level, first_leaf=p.first_leaf + c * span))
        p.children.append(len(nodes) - 1)
        out.append(len(nodes) - 1)
    return out


def _grow_hf(sampler: Any, prompts: list[list[int]], nodes: list[_Node], schedule: BranchSchedule, sampling: SamplingConfig,
             seeds: list[int] | None, budget: list[int]) -> tuple[int, int]:
    """Grow the trees with one multi-turn state, forking at each branch point. Returns the
    prompt tokens prefilled and the peak KV bytes."""
    N, G = len(prompts), schedule.leaves
    level_nodes = [c for i in range(N) for c in _children(nodes, i, schedule, 0)]
    state = sampler.start([prompts[nodes[n].group] for n in level_nodes], group_size=1, sampling=sampling)
    traj = {n: t for t, n in enumerate(level_nodes)}
    try:
        for level in range(len(schedule.branches)):
            ids = [traj[n] for n in level_nodes]
            node_seeds = [_node_seed(seeds, nodes[n], G) for n in level_nodes]
            out = sampler.continue_(state, [[] for _ in ids], trajectories=ids, max_new_tokens=budget[level],
                                    seeds=None if seeds is None else node_seeds)
            for n, o in zip(level_nodes, out):
                nodes[n].tokens, nodes[n].logp, nodes[n].stopped = list(o.token_ids), [torch.tensor(o.logprobs)], o.stopped
            if level + 1 == len(schedule.branches):
                break
            nxt, forks = [], []
            for n in level_nodes:
                if nodes[n].stopped:
                    continue
                kids = _children(nodes, n, schedule, level + 1)
                traj[kids[0]] = traj[n]  # the first child continues the parent's own trajectory
                forks.extend((kid, traj[n]) for kid in kids[1:])
                nxt.extend(kids)
            if not nxt:
                break
            for (kid, _), t in zip(forks, fork_trajectories(state, [t for _, t in forks])):
                traj[kid] = t
            level_nodes = nxt
        return sum(state.prefill_tokens), state.kv.peak_bytes
    finally:
        sampler.close(state)


def _grow_generic(sampler: Any, prompts: list[list[int]], nodes: list[_Node], schedule: BranchSchedule, sampling: SamplingConfig,
                  seeds: list[int] | None, budget: list[int]) -> tuple[int, int, float | None]:
    """Grow the trees with one ``generate`` call per level (prompts = prompt + path so far).
    Returns the prompt tokens computed, those reused (prefix caching) and the mean hit rate."""
    N, G = len(prompts), schedule.leaves
    parents = list(range(N))
    prefill, reused, hits = 0, 0, []
    for level, k in enumerate(schedule.branches):
        if not parents:
            break
        node_prompts = [prompts[nodes[p].group] + _path_tokens(nodes, p) for p in parents]
        extra = {} if seeds is None else {"prompt_seeds": [_node_seed(seeds, nodes[p], G) for p in parents]}
        batch = sampler.generate(node_prompts, group_size=k, sampling=dataclasses.replace(sampling, max_new_tokens=budget[level]),
                                 **extra)
        prefill += batch.stats.prefill_tokens_computed
        reused += batch.stats.prefix_tokens_reused
        if batch.stats.prefix_cache_hit_rate is not None:
            hits.append(batch.stats.prefix_cache_hit_rate)
        nxt = []
        for i, p in enumerate(parents):
            for j, n in enumerate(_children(nodes, p, schedule, level)):
                b = i * k + j
                nodes[n].tokens = list(batch.completion_ids[b])
                nodes[n].logp = [batch.completion_logp[b].float().cpu()]
                nodes[n].stopped = batch.finish_reasons[b] == "stop"
                if not nodes[n].stopped:
                    nxt.append(n)
        parents = nxt
    return prefill, reused, (sum(hits) / len(hits) if hits else None)


def _path(nodes: list[_Node], n: int) -> list[int]:
    out = []
    while nodes[n].parent >= 0:
        out.append(n)
        n = nodes[n].parent
    return out[::-1]


def _path_tokens(nodes: list[_Node], n: int) -> list[int]:
    return [t for m in _path(nodes, n) for t in nodes[m].tokens]


def _leaves(nodes: list[_Node], n: int, schedule: BranchSchedule) -> list[int]:
    """The ``span`` leaves under node ``n``, depth first (a node without children is all of them)."""
    node = nodes[n]
    if node.children:
        return [leaf for c in node.children for leaf in _leaves(nodes, c, schedule)]
    return [n] * (schedule.leaves if node.level < 0 else schedule.span(node.level))


@torch.no_grad()
def sample_tree(sampler: Any, prompts: Sequence[Sequence[int]], *, schedule: BranchSchedule, sampling: SamplingConfig,
                prompt_seeds: Sequence[int] | None = None) -> TreeRolloutBatch:
    """``schedule.leaves`` completions per prompt grown as a tree (see the module docstring),
    flat in group order, depth first within a group."""
    t0 = time.perf_counter()
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    schedule.check(group_size=schedule.leaves, max_new_tokens=sampling.max_new_tokens)
    N, G = len(prompts), schedule.leaves
    ends = [*schedule.depths[1:], sampling.max_new_tokens]
    budget = [b - a for a, b in zip(schedule.depths, ends)]
    seeds = None if sampling.greedy else _prompt_seeds(prompt_seeds, sampling, N)
    nodes = [_Node(parent=-1, group=i, level=-1, first_leaf=0) for i in range(N)]
    hit_rate = None
    if supports_multi_turn(sampler):
        prefill, peak = _grow_hf(sampler, prompts, nodes, schedule, sampling, seeds, budget)
        reused = G * sum(len(p) for p in prompts) - prefill  # every row's prompt, stored once per distinct prompt
    else:
        prefill, reused, hit_rate = _grow_generic(sampler, prompts, nodes, schedule, sampling, seeds, budget)
        peak = 0
    completions, logps, reasons, row_spans = [], [], [], []
    for i in range(N):
        for leaf in _leaves(nodes, i, schedule):
            path = _path(nodes, leaf)
            spans, at = [], 0
            for m in path:
                spans.append((m, at, at + len(nodes[m].tokens)))
                at += len(nodes[m].tokens)
            row_spans.append(spans)
            completions.append([t for m in path for t in nodes[m].tokens])
            logps.append(torch.cat([x for m in path for x in nodes[m].logp]).float())
            reasons.append("stop" if nodes[leaf].stopped else "length")
    generated = sum(len(n.tokens) for n in nodes)
    stats = RolloutStats(prompts=N, samples=N * G, prefill_tokens_computed=prefill, prefix_tokens_reused=reused,
                         generated_tokens=generated, peak_kv_cache_bytes=peak, seconds=time.perf_counter() - t0,
                         prefix_cache_hit_rate=hit_rate)
    batch = TreeRolloutBatch.from_samples(prompts, completions, logps, reasons, group_size=G, pad_token_id=sampler.pad_token_id,
                                          stats=stats)
    batch.tree = TreeSpans(parents=[n.parent for n in nodes], groups=[n.group for n in nodes], levels=[n.level for n in nodes],
                           row_spans=row_spans, leaf_tokens=sum(len(c) for c in completions))
    return batch
