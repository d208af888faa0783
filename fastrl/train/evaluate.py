"""Held-out evaluation: greedy accuracy and pass@k, one rule for every caller.

A completion succeeds when its score reaches 1 (``SUCCESS_THRESHOLD``: the built-in rewards
give 1 for a right answer; the margin absorbs the rounding of weighted sums). Greedy
accuracy decodes one completion per prompt with the argmax; pass@k samples ``k``
completions per prompt (one group of ``k``) and counts a prompt as solved when any of them
succeeds (the direct estimate with n = k samples); ``sampled_accuracy`` is the mean success
over all samples (an estimate of pass@1 at that temperature).

- ``HeldOutEvaluator``: the trainer's (``eval/...`` metrics): the run's sampler and reward
  pool, one sampling seed per prompt, under torchrun each rank a share of the rows.
- ``evaluate``: a model and a ``score_fn`` from Python (the warm-up's probe uses it).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from fastrl.rollout import HFGroupSampler, SamplingConfig
from fastrl.train.data import check_rows, encode_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from fastrl.rollout.base import GroupSampler
    from fastrl.train.ranks import Ranks
    from fastrl.train.score import GroupScorer


__all__ = ["SUCCESS_THRESHOLD", "HeldOutEvaluator", "evaluate", "succeeded"]

SUCCESS_THRESHOLD = 1.0 - 1e-6
"""A score at least this is a success (1 up to float rounding)."""

SAMPLES_PER_CALL = 256
"""The trainer's evaluator asks its sampler for at most this many samples per call (256 // k prompts)."""

EVAL_SEED_OFFSET = 17
"""The held-out pass@k samples use seed ``cfg.seed + EVAL_SEED_OFFSET`` (apart from the training rollouts' seeds)."""


def succeeded(scores: torch.Tensor) -> torch.Tensor:
    """Bool tensor: which scores are successes."""
    return scores >= SUCCESS_THRESHOLD


class HeldOutEvaluator:
    """The trainer's held-out evaluation: greedy accuracy and mean reward, and pass@k with
    ``pass_k`` samples per prompt at the training temperature.

    ``sampler``: the run's ``GroupSampler``; ``scorer``: a ``GroupScorer`` (the run's reward
    pool; the score is the total reward); ``prompt_seeds(sampling, first, count)``: the
    run's per-prompt seeds; ``ranks``: each rank scores a contiguous share of the rows and
    the scores are gathered, in row order.
    """

    def __init__(self, *, sampler: GroupSampler, scorer: GroupScorer, ranks: Ranks, rows: Sequence[dict],
                 prompt_ids: Sequence[list[int]],
                 max_new_tokens: int, pass_k: int, temperature: float, top_p: float, top_k: int, seed: int,
                 prompt_seeds: Callable[[SamplingConfig, int, int], list[int] | None]):
        self.sampler, self.scorer, self.ranks = sampler, scorer, ranks
        self.rows, self.prompt_ids = list(rows), list(prompt_ids)
        self.max_new_tokens, self.pass_k = max_new_tokens, pass_k
        self.sampled = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                                      seed=seed + EVAL_SEED_OFFSET)
        self.prompt_seeds = prompt_seeds
        self.last_row_success: list[int] | None = None
        """The last evaluation's greedy success (0/1) per held-out row, in row order (``fastrl.commands.paired``)."""

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        if not self.rows:
            return {}
        t0 = time.perf_counter()
        share = self.ranks.share(len(self.rows))
        rows, prompts, first = self.rows[share], self.prompt_ids[share], share.start
        greedy = self.scores(rows, prompts, SamplingConfig(greedy=True, temperature=1.0, max_new_tokens=self.max_new_tokens), 1,
                             first=first)
        ok = succeeded(greedy)
        self.last_row_success = ok.int().tolist()
        out = {"eval/accuracy": float(ok.float().mean()), "eval/reward_mean": float(greedy.mean())}
        k = self.pass_k
        if k > 1:
            ok = succeeded(self.scores(rows, prompts, self.sampled, k, first=first).view(-1, k))
            out[f"eval/pass@{k}"] = float(ok.any(1).float().mean())
            out["eval/sampled_accuracy"] = float(ok.float().mean())
        out["time/eval"] = time.perf_counter() - t0
        return out

    def scores(self, rows, prompts, sampling: SamplingConfig, k: int, *, first: int = 0) -> torch.Tensor:
        """Total reward of every completion (k per prompt) of every rank's rows (this rank's
        start at ``first``), in row order."""
        scores = [torch.zeros(0)]
        chunk = max(1, SAMPLES_PER_CALL // k)
        for s in range(0, len(rows), chunk):
            r, p = rows[s : s + chunk], prompts[s : s + chunk]
            seeds = self.prompt_seeds(sampling, first + s, len(p))
            extra = {"prompt_seeds": seeds} if seeds is not None else {}
            batch = self.sampler.generate(p, group_size=k, sampling=sampling, **extra)
            _, result = self.scorer.score(r, batch, k)
            scores.append(result.rewards.float())
        return self.ranks.gather(torch.cat(scores))

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
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
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
        score_fn: ``(prompts, completions, answers) -> list[float]``; success is a score of
            at least ``SUCCESS_THRESHOLD`` (None or non-finite scores count as failures).
        max_new_tokens: completion budget.
        greedy: measure greedy accuracy (``accuracy``).
        k: when > 1, sample ``k`` completions per prompt at ``temperature`` and report
            ``pass@k`` and ``sampled_accuracy`` (mean success over all samples, an estimate
            of pass@1 at that temperature; also under its former name ``sample_accuracy``).
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
            greedy_success.extend(s >= SUCCESS_THRESHOLD for s in scores)
            greedy_completions.extend(texts)
        if k > 1:
            sampling = SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed + batch_index)
            out = sampler.generate(ids, group_size=k, sampling=sampling)
            texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
            rep_prompts = [p for p in ps for _ in range(k)]
            rep_answers = [a for a in ans for _ in range(k)]
            ok = [s >= SUCCESS_THRESHOLD for s in _scores(score_fn, rep_prompts, texts, rep_answers)]
            sample_success.extend(ok)
            solved.extend(any(ok[i * k : (i + 1) * k]) for i in range(len(ids)))

    result: dict[str, Any] = {"num_prompts": len(rows)}
    if greedy:
        result["accuracy"] = sum(greedy_success) / len(rows)
    if k > 1:
        result[f"pass@{k}"] = sum(solved) / len(rows)
        result["sampled_accuracy"] = result["sample_accuracy"] = sum(sample_success) / len(sample_success)
    if return_completions and greedy:
        result["completions"] = greedy_completions
    result["seconds"] = time.perf_counter() - t0
    return result
