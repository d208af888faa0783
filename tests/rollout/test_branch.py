"""Tree rollouts (``fastrl.rollout.branch``) on tiny real models: the forked KV continues like
HF ``generate`` on the full prefix, sampled log-probs equal a plain forward over the leaves,
shared segments are sampled once, and the per-level ``generate`` path (any other sampler)
grows the same greedy trees."""

from __future__ import annotations

import pytest
import torch

from fastrl.errors import InputError
from fastrl.rollout import HFGroupSampler, SamplingConfig
from fastrl.rollout.branch import BranchSchedule, fork_trajectories, sample_tree

from test_hf_multiturn import EOS, tiny  # the same tiny models

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]


def hf_greedy(model, ids, n):
    ids = torch.tensor([ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


class GenerateOnly:
    """A sampler that only has ``generate`` (like vLLM's): the HF sampler behind it, so the
    per-level path runs on the same real model."""

    def __init__(self, sampler):
        self.generate, self.pad_token_id = sampler.generate, sampler.pad_token_id


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_forked_trajectories_continue_like_generate_on_the_full_prefix(kind):
    model = tiny(kind)
    sampler = HFGroupSampler(model, backend="torch")
    greedy = SamplingConfig(greedy=True, max_new_tokens=4)
    state = sampler.start(PROMPTS, group_size=1, sampling=greedy)
    first = sampler.continue_(state, [[], []], max_new_tokens=3)
    new = fork_trajectories(state, [0, 0, 1])  # trajectory 0 three ways, 1 two ways
    assert new == [2, 3, 4] and state.live == [0, 1, 2, 3, 4]
    # each copy goes on from the same history with its own appended tokens (an empty one too)
    appended = {0: [40, 41], 1: [], 2: [], 3: [50], 4: [60, 61, 62]}
    out = sampler.continue_(state, [appended[t] for t in state.live], max_new_tokens=4)
    parent = {0: 0, 1: 1, 2: 0, 3: 0, 4: 1}
    for t, o in zip(state.live, out):
        p = parent[t]
        prefix = PROMPTS[p] + first[p].token_ids + appended[t]
        assert o.token_ids == hf_greedy(model, prefix, len(o.token_ids)), t
    sampler.close(state)
    # a greedy tree: every leaf is the greedy continuation of its prompt
    batch = sample_tree(sampler, PROMPTS, schedule=BranchSchedule(branches=(2, 2), depths=(0, 3)),
                        sampling=SamplingConfig(greedy=True, max_new_tokens=7))
    for b, c in enumerate(batch.completion_ids):
        assert c == hf_greedy(model, PROMPTS[b // 4], len(c)), b
    # the per-level generate path grows the same greedy trees
    other = sample_tree(GenerateOnly(sampler), PROMPTS, schedule=BranchSchedule(branches=(2, 2), depths=(0, 3)),
                        sampling=SamplingConfig(greedy=True, max_new_tokens=7))
    assert other.completion_ids == batch.completion_ids and other.tree.row_spans == batch.tree.row_spans


def _forward_logp(model, batch, temperature):
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float() / temperature
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    return lp, batch.response_mask[:, 1:].bool()


@pytest.mark.parametrize("path", ["fork", "generate"])
def test_sampled_tree_logprobs_equal_a_forward_and_shared_segments_are_sampled_once(path):
    model = tiny("llama")
    hf = HFGroupSampler(model, backend="torch")
    sampler = hf if path == "fork" else GenerateOnly(hf)
    schedule = BranchSchedule(branches=(2, 3), depths=(0, 4))
    sampling = SamplingConfig(temperature=0.8, max_new_tokens=9)
    batch = sample_tree(sampler, PROMPTS, schedule=schedule, sampling=sampling, prompt_seeds=[11, 12])
    G = schedule.leaves
    assert len(batch.completion_ids) == 2 * G
    lp, mask = _forward_logp(model, batch, 0.8)
    torch.testing.assert_close(batch.sampler_logp[:, 1:][mask], lp[mask], atol=2e-4, rtol=0)
    # rows under one level-0 node share its first segment; the tree says so, and it was sampled once
    tree = batch.tree
    distinct = set()
    for b, spans in enumerate(tree.row_spans):
        c = batch.completion_ids[b]
        assert spans[0][1] == 0 and spans[-1][2] == len(c)
        assert len(spans) == 1 or spans[0][2] == 4  # the first segment runs to the branch point
        for node, s, e in spans:
            distinct.add((node, tuple(c[s:e])))
    nodes = {n for n, _ in distinct}
    assert len(nodes) == len(distinct)  # one token sequence per node: a node is shared, never re-sampled
    assert batch.stats.generated_tokens == sum(len(t) for _, t in distinct) < tree.leaf_tokens
    for g in range(2):
        rows = batch.completion_ids[g * G:(g + 1) * G]
        for half in (rows[:3], rows[3:]):  # the 3 leaves under one first segment start with it
            assert len({tuple(r[:4]) for r in half}) == 1
    assert tree.branch_points >= 2
    # a tree depends on its prompt's seed only, not on the batch around it
    alone = sample_tree(sampler, PROMPTS[1:], schedule=schedule, sampling=sampling, prompt_seeds=[12])
    assert alone.completion_ids == batch.completion_ids[G:]


def test_a_stopped_path_ends_every_leaf_below_it():
    model = tiny("llama")
    sampler = HFGroupSampler(model, backend="torch")
    # the greedy path of prompt 0 with this stop token list ends at its first token: both leaves copy it
    first = hf_greedy(model, PROMPTS[0], 1)[0]
    sampling = SamplingConfig(greedy=True, max_new_tokens=6, stop_token_ids=(first,))
    batch = sample_tree(sampler, PROMPTS[:1], schedule=BranchSchedule(branches=(1, 2), depths=(0, 2)), sampling=sampling)
    assert batch.completion_ids == [[first], [first]] and batch.finish_reasons == ["stop", "stop"]
    assert batch.stats.generated_tokens == 1 and batch.tree.branch_points == 0


def test_schedules_are_checked():
    with pytest.raises(InputError, match="tree_depths must start at 0"):
        BranchSchedule(branches=(2, 2), depths=(1, 3))
    with pytest.raises(InputError, match="one depth per level"):
        BranchSchedule(branches=(2, 2), depths=(0,))
    with pytest.raises(InputError, match="product must be group_size"):
        BranchSchedule(branches=(2, 2), depths=(0, 3)).check(group_size=8, max_new_tokens=8)
    with pytest.raises(InputError, match="before max_new_tokens"):
        BranchSchedule(branches=(2, 2), depths=(0, 8)).check(group_size=4, max_new_tokens=8)
    assert BranchSchedule.default(group_size=8, max_new_tokens=10) == BranchSchedule(branches=(2, 4), depths=(0, 5))
