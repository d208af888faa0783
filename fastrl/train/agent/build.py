"""What an agent run (``fastrl train --env``) is built from, before its first step.

``build_agent(cfg, tokenizer, ...)`` resolves the environment (a built-in name or
``module:Class``; a class missing a method, a tool without type hints or docstring, a
spec naming nothing importable are ``InputError`` here), takes its rows (a built-in's
seeded row builder, the user's ``dataset``, or ``{"index": i}`` rows), starts the
environment workers (``EnvRuntime``), builds the ``ChatRenderer`` (a tools run with a
template that does not render tools is an ``InputError``) and resets one environment on the
first training row (a ``reset`` that fails, hangs or returns the wrong type is an
``InputError``): everything a user can get wrong fails before the first step.
``agent_scorer`` builds the run's ``TrajectoryScorer`` (``agent.score``): the ``--rewards``
functions in the reward pool's workers, probed on that row's first observation.

``warm_up_on_transcripts``: the supervised warm-up of a built-in environment on its oracle's
transcripts (``synthetic_transcripts``), laid out exactly as RL's trajectories
(``demonstration_sample``: loss on the policy turns only), until greedy episodes on
training rows succeed ``sft_target_accuracy`` of the time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import json

import torch

from fastrl.agents.batch import collate_samples
from fastrl.agents.driver import AgentConfig
from fastrl.agents.envs import BUILTIN_ENVS, resolve_environment, synthetic_transcripts
from fastrl.agents.render import ChatRenderer, demonstration_sample
from fastrl.agents.runtime import EnvRuntime
from fastrl.agents.tools import tool_schemas
from fastrl.errors import InputError
from fastrl.train.env_task import USER_ENV_ROWS
from fastrl.train.config import TrainConfig
from fastrl.train.ranks import Ranks
from fastrl.train.sft import ProbeSchedule, WarmupResult
from fastrl.workers import OK

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from fastrl.rollout.base import GroupSampler
    from fastrl.train.agent.evaluate import AgentEvaluator
    from fastrl.train.agent.score import TrajectoryScorer
    from fastrl.train.sft import WarmupState

__all__ = ["AgentSetup", "build_agent", "agent_prompts", "agent_evaluator", "agent_scorer", "warm_up_on_transcripts", "env_rows"]


@dataclass
class AgentSetup:
    """An agent run's environment side."""

    factory: Callable[[], Any]
    """Zero-argument environment factory (what the workers build)."""
    runtime: EnvRuntime
    renderer: ChatRenderer
    agent: AgentConfig
    train_rows: list[dict]
    eval_rows: list[dict]
    probe_prompt: list[int]
    """The first training row's prompt ids (the weight-sync probe's prompt)."""
    probe_messages: list[dict]
    """The first training row's first observation (the reward functions' probe prompt)."""

    def close(self) -> None:
        self.runtime.close()


def env_rows(cfg: TrainConfig, train_rows: Sequence[dict] | None, eval_rows: Sequence[dict] | None) -> tuple[list[dict], list[dict]]:
    """``(train, held-out)`` rows of an env run: given, ``dataset``'s, the built-in
    environment's seeded rows, or ``{"index": i}`` rows for a user's environment."""
    from fastrl.train.prompts import run_rows

    if train_rows is not None or cfg.dataset is not None:
        return run_rows(cfg, train_rows, eval_rows)
    if cfg.env in BUILTIN_ENVS:
        train, heldout = BUILTIN_ENVS[cfg.env].rows(num_train=cfg.task_train_size, num_heldout=cfg.task_eval_size, seed=cfg.seed)
    else:
        n_train = cfg.task_train_size or USER_ENV_ROWS[0]
        n_eval = cfg.task_eval_size or USER_ENV_ROWS[1]
        train = [{"index": i} for i in range(n_eval, n_eval + n_train)]
        heldout = [{"index": i} for i in range(n_eval)]
    if not train:
        raise InputError(f"--env {cfg.env}: no training rows")
    return train, heldout[: cfg.eval_prompts]


