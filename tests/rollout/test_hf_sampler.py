"""HFGroupSampler on tiny Llama / Qwen2 models built from configs (no downloads)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from fastrl.rollout import GroupSampler, HFGroupSampler, RolloutBatch, SamplingConfig
from fastrl.rollout import hf
from fastrl.rollout.hf import ATTN_NAME, process_logits

VOCAB = 256
EOS = 3


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(kind: str, *, seed: int = 0, eos=EOS, max_pos: int = 256):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_pos, eos_token_id=eos, bos_token_id=1, pad_token_id=0,
    )
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "llama_tied":  # tied input/output embeddings, multi-head (no GQA)
        model = LlamaForCausalLM(LlamaConfig(**{**common, "num_key_value_heads": 4, "tie_word_embeddings": True}))
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    elif kind == "qwen2":  # attention biases, GQA 4:1
        model = Qwen2ForCausalLM(Qwen2Config(**{**common, "num_key_value_heads": 1}))
    else:
        raise ValueError(kind)
    # a larger init than the default 0.02 so the tiny model's distributions are not flat
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    return model.eval()


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]]


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "llama_tied"])
def test_greedy_equals_model_generate(kind):
    model = tiny(kind)
    sampler = HFGroupSampler(model)
    assert isinstance(sampler, GroupSampler)
    batch = sampler.generate(PROMPTS, group_size=2, sampling=SamplingConfig(greedy=True, max_new_tokens=10))
    assert isinstance(batch, RolloutBatch)
    for i, p in enumerate(PROMPTS):
        want = hf_greedy(model, p, 10)
        for b in (2 * i, 2 * i + 1):
            assert batch.completion_ids[b] == want, (kind, i, b)
            assert batch.finish_reasons[b] == ("stop" if want[-1] == EOS else "length")
    # the model is left as it was
    assert model.config._attn_implementation != ATTN_NAME


def test_greedy_with_eos_finishing_some_samples_early():
    model = tiny("llama", eos=None)
    eos = hf_greedy(model, PROMPTS[0], 10)[3]  # prompt 0 ends at its 4th token, the others run on
    model.config.eos_token_id = model.generation_config.eos_token_id = eos
    batch = HFGroupSampler(model).generate(PROMPTS, group_size=2, sampling=SamplingConfig(greedy=True, max_new_tokens=10))
    assert batch.finish_reasons[:2] == ["stop", "stop"] and len(batch.completion_ids[0]) == 4
    for i, p in enumerate(PROMPTS):
        want = hf_greedy(model, p, 10)
        assert batch.completion_ids[2 * i] == batch.completion_ids[2 * i + 1] == want
    assert "length" in batch.finish_reasons


def test_greedy_triton_backend_matches_torch_backend():
    # the Triton kernels (interpreter on CPU) inside the real decode loop
    model = tiny("llama")
    cfg = SamplingConfig(greedy=True, max_new_tokens=4)
    a = HFGroupSampler(model, backend="triton").generate(PROMPTS[:2], group_size=2, sampling=cfg)
    b = HFGroupSampler(model, backend="torch").generate(PROMPTS[:2], group_size=2, sampling=cfg)
    assert a.completion_ids == b.completion_ids
    torch.testing.assert_close(a.sampler_logp, b.sampler_logp, rtol=1e-5, atol=1e-5)


def training_logp(model, batch, temperature):
    """What the training forward recomputes: logits / T, log_softmax, gather the next token."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    out = torch.zeros_like(batch.sampler_logp)
    out[:, 1:] = logp.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    return out * batch.response_mask, logits


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_sampler_logp_equals_training_forward(kind):
    model = tiny(kind)
    sampler = HFGroupSampler(model)
    batch = sampler.generate(PROMPTS, group_size=3, sampling=SamplingConfig(temperature=0.7, max_new_tokens=12, seed=1))
    want, _ = training_logp(model, batch, 0.7)
    mask = batch.response_mask.bool()
    assert mask.sum() == batch.stats.generated_tokens > 0
    assert batch.sampler_logp.dtype == torch.float32
    torch.testing.assert_close(batch.sampler_logp[mask], want[mask], rtol=0, atol=1e-5)
    assert (batch.sampler_logp[~mask] == 0).all()
    # per-sample lists agree with the packed tensor
    for b in range(len(batch.completion_ids)):
        p = len(batch.prompt_ids[b // 3])
        n = len(batch.completion_ids[b])
        torch.testing.assert_close(batch.completion_logp[b], batch.sampler_logp[b, p : p + n])
        assert batch.input_ids[b, p : p + n].tolist() == batch.completion_ids[b]


def test_sampler_logp_with_top_k_is_the_filtered_distribution():
    model = tiny("llama")
    T, k = 1.3, 20
    batch = HFGroupSampler(model).generate(PROMPTS[:2], group_size=4, sampling=SamplingConfig(temperature=T, top_k=k, max_new_tokens=8, seed=3))
    _, logits = training_logp(model, batch, T)
    x = logits[:, :-1] / T
    kth = x.topk(k, dim=-1).values[..., -1:]
    filtered = torch.log_softmax(x.masked_fill(x < kth, float("-inf")), dim=-1)
    want = torch.zeros_like(batch.sampler_logp)
    want[:, 1:] = filtered.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    mask = batch.response_mask.bool()
    assert torch.isfinite(want[mask]).all()  # every sampled token is inside the top-k
    torch.testing.assert_close(batch.sampler_logp[mask], want[mask], rtol=0, atol=1e-5)
    # renormalised over fewer tokens: at least the unfiltered log-prob
    full, _ = training_logp(model, batch, T)
    assert (batch.sampler_logp[mask] >= full[mask] - 1e-6).all()


def test_process_logits_top_p_keeps_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    lp = process_logits(logits, SamplingConfig(top_p=0.8))
    assert torch.isinf(lp[0, 2:]).all() and torch.isfinite(lp[0, :2]).all()
    torch.testing.assert_close(lp[0, :2].exp(), torch.tensor([0.625, 0.375]))
    lp = process_logits(logits, SamplingConfig(top_p=0.81))
    assert torch.isfinite(lp[0, :3]).all() and torch.isinf(lp[0, 3])
    lp = process_logits(logits, SamplingConfig(top_p=0.1))  # the most likely token always stays
    assert lp[0, 0] == 0 and torch.isinf(lp[0, 1:]).all()


def test_seeded_sampling_is_reproducible():
    model = tiny("qwen2")
    sampler = HFGroupSampler(model)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=10, seed=1234)
    a = sampler.generate(PROMPTS, group_size=4, sampling=cfg)
    b = sampler.generate(PROMPTS, group_size=4, sampling=cfg)
    c = sampler.generate(PROMPTS, group_size=4, sampling=SamplingConfig(temperature=1.0, max_new_tokens=10, seed=99))
    assert a.completion_ids == b.completion_ids
    torch.testing.assert_close(a.sampler_logp, b.sampler_logp, rtol=0, atol=0)
    assert a.completion_ids != c.completion_ids
    # samples of one group differ (they are drawn independently from the shared prefix)
    assert len({tuple(x) for x in a.completion_ids[:4]}) > 1


def test_stats_and_kv_memory():
    model = tiny("llama", eos=None)
    sampler = HFGroupSampler(model)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[0]]  # the repeated prompt is prefilled once
    G, L = 4, 6
    batch = sampler.generate(prompts, group_size=G, sampling=SamplingConfig(max_new_tokens=L, seed=0))
    s = batch.stats
    distinct = len(PROMPTS[0]) + len(PROMPTS[2])
    assert (s.prompts, s.samples) == (3, 3 * G)
    assert s.prefill_tokens_computed == distinct
    assert s.prefix_tokens_reused == G * sum(map(len, prompts)) - distinct
    assert s.generated_tokens == 3 * G * L and all(r == "length" for r in batch.finish_reasons)
    cfg = model.config
    slot = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    # distinct prompts padded to the longest (2 x 13 slots), each sample's L - 1 generated tokens + 1 scratch slot
    assert s.peak_kv_cache_bytes == (2 * len(PROMPTS[2]) + 3 * G * L) * slot
    assert s.seconds > 0
    assert batch.group_ids.tolist() == [i for i in range(3) for _ in range(G)]
    # the same rows for the same prompt's two groups in greedy mode
    g = sampler.generate(prompts, group_size=2, sampling=SamplingConfig(greedy=True, max_new_tokens=L))
    assert g.completion_ids[0] == g.completion_ids[4]


