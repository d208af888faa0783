"""tree_step_advantages: the reference on hand-computed trees, the op against the reference."""

from __future__ import annotations

import math

import pytest
import torch

from fastrl.ops.tree_advantages import tree_step_advantages
from fastrl.reference.tree_advantages import tree_step_advantages_reference

# two trees. Group 0: root 0 -> 1, 2; 1 -> 3, 4; 2 -> 5, 6 (leaves (1,3) (1,4) (2,5) (2,6)).
# Group 1: root 7 -> 8, 9; 8 -> 10, 11; 9 stopped before branching (its two leaves are copies).
PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2, 2, -1, 7, 7, 8, 8])
PATHS = [[1, 3], [1, 4], [2, 5], [2, 6], [8, 10], [8, 11], [9], [9]]
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0], dtype=torch.float64)


def _node_grid(paths, seg=2, prompt=1, T=6):
    """Each path's segments are ``seg`` tokens after a ``prompt``-token prefix (node -1 there and in padding)."""
    grid = torch.full((len(paths), T), -1, dtype=torch.long)
    for b, path in enumerate(paths):
        for i, n in enumerate(path):
            grid[b, prompt + i * seg: prompt + (i + 1) * seg] = n
    return grid


def test_reference_on_hand_computed_trees():
    node_of = _node_grid(PATHS)
    got, stats = tree_step_advantages_reference(REWARDS, node_of, PARENTS, norm="none")
    # V: 3 -> 1, 4 -> 0, 5 -> 0, 6 -> 0, 1 -> 0.5, 2 -> 0; 10 -> 1, 11 -> 0, 8 -> 0.5, 9 -> 1
    step = {1: 0.25, 2: -0.25, 3: 0.5, 4: -0.5, 5: 0.0, 6: 0.0, 8: -0.25, 9: 0.25, 10: 0.5, 11: -0.5}
    want = torch.zeros_like(got)
    for b, path in enumerate(PATHS):
        for i, n in enumerate(path):
            want[b, 1 + 2 * i: 3 + 2 * i] = step[n]
    torch.testing.assert_close(got, want)
    # branch points: 0, 1, 2, 7, 8; node 2's children are equal (0, 0)
    assert float(stats["branch_points"]) == 5 and math.isclose(float(stats["frac_all_equal_branch_points"]), 1 / 5, rel_tol=1e-6)
    # std: siblings {0.5, 0} -> +-0.25 / std(0.5, 0) = +-1/sqrt(2); {1, 0} -> +-0.5 / std(1, 0) = +-1/sqrt(2)
    got_std, _ = tree_step_advantages_reference(REWARDS, node_of, PARENTS, norm="std")
    r = 1 / math.sqrt(2)
    assert torch.allclose(got_std[0, 1:5], torch.tensor([r, r, r, r], dtype=torch.float64))
    assert torch.allclose(got_std[3, 1:5], torch.tensor([-r, -r, 0.0, 0.0], dtype=torch.float64))
    assert torch.allclose(got_std[6, 1:3], torch.tensor([r, r], dtype=torch.float64)) and float(got_std[6, 3:].abs().sum()) == 0


def test_singletons_and_tokens_of_no_node_get_zero():
    # a root with one child (one level of width 1 above two leaves), and node 3 nobody reaches
    parents = torch.tensor([-1, 0, 1, 1, 0])
    node_of = torch.tensor([[-1, 1, 2, -1], [-1, 1, 3, 3]])
    got, stats = tree_step_advantages_reference(torch.tensor([1.0, 3.0]), node_of, parents, norm="none")
    torch.testing.assert_close(got, torch.tensor([[0.0, 0.0, -1.0, 0.0], [0.0, 0.0, 1.0, 1.0]]))
    assert float(stats["branch_points"]) == 1


@pytest.mark.parametrize("norm", ["std", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_op_equals_the_reference(norm, dtype):
    torch.manual_seed(0)
    node_of = _node_grid(PATHS)
    for rewards in (REWARDS.to(dtype), torch.randn(8, dtype=dtype), torch.ones(8, dtype=dtype)):
        want, wstats = tree_step_advantages_reference(rewards, node_of, PARENTS, norm=norm)
        got, gstats = tree_step_advantages(rewards, node_of, PARENTS, norm=norm)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want)
        for k in wstats:
            torch.testing.assert_close(gstats[k].double(), wstats[k].double(), msg=k)


def test_op_checks_its_inputs():
    node_of = _node_grid(PATHS)
    with pytest.raises(ValueError, match="node_of holds node"):
        tree_step_advantages(REWARDS, node_of, PARENTS[:5])
    with pytest.raises(ValueError, match="rewards must be a float"):
        tree_step_advantages(REWARDS.long(), node_of, PARENTS)
    with pytest.raises(ValueError, match="norm"):
        tree_step_advantages(REWARDS, node_of, PARENTS, norm="max")


def test_on_a_full_tree_the_step_term_is_gigpos_step_group_summed_over_the_rows_of_a_segment():
    """GiGPO (``turn_advantages(mode="gigpo")``) with each level as a turn and the branch point
    as the state key: its step advantage of row b at level k is R_b - mean of the leaves under
    the branch point (norm none, gamma 1, the reward at the last turn). Summed over the rows
    through a segment, that is |L(c)| (V(c) - mean of its siblings' V) when the siblings have
    as many leaves each: the tree's step term on the segment's shared tokens."""
    from fastrl.ops.turn_advantages import turn_advantages

    torch.manual_seed(0)
    # a full tree of one group: root 0 -> 1, 2, 3; each -> two leaves (nodes 4..9)
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 2, 2, 3, 3])
    paths = [[1, 4], [1, 5], [2, 6], [2, 7], [3, 8], [3, 9]]
    B, K = len(paths), 2
    rewards = torch.randn(B, dtype=torch.float64)
    ours, _ = tree_step_advantages(rewards, _node_grid(paths), parents, norm="none")
    columns = torch.arange(K).expand(B, K)
    mask = torch.ones(B, K)
    turn_rewards = torch.zeros(B, K, dtype=torch.float64)
    turn_rewards[:, -1] = rewards
    keys = torch.tensor([[int(parents[p[0]]), p[0]] for p in paths])  # the state each level acted in: its branch point
    common = dict(norm="none", gamma=1.0, backend="torch")
    group = torch.zeros(B, dtype=torch.long)
    n = torch.full((B,), K)
    gigpo, _ = turn_advantages(columns, mask, turn_rewards, n, rewards, group, mode="gigpo", state_keys=keys, step_coef=1.0, **common)
    episode, _ = turn_advantages(columns, mask, turn_rewards, n, rewards, group, mode="broadcast", **common)
    step = gigpo - episode  # [B, K]: GiGPO's step advantage per row and level
    assert float(ours.abs().sum()) > 0 and float(step.abs().sum()) > 0
    for k in range(K):
        for c in {p[k] for p in paths}:
            rows = [b for b, p in enumerate(paths) if p[k] == c]
            ours_c = ours[rows[0], 1 + 2 * k]  # the segment's tokens carry one value in every row
            assert all(float(ours[b, 1 + 2 * k]) == float(ours_c) for b in rows)
            torch.testing.assert_close(step[rows, k].sum().double(), len(rows) * ours_c, atol=1e-5, rtol=1e-5)
