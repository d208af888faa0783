"""SFT warm-up: the completion-only loss against a logits reference, determinism, learning."""

import copy

import pytest
import torch

from fastrl.train.data import encode_prompt
from fastrl.train.sft import collate_sft, encode_sft_example, sft_loss, sft_warmup
from fastrl.train.task import ArithmeticTask, char_tokenizer, tiny_model


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def _reference_loss(model, examples, pad_id):
    """Plain PyTorch: full logits, log_softmax, mean NLL of the answer+eos tokens of each example."""
    total, count = 0.0, 0
    for ids, prompt_len in examples:
        x = torch.tensor([ids])
        logp = torch.log_softmax(model(x).logits[0, :-1].double(), -1)
        targets = x[0, 1:]
        token_logp = logp.gather(-1, targets[:, None])[:, 0]
        total = total - token_logp[prompt_len - 1 :].sum()
        count += len(ids) - prompt_len
    return total / count


def test_example_encoding_and_mask(tok):
    ids, plen = encode_sft_example(tok, "12+3=", "15")
    assert ids[:plen] == encode_prompt(tok, "12+3=")
    assert tok.decode(ids[plen:]) == "15<eos>"
    examples = [(ids, plen), encode_sft_example(tok, "1+1=", "2")]
    input_ids, attention_mask, loss_mask = collate_sft(examples, pad_token_id=tok.pad_token_id)
    assert input_ids.shape == (2, len(ids)) and loss_mask.shape == (2, len(ids) - 1)
    for b, (row_ids, p) in enumerate(examples):
        scored = input_ids[b, 1:][loss_mask[b].bool()].tolist()  # the tokens the mask scores
        assert scored == row_ids[p:]
        assert attention_mask[b].sum() == len(row_ids)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_loss_and_gradient_match_the_logits_reference(tok, arch):
    model = tiny_model(tok, hidden_size=32, layers=2, heads=4, arch=arch, max_position_embeddings=32, seed=3)
    with torch.no_grad():  # sharper than the default init so the loss is not flat
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    rows = ArithmeticTask(digits=2, num_train=5, num_heldout=0, seed=1).train_rows()
    examples = [encode_sft_example(tok, r["prompt"], r["answer"]) for r in rows]
    input_ids, attention_mask, loss_mask = collate_sft(examples, pad_token_id=tok.pad_token_id)
    loss = sft_loss(model, input_ids, attention_mask, loss_mask)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    ref = copy.deepcopy(model).double()
    want = _reference_loss(ref, examples, tok.pad_token_id)
    want_grads = torch.autograd.grad(want, list(ref.parameters()))
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g.double(), w, rtol=1e-3, atol=1e-5)
    # whatever sits in the padding changes nothing
    garbage = input_ids.masked_fill(attention_mask == 0, 77)
    torch.testing.assert_close(sft_loss(model, garbage, attention_mask, loss_mask), loss)


def test_short_sft_lowers_the_loss_and_is_deterministic(tok):
    rows = ArithmeticTask(digits=1, num_train=60, num_heldout=0, seed=0).train_rows()
    a = tiny_model(tok, hidden_size=32, layers=1, heads=4, max_position_embeddings=24, seed=0)
    b = copy.deepcopy(a)
    seen = []
    out_a = sft_warmup(a, tok, rows, steps=30, lr=3e-3, batch_size=8, seed=5, callback=lambda s, l: seen.append(s))
    out_b = sft_warmup(b, tok, rows, steps=30, lr=3e-3, batch_size=8, seed=5)
    assert seen == list(range(30)) and len(out_a["losses"]) == 30 and out_a["steps"] == 30
    assert out_a["losses"] == out_b["losses"]
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    first = sum(out_a["losses"][:5]) / 5
    last = sum(out_a["losses"][-5:]) / 5
    assert last < 0.6 * first, (first, last)
    assert out_a["tokens"] > 0 and not a.training
    # nothing of the warm-up's optimizer is left behind: the trainer's first backward starts from no gradient
    assert all(p.grad is None for p in a.parameters())
    c = tiny_model(tok, hidden_size=32, layers=1, heads=4, max_position_embeddings=24, seed=0)
    out_c = sft_warmup(c, tok, rows, steps=5, lr=3e-3, batch_size=8, seed=6)
    assert out_c["losses"] != out_a["losses"][:5]  # another data order


