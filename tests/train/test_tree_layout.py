"""TreePackedBatching: step-wise samples of agent trajectories (sample k = turns 0..k) packed as
a trie give the padded layout's loss, metrics, gradients and critic values, at a fraction
of its tokens.

Two groups: one trajectory of 4 turns as 4 step-wise samples (each trained on its last
turn only, as step-wise training does), and one whose samples re-render an earlier turn
(a template that is not prefix-preserving) or branch.
"""

from __future__ import annotations

import torch

from fastrl.config import PolicyLossConfig
from fastrl.ops.policy_loss import policy_loss
from fastrl.rollout.base import RolloutBatch, RolloutStats
from fastrl.train.critic import ValueModel
from fastrl.train.experience import Experience
from fastrl.train.batching import GroupPackedBatching, PaddedBatching, TreePackedBatching, make_batching
from fastrl.train.task import char_tokenizer, tiny_model

CPU = torch.device("cpu")
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]
TURNS = [[20, 21, 22], [40, 41], [23, 24], [42], [25, 26, 27, 28], [43, 44], [29, 30]]  # policy, env, policy, ...


def _stepwise(turns, k):
    """Sample k: policy turns 0..k with the environment replies between them."""
    return [t for turn in turns[: 2 * k + 1] for t in turn]


def _experience() -> Experience:
    g0 = [_stepwise(TURNS, k) for k in range(4)]
    g1 = [[31, 32, 45, 33], [31, 34, 45, 33, 35], [31, 32, 45, 36, 37], [31, 32, 45, 33]]  # re-rendered, branch, duplicate
    completions = g0 + g1
    logp = [-torch.rand(len(c)) for c in completions]
    batch = RolloutBatch.from_samples(PROMPTS, completions, logp, ["stop"] * 8, group_size=4, pad_token_id=0,
                                      stats=RolloutStats())
    exp = Experience.from_rollout(batch, group_size=4, rewards=torch.arange(8.0), device=CPU)
    # step-wise training: sample k of the trajectory trains on its last policy turn only
    mask = torch.zeros_like(exp.loss_mask)
    P = len(PROMPTS[0])
    for k in range(4):
        last = len(TURNS[2 * k])
        end = P + len(g0[k])
        mask[k, end - last - 1:end - 1] = 1
    mask[4:] = exp.loss_mask[4:]
    exp.loss_mask = mask
    exp.old_logp = exp.sampler_logp.clone() * exp.loss_mask
    exp.advantages = torch.randn(8)
    exp.values = torch.randn_like(exp.loss_mask) * exp.loss_mask
    exp.returns = torch.randn_like(exp.loss_mask) * exp.loss_mask
    return exp


def _loss_and_grads(layout, model, critic, exp, cfg):
    (mb,) = layout.micro_batches(exp)
    take = lambda x: layout.gather(mb, x)
    with layout.attention(mb, [model, critic.body]):
        logp, ent = layout.logprobs(model, mb, entropy=True)
        loss, metrics = policy_loss(logp, take(exp.old_logp), take(exp.advantages), take(exp.loss_mask), entropy=ent,
                                    config=cfg, global_counts=exp.counts(mb.rows), cu_seqlens=layout.cu_seqlens(mb))
        values = layout.values(critic, mb)
        (loss + (values * take(exp.loss_mask)).square().sum()).backward()
    grid = torch.zeros_like(exp.loss_mask)
    layout.scatter(mb, values.detach(), grid)
    grads = {n: p.grad.clone() for n, p in [*model.named_parameters(), *critic.named_parameters()] if p.grad is not None}
    model.zero_grad(set_to_none=True)
    critic.zero_grad(set_to_none=True)
    return loss.detach(), metrics, grid * exp.loss_mask, grads


def test_tree_layout_equals_the_padded_layout_and_costs_less():
    torch.manual_seed(0)
    model = tiny_model(char_tokenizer(), hidden_size=32, layers=2).double()
    critic = ValueModel(tiny_model(char_tokenizer(), hidden_size=32, layers=1)).double()
    exp = _experience()
    cfg = PolicyLossConfig(loss_agg="seq-mean-token-mean", clip_low=0.2, clip_high=0.2, entropy_coef=0.01)
    common = dict(token_budget=100_000, device=CPU, temperature=0.8)
    padded, tree = PaddedBatching(**common), make_batching(shared_prefix=True, prefix_tree=True, **common)
    assert isinstance(tree, TreePackedBatching)
    want = _loss_and_grads(padded, model, critic, exp, cfg)
    got = _loss_and_grads(tree, model, critic, exp, cfg)
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=0)
    for key in want[1]:
        torch.testing.assert_close(got[1][key].double(), want[1][key].double(), atol=1e-6, rtol=0, msg=key)
    torch.testing.assert_close(got[2], want[2], atol=1e-6, rtol=0)
    assert float(want[2].abs().sum()) > 0
    assert got[3].keys() == want[3].keys() and len(want[3]) > 0
    for name, g in want[3].items():
        assert (got[3][name] - g).abs().max() <= 1e-5 * g.abs().max() + 1e-12, name
    # the trie runs each shared turn once: far fewer tokens than padded rows or one document per group
    groups = [0, 1]
    trie, grouped, rows = tree.cost(exp, groups), GroupPackedBatching(**common).cost(exp, groups), padded.cost(exp, groups)
    assert trie == tree.micro_batches(exp)[0].data.tree.layout.num_tokens
    assert trie < 0.6 * grouped < rows
    # trajectory 0 alone: the trie is its longest sample; a chunk costs the sum of its groups' tries
    assert tree.cost(exp, [0]) == len(PROMPTS[0]) + len(_stepwise(TURNS, 3))
    assert trie == tree.cost(exp, [0]) + tree.cost(exp, [1])
    # the per-group sizes are cached per batch: another batch is measured afresh
    fresh = _experience()
    short = [c[:2] for c in fresh.batch.completion_ids[:4]] + fresh.batch.completion_ids[4:]
    fresh.batch = RolloutBatch.from_samples(PROMPTS, short, [torch.zeros(len(c)) for c in short], ["stop"] * 8, group_size=4,
                                            pad_token_id=0, stats=RolloutStats())
    assert tree.cost(fresh, [0]) == len(PROMPTS[0]) + 2
