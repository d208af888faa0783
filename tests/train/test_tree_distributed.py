"""Branching rollouts under ``torchrun`` (2 gloo processes on the CPU, FSDP2).

``fastrl train --rollout tree`` (single-turn: each prompt's group grown as a tree,
``fastrl.rollout.branch``): each rank grows the trees of its own prompts and numbers their
nodes locally, the tree's step advantages are taken within each rank's trees, and the leaves
train on the trie layout; two processes equal one process on the same data and seed (losses,
gradient norms, the tree's figures, parameters after 2 steps, within the tolerances of
``tests/train/test_distributed.py``). A rank whose trees were numbered or linked wrongly
changes its step advantages, hence the loss and the update.

Branching agent runs (``--env NAME --rollout tree``) are refused on every rank before any work
(docs/agents.md: ``--env`` runs in one process for now).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_distributed import REWARD, assert_same_run, base_args, run_two_ranks, steps  # noqa: E402

from fastrl.train.cli import parse_train_args  # noqa: E402
from fastrl.train.trainer import Trainer  # noqa: E402

# two branch points (the prompt, token 3 of 5): 2 x 2 leaves per prompt, step groups at both depths
TREE = ["--rollout", "tree", "--tree_branches", "[2, 2]", "--tree_depths", "[0, 3]", "--advantage_mode", "grpo",
        "--kl_coef", "0"]
TREE_COUNTS = ("rollout/generated_tokens", "rollout/tree_leaf_tokens", "rollout/tree_branch_points",
               "advantage/tree_branch_points", "layout/tree")
AGENT_TREE = ["--env", "frozenlake", "--rollout", "tree", "--tree_turns", "[0, 1]", "--tree_branches", "[2, 2]",
              "--max_turns", "3"]
AGENT_REFUSAL = "--env (agent training) runs in one process for now"


@pytest.fixture(scope="module")
def two_process_tree_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree_dist")
    (root / "reward.py").write_text(REWARD)
    cases = {
        "tree": [*base_args(root), *TREE, "--output_dir", str(root / "two")],
        "bad_agent_tree": [*base_args(root), *AGENT_TREE, "--output_dir", str(root / "bad_agent")],
    }
    return root, run_two_ranks(root, cases)


def test_two_process_tree_run_equals_one_process(two_process_tree_run, tmp_path):
    root, seen = two_process_tree_run
    assert all(s["tree"] == "exit 0" for s in seen), seen
    one = tmp_path / "one"
    with Trainer(parse_train_args([*base_args(root), *TREE, "--output_dir", str(one)])) as trainer:
        trainer.train()
    two = root / "two"
    assert_same_run(one, two)
    for a, b in zip(steps(one), steps(two)):
        # the trees' counts are the whole batch's (each rank's trees summed), and they train on the trie
        assert {k: a[k] for k in TREE_COUNTS} == {k: b[k] for k in TREE_COUNTS}, (a["step"], a, b)
        assert b["layout/tree"] == 1.0 and b["advantage/tree_branch_points"] >= 4  # at least each prompt's root
        assert b["rollout/samples"] == 16.0


def test_branching_agent_run_is_refused_on_every_rank(two_process_tree_run):
    root, seen = two_process_tree_run
    for rank_seen in seen:
        record = rank_seen["bad_agent_tree"]  # "exit 2: " + stderr
        assert record.startswith("exit 2:") and "Traceback" not in record, record
        assert AGENT_REFUSAL in record.split("fastrl train: error: ", 1)[1].splitlines()[0], record
    assert not (root / "bad_agent" / "metrics.jsonl").exists()
