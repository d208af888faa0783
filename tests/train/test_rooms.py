"""The trainer's rooms on their own: ``Experience`` (rows, groups, spans, counts), the three
layouts (same tokens, same gathered inputs, scatter inverts gather, token-budget split),
``Ranks`` in one process (the identity), and the sampler registry (one list of names)."""

from __future__ import annotations

import typing

import pytest
import torch

from fastrl.rollout import HFGroupSampler, SamplingConfig
from fastrl.train.samplers import SAMPLERS, sampler_spec
from fastrl.train.config import TrainConfig
from fastrl.train.experience import Experience
from fastrl.train.batching import GroupPackedBatching, PaddedBatching, TreePackedBatching
from fastrl.train.ranks import Ranks
from fastrl.train.task import char_tokenizer, tiny_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def sampled():
    tok = char_tokenizer()
    model = tiny_model(tok, hidden_size=32, layers=1).eval()
    prompts = [tok("12+3=")["input_ids"], tok("4+45=")["input_ids"][:3], tok("7*8=")["input_ids"]]
    batch = HFGroupSampler(model).generate(prompts, group_size=2, sampling=SamplingConfig(max_new_tokens=4, seed=3))
    return model, Experience.from_rollout(batch, group_size=2, rewards=torch.arange(6.0), device=CPU)


def test_experience_rows_groups_spans_and_counts(sampled):
    _, exp = sampled
    batch = exp.batch
    assert exp.num_groups == 3 and exp.num_samples == 6
    assert exp.group(1) == slice(2, 4) and exp.rows([2, 0]).tolist() == [4, 5, 0, 1]
    assert exp.rows().tolist() == list(range(6))
    for b in range(6):
        (start, end), = exp.spans(b)
        p = len(batch.prompt_ids[b // 2])
        assert (start, end) == (p, p + len(batch.completion_ids[b]))
        # the loss mask is the generated span, shifted to the [B, T-1] grid (column c scores token c + 1)
        assert exp.loss_mask[b].nonzero().flatten().tolist() == list(range(start - 1, end - 1))
    tokens, seqs = exp.counts(exp.rows([0, 2]))
    assert int(tokens) == sum(len(batch.completion_ids[b]) for b in (0, 1, 4, 5))
    assert int(seqs) == sum(len(batch.completion_ids[b]) > 0 for b in (0, 1, 4, 5))


def _layouts():
    common = dict(device=CPU, temperature=1.0)
    return (PaddedBatching(token_budget=10_000, **common), GroupPackedBatching(token_budget=10_000, **common),
            TreePackedBatching(token_budget=10_000, **common))


def test_both_layouts_score_the_same_tokens_and_scatter_inverts_gather(sampled):
    model, exp = sampled
    grids = []
    for layout in _layouts():
        grid = torch.zeros_like(exp.loss_mask)
        with torch.no_grad():
            for mb in layout.micro_batches(exp):
                with layout.attention(mb, [model]):
                    logp, _ = layout.logprobs(model, mb, entropy=False)
                layout.scatter(mb, logp, grid)
                # a [B] tensor gathers the micro-batch's rows; a grid tensor its scored tokens
                assert layout.gather(mb, exp.rewards).tolist() == exp.rewards[mb.rows].tolist()
                torch.testing.assert_close(layout.gather(mb, grid), logp)
        grids.append(grid * exp.loss_mask)
    for other in grids[1:]:
        torch.testing.assert_close(grids[0], other, rtol=1e-5, atol=1e-6)
    assert float(grids[0].abs().sum()) > 0


def test_the_token_budget_splits_whole_groups(sampled):
    _, exp = sampled
    for layout in _layouts():
        whole = layout.cost(exp, [0, 1, 2])
        layout.token_budget = whole - 1
        parts = layout.micro_batches(exp)
        assert len(parts) >= 2 and torch.cat([mb.rows for mb in parts]).tolist() == list(range(6))
        assert all(layout.cost(exp, sorted({int(r) // 2 for r in mb.rows})) <= whole - 1 or len(mb.rows) == 2 for mb in parts)
        layout.token_budget = 1  # smaller than any group: one group per micro-batch
        assert [mb.rows.tolist() for mb in layout.micro_batches(exp)] == [[0, 1], [2, 3], [4, 5]]


def test_ranks_in_one_process_are_the_identity():
    ranks = Ranks(None, CPU)
    assert (ranks.world_size, ranks.rank, ranks.is_main, ranks.sharded, ranks.whole_batch) == (1, 0, True, False, True)
    t = torch.tensor([1.5, -2.0])
    assert ranks.sum(t) is t and ranks.max(3) == 3 and ranks.gather(t) is t and ranks.offset(7) == 0
    assert ranks.pad_passes(5) == 0 and ranks.padded_passes(["a", "b"], spare=lambda: "spare") == [("a", True), ("b", True)]
    assert ranks.padding_metrics(0) == {} and ranks.pool_reward_metrics({"x/mean": 1.0}) == {"x/mean": 1.0}
    assert ranks.share(5) == slice(0, 5) and ranks.union({"b", "a"}) == ["a", "b"]
    assert [len(p) for p in ranks.split(torch.arange(5), 2)] == [3, 2]
    pooled = ranks.pool_update_metrics({"pg_loss": [(0.25, 3.0), (0.5, 1.0)], "clip_frac": [(0.0, 3.0), (1.0, 1.0)],
                                        "ratio_max": [(1.5, 1.0), (2.0, 1.0)]}, updates=2, loss_shares=frozenset({"pg_loss"}))
    assert pooled == {"pg_loss": 0.375, "clip_frac": 0.25, "ratio_max": 2.0}


def test_one_list_of_sampler_names_and_what_each_declares():
    literal = typing.get_type_hints(TrainConfig)["sampler"]
    assert set(typing.get_args(literal)) == set(SAMPLERS)
    assert not sampler_spec("hf").own_weights and sampler_spec("hf").torchrun is None
    assert sampler_spec("vllm").own_weights and "single-process only" in sampler_spec("vllm").torchrun
    server = sampler_spec("vllm-server")
    assert server.own_weights and server.needs_url and server.connect is not None and server.push_on_start
    assert server.torchrun is None
    with pytest.raises(ValueError, match="sampler must be one of"):
        sampler_spec("nope")
