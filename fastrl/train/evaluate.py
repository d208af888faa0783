"""Held-out evaluation: greedy accuracy and pass@k with the shared-prefix sampler.

A completion succeeds when ``score_fn(prompts, completions, answers)`` gives it a score
>= 1. Greedy accuracy decodes one completion per prompt with the argmax; pass@k samples
``k`` completions per prompt (one group of ``k`` in ``HFGroupSampler``) and counts a
prompt as solved when any of them succeeds (the direct estimate with n = k samples).
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

from fastrl.rollout import HFGroupSampler, SamplingConfig
from fastrl.train.data import check_rows, encode_prompt

__all__ = ["evaluate"]

ScoreFn = Callable[[list, list[str], list], list[float]]


def _scores(score_fn: ScoreFn, prompts: list, completions: list[str], answers: list) -> list[float]:
    scores = score_fn(prompts, completions, answers)
    if len(scores) != len(completions):
        raise ValueError(f"score_fn returned {len(scores)} scores for {len(completions)} completions")
    out = []
    for s in scores:
        s = float("nan") if s is None else float(s)
        out.append(s if math.isfinite(s) else 0.0)  # an unscorable completion counts as a failure
    return out


def evaluate(
    model: Any,
    tokenizer: Any,
    rows: Sequence[dict],
    *,
    score_fn: ScoreFn,
    max_new_tokens: int,
    greedy: bool = True,
    k: int = 1,
    batch_size: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
    chat_template: bool | None = None,
    sampler: HFGroupSampler | None = None,
    return_completions: bool = False,
) -> dict[str, Any]:
    """Greedy accuracy and/or pass@k of ``model`` on ``rows``.

    Args:
        score_fn: ``(prompts, completions, answers) -> list[float]``; success is score >= 1
            (None or non-finite scores count as failures).
        max_new_tokens: completion budget.
        greedy: measure greedy accuracy (``accuracy``).
        k: when > 1, sample ``k`` completions per prompt at ``temperature`` and report
            ``pass@k`` and ``sample_accuracy`` (mean success over all samples, an estimate
            of pass@1 at that temperature).
        batch_size: prompts per sampler call.
        seed: sampling seed (each batch uses ``seed + batch index``).
        sampler: reuse an existing ``HFGroupSampler`` of ``model`` (else one is made).
        return_completions: also return the decoded greedy ``completions`` (in row order).

    Returns a dict with ``num_prompts``, ``seconds`` and the metrics asked for.
    """
    if not greedy and k <= 1:
        raise ValueError("nothing to evaluate: set greedy=True and/or k > 1")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    check_rows(rows, prompt_column=prompt_column)
    for i, row in enumerate(rows):
        if answer_column not in row:
            raise ValueError(f"row {i} has no answer column {answer_column!r}; its columns are {sorted(row)}")
    sampler = sampler if sampler is not None else HFGroupSampler(model)
    t0 = time.perf_counter()
    prompts = [row[prompt_column] for row in rows]
    answers = [row[answer_column] for row in rows]
    prompt_ids = [encode_prompt(tokenizer, p, chat_template=chat_template) for p in prompts]

    greedy_success: list[bool] = []
    greedy_completions: list[str] = []
    solved: list[bool] = []
    sample_success: list[bool] = []
    for batch_index, start in enumerate(range(0, len(rows), batch_size)):
        sl = slice(start, start + batch_size)
        ids, ps, ans = prompt_ids[sl], prompts[sl], answers[sl]
        if greedy:
            out = sampler.generate(ids, group_size=1, sampling=SamplingConfig(greedy=True, max_new_tokens=max_new_tokens))
            texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
            scores = _scores(score_fn, ps, texts, ans)
            greedy_success.extend(s >= 1.0 for s in scores)
            greedy_completions.extend(texts)
        if k > 1:
            sampling = SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed + batch_index)
            out = sampler.generate(ids, group_size=k, sampling=sampling)
            texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
            rep_prompts = [p for p in ps for _ in range(k)]
            rep_answers = [a for a in ans for _ in range(k)]
            ok = [s >= 1.0 for s in _scores(score_fn, rep_prompts, texts, rep_answers)]
            sample_success.extend(ok)
            solved.extend(any(ok[i * k : (i + 1) * k]) for i in range(len(ids)))

    result: dict[str, Any] = {"num_prompts": len(rows)}
    if greedy:
        result["accuracy"] = sum(greedy_success) / len(rows)
    if k > 1:
        result[f"pass@{k}"] = sum(solved) / len(rows)
        result["sample_accuracy"] = sum(sample_success) / len(sample_success)
    if return_completions and greedy:
        result["completions"] = greedy_completions
    result["seconds"] = time.perf_counter() - t0
    return result
