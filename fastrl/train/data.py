"""Prompts for the trainer: load rows, encode prompts, check lengths, batch them resumably.

- ``load_rows(source)``: a local ``.jsonl``/``.json``/``.parquet`` file, a directory saved
  with ``datasets`` (``save_to_disk``) or holding data files, or a hub dataset id (through
  ``datasets.load_dataset``) -> ``list[dict]``; the prompt column is checked up front.
- ``encode_prompt(tokenizer, prompt)``: token ids of a prompt (a string or a list of chat
  messages), through the tokenizer's chat template when it has one.
- ``encode_rows(...)``: every row's prompt ids, with the context-length check (or the
  explicit ``drop_long_prompts``) done before training starts.
- ``PromptBatcher``: shuffled epochs, batches by prompt count and/or by a token budget,
  ``state_dict()``/``load_state_dict()`` for exact resume.
- ``check_tokenizer_matches_model(tokenizer, model)``: the vocabulary fits the embedding.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np

from fastrl.errors import InputError

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase


__all__ = [
    "DatasetNotFoundError",
    "load_rows",
    "encode_prompt",
    "encode_rows",
    "EncodedRows",
    "PromptBatch",
    "PromptBatcher",
    "check_tokenizer_matches_model",
    "model_context_length",
]

_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


class DatasetNotFoundError(InputError, FileNotFoundError):
    """A dataset path that does not exist (an ``InputError`` and a ``FileNotFoundError``)."""


# ---------------------------------------------------------------------------- loading


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}: line {line_no} is not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise InputError(f"{path}: line {line_no} is a JSON {type(row).__name__}, expected an object (one row)")
            rows.append(row)
    return rows


def _read_json(path: Path, split: str) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise InputError(f"{path} is not valid JSON ({e.msg}); JSON Lines files must end in .jsonl") from None
    if isinstance(data, dict):
        if split in data and isinstance(data[split], list):  # {"train": [...], "test": [...]}
            data = data[split]
        elif data and all(isinstance(v, list) for v in data.values()):  # columns: {"prompt": [...], ...}
            lengths = {len(v) for v in data.values()}
            if len(lengths) != 1:
                raise InputError(f"{path}: the columns have different lengths {sorted(lengths)}")
            keys = list(data)
            data = [dict(zip(keys, values)) for values in zip(*data.values())]
        else:
            raise InputError(
                f"{path}: expected a list of row objects, an object of equal-length columns, or an object with a "
                f"{split!r} list; got an object with keys {sorted(data)[:10]}"
            )
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise InputError(f"{path}: expected a list of row objects")
    return data


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        pq = None
    if pq is not None:
        return pq.read_table(path).to_pylist()
    try:
        import pandas as pd
    except ImportError:
        raise ImportError(
            f"reading {path} needs 'pyarrow' (or 'pandas' with a parquet engine): pip install pyarrow"
        ) from None
    return pd.read_parquet(path).to_dict(orient="records")


def _need_datasets(what: str):
    try:
        import datasets
    except ImportError:
        raise ImportError(f"{what} needs the 'datasets' package: pip install datasets") from None
    return datasets


def _pick_split(dataset: Any, split: str, source: str) -> Any:
    if isinstance(dataset, dict):  # DatasetDict: one dataset per split
        if split not in dataset:
            raise InputError(f"{source} has no split {split!r}; splits: {sorted(dataset.keys())}")
        return dataset[split]
    return dataset


def _read_directory(path: Path, split: str) -> list[dict]:
    datasets = _need_datasets(f"loading the directory {path}")
    if (path / "dataset_dict.json").exists() or (path / "dataset_info.json").exists() or (path / "state.json").exists():
        dataset = _pick_split(datasets.load_from_disk(str(path)), split, str(path))
    else:  # a folder of data files (e.g. a downloaded dataset repository)
        dataset = datasets.load_dataset(str(path), split=split)
    return [dict(r) for r in dataset]


def load_rows(source: str | Path, *, split: str = "train", prompt_column: str = "prompt") -> list[dict]:
    """Rows of a dataset as a list of dicts, each checked to have ``prompt_column``.

    ``source`` is one of:

    - a local ``.jsonl`` file (one JSON object per line), ``.json`` file (a list of objects,
      an object of equal-length columns, or an object whose ``split`` key holds the list) or
      ``.parquet`` file (read with pyarrow, else pandas);
    - a local directory written by ``datasets`` ``save_to_disk`` (a ``DatasetDict`` is indexed
      by ``split``) or holding data files ``datasets.load_dataset`` understands;
    - a Hugging Face Hub dataset id, loaded with ``datasets.load_dataset(source, split=split)``.

    Prompts are strings or chat messages (lists of ``{"role", "content"}`` dicts).

    Raises:
        FileNotFoundError: a path that looks like a local file does not exist.
        ImportError: the package needed to read the source is missing (named).
        ValueError: no rows; a row without ``prompt_column`` (the columns present are
            listed); a prompt that is neither a non-empty string nor a list of messages.
    """
    path = Path(source)
    text = str(source)
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            rows = _read_jsonl(path)
        elif suffix == ".json":
            rows = _read_json(path, split)
        elif suffix == ".parquet":
            rows = _read_parquet(path)
        else:
            raise InputError(f"{path}: unsupported file type {suffix!r}; expected one of {', '.join(_FILE_SUFFIXES)}")
    elif path.is_dir():
        rows = _read_directory(path, split)
    elif path.suffix.lower() in _FILE_SUFFIXES or text.startswith((".", "/", "~")):
        raise DatasetNotFoundError(f"dataset file {text} does not exist")
    else:
        datasets = _need_datasets(f"loading the hub dataset {text!r}")
        rows = [dict(r) for r in _pick_split(datasets.load_dataset(text, split=split), split, text)]
    check_rows(rows, prompt_column=prompt_column, source=text)
    return rows


def _check_messages(prompt: list, where: str) -> None:
    if not prompt:
        raise InputError(f"{where}: the prompt is an empty list of messages")
    for j, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InputError(f"{where}: message {j} must be a dict with string 'role' and 'content', got {m!r:.200}")


def check_rows(rows: Sequence[dict], *, prompt_column: str = "prompt", source: str = "dataset") -> None:
    """ValueError unless every row is a dict with a usable ``prompt_column``."""
    if len(rows) == 0:
        raise InputError(f"{source} has no rows")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise InputError(f"{source}: row {i} is a {type(row).__name__}, expected a dict")
        if prompt_column not in row:
            raise InputError(
                f"{source}: row {i} has no prompt column {prompt_column!r}; its columns are {sorted(row)}"
                " (choose the prompt column with prompt_column=...)"
            )
        prompt = row[prompt_column]
        where = f"{source}: row {i}, column {prompt_column!r}"
        if isinstance(prompt, str):
            if not prompt:
                raise InputError(f"{where}: the prompt is an empty string")
        elif isinstance(prompt, (list, tuple)):
            _check_messages(list(prompt), where)
        else:
            raise InputError(f"{where}: the prompt must be a string or a list of chat messages, got {type(prompt).__name__}")


# ---------------------------------------------------------------------------- encoding


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | Sequence[dict], *,
                  chat_template: bool | None = None) -> list[int]:
    """Token ids of ``prompt`` ready for generation.

    With a chat template (``chat_template`` True, or None and the tokenizer has one) the
    prompt -- a string becomes one user message -- is rendered with
    ``add_generation_prompt=True`` and tokenized without adding special tokens again (the
    template writes them). Without one, a string is tokenized as is (with the tokenizer's
    own special tokens, e.g. a leading bos); chat messages then raise ValueError.
    """
    has_template = bool(getattr(tokenizer, "chat_template", None))
    use_template = has_template if chat_template is None else bool(chat_template)
    if use_template and not has_template:
        raise InputError("chat_template=True but the tokenizer has no chat template")
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)):
        _check_messages(list(prompt), "prompt")
        messages = [dict(m) for m in prompt]
    else:
        raise InputError(f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
    if use_template:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        if not isinstance(prompt, str):
            raise InputError("chat-message prompts need a tokenizer with a chat template (or chat_template=True)")
        ids = tokenizer(prompt)["input_ids"]
    ids = [int(t) for t in ids]
    if not ids:
        raise InputError(f"prompt {prompt!r:.100} encodes to no tokens")
    return ids


def model_context_length(model: torch.nn.Module) -> int | None:
    """The longest sequence the model takes (``config.max_position_embeddings``), or None."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@dataclass
