"""Reference step advantages over the branch points of tree rollouts (the specification).

Plain PyTorch with Python loops over nodes, rows and tokens, written to be read;
``fastrl.ops.tree_advantages.tree_step_advantages`` is tested against it. Float64 when
``rewards`` is float64, else float32.

Inputs
------
- ``rewards`` [B] float R_b: the outcome of row b. Each row is one leaf of a tree
  (``fastrl.rollout.branch``: a root-to-leaf path, the prompt then its segments).
- ``node_of`` [B, T] integer: the tree node (segment) each token of row b belongs to; < 0
  where the token is in no segment (the prompt, padding, tokens not trained on).
- ``parents`` [M] integer: the parent of each node, -1 for a root (a prompt: a root has no
  tokens). Nodes of different trees never share a parent.

Definitions
-----------
- Leaves under node n: L(n) = {b : node_of[b, t] = n for some t} (the rows whose path
  passes through n; a node no row has a token of belongs to no step group).
- Value of node n: V(n) = mean_{b in L(n)} R_b, the mean outcome of the leaves below it
  (TreeRL, arXiv 2506.11902, estimates a node's value the same way).
- Step group of branch point p: its children with leaves, C(p) = {c : parents[c] = p,
  L(c) non-empty}. This is GiGPO's step group (arXiv 2505.10978) without hashing: the
  siblings acted in the same state by construction (they continue one shared prefix).
- Step advantage of node c with parent p:

      A^S(c) = norm(V(c); {V(c') : c' in C(p)})

  with ``norm`` as in ``fastrl.reference.turn_advantages``: ``"std"`` -> (x - mean(S)) /
  (std(S) + eps), std unbiased; ``"none"`` -> x - mean(S); 0 for a group of one (a node
  whose siblings all stopped before branching, or a level with one child).
- Per token: ``A^S[b, t] = A^S(node_of[b, t])`` where ``node_of[b, t] >= 0``, else 0.

The trainer adds this on top of the episode (group) advantage of the leaves:
``A[b, t] = A^E_b + omega * A^S[b, t]`` (``TrainConfig.step_coef`` = omega); the root's
children are compared at the root, like every other branch point, so with one level
(``tree_branches G``) the step term is the group's own normalised outcome once more.

Relation to GiGPO's own step group: with each level as a turn, the branch point as the
state key, gamma 1 and ``norm="none"``, GiGPO gives row b at level k the advantage
R_b - mean_{leaves under p} R; summed over the rows through a segment c that is
|L(c)| (V(c) - mean of its siblings' V) whenever the siblings have equally many leaves (no
path stopped early): the same total weight on the segment's shared tokens, which here carry
one value in every row (tested against ``turn_advantages(mode="gigpo")``). With ``"std"``
the scales differ (GiGPO normalises over leaves, this over sibling values).

Statistics: ``branch_points`` (step groups with two or more members) and
``frac_all_equal_branch_points`` (their share whose members' values are all equal: no step
signal there).
"""

from __future__ import annotations

import torch

from fastrl.reference.turn_advantages import NORMS, _normalise

__all__ = ["tree_step_advantages_reference", "NORMS"]


def tree_step_advantages_reference(rewards: torch.Tensor, node_of: torch.Tensor, parents: torch.Tensor, *, norm: str = "std",
                                   eps: float = 1e-6) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``[B, T]`` step advantages ``A^S[b, t]`` and the statistics (see the module docstring)."""
    dt = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    R = rewards.to(dt)
    B, T = node_of.shape
    M = parents.numel()
    leaves: list[set[int]] = [set() for _ in range(M)]
    for b in range(B):
        for t in range(T):
            n = int(node_of[b, t])
            if n >= 0:
                leaves[n].add(b)
    value = [R[sorted(leaves[n])].mean() if leaves[n] else None for n in range(M)]
    step = [torch.zeros((), dtype=dt) for _ in range(M)]
    points = equal = 0
    for p in range(M):
        kids = [c for c in range(M) if int(parents[c]) == p and value[c] is not None]
        if len(kids) >= 2:
            points += 1
            vals = [value[c] for c in kids]
            equal += int(all(bool(v == vals[0]) for v in vals))
        for c, a in zip(kids, _normalise([value[c] for c in kids], norm, eps)):
            step[c] = a
    out = torch.zeros(B, T, dtype=dt)
    for b in range(B):
        for t in range(T):
            n = int(node_of[b, t])
            if n >= 0:
                out[b, t] = step[n]
    stats = {"branch_points": torch.tensor(float(points)),
             "frac_all_equal_branch_points": torch.tensor(equal / points if points else 0.0)}
    return out, stats
