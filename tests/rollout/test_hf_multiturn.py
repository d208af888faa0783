"""Multi-turn rollouts on HFGroupSampler: each trajectory's KV is continued across turns (turn
k runs only its new tokens), checked against HF ``generate`` and a plain forward over the
whole history, on tiny models built from configs."""

from dataclasses import replace

import pytest
import torch

from fastrl.rollout import HFGroupSampler, SamplingConfig
from fastrl.rollout.hf import HFTokenSampler, TURN_SEED_STRIDE

from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

EOS = 3
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]]


def tiny(kind, *, eos=EOS):
    """A tiny Llama (GQA 2:1) or Qwen2 (biases, GQA 4:1) with a large init (peaked distributions)."""
    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, eos_token_id=eos, bos_token_id=1, pad_token_id=0)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**{**common, "num_key_value_heads": 1}))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    return model.eval()


pytestmark = pytest.mark.usefixtures("one_thread")


def env_tokens(turn, t, n):
    """The 'environment's' answer to trajectory t at a turn: n ids, no eos."""
    g = torch.Generator().manual_seed(1000 * turn + t)
    return torch.randint(4, 200, (n,), generator=g).tolist()


def hf_greedy(model, ids, n):
    ids = torch.tensor([ids])  # an explicit mask: a sampled pad id in the history is a real token
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