class EncodedRows:
    """Rows kept for training and their prompt token ids (same order)."""

    rows: list[dict]
    prompt_ids: list[list[int]]
    dropped: list[int]
    """Indices (into the input rows) of prompts dropped as too long."""


def encode_rows(
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict],
    *,
    prompt_column: str = "prompt",
    chat_template: bool | None = None,
    max_new_tokens: int = 0,
    max_length: int | None = None,
    drop_long_prompts: bool = False,
) -> EncodedRows:
    """Encode every row's prompt and check it fits: ``len(prompt) + max_new_tokens <= max_length``.

    A prompt that does not fit raises ValueError naming the row (its index and the start of
    its prompt), unless ``drop_long_prompts`` -- then it is left out and its index listed in
    ``dropped``; if every row is dropped, ValueError. ``max_length=None`` skips the check
    (pass ``model_context_length(model)``).
    """
    check_rows(rows, prompt_column=prompt_column)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    kept_rows, kept_ids, dropped = [], [], []
    for i, row in enumerate(rows):
        ids = encode_prompt(tokenizer, row[prompt_column], chat_template=chat_template)
        if max_length is not None and len(ids) + max_new_tokens > max_length:
            if drop_long_prompts:
                dropped.append(i)
                continue
            raise InputError(
                f"row {i}: the prompt has {len(ids)} tokens; with max_new_tokens={max_new_tokens} that is "
                f"{len(ids) + max_new_tokens} > the model's context length {max_length} "
                f"(prompt starts {str(row[prompt_column])[:80]!r}); shorten it, lower max_new_tokens, or set "
                "drop_long_prompts=True"
            )
        kept_rows.append(row)
        kept_ids.append(ids)
    if not kept_rows:
        raise InputError(f"every one of the {len(rows)} prompts is longer than the context length {max_length} allows")
    return EncodedRows(rows=kept_rows, prompt_ids=kept_ids, dropped=dropped)


