"""The single-turn run's supervised warm-up stage: ``sft_steps`` on the rows' answers (to
``sft_target_accuracy`` when set), with its progress shown; ``fastrl.train.sft`` holds the
warm-up's mechanics (batches, loss, probes, pause and resume), which take no ``TrainConfig``.
An env run's warm-up on its oracle's transcripts is ``agent.build.warm_up_on_transcripts``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch

from fastrl.errors import InputError
from fastrl.train.config import TrainConfig
from fastrl.train.sft import WarmupResult, WarmupState, sft_to_target, sft_warmup

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["warm_up_on_answers"]


def warm_up_on_answers(cfg: TrainConfig, policy: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, rows: Sequence[dict], *,
                       score_fn: Callable[[list, list[str], list], list[float]], progress: bool, resume: WarmupState | None = None,
                       pause: Callable[[], bool] | None = None) -> WarmupResult:
    """The supervised warm-up (``sft_steps``; to ``sft_target_accuracy`` when set, probing with
    ``score_fn``); returns its ``sft/...`` metrics and probes, the policy back in train mode. ``progress``:
    show its progress (``WarmupProgress``). ``resume`` (a paused warm-up's ``WarmupState``) and
    ``pause`` as for ``fastrl.train.sft.sft_batches``."""
    from fastrl.train.run.progress import WarmupProgress

    if not all("answer" in r for r in rows):
        raise InputError("sft_steps > 0 needs an 'answer' column in the dataset (the warm-up targets)")
    warm = WarmupProgress(cfg.sft_steps, target_accuracy=cfg.sft_target_accuracy, enabled=progress,
                          initial=resume.steps_done if resume is not None else 0)
    common = dict(steps=cfg.sft_steps, lr=cfg.sft_lr, batch_size=cfg.sft_batch_size, seed=cfg.seed, warmup_steps=cfg.sft_warmup_steps,
                  prompt_column=cfg.prompt_column, chat_template=cfg.chat_template, on_step=warm.on_step, layout=cfg.sft_layout,
                  resume=resume, pause=pause)
    try:
        if cfg.sft_target_accuracy is not None:
            common["max_steps"] = common.pop("steps")
            result = sft_to_target(
                policy, tokenizer, rows, score_fn=score_fn, target_accuracy=cfg.sft_target_accuracy,
                check_every=cfg.sft_check_every, probe_rows=cfg.sft_probe_rows, max_new_tokens=cfg.max_new_tokens,
                on_probe=warm.on_probe, sooner_near_target=cfg.sft_probe_sooner, **common,
            )
        else:
            result = sft_warmup(policy, tokenizer, rows, **common)
    finally:
        warm.close()
    policy.train()
    return WarmupResult.of_run(result, result.get("probe", ()))