def test_sft_bad_input(tok):
    model = tiny_model(tok, hidden_size=16, layers=1, heads=2)
    with pytest.raises(ValueError, match="answer column 'answer'"):
        sft_warmup(model, tok, [{"prompt": "1+1=", "solution": "2"}], steps=1, lr=1e-3, batch_size=1)
    with pytest.raises(ValueError, match="no prompt column"):
        sft_warmup(model, tok, [{"question": "1+1=", "answer": "2"}], steps=1, lr=1e-3, batch_size=1)
    with pytest.raises(ValueError, match="lr"):
        sft_warmup(model, tok, [{"prompt": "1+1=", "answer": "2"}], steps=1, lr=float("nan"), batch_size=1)
    with pytest.raises(ValueError, match="batch_size"):
        sft_warmup(model, tok, [{"prompt": "1+1=", "answer": "2"}], steps=1, lr=1e-3, batch_size=0)


def test_learning_rate_schedules():
    from fastrl.train.sft import _learning_rate

    const = [_learning_rate(s, steps=10, lr=1.0, warmup_steps=4, schedule="constant") for s in range(10)]
    assert const == [0.25, 0.5, 0.75, 1.0] + [1.0] * 6
    cos = [_learning_rate(s, steps=10, lr=2.0, warmup_steps=2, schedule="cosine") for s in range(10)]
    assert cos[:3] == [1.0, 2.0, 2.0]  # warm-up, then the decay starts from the full rate
    assert all(a > b for a, b in zip(cos[2:], cos[3:])) and 0 < cos[-1] < 0.2
    assert _learning_rate(5, steps=10, lr=1.0, warmup_steps=0, schedule="cosine") == pytest.approx(0.5)
    with pytest.raises(ValueError, match="schedule"):
        sft_warmup(tiny_model(char_tokenizer(), hidden_size=16, layers=1, heads=2), char_tokenizer(),
                   [{"prompt": "1+1=", "answer": "2"}], steps=1, lr=1e-3, batch_size=1, schedule="linear")


def test_callback_can_stop_the_warmup_early(tok):
    rows = ArithmeticTask(digits=1, num_train=20, num_heldout=0).train_rows()
    model = tiny_model(tok, hidden_size=16, layers=1, heads=2, max_position_embeddings=24)
    out = sft_warmup(model, tok, rows, steps=50, lr=1e-3, batch_size=4, callback=lambda step, loss: step == 4)
    assert out["steps"] == 5 and len(out["losses"]) == 5 and out["final_loss"] == out["losses"][-1]
    # only an explicit True stops it (a callback returning a loss or None does not)
    out = sft_warmup(model, tok, rows, steps=6, lr=1e-3, batch_size=4, callback=lambda step, loss: loss)
    assert out["steps"] == 6


def test_probe_schedule_probes_every_check_every_steps_or_sooner_near_the_target():
    from fastrl.train.sft import ProbeSchedule

    fixed = ProbeSchedule(10, 0.5)  # the default: every 10 steps whatever the accuracy
    assert [n for n in range(1, 12) if fixed.due(n)] == [10, 11]
    assert not fixed.reached(10, 0.0) and fixed.next_at == 20
    assert not fixed.reached(20, 0.49) and fixed.next_at == 30 and fixed.reached(30, 0.5)
    s = ProbeSchedule(10, 0.5, sooner_near_target=True)
    assert [n for n in range(1, 12) if s.due(n)] == [10, 11]  # the first probe after check_every steps
    assert not s.reached(10, 0.0) and s.next_at == 20  # nothing right yet: the whole interval
    assert not s.reached(20, 0.25) and s.next_at == 25  # half the target missing: half the interval (5.0, not 6)
    assert not s.reached(25, 1 / 6) and s.next_at == 32  # 2/3 missing: ceil(6.67)
    assert not s.reached(32, 0.49) and s.next_at == 33  # just under: the next step, never 0 steps
    assert s.reached(33, 0.5) and s.reached(33, 0.9)  # at or past the target
    # an unreachable target keeps probing at the interval its shortfall gives; a target of 0 is met at once
    t = ProbeSchedule(3, 1.01, sooner_near_target=True)
    assert not t.reached(3, 0.0) and t.next_at == 6
    assert ProbeSchedule(3, 0.0).reached(3, 0.0)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="check_every"):
            ProbeSchedule(bad, 0.5)
    with pytest.raises(ValueError, match="target"):
        ProbeSchedule(10, -0.1)
    with pytest.raises(ValueError, match="target"):
        ProbeSchedule(10, float("nan"))