def build_agent(cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase, *, train_rows: Sequence[dict] | None = None,
                eval_rows: Sequence[dict] | None = None, max_length: int | None = None) -> AgentSetup:
    """The environment, its rows, workers and renderer, checked on a real row (module docstring).
    ``max_length``: the model's context; a trajectory limit past it is an ``InputError``."""
    agent = cfg.agent_config()
    if max_length is not None and agent.max_trajectory_tokens > max_length:
        raise InputError(f"max_trajectory_tokens={agent.max_trajectory_tokens} is longer than the model's context ({max_length} tokens)")
    options: dict[str, Any] = {}
    if cfg.env in BUILTIN_ENVS:
        options = {"call_format": cfg.env_call_format, "max_repeated_calls": cfg.env_max_repeated_calls or None}
    factory = resolve_environment(cfg.env, **options)
    probe = factory()
    try:
        tools = getattr(probe, "tools", None)
        schemas = tool_schemas(tools, owner=f"environment {cfg.env!r}") if tools else None
    finally:
        close = getattr(probe, "close", None)
        if callable(close):
            close()
    # hermes calls are shown to the model through the template's tools= (which must render them)
    renderer = ChatRenderer(tokenizer, tools=schemas if schemas and cfg.env_call_format == "hermes" else None)
    train, evals = env_rows(cfg, train_rows, eval_rows)
    runtime = EnvRuntime(factory, num_workers=cfg.env_workers, step_timeout_s=cfg.env_step_timeout,
                         trajectory_timeout_s=cfg.env_trajectory_timeout)
    try:
        reply = runtime.reset([(-1, train[0], cfg.seed)])[0]
        runtime.release([-1])
        if reply.status != OK:
            first = reply.message.strip().splitlines()[0] if reply.message else ""
            raise InputError(f"--env {cfg.env}: reset() failed on the first training row ({reply.status}): {first}")
        probe_prompt, probe_messages = renderer.prompt_ids(reply.value), [dict(m) for m in reply.value]
        if len(probe_prompt) >= agent.max_trajectory_tokens:
            raise InputError(f"--env {cfg.env}: the first row's prompt has {len(probe_prompt)} tokens, not less than "
                             f"max_trajectory_tokens={agent.max_trajectory_tokens}")
    except BaseException:
        runtime.close()
        raise
    return AgentSetup(factory=factory, runtime=runtime, renderer=renderer, agent=agent, train_rows=train, eval_rows=evals,
                      probe_prompt=probe_prompt, probe_messages=probe_messages)


def agent_prompts(cfg: TrainConfig, setup: AgentSetup, *, max_length: int | None, sharded: bool):
    """The run's ``prompts.Prompts`` for an env run: the batcher over the training rows (each
    row's identity is its JSON, so a resumed run checks it has the same rows), the probe
    prompt as the only encoded prompt (the weight-sync probe's), no encoded held-out prompts
    (the agent evaluator renders its own)."""
    from fastrl.train.prompts import Prompts
    from fastrl.train.data import PromptBatcher

    identities = [list(json.dumps(row, sort_keys=True, default=str).encode()) for row in setup.train_rows]
    batcher = PromptBatcher(setup.train_rows, identities, batch_size=cfg.prompts_per_step, group_size=cfg.group_size,
                            seed=cfg.seed, drop_last=sharded)
    return Prompts(train_rows=setup.train_rows, train_ids=[setup.probe_prompt], eval_rows=setup.eval_rows, eval_ids=[],
                   max_length=max_length, dropped=0, batcher=batcher)


def agent_scorer(cfg: TrainConfig, setup: AgentSetup, specs: Sequence[Any]) -> Any:
    """The run's ``TrajectoryScorer``: ``specs`` (the ``--rewards`` functions or ``Trainer``'s
    ``reward_functions``; none: the environment's outcome alone) in a ``RewardPool`` of
    ``reward_workers`` processes, checked on the first training row's first observation (a
    function that cannot be called, raises or returns the wrong count is an ``InputError``
    here). Close its ``rewards`` pool (when not None) with the run."""
    from fastrl.train.agent.score import TrajectoryScorer, reward_names
    from fastrl.train.rewards.pool import RewardPool

    pool = None
    if specs:
        pool = RewardPool(list(specs), weights=cfg.reward_weights, names=reward_names(specs), timeout_s=cfg.reward_timeout,
                          num_workers=cfg.reward_workers)
    scorer = TrajectoryScorer(rewards=pool, env_weight=cfg.env_reward_weight)
    try:
        scorer.validate(prompt=setup.probe_messages, row=setup.train_rows[0])
    except BaseException:
        if pool is not None:
            pool.close()
        raise
    return scorer


