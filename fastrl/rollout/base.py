"""Types shared by every group sampler: the sampling settings, the batch a rollout
returns (``RolloutBatch``), the batch with its scores (``GroupRollout``), and the
``GroupSampler`` protocol."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Protocol, Sequence, runtime_checkable

import torch

from fastrl._checks import check_scalar


@dataclass(frozen=True)
class SamplingConfig:
    """How completions are sampled.

    The sampled tokens' log-probs (``RolloutBatch.sampler_logp``) are those of the
    distribution actually sampled from: logits / temperature, after top-k and top-p
    filtering (renormalised over the kept tokens).
    """

    temperature: float = 1.0
    """Softmax temperature, > 0."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (0 < top_p <= 1)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""
    max_new_tokens: int = 64
    """Upper bound on completion length, >= 1."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end a completion (included in it). The sampler adds the model's eos."""
    seed: int | None = None
    """Seed for reproducible sampling; None draws from the global generator."""
    greedy: bool = False
    """Take the argmax instead of sampling (sampler_logp is then that of the tempered distribution)."""

    def __post_init__(self) -> None:
        check_scalar("temperature", self.temperature, low=0.0, low_inclusive=False)
        check_scalar("top_p", self.top_p, low=0.0, high=1.0, low_inclusive=False)
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass
class RolloutStats:
    prompts: int = 0
    samples: int = 0
    prefill_tokens_computed: int = 0
    """Prompt tokens run through the model (shared prefixes count once)."""
    prefix_tokens_reused: int = 0
    """Prompt tokens a sample did not recompute because it shares its group's prefix."""
    generated_tokens: int = 0
    peak_kv_cache_bytes: int = 0
    """The most bytes the HF sampler's key/value store held at once (its prefix and suffix
    tensors; while the store grows or narrows, one layer's key or value tensor at a time is
    copied on top of that and is not counted); 0 where a backend does not measure it (vLLM)."""
    seconds: float = 0.0
    prefix_cache_hit_rate: float | None = None
    """vLLM: hits / queries of its prefix cache during this call."""


@dataclass
class RolloutBatch:
    """G completions per prompt, flat in group order (prompt 0's G samples first).

    ``input_ids``/``attention_mask``/``response_mask``/``sampler_logp`` are ``[B, T]``
    right-padded (prompt then completion), ready for the training forward:
    ``response_mask`` marks completion tokens and ``sampler_logp[b, t]`` is the sampler's
    log-prob of ``input_ids[b, t]`` at completion positions (0 elsewhere).
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    group_ids: torch.Tensor  # [B] int64: index of the prompt each sample belongs to
    finish_reasons: list[str]  # "stop" (a stop token was sampled) or "length"
    completion_logp: list[torch.Tensor]  # per sample, [len(completion)] fp32
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    sampler_logp: torch.Tensor
    stats: RolloutStats = field(default_factory=RolloutStats)

    @classmethod
    def from_samples(
        cls,
        prompts: list[list[int]],
        completion_ids: list[list[int]],
        completion_logp: list[torch.Tensor],
        finish_reasons: list[str],
        *,
        group_size: int,
        pad_token_id: int,
        stats: RolloutStats,
    ) -> "RolloutBatch":
        """A batch from per-sample completions in group order, with the training tensors packed."""
        input_ids, attention_mask, response_mask, sampler_logp, group_ids = pack_batch(
            prompts, completion_ids, completion_logp, group_size, pad_token_id
        )
        return cls(
            prompt_ids=prompts,
            completion_ids=completion_ids,
            group_ids=group_ids,
            finish_reasons=finish_reasons,
            completion_logp=completion_logp,
            input_ids=input_ids,
            attention_mask=attention_mask,
            response_mask=response_mask,
            sampler_logp=sampler_logp,
            stats=stats,
        )


@dataclass
class GroupRollout:
    """One step's sampled groups with their scores: the sampler's batch, the dataset row of
    each prompt, the decoded completions and the reward pool's results."""

    batch: RolloutBatch
    rows: list[dict[str, Any]]
    """One dataset row per prompt."""
    completions: list[str]
    """Decoded, one per sample (batch order)."""
    rewards: torch.Tensor
    """``[B]`` fp32 outcome rewards (failed or timed-out reward calls already 0)."""
    reward_metrics: dict[str, float]
    per_function: dict[str, torch.Tensor]
    """Each reward function's ``[B]`` scores."""

    def group(self, g: int, group_size: int) -> slice:
        """The samples of prompt ``g``."""
        return slice(g * group_size, (g + 1) * group_size)


