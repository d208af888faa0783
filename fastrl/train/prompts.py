"""The run's prompts: its rows (given, the built-in task's, or a dataset's, with the held-out
split) and their encoding against the model's context, with the batcher over the training ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from fastrl.errors import InputError
from fastrl.train.config import TrainConfig
from fastrl.train import data as data_mod
from fastrl.train.data import PromptBatcher

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Prompts", "encode_prompts", "run_rows"]


def run_rows(cfg: TrainConfig, train_rows: Sequence[dict] | None, eval_rows: Sequence[dict] | None) -> tuple[list[dict], list[dict]]:
    """``(train rows, held-out rows)``: given, the built-in task's, or from ``cfg.dataset``."""
    if train_rows is not None:
        train = [dict(r) for r in train_rows]
        evals = [dict(r) for r in eval_rows] if eval_rows is not None else []
    elif cfg.dataset is None:
        from fastrl.train.task import ArithmeticTask

        task = ArithmeticTask(
            digits=cfg.task_digits, operations=cfg.task_operations, num_train=cfg.task_train_size,
            num_heldout=cfg.task_eval_size, seed=cfg.seed,
        )
        train, evals = task.train_rows(), task.heldout_rows()
    else:
        train = data_mod.load_rows(cfg.dataset, split=cfg.dataset_split, prompt_column=cfg.prompt_column)
        if cfg.eval_dataset is not None:
            evals = data_mod.load_rows(cfg.eval_dataset, split=cfg.dataset_split, prompt_column=cfg.prompt_column)
        else:
            n_eval = max(1, int(len(train) * cfg.eval_fraction))
            g = torch.Generator().manual_seed(cfg.seed)
            order = torch.randperm(len(train), generator=g).tolist()
            evals = [train[i] for i in order[:n_eval]]
            train = [train[i] for i in order[n_eval:]]
    if not train:
        raise InputError("the training dataset is empty")
    for r in train[:1] + evals[:1]:
        if cfg.prompt_column not in r:
            raise InputError(f"dataset rows have no {cfg.prompt_column!r} column (columns: {sorted(r)})")
    return train, evals[: cfg.eval_prompts]

@dataclass
class Prompts:
    """The run's encoded prompts and the batcher over the training ones."""

    train_rows: list[dict]
    train_ids: list[list[int]]
    eval_rows: list[dict]
    eval_ids: list[list[int]]
    max_length: int | None
    """Longest sequence (prompt + completion) the run allows."""
    dropped: int
    """Training prompts dropped for length (``drop_long_prompts``)."""
    batcher: PromptBatcher


def encode_prompts(cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase, policy: torch.nn.Module, train_rows: list[dict], eval_rows: list[dict], *,
                   sharded: bool) -> Prompts:
    """Tokenise the prompts against the model's context (``max_prompt_length`` + ``max_new_tokens``)
    and batch the training ones (by prompt count or token budget; under torchrun no short batch)."""
    max_length = data_mod.model_context_length(policy)
    if cfg.max_prompt_length is not None:
        limit = cfg.max_prompt_length + cfg.max_new_tokens
        max_length = limit if max_length is None else min(max_length, limit)
    encode = dict(prompt_column=cfg.prompt_column, chat_template=cfg.chat_template, max_new_tokens=cfg.max_new_tokens,
                  max_length=max_length, drop_long_prompts=cfg.drop_long_prompts)
    train = data_mod.encode_rows(tokenizer, train_rows, **encode)
    eval_ids: list[list[int]] = []
    if eval_rows:
        held_out = data_mod.encode_rows(tokenizer, eval_rows, **encode)
        eval_rows, eval_ids = held_out.rows, held_out.prompt_ids
    batcher = PromptBatcher(
        train.rows, train.prompt_ids,
        batch_size=None if cfg.prompt_token_budget else cfg.prompts_per_step,
        token_budget=cfg.prompt_token_budget, group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
        seed=cfg.seed,
        drop_last=sharded,  # every rank takes an equal slice of each batch: no short batch at an epoch's end
    )
    return Prompts(train_rows=train.rows, train_ids=train.prompt_ids, eval_rows=eval_rows, eval_ids=eval_ids, max_length=max_length,
                   dropped=len(train.dropped), batcher=batcher)