def test_stop_tokens_end_completions():
    model = tiny("llama", eos=None)
    sampler = HFGroupSampler(model)
    free = sampler.generate(PROMPTS, group_size=1, sampling=SamplingConfig(greedy=True, max_new_tokens=8))
    stop = free.completion_ids[1][2]  # the third greedy token of prompt 1
    batch = sampler.generate(PROMPTS, group_size=1, sampling=SamplingConfig(greedy=True, max_new_tokens=8, stop_token_ids=(stop,)))
    for full, cut, reason in zip(free.completion_ids, batch.completion_ids, batch.finish_reasons):
        if stop in full:
            assert cut == full[: full.index(stop) + 1] and reason == "stop"
        else:
            assert cut == full and reason == "length"
    assert batch.completion_ids[1] == free.completion_ids[1][:3]
    n = len(PROMPTS[1]) + 3
    assert batch.attention_mask[1].sum() == n and batch.response_mask[1].sum() == 3
    assert (batch.input_ids[1, n:] == sampler.pad_token_id).all()


def test_max_new_tokens_one():
    model = tiny("llama")
    batch = HFGroupSampler(model).generate(PROMPTS, group_size=2, sampling=SamplingConfig(greedy=True, max_new_tokens=1))
    assert [c for c in batch.completion_ids] == [hf_greedy(model, p, 1) for p in PROMPTS for _ in range(2)]


