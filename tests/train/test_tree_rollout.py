"""``fastrl train --rollout tree``: a real tiny-model run through the CLI (the tree collector,
the tree's step advantages, the automatically picked prefix-tree layout and the
equal-budget figures in metrics.jsonl), and the layout choice of ``prefix_tree=auto`` on a
tree rollout, on independent samples and on split agent samples, with gradients equal to
the padded layout's."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from fastrl.agents import metric_names as names
from fastrl.cli import main
from fastrl.config import PolicyLossConfig
from fastrl.ops.policy_loss import policy_loss
from fastrl.rollout import HFGroupSampler, SamplingConfig
from fastrl.rollout.branch import BranchSchedule, sample_tree
from fastrl.commands.compare import format_table, run_metrics, summarize
from fastrl.train.experience import Experience
from fastrl.train.batching import AutoTreeBatching, PaddedBatching, TreePackedBatching, make_batching, prefers_tree
from fastrl.train.task import char_tokenizer, tiny_model

CPU = torch.device("cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agents"))


def test_fastrl_train_rollout_tree_runs_and_logs_its_budget(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--output_dir", str(out), "--steps", "2", "--prompts_per_step", "2", "--group_size", "4",
            "--max_new_tokens", "6", "--task_digits", "1", "--task_train_size", "20", "--task_eval_size", "4",
            "--model_hidden_size", "32", "--model_layers", "1", "--sft_steps", "0", "--eval_every", "0",
            "--reward_workers", "0", "--progress", "false", "--tensorboard", "false", "--seed", "0",
            "--rewards", f"[{Path(__file__).with_name('test_trainer.py')}:digit_share]",
            "--rollout", "tree", "--tree_branches", "[2, 2]", "--tree_depths", "[0, 3]"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if names.TREE_LEAF_TOKENS in r]
    assert len(steps) == 2
    for r in steps:
        # the equal-budget figures: shared first segments were generated once
        assert 0 < r[names.GENERATED_TOKENS] < r[names.TREE_LEAF_TOKENS] <= 2 * 4 * 6
        assert r["rollout/samples"] == 8 and r[names.TREE_BRANCH_POINTS] >= 2
        # the layout was picked from the experience: the leaves share their first segment
        assert r["layout/tree"] == 1.0 and r["layout/trie_saving"] >= 0.1
        assert r["advantage/tree_branch_points"] == r[names.TREE_BRANCH_POINTS]
    # fastrl compare's report states the budget: generated tokens, and what independent sampling would have cost
    evals = [r for r in rows if r.get("event") == "eval"]
    record = {"algorithm": "grpo", "seed": 0, "success": True, "status": "ok", **run_metrics(steps, evals)}
    assert record["cost"]["generated_tokens"] == sum(r[names.GENERATED_TOKENS] for r in steps)
    assert record["cost"]["leaf_tokens"] == sum(r[names.TREE_LEAF_TOKENS] for r in steps) > record["cost"]["generated_tokens"]
    table = format_table(summarize([record]), [])
    assert "generated tokens" in table and "tokens if sampled independently" in table
    independent = run_metrics([{k: v for k, v in r.items() if k != names.TREE_LEAF_TOKENS} for r in steps], evals)
    assert math.isnan(independent["cost"]["leaf_tokens"])  # a G-independent run has no such row


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model(char_tokenizer(), hidden_size=32, layers=2, seed=1).double()


def _experience(batch, G):
    exp = Experience.from_rollout(batch, group_size=G, rewards=torch.arange(float(batch.input_ids.shape[0])), device=CPU)
    exp.old_logp = exp.sampler_logp.double().clone()
    exp.advantages = torch.randn(exp.num_samples, dtype=torch.float64)
    return exp


def _grads(layout, model, exp):
    cfg = PolicyLossConfig(loss_agg="token-mean", clip_low=0.2, clip_high=0.2)
    model.zero_grad(set_to_none=True)
    counts = exp.counts(exp.rows())
    for mb in layout.micro_batches(exp):
        with layout.attention(mb, [model]):
            logp, _ = layout.logprobs(model, mb, entropy=False)
            take = lambda x: layout.gather(mb, x)
            loss, _ = policy_loss(logp, take(exp.old_logp) - 0.01, take(exp.advantages), take(exp.loss_mask), config=cfg,
                                  global_counts=counts, cu_seqlens=layout.cu_seqlens(mb), backend="torch")
            loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, want):
    assert got.keys() == want.keys() and any(g.abs().sum() > 0 for g in want.values())
    for n, g in want.items():
        assert (got[n] - g).abs().max() <= 1e-6 * g.abs().max() + 1e-12, n


def test_auto_layout_picks_the_trie_for_tree_rollouts_and_the_group_layout_otherwise(model):
    common = dict(token_budget=100_000, device=CPU, temperature=1.0)
    assert isinstance(make_batching(shared_prefix=True, prefix_tree="auto", **common), AutoTreeBatching)
    assert type(make_batching(shared_prefix=False, prefix_tree="auto", **common)) is PaddedBatching
    sampler = HFGroupSampler(model.float(), backend="torch")
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    sampling = SamplingConfig(max_new_tokens=8, seed=0, stop_token_ids=())
    tree = sample_tree(sampler, prompts, schedule=BranchSchedule(branches=(2, 2), depths=(0, 5)), sampling=sampling,
                       prompt_seeds=[1, 2])
    independent = sampler.generate(prompts, group_size=4, sampling=sampling, prompt_seeds=[1, 2])
    model.double()
    for batch, want_tree in ((tree, True), (independent, False)):
        exp = _experience(batch, 4)
        auto = AutoTreeBatching(**common)
        facts = auto.describe(exp)
        assert facts["layout/tree"] == float(want_tree) == float(auto.uses_tree(exp))
        # the rule's inputs: the trie's tokens against the group layout's prompt-once tokens
        trie = TreePackedBatching(**common).cost(exp, range(exp.num_groups))
        once = sum(len(p) for p in batch.prompt_ids) + sum(len(c) for c in batch.completion_ids)
        assert prefers_tree(trie_tokens=trie, prompt_once_tokens=once) == want_tree
        assert facts["layout/trie_saving"] == pytest.approx((once - trie) / once)
        kinds = {type(mb.data).__name__ for mb in auto.micro_batches(exp)}
        assert kinds == ({"_Tree"} if want_tree else {"_Packed"})
        _assert_same(_grads(auto, model, exp), _grads(PaddedBatching(**common), model, exp))


def test_split_agent_samples_select_the_trie_and_train_like_padded_rows():
    from test_agent_experience import REWRITING, _agent_batch
    from fastrl.ops import group_advantages

    tokenizer = char_tokenizer()
    tokenizer.chat_template = REWRITING
    exp = Experience.from_agent_batch(_agent_batch(tokenizer), device=CPU)
    assert not exp.packable and exp.num_samples > exp.num_groups * exp.group_size  # split samples, own prompts
    exp.advantages = group_advantages(exp.rewards, exp.group_ids, mode="grpo")[0].double()
    exp.old_logp = exp.sampler_logp.double()
    common = dict(token_budget=100_000, device=CPU, temperature=1.0)
    auto = AutoTreeBatching(**common)
    assert auto.uses_tree(exp) and {type(mb.data).__name__ for mb in auto.micro_batches(exp)} == {"_Tree"}
    m = tiny_model(tokenizer, hidden_size=32, layers=2, heads=2, max_position_embeddings=256, seed=3).double()
    _assert_same(_grads(auto, m, exp), _grads(PaddedBatching(**common), m, exp))


@pytest.mark.parametrize("changes, match", [
    (dict(tree_branches=[2, 2]), "tree_branches shapes a tree rollout: it needs --rollout tree"),
    (dict(rollout="tree", tree_branches=[2, 3]), r"give 6 leaves per prompt; their product must be group_size \(4\)"),
    (dict(rollout="tree", tree_branches=[2, 2], tree_depths=[0, 6]), "must lie before max_new_tokens"),
    (dict(rollout="tree", env="frozenlake", tree_branches=[2, 2], tree_depths=[0, 3]), "with --env the tree branches at policy turns"),
    (dict(rollout="tree", dynamic_sampling=True), "rollout=tree is not supported with dynamic_sampling"),
])
def test_tree_options_are_checked_before_any_work(changes, match):
    from fastrl.errors import InputError
    from fastrl.train.config import TrainConfig

    with pytest.raises(InputError, match=match):
        TrainConfig(**{"group_size": 4, "max_new_tokens": 6, **changes}).resolved()
    assert TrainConfig(rollout="tree", group_size=4, max_new_tokens=6).resolved().tree_schedule() == BranchSchedule(
        branches=(2, 2), depths=(0, 3))