class Widths:
    """Forward pre-hook: the [rows, width] of every input the model runs (hooked on its input
    embedding, which every forward calls: the model's own, and the sampler's lean decode
    forward, which runs the layers itself)."""

    def __init__(self, model):
        self.shapes = []
        self.handle = model.get_input_embeddings().register_forward_pre_hook(lambda m, a: self.shapes.append(tuple(a[0].shape)))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_turns_equal_hf_generate_on_the_whole_history(kind):
    model = tiny(kind)
    sampler = HFGroupSampler(model)
    # a sampler's first prefill also runs its one-time check of the lean forward (lean_decode)
    sampler.generate(PROMPTS[:1], group_size=1, sampling=SamplingConfig(greedy=True, max_new_tokens=1))
    G = 2
    widths = Widths(model)
    state = sampler.start(PROMPTS, group_size=G, sampling=SamplingConfig(greedy=True))
    assert widths.shapes == [(1, sum(map(len, PROMPTS)))]  # the distinct prompts, once
    full = {t: list(PROMPTS[t // G]) for t in range(len(PROMPTS) * G)}
    live = list(full)
    for turn in range(4):
        appended = [[] if turn == 0 else env_tokens(turn, t, 1 + (t * 3 + turn) % 6) for t in live]
        budgets = [3 + (t + turn) % 4 for t in live]
        widths.shapes.clear()
        out = sampler.continue_(state, appended, trajectories=live, max_new_tokens=budgets)
        # the turn ran only the new tokens (+ the previous turn's last sampled token), never the history
        assert state.prefill_tokens[-1] == sum(map(len, appended))
        assert widths.shapes[0] == ((len(live), max(len(a) for a in appended) + 1) if turn else (len(live), 1))
        assert all(w == 1 for _, w in widths.shapes[1:])
        for t, a, n, o in zip(live, appended, budgets, out):
            full[t] += a
            want = hf_greedy(model, full[t], n)
            assert o.token_ids == want, (kind, turn, t)
            assert o.stopped == (want[-1] == EOS) and len(o.logprobs) == len(want)
            full[t] += o.token_ids
            assert PROMPTS[t // G] + state.history[t] == full[t]
        # trajectories drop out: those that stopped, and one more each turn
        live = [t for t, o in zip(live, out) if not o.stopped][1:] if turn else [t for t in live if t != 3]
        if not live:
            break
    sampler.close(state)
    assert state.closed and all(k is None for k in state.kv.suffix_k)
    with pytest.raises(ValueError, match="closed"):
        sampler.continue_(state, [[5]], trajectories=[0], max_new_tokens=2)


def test_sampled_logprobs_equal_a_forward_over_the_final_trajectory():
    model = tiny("qwen2")
    sampler = HFGroupSampler(model)
    T = 0.8
    G = 3
    state = sampler.start(PROMPTS[:2], group_size=G, sampling=SamplingConfig(temperature=T), prompt_seeds=[5, 6])
    policy = {t: [] for t in range(2 * G)}  # (position, logp) of every sampled token
    for turn in range(3):
        live = list(state.live)
        appended = [[] if turn == 0 else env_tokens(turn, t, 2 + t % 3) for t in live]
        out = sampler.continue_(state, appended, max_new_tokens=5)
        for t, a, o in zip(live, appended, out):
            base = len(PROMPTS[t // G]) + len(state.history[t]) - len(o.token_ids)
            policy[t] += [(base + i, lp) for i, lp in enumerate(o.logprobs)]
    for t, pairs in policy.items():
        ids = torch.tensor([PROMPTS[t // G] + state.history[t]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float() / T, dim=-1)
        pos = torch.tensor([p for p, _ in pairs])
        want = logp[pos - 1].gather(1, ids[0, pos][:, None])[:, 0]
        torch.testing.assert_close(torch.tensor([lp for _, lp in pairs]), want, rtol=0, atol=1e-5)
    assert len({tuple(h) for h in state.history[:G]}) > 1  # the samples of a group differ


def test_a_trajectorys_tokens_do_not_depend_on_the_batch():
    model = tiny("llama")
    sampler = HFGroupSampler(model)
    cfg = SamplingConfig(temperature=1.0)
    G = 2

    def play(prompts, seeds, first_id):
        state = sampler.start(prompts, group_size=G, sampling=cfg, prompt_seeds=seeds)
        outs = {}
        for turn in range(3):
            live = list(state.live)
            appended = [[] if turn == 0 else env_tokens(turn, first_id + t, 1 + (first_id + t) % 4) for t in live]
            for t, o in zip(live, sampler.continue_(state, appended, max_new_tokens=4)):
                outs[(first_id + t, turn)] = o.token_ids
        return outs

    whole = play(PROMPTS, [7, 8, 9], 0)
    part = play(PROMPTS[1:], [8, 9], G)
    assert {k: v for k, v in whole.items() if k[0] >= G} == part
    assert whole != play(PROMPTS, [1, 2, 3], 0)


def test_token_sampler_continues_kv_and_equals_reprefilling_the_history():
    # the agents driver's contract (continue_sequences over whole sequences) against the same
    # driver over generate() with the whole history as the prompt (what it does today)
    model = tiny("llama")
    sampler = HFGroupSampler(model)
    cfg = SamplingConfig(temperature=0.9)
    tokens = HFTokenSampler(sampler, cfg)
    G = 2
    seqs = [list(PROMPTS[i]) for i in range(2) for _ in range(G)]
    prefill = []
    for turn in range(3):
        seeds = [(i * TURN_SEED_STRIDE + turn) for i in range(len(seqs))]
        budgets = [4 + i % 2 for i in range(len(seqs))]
        got = tokens.continue_sequences(seqs, max_new_tokens=budgets, seeds=seeds)
        prefill.append(tokens.state.prefill_tokens[-1])
        for s, n, seed, o in zip(seqs, budgets, seeds, got):
            want = sampler.generate([s], group_size=1, sampling=replace(cfg, max_new_tokens=n), prompt_seeds=[seed])
            assert o.token_ids == want.completion_ids[0], turn
            torch.testing.assert_close(torch.tensor(o.logprobs), want.completion_logp[0], rtol=0, atol=1e-5)
        seqs = [s + o.token_ids + env_tokens(turn, i, 3 + i) for i, (s, o) in enumerate(zip(seqs, got))]
    assert tokens.restarts == 1  # one prefill of the prompts (identical ones once), then continuations
    assert tokens.state.prefill_tokens[0] == len(PROMPTS[0]) + len(PROMPTS[1])
    assert prefill == [0, sum(3 + i for i in range(4)), sum(3 + i for i in range(4))]
    tokens.close()


def test_capacity_grows_and_bad_calls_raise():
    model = tiny("llama", eos=None)
    sampler = HFGroupSampler(model)
    state = sampler.start([PROMPTS[1]], group_size=2, sampling=SamplingConfig(greedy=True))
    sampler.continue_(state, [[], []], max_new_tokens=3)
    cap = state.kv.capacity
    sampler.continue_(state, [env_tokens(1, 0, 20), [7]], max_new_tokens=4)
    assert state.kv.capacity > cap and state.kv.capacity >= 2 + 20 + 1 + 4
    full = PROMPTS[1] + state.history[0]
    out = sampler.continue_(state, [[9], [8]], max_new_tokens=2)
    assert out[0].token_ids == hf_greedy(model, full + [9], 2)
    with pytest.raises(ValueError, match="live"):
        sampler.continue_(state, [[5]], trajectories=[7], max_new_tokens=2)
    with pytest.raises(ValueError, match="vocabulary"):
        sampler.continue_(state, [[10**6], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="maximum length"):
        sampler.continue_(state, [[5], [5]], max_new_tokens=1000)
    with pytest.raises(ValueError, match="appended"):
        sampler.continue_(state, [[5]], max_new_tokens=2)


def test_triton_decode_steps_match_torch_across_turns_and_dropouts():
    # the Triton cascade kernels (interpreter on CPU) run the one-token decode steps, with
    # per-row prompt starts once a group has lost a trajectory
    model = tiny("llama")
    outs = {}
    for backend in ("triton", "torch"):
        sampler = HFGroupSampler(model, backend=backend)
        state = sampler.start(PROMPTS[:2], group_size=2, sampling=SamplingConfig(greedy=True))
        got = [o.token_ids for o in sampler.continue_(state, [[]] * 4, max_new_tokens=3)]
        got += [o.token_ids for o in sampler.continue_(state, [[40, 41], [42]], trajectories=[1, 2], max_new_tokens=3)]
        outs[backend] = got
    assert outs["triton"] == outs["torch"]


def test_close_without_a_state_is_the_samplers_own_close():
    sampler = HFGroupSampler(tiny("llama"))
    sampler.close()  # what the trainer calls on any sampler with a close()
    out = sampler.generate([PROMPTS[1]], group_size=1, sampling=SamplingConfig(greedy=True, max_new_tokens=2))
    assert len(out.completion_ids[0]) >= 1