def test_update_weights_in_place():
    model = tiny("llama_tied", seed=0)
    other = tiny("llama_tied", seed=1)
    sampler = HFGroupSampler(model)
    cfg = SamplingConfig(greedy=True, max_new_tokens=6)
    before = sampler.generate(PROMPTS, group_size=1, sampling=cfg).completion_ids
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    sampler.update_weights((n, t.clone()) for n, t in other.state_dict().items())
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs  # in place
    after = sampler.generate(PROMPTS, group_size=1, sampling=cfg).completion_ids
    assert after == [hf_greedy(other, p, 6) for p in PROMPTS] and after != before
    w = model.model.layers[0].mlp.up_proj.weight
    with pytest.raises(ValueError, match="no parameter"):
        sampler.update_weights([("model.nope.weight", torch.zeros(1))])
    old = w.clone()
    with pytest.raises(ValueError, match="shape"):  # checked before anything is copied
        sampler.update_weights([("model.layers.0.mlp.up_proj.weight", torch.zeros_like(w)), ("lm_head.weight", torch.zeros(3, 3))])
    assert torch.equal(w, old)


class _Counter:
    def __init__(self, model):
        self.calls = 0
        model.register_forward_pre_hook(self)

    def __call__(self, *a):
        self.calls += 1


@pytest.mark.parametrize(
    "prompts, group_size, match",
    [
        ([], 2, "non-empty"),
        ([[5, 6], []], 2, r"prompts\[1\] is empty"),
        ([[5] * 250], 2, "maximum length"),  # 250 + 10 new tokens > 256 positions
        ([[5, 6]], 0, "group_size"),
        ([[5, 6]], 1.5, "group_size"),
        ([[5, VOCAB]], 2, "outside the vocabulary"),
        ([[-1, 5]], 2, "outside the vocabulary"),
    ],
)
def test_bad_input_raises_before_any_work(prompts, group_size, match):
    model = tiny("llama")
    counter = _Counter(model)
    sampler = HFGroupSampler(model)
    with pytest.raises(ValueError, match=match):
        sampler.generate(prompts, group_size=group_size, sampling=SamplingConfig(max_new_tokens=10))
    assert counter.calls == 0


