"""Supervised warm-up: teacher-forced cross-entropy on the completion tokens only.

Each example is ``encode_prompt(prompt) + answer tokens + eos``; the loss is minus the mean
log-prob of the answer and eos tokens over the batch (prompt and padding tokens carry no
loss). Log-probs come from ``fastrl.ops.hf.causal_lm_logprobs``: the LM head is applied
tile by tile from the hidden states, so the ``[tokens, vocab]`` logits are never built.

A batch runs in one of two layouts (``SFT_LAYOUTS``), with the same loss and gradients:
``padded`` rows ``[B, T]``, or ``trie``: the batch's sequences packed as the trie of their
tokens (``fastrl.ops.hf_tree``), every prefix two examples share run once -- demonstrations
of one environment share the system text, the question's template and much of the tool
call, so the trie runs a third of the padded tokens or less. ``auto`` takes the trie per
batch when it saves at least ``SFT_TRIE_MIN_SAVING`` of the padded tokens and the model
supports the shared-prefix forward.

A warm-up to a target accuracy probes greedy accuracy between steps (``ProbeSchedule``):
every ``check_every`` steps, or, with ``sooner_near_target``, at most that far apart and sooner
as the probe nears the target.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch

from fastrl.ops.hf import causal_lm_logprobs
from fastrl.train.data import check_rows, encode_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["encode_sft_example", "collate_sft", "sft_loss", "sft_warmup", "sft_batches", "sft_to_target", "SFT_LAYOUTS",
           "SFT_TRIE_MIN_SAVING", "TrieBatch", "trie_batch", "trie_sft_loss", "ProbeSchedule", "WarmupResult",
           "probe_when_due", "WarmupState", "WarmupPaused"]

SFT_LAYOUTS = ("auto", "padded", "trie")
"""How a warm-up batch runs (module docstring)."""
SFT_TRIE_MIN_SAVING = 0.5
"""``auto`` runs a batch as a trie when the trie has at most half the padded batch's tokens.
The trie's attention (a dense tree mask up to ``fastrl.ops.tree_attention.DENSE_MAX_TOKENS``
tokens, per-segment SDPA above) costs more per token than the padded causal kernel, so a
small saving does not pay. ``benchmarks/bench_sft_layout.py`` (batches of 64, two threads):
the trie's step is 2.55x faster on sql's demonstrations (saving 0.72) and 2.28x on frozenlake's
(0.72), 0.75x on the calculator's (0.20) and 0.47x on the default task's (0.31)."""


@dataclass(frozen=True)
class WarmupResult:
    """What a run's warm-up stage returns (``fastrl.train.assemble.warm_up``)."""

    metrics: dict[str, float]
    """Its ``sft/...`` metrics (empty without a warm-up)."""
    probes: tuple[tuple[int, float], ...] = ()
    """Each accuracy probe, ``(steps done, accuracy)``, in order (logged with the metrics)."""

    @classmethod
    def of_run(cls, run: dict[str, Any], probes: Sequence[tuple[int, float]] = ()) -> "WarmupResult":
        """From ``sft_batches``' (or ``sft_warmup``'s) dict and the probes: ``sft/steps``,
        ``sft/first_loss``, ``sft/final_loss``, ``sft/seconds``, ``sft/trie_steps`` and, when it
        probed, ``sft/probe_accuracy`` (the last probe's) and ``sft/probes`` (how many)."""
        metrics = {"sft/steps": float(run["steps"]), "sft/first_loss": float(run["first_loss"]),
                   "sft/final_loss": float(run["final_loss"]), "sft/seconds": float(run["seconds"]),
                   "sft/trie_steps": float(run["trie_steps"])}
        if probes:
            metrics["sft/probe_accuracy"] = float(probes[-1][1])
            metrics["sft/probes"] = float(len(probes))
        return cls(metrics=metrics, probes=tuple(probes))


WARMUP_SETTINGS = ("num_examples", "lr", "batch_size", "seed", "weight_decay", "warmup_steps", "schedule", "max_grad_norm",
                   "layout")
"""The settings a paused warm-up must continue with to be the uninterrupted one (``WarmupState.check``);
the number of steps may change (the constant-rate default does not depend on it)."""