def merge_rollouts(kept: list[tuple[GroupRollout, list[int]]], *, group_size: int, limit: int, pad_token_id: int) -> GroupRollout:
    """One rollout from chosen groups of several (dynamic sampling), at most ``limit`` groups;
    reward metrics are the rollouts' means, rollout statistics their sums."""
    prompts, comps, logps, reasons, rows, texts, rewards = [], [], [], [], [], [], []
    per_fn: dict[str, list[torch.Tensor]] = {}
    metrics: dict[str, list[float]] = {}
    stats = RolloutStats()
    for ro, groups in kept:
        for name, v in ro.reward_metrics.items():
            metrics.setdefault(name, []).append(v)
        for f in ("prefill_tokens_computed", "prefix_tokens_reused", "generated_tokens", "seconds"):
            setattr(stats, f, getattr(stats, f) + getattr(ro.batch.stats, f))
        for g in groups:
            if len(rows) == limit:
                break
            rows.append(ro.rows[g])
            prompts.append(ro.batch.prompt_ids[g])
            sl = ro.group(g, group_size)
            comps.extend(ro.batch.completion_ids[sl])
            logps.extend(ro.batch.completion_logp[sl])
            reasons.extend(ro.batch.finish_reasons[sl])
            texts.extend(ro.completions[sl])
            rewards.append(ro.rewards[sl])
            for name, v in ro.per_function.items():
                per_fn.setdefault(name, []).append(v[sl])
    stats.prompts, stats.samples = len(prompts), len(comps)
    batch = RolloutBatch.from_samples(prompts, comps, logps, reasons, group_size=group_size, pad_token_id=pad_token_id, stats=stats)
    return GroupRollout(
        batch=batch, rows=rows, completions=texts, rewards=torch.cat(rewards),
        reward_metrics={k: sum(v) / len(v) for k, v in metrics.items()},
        per_function={k: torch.cat(v) for k, v in per_fn.items()},
    )


@runtime_checkable
class GroupSampler(Protocol):
    """What the trainer asks of a sampler (``fastrl/train/samplers.py`` registers each one).

    Capabilities beyond these: a sampler class that also keeps trajectories' keys/values across
    calls declares ``multi_turn = True`` (:class:`MultiTurnSampler`); callers ask
    :func:`supports_multi_turn`, never the sampler's class."""

    pad_token_id: int
    """Id that right-pads the ``[B, T]`` batch."""

    def generate(
        self, prompts: list[list[int]], *, group_size: int, sampling: SamplingConfig, prompt_seeds: Iterable[int] | None = None
    ) -> RolloutBatch:
        """``group_size`` completions per prompt, flat in group order. ``prompt_seeds``: one
        sampling seed per prompt (``validate_prompt_seeds``), so a prompt's samples do not
        depend on which prompts share the call; None uses ``sampling.seed``."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int | None:
        """Load the policy's ``(name, tensor)`` pairs; returns the sampler's weights version
        after the load (a server counts its loads), or None when it keeps none."""
        ...


class MultiTurnSampler(GroupSampler, Protocol):
    """A ``GroupSampler`` whose trajectories keep their keys/values across calls (``HFGroupSampler``).

    Its class declares ``multi_turn = True``. ``start`` opens a state (the prompts prefilled
    once), each ``continue_`` appends tokens to named live trajectories and samples after them
    (running only the new tokens), ``close`` releases the state. The state is one that
    ``fastrl.rollout.branch.fork_trajectories`` can fork (``kv``, ``prompts``, ``history``,
    ``pending``, ``live``, ``first_logits``: ``fastrl.rollout.hf.MultiTurnState``). What uses it:
    the agents driver's KV-continuing token samplers (``fastrl.rollout.token_sampler``) and the
    fork path of tree rollouts (``fastrl.rollout.branch.sample_tree``).
    """

    multi_turn: ClassVar[bool]
    max_length: int | None

    def start(self, prompts: list[list[int]], *, group_size: int, sampling: SamplingConfig | None = None,
              prompt_seeds: Sequence[int] | None = None) -> Any:
        """Open a multi-turn state: trajectory ``i * group_size + j`` is sample ``j`` of prompt ``i``."""
        ...

    def continue_(self, state: Any, appended: Sequence[Sequence[int]], *, trajectories: Sequence[int] | None = None,
                  max_new_tokens: int | Sequence[int], seeds: Sequence[int] | None = None) -> list[Any]:
        """One turn: append ``appended[i]`` to trajectory ``trajectories[i]`` and sample up to
        ``max_new_tokens`` after it (``TurnOutput`` per trajectory); the others drop out."""
        ...

    def close(self, state: Any = None) -> None:
        """Release a state's keys/values."""
        ...


