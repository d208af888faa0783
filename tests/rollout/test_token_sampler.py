"""The token samplers' one factory and the multi-turn capability it reads: a sampler is chosen by
what its class declares (``multi_turn``), not by its class; ``HFTokenSampler.fork_siblings``
gives each sibling its own copy of a live trajectory (checked against sampling each sibling's
whole sequence from scratch), on a tiny Llama built from a config."""

from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fastrl.rollout import HFGroupSampler, SamplingConfig
from fastrl.rollout.base import supports_multi_turn
from fastrl.rollout.branch import BranchSchedule, sample_tree
from fastrl.rollout.token_sampler import ForkingTokenSampler, GroupSamplerTokens, HFTokenSampler, token_sampler_for

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 6, 7, 8, 9]


def tiny_sampler() -> HFGroupSampler:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                         eos_token_id=3, bos_token_id=1, pad_token_id=0))
    return HFGroupSampler(model.eval(), backend="torch")


class Forwarding:
    """A sampler that forwards every attribute to an HF sampler (as a test wrapper or a proxy
    does) but declares nothing: it answers ``generate`` only."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Declared(Forwarding):
    """The same forwarding sampler, stating that it keeps trajectories across calls."""

    multi_turn = True


def test_the_factory_and_tree_rollouts_read_the_declared_capability_not_the_class():
    hf = tiny_sampler()
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=4, seed=1)
    assert supports_multi_turn(hf) and not supports_multi_turn(Forwarding(hf)) and supports_multi_turn(Declared(hf))
    assert not supports_multi_turn(object())
    assert type(token_sampler_for(hf, cfg)) is HFTokenSampler
    assert type(token_sampler_for(hf, cfg, fork=True)) is ForkingTokenSampler
    for fork in (False, True):
        assert type(token_sampler_for(Forwarding(hf), cfg, fork=fork)) is GroupSamplerTokens
    assert type(token_sampler_for(Declared(hf), cfg, fork=True)) is ForkingTokenSampler
    # sample_tree forks the multi-turn state of a sampler that declares it (its peak KV is
    # reported), and asks any other one for one generate() call per level
    schedule = BranchSchedule(branches=(2, 2), depths=(0, 2))
    forked = sample_tree(Declared(hf), [PROMPT], schedule=schedule, sampling=cfg)
    generic = sample_tree(Forwarding(hf), [PROMPT], schedule=schedule, sampling=cfg)
    assert forked.stats.peak_kv_cache_bytes > 0 and generic.stats.peak_kv_cache_bytes == 0
    assert len(forked.completion_ids) == len(generic.completion_ids) == schedule.leaves


def test_fork_siblings_gives_each_sibling_its_own_copy_of_a_live_trajectory():
    sampler = tiny_sampler()
    cfg = SamplingConfig(temperature=1.0)
    tokens = HFTokenSampler(sampler, cfg)
    assert tokens.fork_siblings([PROMPT, PROMPT]) == []  # no live state yet
    [first] = tokens.continue_sequences([PROMPT], max_new_tokens=[3], seeds=[11])
    parent = PROMPT + first.token_ids
    siblings = [parent + [40 + i] for i in range(3)]  # three continuations of the one live trajectory
    new = tokens.fork_siblings(siblings)
    assert len(new) == 2 and tokens.state.live == [0, *new]
    assert tokens.fork_siblings(siblings) == []  # each sibling has its copy now
    seeds = [21, 22, 23]
    got = tokens.continue_sequences(siblings, max_new_tokens=[4, 4, 4], seeds=seeds)
    assert tokens.restarts == 1  # continued from the forked copies, not prefilled again
    assert tokens.state.prefill_tokens[-1] == 3  # each sibling ran its one new token only
    for seq, seed, out in zip(siblings, seeds, got):
        want = sampler.generate([seq], group_size=1, sampling=replace(cfg, max_new_tokens=4), prompt_seeds=[seed])
        assert out.token_ids == want.completion_ids[0]
        torch.testing.assert_close(torch.tensor(out.logprobs), want.completion_logp[0], rtol=0, atol=1e-5)
    tokens.close()