def test_bad_constructor_arguments():
    with pytest.raises(TypeError):
        HFGroupSampler(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="backend"):
        HFGroupSampler(tiny("llama"), backend="cuda")
    sliding = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True,
                                           sliding_window=8, max_window_layers=0))
    with pytest.raises(ValueError, match="full-attention"):
        HFGroupSampler(sliding)


def test_bench_cases_registered():
    from fastrl.bench.cases_rollout import cases
    from fastrl.cli import BENCH_MODULES

    assert "cases_rollout" in BENCH_MODULES
    (case,) = cases(torch.device("cpu"), quick=True)
    assert set(case.impls) == {"fastrl", "hf_generate_dup"} and case.fastrl == "fastrl"


# ---------------------------------------------------------------- the sampling primitives
def full_cdf_sample(probs, u):
    """The previous sampler's draw (the reference): a full-vocabulary fp64 cumulative sum."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1]
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x[:, None], right=True)[:, 0].clamp(max=probs.shape[-1] - 1)


@pytest.mark.parametrize("V, block", [(7, 1024), (1024, 1024), (5000, 1024), (300, 16)])
def test_two_level_inverse_cdf_draws_the_same_tokens_as_the_full_cdf(V, block):
    from fastrl.rollout.sampling import _inverse_cdf_sample

    g = torch.Generator().manual_seed(V)
    n = 4000
    logits = torch.randn(n, V, generator=g) * 3
    logits[:, torch.randperm(V, generator=g)[: V // 3]] = float("-inf")  # zero-probability tokens
    probs = torch.softmax(logits, dim=-1)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    u[:3] = torch.tensor([0.0, 1.0 - 1e-16, 0.5])
    got = _inverse_cdf_sample(probs, u, block=block)
    assert torch.equal(got, full_cdf_sample(probs, u))
    assert (probs.gather(1, got[:, None]) > 0).all()


def test_two_level_inverse_cdf_passes_a_chi_square_test():
    from fastrl.rollout.sampling import _inverse_cdf_sample

    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(40, generator=g), dim=0)
    n = 40000
    draws = _inverse_cdf_sample(p.expand(n, 40), torch.rand(n, generator=g, dtype=torch.float64), block=8)
    counts = torch.bincount(draws, minlength=40).double()
    expected = p.double() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 80.0, chi2  # 39 degrees of freedom: P(chi2 > 80) < 1e-4


def full_sort_top_p(x, top_p):
    """Top-p with a full sort of the vocabulary (the reference)."""
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    probs = torch.softmax(sorted_x, dim=-1)
    drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
    return x.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))


@pytest.mark.parametrize("scale, top_p", [(4.0, 0.9), (0.05, 0.95), (1.0, 0.5)])  # 0.05: flat, the cut lies past the first candidates
def test_top_p_by_partial_sort_equals_the_full_sort(scale, top_p):
    x = torch.randn(6, 5000, generator=torch.Generator().manual_seed(1)) * scale
    got = process_logits(x, SamplingConfig(top_p=top_p))
    want = torch.log_softmax(full_sort_top_p(x, top_p), dim=-1)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[torch.isfinite(got)], want[torch.isfinite(want)], rtol=0, atol=1e-6)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (12, 1.0), (0, 0.8)])
def test_first_token_distribution_passes_a_chi_square_test(top_k, top_p):
    # 3000 samples of one prompt's first token (prompt seeds: the inverse-CDF path) against the
    # processed distribution of a plain forward
    model = tiny("llama")
    prompt = PROMPTS[0]
    T = 1.5
    cfg = SamplingConfig(temperature=T, top_k=top_k, top_p=top_p, max_new_tokens=1)
    batch = HFGroupSampler(model).generate([prompt], group_size=3000, sampling=cfg, prompt_seeds=[11])
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1:]
    p = process_logits(logits, cfg)[0].exp().double()
    counts = torch.bincount(torch.tensor([c[0] for c in batch.completion_ids]), minlength=VOCAB).double()
    assert counts[p == 0].sum() == 0
    expected = p * 3000
    big = expected >= 5  # pool the rare tokens into one bin
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp_ = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp_ > 0
    obs, exp_ = obs[keep], exp_[keep]
    chi2 = float(((obs - exp_) ** 2 / exp_).sum())
    df = len(obs) - 1
    assert chi2 < df + 5 * (2 * df) ** 0.5, (chi2, df)  # ~5 sigma above the mean of chi2(df)


# ---- the eager decode narrows its KV store to the rows still sampling (hf.COMPACT_FRACTION)
NARROW_G = 4
NARROW_BUDGETS = [1, 24, 3, 17, 2, 30, 8, 5, 12, 1, 20, 6]  # per trajectory (3 prompts x 4)
NARROW_STOPS = tuple(range(100, 116))  # stop tokens: some trajectories end before their budget


def _narrow_turns(model, monkeypatch, fraction, turns, *, backend="torch", budgets=NARROW_BUDGETS, garbage=False):
    """Multi-turn rollout over PROMPTS x NARROW_G with per-trajectory budgets (the first turn;
    6 after that) and seeds at this
    COMPACT_FRACTION (0: never narrow). Per turn: the outputs, the rows the turn's forwards
    ran, and a copy of the store's suffix keys/values with the suffix lengths after it.
    ``garbage``: after each turn, the slots past each row's length are overwritten with large
    finite noise (nothing may read them)."""
    monkeypatch.setattr(hf, "COMPACT_FRACTION", fraction)
    sampler = HFGroupSampler(model, backend=backend)
    state = sampler.start(PROMPTS, group_size=NARROW_G, sampling=SamplingConfig(temperature=1.0, stop_token_ids=NARROW_STOPS))
    kv = state.kv
    turns_out = []
    for turn in range(turns):
        live = list(state.live)
        appended = [[] if turn == 0 else [40 + t, 41 + turn, 7] for t in live]
        seeds = [1000 * t + turn for t in live]
        run = kv.rows_run
        out = sampler.continue_(state, appended, max_new_tokens=[budgets[t] if turn == 0 else 6 for t in live], seeds=seeds)
        assert kv.order is None  # widened back
        suffix = [(k.clone(), v.clone()) for k, v in zip(kv.suffix_k, kv.suffix_v)]
        turns_out.append((out, kv.rows_run - run, suffix, list(kv.suffix_len)))
        if garbage:
            g = torch.Generator().manual_seed(turn)
            for t in (*kv.suffix_k, *kv.suffix_v):
                for b, n in enumerate(kv.suffix_len):
                    t[b, :, n:] = 1e3 * torch.randn(t[b, :, n:].shape, generator=g)
    sampler.close(state)
    return turns_out


def _same_outputs(a, b):
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.stopped for o in a] == [o.stopped for o in b]
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=1e-5)


def test_narrowed_decode_equals_each_row_alone_and_the_unnarrowed_decode(monkeypatch):
    model = tiny("llama")
    [(on, rows_on, _, _)] = _narrow_turns(model, monkeypatch, 0.75, 1)
    [(off, rows_off, _, _)] = _narrow_turns(model, monkeypatch, 0.0, 1)
    lengths = [len(o.token_ids) for o in on]
    assert any(o.stopped for o in on) and len(set(lengths)) > 5  # rows end at very different steps
    # unnarrowed, every row runs every decode step (one per sampled token but the longest row's last)
    assert rows_off == len(on) * (max(lengths) - 1)
    assert sum(lengths) - len(on) <= rows_on < rows_off / 2  # narrowed: far fewer
    _same_outputs(on, off)
    # each trajectory alone (one row: nothing to narrow) samples the same tokens
    sampler = HFGroupSampler(model)
    for t, o in enumerate(on):
        state = sampler.start([PROMPTS[t // NARROW_G]], group_size=1, sampling=SamplingConfig(temperature=1.0, stop_token_ids=NARROW_STOPS))
        _same_outputs([o], sampler.continue_(state, [[]], max_new_tokens=NARROW_BUDGETS[t], seeds=[1000 * t]))


def test_narrowed_decode_through_the_triton_kernels(monkeypatch):
    # the narrowed layouts (per-row prompt starts) in the Triton cascade kernels (interpreter on
    # CPU: short budgets)
    model = tiny("llama")
    budgets = [min(n, 6) for n in NARROW_BUDGETS]
    [(on, rows_on, _, _)] = _narrow_turns(model, monkeypatch, 0.75, 1, backend="triton", budgets=budgets)
    [(off, rows_off, _, _)] = _narrow_turns(model, monkeypatch, 0.0, 1, backend="triton", budgets=budgets)
    assert rows_on < rows_off
    _same_outputs(on, off)


def test_turn_after_a_narrowed_turn_continues_every_trajectory_from_its_own_kv(monkeypatch):
    model = tiny("qwen2")
    on = _narrow_turns(model, monkeypatch, 0.75, 3)
    off = _narrow_turns(model, monkeypatch, 0.0, 3)
    assert on[0][1] < off[0][1]  # turn 1 narrowed
    for (a, _, _, _), (b, _, _, _) in zip(on, off):
        assert len(a) == len(PROMPTS) * NARROW_G  # every trajectory continues
        _same_outputs(a, b)


def test_widened_store_holds_every_rows_keys_and_values(monkeypatch):
    model = tiny("llama")
    on = _narrow_turns(model, monkeypatch, 0.75, 2, garbage=True)
    off = _narrow_turns(model, monkeypatch, 0.0, 2)
    assert on[0][1] < off[0][1]  # turn 1 narrowed
    for (_, rows_on, kv_on, len_on), (_, rows_off, kv_off, len_off) in zip(on, off):
        assert rows_on <= rows_off and len_on == len_off and sum(len_on) > 0
        for (k_on, v_on), (k_off, v_off) in zip(kv_on, kv_off):
            for b, n in enumerate(len_on):  # the slots row b has written, in row b
                torch.testing.assert_close(k_on[b, :, :n], k_off[b, :, :n], rtol=0, atol=1e-5)
                torch.testing.assert_close(v_on[b, :, :n], v_off[b, :, :n], rtol=0, atol=1e-5)
    # the second turn read none of the garbage written past every row's length after the first
    _same_outputs(on[1][0], off[1][0])


def test_narrow_and_widen_restore_the_store_exactly():
    kv = hf.CascadeKV(num_layers=1, prompt_lens=[3, 5], backend="torch", device=torch.device("cpu"))
    kv.prefix_k = [torch.zeros(2, 2, 5, 4)]
    kv.set_rows([0, 0, 0, 1, 1, 1], group_size=3)
    kv.reserve(6)
    k = torch.randn(kv.suffix_k[0].shape)
    kv.suffix_k[0].copy_(k)
    kv.suffix_len = [1, 2, 3, 4, 5, 6]
    kv.narrow([0, 2, 3, 5])
    assert kv.batch == 4 and kv.prefix_of == [0, 0, 1, 1] and kv.suffix_len == [1, 3, 4, 6]
    assert kv.group_size == 1  # no longer groups of the rollout's group size
    assert kv.prompt_len_rows.tolist() == [3, 3, 5, 5]
    assert torch.equal(kv.suffix_k[0][:4], k[[0, 2, 3, 5]])
    kv.suffix_len = [n + 1 for n in kv.suffix_len]
    kv.narrow([2, 5])
    assert kv.prefix_of == [0, 1] and kv.group_size == 1 and kv.suffix_len == [4, 7]
    assert torch.equal(kv.suffix_k[0][:2], k[[2, 5]])
    with pytest.raises(AssertionError, match="narrowed"):
        kv.keep([0])
    with pytest.raises(AssertionError, match="narrowed"):
        kv.reserve(100)
    kv.widen()
    assert kv.order is None and kv.batch == 6 and kv.group_size == 3 and kv.prefix_of == [0, 0, 0, 1, 1, 1]
    assert kv.suffix_len == [2, 2, 4, 5, 5, 7]  # rows left out keep the length they had then
    assert torch.equal(kv.suffix_k[0], k)