@pytest.mark.parametrize("sooner", [False, True])
def test_sft_to_target_stops_at_the_probe_target(tok, sooner):
    from fastrl.train.evaluate import evaluate
    from fastrl.train.sft import ProbeSchedule, sft_to_target
    from fastrl.train.task import exact_match_score

    rows = ArithmeticTask(digits=1, num_train=40, num_heldout=0).train_rows()
    kw = dict(score_fn=exact_match_score, check_every=3, probe_rows=10, max_new_tokens=3, lr=3e-3, batch_size=8,
              sooner_near_target=sooner)
    model = tiny_model(tok, hidden_size=16, layers=1, heads=2, max_position_embeddings=24)
    out = sft_to_target(model, tok, rows, target_accuracy=0.0, max_steps=20, **kw)
    assert out["steps"] == 3 and [s for s, _ in out["probe"]] == [3]  # 0.0 is reached at the first check
    model = tiny_model(tok, hidden_size=16, layers=1, heads=2, max_position_embeddings=24)
    out = sft_to_target(model, tok, rows, target_accuracy=1.01, max_steps=12, **kw)  # unreachable: runs to max_steps
    assert out["steps"] == 12 and out["probe"][0][0] == 3
    if not sooner:
        assert [s for s, _ in out["probe"]] == [3, 6, 9, 12]
    replay = ProbeSchedule(3, 1.01, sooner_near_target=sooner)  # each probe came when the schedule said, from the accuracy before it
    for (step, acc), (next_step, _) in zip(out["probe"], out["probe"][1:]):
        assert not replay.reached(step, acc) and next_step == replay.next_at
    assert not replay.reached(*out["probe"][-1]) and replay.next_at > 12
    final = evaluate(model, tok, rows[:10], score_fn=exact_match_score, max_new_tokens=3)["accuracy"]
    assert out["probe"][-1][1] <= 1.0 and 0.0 <= final <= 1.0


def _demonstrations(tok, env, n):
    """``n`` oracle transcripts of a built-in environment, as the agent warm-up lays them out."""
    from fastrl.agents.envs import BUILTIN_ENVS, synthetic_transcripts
    from fastrl.agents.render import ChatRenderer, demonstration_sample

    train, _ = BUILTIN_ENVS[env].rows(num_train=n, num_heldout=1, seed=0)
    renderer = ChatRenderer(tok, tools=None)
    return [demonstration_sample(renderer, p, t) for p, t in synthetic_transcripts(env, train, call_format="compact", seed=0)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_trie_batch_has_the_padded_batchs_loss_and_gradients(tok, arch):
    from fastrl.agents.batch import collate_samples
    from fastrl.ops.hf_packed import shared_prefix_attention_enabled
    from fastrl.train.sft import trie_batch, trie_sft_loss

    # multi-turn sql demonstrations (tool result tokens between the policy turns carry no loss), the
    # answer turn weighted 3x, and one row that scores nothing
    samples = _demonstrations(tok, "sql", 6)
    model = tiny_model(tok, hidden_size=32, layers=2, heads=4, arch=arch, max_position_embeddings=256, seed=3)
    input_ids, attention_mask, loss_mask = collate_samples(samples, pad_token_id=tok.pad_token_id, answer_weight=3.0)
    loss_mask[5] = 0.0
    padded = sft_loss(model, input_ids, attention_mask, loss_mask)
    want = torch.autograd.grad(padded, list(model.parameters()))
    garbage = input_ids.masked_fill(attention_mask == 0, 77)  # what sits in the padding is never packed
    batch = trie_batch(garbage, attention_mask, loss_mask)
    assert batch.tokens < 0.6 * sum(len(s.token_ids) for s in samples)  # the schema line and templates run once
    assert batch.weights.max() == 3.0 and (batch.weights == 0).any()
    with shared_prefix_attention_enabled(model):
        loss = trie_sft_loss(model, batch)
        got = torch.autograd.grad(loss, list(model.parameters()))
    torch.testing.assert_close(loss, padded, rtol=1e-5, atol=1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_the_trie_layout_trains_like_the_padded_one_and_auto_takes_it_when_it_saves(tok):
    from fastrl.agents.batch import collate_samples
    from fastrl.train.sft import SFT_TRIE_MIN_SAVING, _as_trie, sft_batches

    samples = _demonstrations(tok, "sql", 48)
    collate = lambda picked: collate_samples([samples[i] for i in picked], pad_token_id=tok.pad_token_id)  # noqa: E731
    base = tiny_model(tok, hidden_size=32, layers=2, heads=4, max_position_embeddings=256, seed=1)
    outs, models = {}, {}
    for layout in ("padded", "trie", "auto"):
        models[layout] = copy.deepcopy(base)
        outs[layout] = sft_batches(models[layout], len(samples), collate, steps=4, lr=3e-3, batch_size=24, seed=2, layout=layout)
    assert outs["padded"]["trie_steps"] == 0 and outs["trie"]["trie_steps"] == outs["auto"]["trie_steps"] == 4
    assert outs["trie"]["forward_tokens"] < 0.5 * outs["padded"]["forward_tokens"] == 0.5 * outs["trie"]["padded_tokens"]
    assert outs["trie"]["tokens"] == outs["padded"]["tokens"]
    torch.testing.assert_close(outs["trie"]["losses"], outs["padded"]["losses"], rtol=1e-4, atol=1e-5)
    for a, b in zip(models["trie"].parameters(), models["padded"].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)
    # the rule's input is the trie's share of the padded tokens: arithmetic prompts share little
    rows = ArithmeticTask(digits=2, num_train=16, num_heldout=0, seed=0).train_rows()
    few = collate_sft([encode_sft_example(tok, r["prompt"], r["answer"]) for r in rows], pad_token_id=tok.pad_token_id)
    assert _as_trie(*few, forced=False) is None and _as_trie(*few, forced=True) is not None
    many = collate(list(range(16)))
    trie = _as_trie(*many, forced=False)
    assert trie is not None and trie.tokens <= (1 - SFT_TRIE_MIN_SAVING) * trie.padded_tokens


def test_trie_layout_bad_input(tok):
    from fastrl.train.sft import sft_batches, trie_batch

    rows = [{"prompt": "1+1=", "answer": "2"}]
    model = tiny_model(tok, hidden_size=16, layers=1, heads=2)
    with pytest.raises(ValueError, match="layout must be one of"):
        sft_warmup(model, tok, rows, steps=1, lr=1e-3, batch_size=1, layout="packed")
    left = torch.tensor([[0, 0, 5, 6], [4, 5, 6, 7]]), torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]), torch.ones(2, 3)
    with pytest.raises(ValueError, match="right-padded"):
        trie_batch(*left)
    # a model the shared-prefix forward does not support: the trie is refused, auto pads
    windowed = tiny_model(tok, hidden_size=16, layers=1, heads=2, arch="qwen2")
    windowed.config.attention_dropout = 0.1
    collate = lambda picked: collate_sft([encode_sft_example(tok, "1+1=", "2")] * len(picked), pad_token_id=tok.pad_token_id)  # noqa: E731
    with pytest.raises(ValueError, match="attention dropout"):
        sft_batches(windowed, 1, collate, steps=1, lr=1e-3, batch_size=2, layout="trie")
    out = sft_batches(windowed, 1, collate, steps=1, lr=1e-3, batch_size=2, layout="auto")
    assert out["steps"] == 1 and out["trie_steps"] == 0


