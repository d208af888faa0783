"""Loading rows, encoding prompts, length checks and the resumable PromptBatcher."""

import json

import pytest
import torch

from fastrl.train.data import (
    PromptBatcher,
    check_tokenizer_matches_model,
    encode_prompt,
    encode_rows,
    load_rows,
    model_context_length,
)
from fastrl.train.task import ArithmeticTask, char_tokenizer, tiny_model

ROWS = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "level": i % 3} for i in range(7)]
CHAT = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}], "answer": "4"}]


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


# ---------------------------------------------------------------- loading


def test_load_jsonl_json_parquet_round_trip(tmp_path):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in ROWS + CHAT) + "\n\n")  # a trailing blank line is fine
    assert load_rows(jsonl) == ROWS + CHAT
    as_list = tmp_path / "list.json"
    as_list.write_text(json.dumps(ROWS))
    assert load_rows(as_list) == ROWS
    as_columns = tmp_path / "cols.json"
    as_columns.write_text(json.dumps({k: [r[k] for r in ROWS] for k in ROWS[0]}))
    assert load_rows(as_columns) == ROWS
    as_splits = tmp_path / "splits.json"
    as_splits.write_text(json.dumps({"train": ROWS[:3], "test": ROWS[3:]}))
    assert load_rows(as_splits, split="test") == ROWS[3:]

    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow (for Parquet datasets) is not installed")
    import pyarrow as pa

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(CHAT * 2), path)
    assert load_rows(path) == CHAT * 2


def test_load_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the datasets package is not installed")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:2])})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert load_rows(tmp_path / "dd", split="test") == ROWS[:2]
    with pytest.raises(ValueError, match="no split 'validation'"):
        load_rows(tmp_path / "dd", split="validation")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    assert load_rows(tmp_path / "single") == ROWS


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_rows(tmp_path / "missing.jsonl")
    bad_column = tmp_path / "q.jsonl"
    bad_column.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(ValueError, match=r"no prompt column 'prompt'; its columns are \['answer', 'question'\]"):
        load_rows(bad_column)
    assert load_rows(bad_column, prompt_column="question") == [{"question": "1+1=", "answer": "2"}]
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match="line 2"):
        load_rows(broken)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no rows"):
        load_rows(empty)
    not_prompt = tmp_path / "n.jsonl"
    not_prompt.write_text(json.dumps({"prompt": 3}) + "\n")
    with pytest.raises(ValueError, match="string or a list of chat messages"):
        load_rows(not_prompt)
    bad_msg = tmp_path / "m.jsonl"
    bad_msg.write_text(json.dumps({"prompt": [{"role": "user"}]}) + "\n")
    with pytest.raises(ValueError, match="message 0"):
        load_rows(bad_msg)
    other = tmp_path / "d.csv"
    other.write_text("prompt\nx\n")
    with pytest.raises(ValueError, match="unsupported file type"):
        load_rows(other)


# ---------------------------------------------------------------- encoding


def test_encode_prompt_with_and_without_chat_template(tok):
    with_template = encode_prompt(tok, "2+2=")
    assert tok.decode(with_template) == "<bos><|user|>2+2=<|assistant|>"
    assert with_template.count(tok.bos_token_id) == 1  # the template's bos, not a second one
    assert encode_prompt(tok, [{"role": "user", "content": "2+2="}]) == with_template
    assert encode_prompt(tok, "2+2=", chat_template=True) == with_template
    plain = encode_prompt(tok, "2+2=", chat_template=False)
    assert tok.decode(plain) == "<bos>2+2="
    chat = encode_prompt(tok, CHAT[0]["prompt"])
    assert tok.decode(chat) == "<bos><|system|>be brief<|user|>2+2=<|assistant|>"
    with pytest.raises(ValueError, match="chat template"):
        encode_prompt(tok, CHAT[0]["prompt"], chat_template=False)


