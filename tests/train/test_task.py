"""The embedded default task: built-in tokenizer, arithmetic problems, tiny models, evaluation."""

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from fastrl.rollout import HFGroupSampler
from fastrl.train.data import encode_prompt
from fastrl.train.evaluate import evaluate
from fastrl.train.task import (
    SPECIAL_TOKENS,
    ArithmeticTask,
    DefaultTask,
    char_tokenizer,
    exact_match_score,
    tiny_model,
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


def test_tokenizer_ids_and_special_tokens(tok):
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) == len(SPECIAL_TOKENS) + 95 + 2
    ids = tok("37+58=")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 7  # bos + one token per character
    assert tok("37+58=", add_special_tokens=False)["input_ids"] == ids[1:]
    text = "Hello, world!\n\tx = 3 * (4 - 1)"
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    # characters outside the vocabulary become <unk>, never a crash or an id out of range
    unk = tok("é", add_special_tokens=False)["input_ids"]
    assert unk == [tok.unk_token_id]


def test_chat_template(tok):
    msgs = [{"role": "user", "content": "1+2="}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<bos><|user|>1+2=<|assistant|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids[1] == tok.convert_tokens_to_ids("<|user|>")
    assert ids[-1] == tok.convert_tokens_to_ids("<|assistant|>") and len(ids) == 2 + 4 + 1
    full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "3"}], tokenize=False)
    assert full == "<bos><|user|>1+2=<|assistant|>3<eos>"


def test_tokenizer_save_load_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    back = AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(back, PreTrainedTokenizerFast)
    assert back.get_vocab() == tok.get_vocab()
    assert (back.pad_token_id, back.bos_token_id, back.eos_token_id, back.unk_token_id) == (0, 1, 2, 3)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12*3="}]
    assert back.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == tok.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False
    )
    for text in ("12*3=", "a b  c\n"):
        assert back(text)["input_ids"] == tok(text)["input_ids"]
        assert back.decode(back(text)["input_ids"], skip_special_tokens=True) == text


@pytest.mark.parametrize("ops", ["+", "-", "*", "+-*"])
def test_arithmetic_rows_are_correct_disjoint_and_seeded(ops):
    task = ArithmeticTask(digits=2, operations=ops, num_train=300, num_heldout=100, seed=3)
    train, held = task.train_rows(), task.heldout_rows()
    assert len(train) == 300 and len(held) == 100
    prompts = [r["prompt"] for r in train + held]
    assert len(set(prompts)) == 400  # distinct, so train and held-out are disjoint
    for r in train + held:
        expr = r["prompt"]
        assert expr.endswith("=")
        assert str(eval(expr[:-1])) == r["answer"]  # noqa: S307 -- our own generated digits and one operator
        a, b = expr[:-1].replace("*", "+").replace("-", "+").split("+")
        assert 0 <= int(a) < 100 and 0 <= int(b) < 100
        assert len(r["answer"]) <= task.max_answer_chars and len(expr) <= task.max_prompt_chars
    assert task.train_rows() == train  # same seed, same rows
    assert ArithmeticTask(digits=2, operations=ops, num_train=300, num_heldout=100, seed=4).train_rows() != train
    if len(ops) > 1:
        assert {op for op in ops} <= {next(c for c in r["prompt"][1:] if c in "+-*") for r in train}


def test_arithmetic_bad_settings():
    with pytest.raises(ValueError, match="digits"):
        ArithmeticTask(digits=0)
    with pytest.raises(ValueError, match="operations"):
        ArithmeticTask(operations="/")
    with pytest.raises(ValueError, match="distinct problems"):
        ArithmeticTask(digits=1, num_train=90, num_heldout=20)  # only 100 problems exist


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_model_matches_tokenizer(tok, arch):
    model = tiny_model(tok, hidden_size=32, layers=1, heads=4, kv_heads=2, arch=arch, max_position_embeddings=24, seed=1)
    assert model.config.model_type == arch
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
    assert (model.config.eos_token_id, model.config.pad_token_id, model.config.bos_token_id) == (2, 0, 1)
    assert model.generation_config.eos_token_id == 2
    assert model.config.max_position_embeddings == 24
    ids = torch.tensor([tok("12+3=")["input_ids"]])
    assert model(ids).logits.shape == (1, ids.shape[1], len(tok))
    # seeded and independent of the global RNG
    torch.manual_seed(123)
    again = tiny_model(tok, hidden_size=32, layers=1, heads=4, kv_heads=2, arch=arch, max_position_embeddings=24, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    other = tiny_model(tok, hidden_size=32, layers=1, heads=4, kv_heads=2, arch=arch, max_position_embeddings=24, seed=2)
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)
    with pytest.raises(ValueError, match="arch"):
        tiny_model(tok, arch="gpt2")


def test_default_task_fits_its_context(tok):
    d = DefaultTask()
    longest = "9" * d.task.digits + d.task.operations[0] + "9" * d.task.digits + "="
    assert len(longest) == d.task.max_prompt_chars
    assert d.max_new_tokens >= d.task.max_answer_chars + 1  # answer + eos
    assert len(encode_prompt(tok, longest)) + d.max_new_tokens <= d.max_position_embeddings


def test_exact_match_score():
    assert exact_match_score(["p"] * 4, ["12", " 12\n", "13", "012"], ["12", "12", "12", "12"]) == [1.0, 1.0, 0.0, 0.0]


def test_evaluate_counts_greedy_and_pass_at_k(tok):
    """Accuracy is checked against a reference: each completion decoded by HF generate (greedy)
    and the sampler's own samples scored by hand."""
    model = tiny_model(tok, hidden_size=32, layers=1, max_position_embeddings=24, seed=0).eval()
    rows = ArithmeticTask(digits=1, num_train=0, num_heldout=12, seed=0).heldout_rows()
    # make the "answers" whatever the model greedily says for half the rows, so accuracy is exactly 1/2
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=False) for r in rows]
    greedy_texts = []
    for p in prompts:
        ids = torch.tensor([tok(p, add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=4, pad_token_id=0)
        greedy_texts.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    rows = [{"prompt": r["prompt"], "answer": greedy_texts[i].strip() if i % 2 == 0 else "no such answer"} for i, r in enumerate(rows)]
    res = evaluate(model, tok, rows, score_fn=exact_match_score, max_new_tokens=4, k=3, batch_size=5, return_completions=True)
    assert res["num_prompts"] == 12
    assert res["completions"] == greedy_texts
    assert res["accuracy"] == pytest.approx(0.5)
    assert res["pass@3"] <= 0.5 and 0.0 <= res["sample_accuracy"] <= res["pass@3"]
    # pass@k with an always-right scorer is 1; a scorer returning None/NaN counts as failure
    always = evaluate(model, tok, rows, score_fn=lambda p, c, a: [1.0] * len(c), max_new_tokens=4, greedy=False, k=2)
    assert always["pass@2"] == 1.0 and always["sample_accuracy"] == 1.0 and "accuracy" not in always
    broken = evaluate(model, tok, rows, score_fn=lambda p, c, a: [None] * len(c), max_new_tokens=4, sampler=HFGroupSampler(model))
    assert broken["accuracy"] == 0.0
    with pytest.raises(ValueError, match="scores for"):
        evaluate(model, tok, rows, score_fn=lambda p, c, a: [1.0], max_new_tokens=4)
    with pytest.raises(ValueError, match="answer column"):
        evaluate(model, tok, [{"prompt": "1+1="}], score_fn=exact_match_score, max_new_tokens=4)