def test_a_paused_trie_warm_up_resumed_on_a_fresh_model_is_bitwise_the_unpaused_one(tok):
    """``sft_batches``' ``pause`` / ``resume`` on the trie layout: paused after step 3 of 5 (mid-epoch
    of the second shuffle: 20 demonstrations in batches of 8), resumed into a freshly initialised
    model, it ends with the unpaused run's weights, losses and token counts; ``pause`` is not asked
    after the last step (a stop requested then lets the warm-up end normally)."""
    from fastrl.agents.batch import collate_samples
    from fastrl.train.sft import WarmupPaused, sft_batches

    samples = _demonstrations(tok, "frozenlake", 20)
    collate = lambda picked: collate_samples([samples[i] for i in picked], pad_token_id=tok.pad_token_id)  # noqa: E731

    def model(seed):
        return tiny_model(tok, hidden_size=32, layers=1, heads=4, max_position_embeddings=256, seed=seed)

    run = dict(steps=5, lr=3e-3, batch_size=8, seed=4, layout="trie")
    straight_model = model(1)
    asked = []
    straight = sft_batches(straight_model, len(samples), collate, pause=lambda: asked.append(1) and False, **run)
    assert len(asked) == 4 and straight["trie_steps"] == 5  # after steps 1-4, never after the last

    calls = iter(range(100))
    with pytest.raises(WarmupPaused) as paused:
        sft_batches(model(1), len(samples), collate, pause=lambda: next(calls) == 2, **run)
    state = paused.value.state
    assert state.steps_done == 3 and len(state.losses) == 3 and state.position == 4  # 24 examples: one epoch and 4
    resumed_model = model(7)  # other initial weights: the state's are loaded
    resumed = sft_batches(resumed_model, len(samples), collate, resume=state, **run)
    assert resumed["losses"] == straight["losses"] and resumed["steps"] == 5
    for key in ("tokens", "forward_tokens", "padded_tokens", "trie_steps"):
        assert resumed[key] == straight[key], key
    for (name, a), b in zip(straight_model.state_dict().items(), resumed_model.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="other settings: batch_size=8"):
        sft_batches(model(1), len(samples), collate, resume=state, **{**run, "batch_size": 4})