def supports_multi_turn(sampler: object) -> bool:
    """Whether ``sampler``'s class declares the multi-turn capability (``multi_turn = True``:
    :class:`MultiTurnSampler`). Read from the class, not the instance, so a wrapper that forwards
    attributes to a multi-turn sampler (but answers ``generate`` itself) does not claim it."""
    return getattr(type(sampler), "multi_turn", False) is True


def validate_prompts(prompts: object, *, group_size: object, vocab_size: int, max_length: int | None, max_new_tokens: int) -> list[list[int]]:
    """Reject bad requests before any work starts (ValueError naming what is wrong)."""
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        ids = [int(t) for t in p]
        if len(ids) == 0:
            raise ValueError(f"prompts[{i}] is empty")
        bad = [t for t in ids if t < 0 or t >= vocab_size]
        if bad:
            raise ValueError(f"prompts[{i}] has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        if max_length is not None and len(ids) + max_new_tokens > max_length:
            raise ValueError(
                f"prompts[{i}] has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it exceeds the model's "
                f"maximum length {max_length}"
            )
        out.append(ids)
    return out


def validate_prompt_seeds(prompt_seeds: Iterable[int] | None, count: int) -> list[int] | None:
    """``prompt_seeds`` as a list of ints, one per prompt (ValueError otherwise); None stays None."""
    if prompt_seeds is None:
        return None
    seeds = [int(s) for s in prompt_seeds]
    if len(seeds) != count:
        raise ValueError(f"prompt_seeds must have one seed per prompt ({count}), got {len(seeds)}")
    return seeds


def pack_batch(
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    completion_logp: list[torch.Tensor],
    group_size: int,
    pad_token_id: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``[B, T]`` training tensors from per-sample prompts and completions.

    ``prompt_ids`` has one entry per prompt; sample ``b`` belongs to prompt ``b // group_size``.
    Returns input_ids, attention_mask, response_mask, sampler_logp, group_ids.
    """
    B = len(completion_ids)
    starts = [len(prompt_ids[b // group_size]) for b in range(B)]
    lengths = [s + len(c) for s, c in zip(starts, completion_ids)]
    T = max(lengths)
    # one tensor from the padded rows and masks from the lengths: no per-row tensor ops
    input_ids = torch.tensor([prompt_ids[b // group_size] + list(completion_ids[b]) + [pad_token_id] * (T - lengths[b]) for b in range(B)],
                             dtype=torch.long).reshape(B, T)
    t = torch.arange(T)[None, :]
    attention_mask = (t < torch.tensor(lengths)[:, None]).long()
    response = (t >= torch.tensor(starts)[:, None]) & attention_mask.bool()
    response_mask = response.long()
    sampler_logp = torch.zeros(B, T, dtype=torch.float32)
    pieces = [completion_logp[b].float().reshape(-1) for b in range(B) if completion_ids[b]]
    if pieces:  # row-major order of the response positions = the rows' completions, concatenated
        sampler_logp[response] = torch.cat(pieces)
    group_ids = torch.arange(len(prompt_ids)).repeat_interleave(group_size)
    return input_ids, attention_mask, response_mask, sampler_logp, group_ids