@dataclass
class WarmupState:
    """Everything a warm-up paused at a step boundary needs to continue as if uninterrupted
    (``sft_batches``' ``resume``): the weights and AdamW's state, where it was in its seeded
    shuffled epochs (the permutation, the position in it, the generator's state), what it
    measured so far, the probes so far and when the next is due. ``global_rng`` (the process's
    python/numpy/torch generators) and ``settings`` are filled by whoever saves it."""

    steps_done: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    order: list[int]
    position: int
    generator: dict[str, Any]
    """``numpy.random.Generator.bit_generator.state`` of the epoch shuffler."""
    losses: list[float]
    tokens: int
    forward_tokens: int
    padded_tokens: int
    trie_steps: int
    seconds: float
    settings: dict[str, Any]
    probes: list[tuple[int, float]] = field(default_factory=list)
    next_probe_at: int | None = None
    """``ProbeSchedule.next_at`` when the warm-up probes, else None."""
    global_rng: dict[str, Any] | None = None

    def check(self, settings: dict[str, Any]) -> None:
        """Refuse to continue under other settings (``WARMUP_SETTINGS``): it would not be the same warm-up."""
        changed = [f"{k}={self.settings.get(k)!r} (now {settings.get(k)!r})" for k in WARMUP_SETTINGS
                   if self.settings.get(k) != settings.get(k)]
        if changed:
            from fastrl.errors import InputError

            raise InputError(f"resume: the warm-up checkpoint was written with other settings: {', '.join(changed)}; "
                             "resume with the run's own options, or start again with --overwrite true")


class WarmupPaused(BaseException):
    """A warm-up asked to stop (``sft_batches``' ``pause``) ended at a step boundary: ``state``
    continues it. A ``BaseException``: no ``except Exception`` on the way up swallows it."""

    def __init__(self, state: WarmupState):
        super().__init__(f"warm-up paused after {state.steps_done} steps")
        self.state = state


@dataclass
class ProbeSchedule:
    """When a warm-up to ``target`` probes its accuracy: every ``check_every`` steps. With
    ``sooner_near_target``, after a probe short of the target the next comes ``check_every``
    times the share of the target still missing, rounded up (at least 1 step): a probe at a third
    of the target comes ``2/3 * check_every`` steps later, one just under it on the next step.
    Near the target the success rate can climb by a third within 10 steps (sql's seed 0 from 0.49
    to 0.82, ``benchmarks/warmup_probe_curve.py``), and a fixed interval stops past it; but
    probing often, the warm-up stops at the first probe that noise lifts over the target, and on
    the built-in environments that did not help RL (``docs/agents.md``), so it is off by default.

    ``due(steps done)`` says whether to probe now; ``reached(steps done, accuracy)`` records
    a probe, sets the next and says whether the target is met."""

    check_every: int
    target: float
    sooner_near_target: bool = False
    next_at: int = field(init=False, default=0)
    """The steps done at which the next probe is due."""

    def __post_init__(self) -> None:
        if not isinstance(self.check_every, int) or isinstance(self.check_every, bool) or self.check_every < 1:
            raise ValueError(f"check_every must be an int >= 1, got {self.check_every!r}")
        if not self.target >= 0.0:
            raise ValueError(f"target must be >= 0, got {self.target!r}")
        self.next_at = self.check_every

    def due(self, steps_done: int) -> bool:
        return steps_done >= self.next_at

    def reached(self, steps_done: int, accuracy: float) -> bool:
        if accuracy >= self.target:
            return True
        if not self.sooner_near_target:
            self.next_at = steps_done + self.check_every
            return False
        missing = (self.target - max(accuracy, 0.0)) / self.target
        self.next_at = steps_done + max(1, math.ceil(self.check_every * missing - 1e-9))
        return False