def test_encode_prompt_tokenizer_without_template(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(tmp_path)
    bare.chat_template = None
    assert encode_prompt(bare, "2+2=") == encode_prompt(tok, "2+2=", chat_template=False)
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(bare, "2+2=", chat_template=True)
    with pytest.raises(ValueError, match="chat template"):
        encode_prompt(bare, CHAT[0]["prompt"])


def test_length_check_names_the_row_or_drops(tok):
    rows = [{"prompt": "1+1="}, {"prompt": "x" * 40}, {"prompt": "2+2="}]
    with pytest.raises(ValueError, match=r"row 1: the prompt has 43 tokens; with max_new_tokens=5 that is 48 > .* 32"):
        encode_rows(tok, rows, max_new_tokens=5, max_length=32)
    enc = encode_rows(tok, rows, max_new_tokens=5, max_length=32, drop_long_prompts=True)
    assert enc.dropped == [1] and enc.rows == [rows[0], rows[2]]
    assert enc.prompt_ids == [encode_prompt(tok, "1+1="), encode_prompt(tok, "2+2=")]
    # exactly at the limit is allowed: bos, <|user|>, 4 characters, <|assistant|> = 7, + 5 new = 12
    assert len(encode_rows(tok, rows[:1], max_new_tokens=5, max_length=12).rows) == 1
    with pytest.raises(ValueError, match="row 0"):
        encode_rows(tok, rows[:1], max_new_tokens=6, max_length=12)
    with pytest.raises(ValueError, match="every one"):
        encode_rows(tok, rows[1:2], max_new_tokens=5, max_length=32, drop_long_prompts=True)


def test_tokenizer_model_match(tok):
    model = tiny_model(tok, hidden_size=16, layers=1, heads=2, max_position_embeddings=40)
    check_tokenizer_matches_model(tok, model)
    assert model_context_length(model) == 40
    model.resize_token_embeddings(len(tok) - 10)
    with pytest.raises(ValueError, match=f"{len(tok)} tokens but the model's input embedding has only {len(tok) - 10} rows"):
        check_tokenizer_matches_model(tok, model)
    big = tiny_model(tok, hidden_size=16, layers=1, heads=2)
    big.resize_token_embeddings(len(tok) + 16)  # padded embedding tables (common on hub models) are fine
    check_tokenizer_matches_model(tok, big)


# ---------------------------------------------------------------- batching


def _ids(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 100, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def _take(batcher, n):
    return [(b.epoch, b.indices) for b in (next(batcher) for _ in range(n))]


def test_batches_by_count_cover_each_epoch_once():
    rows = [{"prompt": str(i)} for i in range(10)]
    b = PromptBatcher(rows, _ids(10), batch_size=4, seed=1)
    batches = _take(b, 6)
    assert [len(ix) for _, ix in batches] == [4, 4, 2, 4, 4, 2]  # never spans two epochs
    assert [e for e, _ in batches] == [0, 0, 0, 1, 1, 1]
    e0 = sum((ix for e, ix in batches if e == 0), [])
    e1 = sum((ix for e, ix in batches if e == 1), [])
    assert sorted(e0) == sorted(e1) == list(range(10)) and e0 != e1  # reshuffled each epoch
    again = PromptBatcher(rows, _ids(10), batch_size=4, seed=1)
    assert _take(again, 6) == batches
    assert _take(PromptBatcher(rows, _ids(10), batch_size=4, seed=2), 3) != batches[:3]
    batch = next(PromptBatcher(rows, _ids(10), batch_size=3, shuffle=False))
    assert batch.indices == [0, 1, 2] and batch.rows == rows[:3] and batch.prompt_ids == _ids(10)[:3]
    dropped = PromptBatcher(rows, _ids(10), batch_size=4, drop_last=True)
    assert [len(ix) for _, ix in _take(dropped, 4)] == [4, 4, 4, 4]
    finite = PromptBatcher(rows, _ids(10), batch_size=4, epochs=2)
    assert len(list(finite)) == 6


def test_token_budget_batches():
    ids = _ids(40, seed=3)
    rows = [{"prompt": str(i)} for i in range(40)]
    G, new, budget = 4, 5, 200
    b = PromptBatcher(rows, ids, token_budget=budget, group_size=G, max_new_tokens=new, seed=0)
    seen = []
    for _ in range(12):
        batch = next(b)
        cost = [(len(ids[i]) + new) * G for i in batch.indices]
        assert sum(cost) <= budget
        if b.position < 40 and batch.epoch == b.epoch:  # not the end of an epoch: the next prompt did not fit
            nxt = b.order(b.epoch)[b.position]
            assert sum(cost) + (len(ids[nxt]) + new) * G > budget
        seen.append(batch)
    assert sorted(sum((x.indices for x in seen if x.epoch == 0), [])) == list(range(40))
    # both limits: whichever comes first
    both = PromptBatcher(rows, ids, token_budget=10_000, batch_size=3, group_size=G, max_new_tokens=new)
    assert len(next(both).indices) == 3
    with pytest.raises(ValueError, match=r"row \d+ alone costs"):
        PromptBatcher(rows, ids, token_budget=40, group_size=G, max_new_tokens=new)


@pytest.mark.parametrize("mode", [dict(batch_size=3), dict(token_budget=60, group_size=2, max_new_tokens=3)])
@pytest.mark.parametrize("stop_after", [0, 1, 4, 7])
def test_resume_reproduces_the_next_batches(mode, stop_after):
    ids = _ids(11, seed=5)
    rows = [{"prompt": str(i)} for i in range(11)]
    straight = PromptBatcher(rows, ids, seed=7, **mode)
    want = _take(straight, stop_after + 8)
    first = PromptBatcher(rows, ids, seed=7, **mode)
    assert _take(first, stop_after) == want[:stop_after]
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON checkpoint
    resumed = PromptBatcher(rows, ids, seed=7, **mode)
    resumed.load_state_dict(state)
    assert _take(resumed, 8) == want[stop_after:]


def test_resume_rejects_other_data_or_seed():
    ids = _ids(6)
    rows = [{"prompt": str(i)} for i in range(6)]
    state = PromptBatcher(rows, ids, batch_size=2).state_dict()
    with pytest.raises(ValueError, match="other data"):
        PromptBatcher(rows[:5], ids[:5], batch_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="other data"):
        PromptBatcher(rows, ids[::-1], batch_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        PromptBatcher(rows, ids, batch_size=2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="missing"):
        PromptBatcher(rows, ids, batch_size=2).load_state_dict({"epoch": 0})


def test_batcher_bad_arguments():
    rows, ids = [{"prompt": "a"}] * 3, [[5]] * 3
    with pytest.raises(ValueError, match="batch_size .*token_budget"):
        PromptBatcher(rows, ids)
    with pytest.raises(ValueError, match="same length"):
        PromptBatcher(rows, ids[:2], batch_size=1)
    with pytest.raises(ValueError, match="batch_size"):
        PromptBatcher(rows, ids, batch_size=0)
    with pytest.raises(ValueError, match="never yield"):
        PromptBatcher(rows, ids, batch_size=4, drop_last=True)
    with pytest.raises(ValueError, match="at least one row"):
        PromptBatcher([], [], batch_size=1)


def test_arithmetic_rows_feed_the_batcher(tok):
    task = ArithmeticTask(digits=2, num_train=50, num_heldout=10)
    enc = encode_rows(tok, task.train_rows(), max_new_tokens=4, max_length=32)
    batch = next(PromptBatcher(enc.rows, enc.prompt_ids, batch_size=8, seed=0))
    for row, ids in zip(batch.rows, batch.prompt_ids):
        assert tok.decode(ids) == f"<bos><|user|>{row['prompt']}<|assistant|>"