def agent_evaluator(cfg: TrainConfig, setup: AgentSetup, *, sampler: GroupSampler, ranks: Ranks,
                    scorer: TrajectoryScorer) -> AgentEvaluator:
    """An env run's ``contracts.Evaluator``: greedy held-out episodes (success is the
    environment's; ``scorer``'s functions add their held-out means)."""
    from fastrl.train.agent.evaluate import AgentEvaluator

    return AgentEvaluator(sampler=sampler, ranks=ranks, rows=setup.eval_rows, runtime=setup.runtime, renderer=setup.renderer,
                          agent=setup.agent, seed=cfg.seed, scorer=scorer)


def warm_up_on_transcripts(cfg: TrainConfig, policy: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, setup: AgentSetup, *,
                           ranks: Ranks, progress: bool, schedule: ProbeSchedule | None = None, resume: WarmupState | None = None,
                           pause: Callable[[], bool] | None = None) -> WarmupResult:
    """The supervised warm-up of a built-in environment (module docstring); returns its
    ``sft/...`` metrics and probes, the policy back in train mode. The probe plays greedy episodes with
    the HF sampler on the first ``sft_probe_rows`` training rows, when ``schedule`` says (its
    ``due`` / ``reached``; None: ``ProbeSchedule`` on ``sft_check_every``, ``sft_target_accuracy`` and
    ``sft_probe_sooner``, no probe without a target). Probing draws no random numbers, so it leaves the warm-up's
    steps as they are. ``resume`` (a paused warm-up's ``WarmupState``, its probes and the next one's step
    included) and ``pause`` as for ``fastrl.train.sft.sft_batches``."""
    from fastrl.rollout import HFGroupSampler
    from fastrl.train.agent.evaluate import AgentEvaluator
    from fastrl.train.run.progress import WarmupProgress
    from fastrl.train.sft import paused_with_probes, probe_when_due, sft_batches

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prober = AgentEvaluator(sampler=HFGroupSampler(policy, pad_token_id=pad_id), ranks=ranks, rows=[], runtime=setup.runtime,
                            renderer=setup.renderer, agent=setup.agent, seed=cfg.seed)
    success_rate = prober.success_rate

    if cfg.env not in BUILTIN_ENVS:
        raise InputError(f"sft_steps > 0 with --env {cfg.env}: a warm-up needs demonstrations, which exist for the built-in "
                         f"environments ({', '.join(BUILTIN_ENVS)}); set --sft_steps 0")
    pairs = synthetic_transcripts(cfg.env, setup.train_rows, call_format=cfg.env_call_format, seed=cfg.seed)
    samples = [demonstration_sample(setup.renderer, prompt, transcript) for prompt, transcript in pairs]
    longest = max(len(s.token_ids) for s in samples)
    if longest > setup.agent.max_trajectory_tokens:
        samples = [s for s in samples if len(s.token_ids) <= setup.agent.max_trajectory_tokens]
        if not samples:
            raise InputError(f"every warm-up transcript of {cfg.env} is longer than max_trajectory_tokens="
                             f"{setup.agent.max_trajectory_tokens} (the longest has {longest} tokens)")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    probe_rows = setup.train_rows[: cfg.sft_probe_rows]
    warm = WarmupProgress(cfg.sft_steps, target_accuracy=cfg.sft_target_accuracy, enabled=progress,
                          initial=resume.steps_done if resume is not None else 0)
    if schedule is None and cfg.sft_target_accuracy is not None:
        schedule = ProbeSchedule(cfg.sft_check_every, cfg.sft_target_accuracy, sooner_near_target=cfg.sft_probe_sooner)

    def probe() -> float:
        rate = success_rate(probe_rows)
        policy.train()
        return rate

    check, history = (None, [])
    if schedule is not None:
        check, history = probe_when_due(schedule, probe, on_probe=warm.on_probe, history=resume.probes if resume is not None else ())
        if resume is not None and resume.next_probe_at is not None:
            schedule.next_at = resume.next_probe_at

    try:
        with paused_with_probes(history, schedule):
            result = sft_batches(
                policy, len(samples), lambda picked: collate_samples([samples[i] for i in picked], pad_token_id=pad,
                                                                   answer_weight=cfg.sft_answer_weight),
                steps=cfg.sft_steps, lr=cfg.sft_lr, batch_size=cfg.sft_batch_size, seed=cfg.seed,
                warmup_steps=cfg.sft_warmup_steps, callback=check, on_step=warm.on_step, layout=cfg.sft_layout,
                resume=resume, pause=pause,
            )
    finally:
        warm.close()
    policy.train()
    return WarmupResult.of_run(result, history)