def probe_when_due(schedule: ProbeSchedule, probe: Callable[[], float], *, on_probe: Callable[[int, float],
                   None] | None = None,
                   history: Sequence[tuple[int, float]] = ()) -> tuple[Callable[[int, float], bool], list[tuple[int, float]]]:
    """A warm-up's ``callback`` (``sft_batches``) that runs ``probe()`` (an accuracy) when
    ``schedule`` (a ``ProbeSchedule``, or anything with its ``due`` / ``reached``) says, calls
    ``on_probe(steps done, accuracy)`` and stops the warm-up once ``schedule.reached``; and the
    list it records each probe ``(steps done, accuracy)`` in (after ``history``: a resumed warm-up's probes)."""
    records: list[tuple[int, float]] = [(int(done), float(accuracy)) for done, accuracy in history]

    def check(step: int, loss: float) -> bool:
        if not schedule.due(step + 1):
            return False
        accuracy = probe()
        records.append((step + 1, accuracy))
        if on_probe is not None:
            on_probe(step + 1, accuracy)
        return schedule.reached(step + 1, accuracy)

    return check, records


@contextlib.contextmanager
def paused_with_probes(history: list[tuple[int, float]], schedule: ProbeSchedule | None):
    """Around a probing warm-up: a ``WarmupPaused`` leaving it carries the probes so far and
    the step the next is due at (``schedule.next_at``; None: no schedule)."""
    try:
        yield
    except WarmupPaused as paused:
        paused.state.probes = list(history)
        paused.state.next_probe_at = getattr(schedule, "next_at", None) if schedule is not None else None
        raise