def check_tokenizer_matches_model(tokenizer: PreTrainedTokenizerBase, model: torch.nn.Module) -> None:
    """ValueError unless every token id the tokenizer can produce has a row in the model's
    input embedding (and output layer), and its special-token ids are in range."""
    embedding = model.get_input_embeddings()
    rows = int(embedding.weight.shape[0])
    vocab = len(tokenizer)
    if vocab > rows:
        raise InputError(
            f"the tokenizer has {vocab} tokens but the model's input embedding has only {rows} rows: "
            f"token ids >= {rows} would index out of range; use the model's own tokenizer or resize its embeddings"
        )
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and hasattr(head, "weight") and int(head.weight.shape[0]) < vocab:
        raise InputError(f"the tokenizer has {vocab} tokens but the model's output layer scores only {int(head.weight.shape[0])}")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None and not 0 <= int(value) < rows:
            raise InputError(f"tokenizer.{name} = {value} is outside the model's vocabulary [0, {rows})")


# ---------------------------------------------------------------------------- batching


@dataclass
class PromptBatch:
    """One batch of prompts: the rows, their token ids and where they came from."""

    rows: list[dict]
    prompt_ids: list[list[int]]
    indices: list[int]
    """Row indices into the batcher's rows."""
    epoch: int


def _fingerprint(prompt_ids: Sequence[Sequence[int]]) -> str:
    h = hashlib.sha256()
    for ids in prompt_ids:
        h.update(np.asarray(ids, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


class PromptBatcher:
    """Endless (or ``epochs``-long) iteration over shuffled epochs of prompts.

    Each epoch is a permutation of the rows drawn from ``(seed, epoch)`` alone, so the data
    position is just ``(epoch, position in the epoch)`` and resuming from ``state_dict()``
    yields exactly the batches the uninterrupted run would have. Batches never span two
    epochs; a batch ends at whichever limit is reached first:

    - ``batch_size``: at most this many prompts;
    - ``token_budget``: at most this many tokens, a prompt costing
      ``(len(prompt_ids) + max_new_tokens) * group_size`` (the sampler's worst case).

    At least one of the two must be given. With ``drop_last`` an epoch's final batch is
    skipped when it is short of ``batch_size`` prompts (token-budget batches are never
    dropped). A single prompt over the token budget raises ValueError at construction.
    """

    def __init__(
        self,
        rows: Sequence[dict],
        prompt_ids: Sequence[Sequence[int]],
        *,
        batch_size: int | None = None,
        token_budget: int | None = None,
        group_size: int = 1,
        max_new_tokens: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        epochs: int | None = None,
        seed: int = 0,
    ):
        if len(rows) != len(prompt_ids):
            raise ValueError(f"rows ({len(rows)}) and prompt_ids ({len(prompt_ids)}) must have the same length")
        if len(rows) == 0:
            raise ValueError("PromptBatcher needs at least one row")
        if batch_size is None and token_budget is None:
            raise ValueError("give batch_size (prompts per batch) and/or token_budget (tokens per batch)")
        for name, value, low in (("batch_size", batch_size, 1), ("token_budget", token_budget, 1), ("epochs", epochs, 1)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise ValueError(f"{name} must be None or an int >= {low}, got {value!r}")
        for name, value, low in (("group_size", group_size, 1), ("max_new_tokens", max_new_tokens, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if drop_last and batch_size is not None and token_budget is None and batch_size > len(rows):
            raise ValueError(f"drop_last with batch_size={batch_size} > {len(rows)} rows would never yield a batch")
        self.rows = list(rows)
        self.prompt_ids = [[int(t) for t in ids] for ids in prompt_ids]
        self.batch_size = batch_size
        self.token_budget = token_budget
        self.group_size = group_size
        self.max_new_tokens = max_new_tokens
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epochs = epochs
        self.seed = seed
        self.costs = [(len(ids) + max_new_tokens) * group_size for ids in self.prompt_ids]
        if token_budget is not None:
            worst = max(range(len(self.costs)), key=self.costs.__getitem__)
            if self.costs[worst] > token_budget:
                raise ValueError(
                    f"row {worst} alone costs {self.costs[worst]} tokens ((prompt {len(self.prompt_ids[worst])} + "
                    f"max_new_tokens {max_new_tokens}) x group_size {group_size}) > token_budget {token_budget}"
                )
        self._fingerprint = _fingerprint(self.prompt_ids)
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order: np.ndarray = np.arange(0)

    def order(self, epoch: int) -> np.ndarray:
        """The row order of ``epoch`` (a function of ``seed`` and ``epoch`` only)."""
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def _current_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            self._order = self.order(self.epoch)
            self._order_epoch = self.epoch
        return self._order

    def __iter__(self) -> Iterator[PromptBatch]:
        return self

    def __next__(self) -> PromptBatch:
        while True:
            if self.epochs is not None and self.epoch >= self.epochs:
                raise StopIteration
            order = self._current_order()
            n = len(order)
            if self.position >= n:
                self.epoch, self.position = self.epoch + 1, 0
                continue
            end = self.position
            tokens = 0
            while end < n:
                if self.batch_size is not None and end - self.position >= self.batch_size:
                    break
                cost = self.costs[order[end]]
                if self.token_budget is not None and end > self.position and tokens + cost > self.token_budget:
                    break
                tokens += cost
                end += 1
            picked = [int(i) for i in order[self.position : end]]
            short = self.batch_size is not None and self.token_budget is None and len(picked) < self.batch_size
            epoch = self.epoch
            self.position = end
            if self.drop_last and short:
                continue
            return PromptBatch(
                rows=[self.rows[i] for i in picked],
                prompt_ids=[list(self.prompt_ids[i]) for i in picked],
                indices=picked,
                epoch=epoch,
            )

    def state_dict(self) -> dict[str, Any]:
        """The data position (JSON-serialisable): restores the exact next batch."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_rows": len(self.rows),
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; ValueError if it belongs to other data or another seed."""
        missing = {"epoch", "position", "seed", "num_rows", "fingerprint"} - set(state)
        if missing:
            raise ValueError(f"PromptBatcher state is missing {sorted(missing)}")
        if state["num_rows"] != len(self.rows) or state["fingerprint"] != self._fingerprint:
            raise ValueError(
                f"PromptBatcher state was saved for other data ({state['num_rows']} rows, fingerprint "
                f"{state['fingerprint']}); these prompts are {len(self.rows)} rows, fingerprint {self._fingerprint}"
            )
        if state["seed"] != self.seed:
            raise ValueError(f"PromptBatcher state was saved with seed {state['seed']}, this batcher has seed {self.seed}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.rows):
            raise ValueError(f"PromptBatcher state has an invalid position (epoch {epoch}, position {position})")
        self.epoch, self.position = epoch, position