def encode_sft_example(
    tokenizer: PreTrainedTokenizerBase, prompt: Any, answer: str, *, chat_template: bool | None = None
) -> tuple[list[int], int]:
    """``(prompt ids + answer ids + [eos], prompt length)`` for one example."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token: SFT teaches the model to stop with it")
    prompt_ids = encode_prompt(tokenizer, prompt, chat_template=chat_template)
    answer_ids = [int(t) for t in tokenizer(str(answer), add_special_tokens=False)["input_ids"]]
    return prompt_ids + answer_ids + [int(tokenizer.eos_token_id)], len(prompt_ids)


def collate_sft(examples: Sequence[tuple[list[int], int]], *, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` ``[B, T]`` and the loss mask ``[B, T-1]``
    (aligned with the log-prob of token ``t + 1``: 1 on answer and eos tokens)."""
    T = max(len(ids) for ids, _ in examples)
    B = len(examples)
    input_ids = torch.full((B, T), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(B, T, dtype=torch.long)
    loss_mask = torch.zeros(B, T - 1, dtype=torch.float32)
    for b, (ids, prompt_len) in enumerate(examples):
        input_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[b, : len(ids)] = 1
        loss_mask[b, prompt_len - 1 : len(ids) - 1] = 1.0  # log-prob index t scores token t + 1
    return input_ids, attention_mask, loss_mask


def sft_loss(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Minus the mean log-prob of the tokens ``loss_mask`` marks (0-dim fp32), weighted by
    it: a 0/1 mask gives the plain mean, a larger weight stresses its tokens."""
    logp = causal_lm_logprobs(model, input_ids, attention_mask)
    return -(logp * loss_mask).sum() / loss_mask.sum().clamp(min=1.0)


@dataclass(frozen=True)
class TrieBatch:
    """A warm-up batch packed as the trie of its sequences: ``tree`` scores each sequence
    from its first weighted token on; ``weights`` ``[M]`` is the loss weight of each of the
    tree's scored tokens (its ``sample_index``/``seq_pos`` order; 0 on the environment's
    tokens between policy turns)."""

    tree: Any
    weights: torch.Tensor
    padded_tokens: int
    """``B * T`` of the padded batch it replaces."""

    @property
    def tokens(self) -> int:
        """Tokens the forward runs (the trie's)."""
        return int(self.tree.input_ids.shape[1])


def _sequences(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    lengths = attention_mask.sum(dim=1)
    right_padded = torch.arange(attention_mask.shape[1], device=lengths.device)[None, :] < lengths[:, None]
    if not torch.equal(attention_mask != 0, right_padded):
        raise ValueError("the trie layout needs right-padded rows (every row's tokens first, then its padding)")
    return [row[:n] for row, n in zip(input_ids.tolist(), lengths.tolist())]


def trie_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor, *,
               sequences: list[list[int]] | None = None) -> TrieBatch:
    """The trie of a right-padded batch (``collate_sft``'s or ``collate_samples``' tensors;
    ``sequences``: its rows without padding, when already at hand), on ``input_ids``' device.
    ``loss_mask[b, c]`` weighs token ``c + 1`` of row ``b``; row ``b`` is scored from its
    first weighted token to its end (a row with no weight scores nothing)."""
    from fastrl.ops.tree_attention import PackedTree

    seqs = _sequences(input_ids, attention_mask) if sequences is None else sequences
    weighted = (loss_mask > 0).tolist()
    starts = []
    for seq, w in zip(seqs, weighted):
        first = next((c for c in range(len(seq) - 1) if w[c]), None)
        starts.append(len(seq) if first is None else first + 1)
    tree = PackedTree.from_sequences(seqs, score_start=starts, device=input_ids.device)
    weights = loss_mask.to(torch.float32)[tree.sample_index, tree.seq_pos - 1]
    return TrieBatch(tree=tree, weights=weights, padded_tokens=int(input_ids.numel()))


def trie_sft_loss(model: torch.nn.Module, batch: TrieBatch) -> torch.Tensor:
    """``sft_loss`` of the padded batch ``batch`` packs, from one forward over its trie (run it
    and its backward inside ``fastrl.ops.hf_packed.shared_prefix_attention_enabled(model)``)."""
    from fastrl.ops.hf_tree import tree_causal_lm_logprobs

    logp = tree_causal_lm_logprobs(model, batch.tree)
    return -(logp * batch.weights).sum() / batch.weights.sum().clamp(min=1.0)


def _supports_trie(model: torch.nn.Module) -> bool:
    from fastrl.ops.hf_packed import check_shared_prefix_support

    try:
        check_shared_prefix_support(model)
    except ValueError:
        return False
    return True


def _learning_rate(step: int, *, steps: int, lr: float, warmup_steps: int, schedule: str) -> float:
    """The rate of step ``step`` (0-based): linear warm-up, then constant or half-cosine decay."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def sft_warmup(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict],
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int = 0,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
    chat_template: bool | None = None,
    weight_decay: float = 0.0,
    warmup_steps: int = 0,
    schedule: str = "constant",
    max_grad_norm: float | None = 1.0,
    callback: Callable[[int, float], bool | None] | None = None,
    on_step: Callable[[int, float], None] | None = None,
    layout: str = "auto",
    resume: WarmupState | None = None,
    pause: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Teacher-forced SFT of ``model`` on ``rows`` (in place), for ``steps`` AdamW steps.

    Batches of ``batch_size`` examples walk through seeded shuffled epochs of the rows; the
    learning rate warms up linearly over ``warmup_steps`` then stays at ``lr``. Given the
    same model, rows and ``seed`` the run is deterministic on CPU. After the warm-up the rate
    stays at ``lr`` (``schedule="constant"``) or decays to 0 along a half cosine
    (``schedule="cosine"``, which ends the stage at a settled point rather than wherever
    the last high-rate step left it). ``callback(step, loss)`` is called after each step;
    when it returns True the warm-up stops there (e.g. once a probe accuracy is reached:
    the cosine schedule still runs over ``steps``). ``on_step(steps done, loss)`` is called
    after each step too, before ``callback`` (a progress bar). The model is left in eval mode.
    ``layout``: how each batch runs, one of ``SFT_LAYOUTS`` (module docstring).

    Returns ``{"losses": [per-step loss], "first_loss", "final_loss", "seconds",
    "tokens" (answer + eos tokens trained on), "steps" (taken: fewer than asked when the
    callback stopped the warm-up), "trie_steps" (steps run as a trie), "forward_tokens"
    (tokens the forwards ran), "padded_tokens" (what the padded batches would have run)}``.
    """
    for name, value, low in (("steps", steps, 0), ("batch_size", batch_size, 1), ("warmup_steps", warmup_steps, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite float > 0, got {lr!r}")
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"schedule must be 'constant' or 'cosine', got {schedule!r}")
    check_rows(rows, prompt_column=prompt_column)
    for i, row in enumerate(rows):
        if answer_column not in row:
            raise ValueError(f"row {i} has no answer column {answer_column!r}; its columns are {sorted(row)}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    examples = [
        encode_sft_example(tokenizer, row[prompt_column], row[answer_column], chat_template=chat_template) for row in rows
    ]
    return sft_batches(
        model, len(examples), lambda picked: collate_sft([examples[i] for i in picked], pad_token_id=pad_id), steps=steps, lr=lr,
        batch_size=batch_size, seed=seed, weight_decay=weight_decay, warmup_steps=warmup_steps, schedule=schedule,
        max_grad_norm=max_grad_norm, callback=callback, on_step=on_step, layout=layout, resume=resume, pause=pause,
    )


def sft_batches(
    model: torch.nn.Module,
    num_examples: int,
    collate: Callable[[list[int]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int = 0,
    weight_decay: float = 0.0,
    warmup_steps: int = 0,
    schedule: str = "constant",
    max_grad_norm: float | None = 1.0,
    callback: Callable[[int, float], bool | None] | None = None,
    on_step: Callable[[int, float], None] | None = None,
    layout: str = "auto",
    resume: WarmupState | None = None,
    pause: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """``sft_warmup``'s loop over any examples: ``collate(indices) -> (input_ids,
    attention_mask, loss_mask [B, T-1])`` of the examples picked (seeded shuffled epochs of
    ``range(num_examples)``); the rest as ``sft_warmup`` (the agent warm-up passes
    ``fastrl.agents.batch.collate_samples`` of demonstrations).

    ``pause()`` is asked after every step (after ``callback``): True ends the warm-up there
    with ``WarmupPaused``, whose ``state`` given back as ``resume`` (same settings, the model
    and the callback's own state as they were) continues it exactly: the same batches, learning
    rates and AdamW moments, so the same weights as a warm-up never paused. ``resume.steps_done``
    at or past ``steps`` ends it at once."""
    if num_examples < 1 and steps > 0:
        raise ValueError("the warm-up needs at least one example")
    if layout not in SFT_LAYOUTS:
        raise ValueError(f"layout must be one of {SFT_LAYOUTS}, got {layout!r}")
    if layout == "trie":
        from fastrl.ops.hf_packed import check_shared_prefix_support

        check_shared_prefix_support(model)
    trie_ok = layout == "trie" or (layout == "auto" and _supports_trie(model))
    settings = dict(num_examples=num_examples, lr=lr, batch_size=batch_size, seed=seed, weight_decay=weight_decay,
                    warmup_steps=warmup_steps, schedule=schedule, max_grad_norm=max_grad_norm, layout=layout)
    examples = range(num_examples)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    device = model.get_input_embeddings().weight.device
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(examples))
    position = 0
    losses: list[float] = []
    tokens = forward_tokens = padded_tokens = trie_steps = 0
    start, seconds_before = 0, 0.0
    if resume is not None:
        resume.check(settings)
        model.load_state_dict(resume.model)
        optimizer.load_state_dict(resume.optimizer)
        rng.bit_generator.state = resume.generator
        order, position = np.asarray(resume.order, dtype=np.int64), int(resume.position)
        losses = [float(v) for v in resume.losses]
        tokens, forward_tokens, padded_tokens = resume.tokens, resume.forward_tokens, resume.padded_tokens
        trie_steps, start, seconds_before = resume.trie_steps, int(resume.steps_done), float(resume.seconds)
    model.train()
    t0 = time.perf_counter()
    for step in range(start, steps):
        picked = []
        while len(picked) < batch_size:
            if position == len(order):
                order, position = rng.permutation(len(examples)), 0
            take = min(batch_size - len(picked), len(order) - position)
            picked.extend(order[position : position + take].tolist())
            position += take
        input_ids, attention_mask, loss_mask = collate(picked)
        input_ids, attention_mask, loss_mask = input_ids.to(device), attention_mask.to(device), loss_mask.to(device)
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(step, steps=steps, lr=lr, warmup_steps=warmup_steps, schedule=schedule)
        trie = _as_trie(input_ids, attention_mask, loss_mask, forced=layout == "trie") if trie_ok else None
        context = contextlib.nullcontext()
        if trie is not None:
            from fastrl.ops.hf_packed import shared_prefix_attention_enabled

            context = shared_prefix_attention_enabled(model)  # the forward's and the backward's
        with context:
            loss = sft_loss(model, input_ids, attention_mask, loss_mask) if trie is None else trie_sft_loss(model, trie)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"SFT loss is {loss.item()} at step {step}")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        trie_steps += trie is not None
        forward_tokens += input_ids.numel() if trie is None else trie.tokens
        padded_tokens += input_ids.numel()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        value = float(loss.detach())
        losses.append(value)
        tokens += int((loss_mask > 0).sum())
        if on_step is not None:
            on_step(step + 1, value)
        if callback is not None and callback(step, value) is True:
            break
        if pause is not None and step + 1 < steps and pause():
            optimizer.zero_grad(set_to_none=True)
            raise WarmupPaused(WarmupState(
                steps_done=step + 1, model={k: v.detach().clone() for k, v in model.state_dict().items()},
                optimizer=optimizer.state_dict(), order=order.tolist(), position=position, generator=rng.bit_generator.state,
                losses=list(losses), tokens=tokens, forward_tokens=forward_tokens, padded_tokens=padded_tokens,
                trie_steps=trie_steps, seconds=seconds_before + time.perf_counter() - t0, settings=settings))
    optimizer.zero_grad(set_to_none=True)  # the last step's gradients are not the next trainer's first step's
    model.eval()
    return {
        "losses": losses,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "seconds": seconds_before + time.perf_counter() - t0,
        "tokens": tokens,
        "steps": len(losses),
        "trie_steps": trie_steps,
        "forward_tokens": forward_tokens,
        "padded_tokens": padded_tokens,
    }


def _as_trie(input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor, *, forced: bool) -> TrieBatch | None:
    """The batch's trie when ``forced`` or when it saves ``SFT_TRIE_MIN_SAVING`` of the padded
    tokens, else None (the padded batch runs)."""
    from fastrl.ops.tree_attention import trie_size

    seqs = _sequences(input_ids, attention_mask)
    if not forced and trie_size(seqs) > (1.0 - SFT_TRIE_MIN_SAVING) * input_ids.numel():
        return None
    return trie_batch(input_ids, attention_mask, loss_mask, sequences=seqs)


def sft_to_target(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict],
    *,
    score_fn: Callable[[list, list[str], list], list[float]],
    target_accuracy: float,
    max_steps: int,
    check_every: int,
    probe_rows: int,
    max_new_tokens: int,
    lr: float,
    batch_size: int,
    seed: int = 0,
    warmup_steps: int = 0,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
    chat_template: bool | None = None,
    on_step: Callable[[int, float], None] | None = None,
    on_probe: Callable[[int, float], None] | None = None,
    layout: str = "auto",
    sooner_near_target: bool = False,
    resume: WarmupState | None = None,
    pause: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """``sft_warmup`` (constant rate) that stops once greedy accuracy on the first
    ``probe_rows`` training rows reaches ``target_accuracy`` (probed when ``ProbeSchedule``
    says: every ``check_every`` steps, or sooner near the target with ``sooner_near_target``), or
    after ``max_steps``. ``on_step(steps done, loss)`` is called after each step,
    ``on_probe(steps done, accuracy)`` after each check (a progress bar); ``layout`` as for ``sft_warmup``.

    Returns ``sft_warmup``'s dict plus ``"probe"``: ``[(steps done, probe accuracy)]``.
    ``pause`` / ``resume`` as for ``sft_batches``, the probes so far and the next one's step in the state.
    """
    from fastrl.rollout import HFGroupSampler
    from fastrl.train.evaluate import evaluate

    schedule = ProbeSchedule(check_every, target_accuracy, sooner_near_target=sooner_near_target)
    probe = list(rows[: max(1, probe_rows)])
    sampler = HFGroupSampler(model)
    check, history = probe_when_due(schedule, lambda: evaluate(
        model, tokenizer, probe, score_fn=score_fn, max_new_tokens=max_new_tokens, sampler=sampler,
        prompt_column=prompt_column, answer_column=answer_column, chat_template=chat_template,
    )["accuracy"], on_probe=on_probe, history=resume.probes if resume is not None else ())
    if resume is not None and resume.next_probe_at is not None:
        schedule.next_at = resume.next_probe_at

    with paused_with_probes(history, schedule):
        out = sft_warmup(
            model, tokenizer, rows, steps=max_steps, lr=lr, batch_size=batch_size, seed=seed, warmup_steps=warmup_steps,
            prompt_column=prompt_column, answer_column=answer_column, chat_template=chat_template, callback=check,
            on_step=on_step, layout=layout, resume=resume, pause=pause,
        )
    out["probe"] = history
    return out
