"""A ``Trainer``'s parts, stage by stage, in the order ``Trainer.__init__`` builds them.

Each stage takes the config and the named objects built before it and returns one; the
order is the order the global RNG is drawn in (so a seed gives one run) and the order the
checks run in (whatever a user can get wrong fails before any long work):

1. ``open_run``         ``RunSite``: threads, the processes (``Ranks``), the device, the
                        output folder locked and claimed, the resume point, the seed
2. ``load_policy``      ``LoadedPolicy``: the tokenizer and the policy, checked together
3. ``build_inputs``     ``RunInputs``: what the run trains on, its encoded prompts and their
                        batcher (an env run's environment side too, checked on a real row)
4. ``connect_sampler``  a shared server's client, checked against the policy (else None)
5. ``build_scoring``    ``Scoring``: the reward pool and the scorers, checked on real rows
6. ``warm_up``          ``WarmupResult``: the supervised warm-up's ``sft/...`` metrics and
                        probes (none on resume)
7. ``build_models``     ``Models``: activation checkpointing, reference, critic, FSDP,
                        optimisers, what a checkpoint holds
8. ``open_sampler``     the sampler (after the resume, so it starts from the restored weights)
9. ``build_loop``       ``Loop``: the step's collector (``collectors.make_collector``) and the
                        held-out evaluator (``contracts``: what the loop asks of each)

Between 7 and 8 the trainer makes its KL controller and layout and restores a resumed
run's state. The builders' bodies live in the rooms of what they build (``policy.py``,
``prompts.py``, ``samplers.py``, ``reference_policy.py``, ``critic.py``, ``optimizers.py``,
``warmup.py``, ``distributed.py``) and, for ``--env``, the agent wing (``agent/build.py``); a
stage here picks which to call and checks what comes back. One name, one meaning: the stage
``load_policy`` calls ``policy.load_model``; the stage ``warm_up`` calls
``warmup.warm_up_on_answers`` or ``agent.build.warm_up_on_transcripts``; ``RunInputs`` is not a
task (``task.DefaultTask`` and ``env_task.EnvTask`` are the built-in tasks' defaults).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from fastrl.errors import InputError
from fastrl.rollout.base import GroupSampler, SamplingConfig
from fastrl.train import distributed as dist_mod
from fastrl.train import seeds
from fastrl.train.agent import build as agent_build
from fastrl.train.agent.build import AgentSetup
from fastrl.train.run.checkpoint import RunCheckpoint, claim_output_dir, resolve_resume
from fastrl.train.collectors import make_collector
from fastrl.train.config import TrainConfig
from fastrl.train.contracts import Collector, Evaluator
from fastrl.train.critic import ValueModel, build_critic
from fastrl.train.data import model_context_length
from fastrl.train.evaluate import HeldOutEvaluator
from fastrl.train.run.heap import maps_large_blocks_for, mmap_large_blocks
from fastrl.train.optimizers import Optimizers, build_optimizers
from fastrl.train.policy import check_shared_prefix_support, device_of, enable_checkpointing, load_model
from fastrl.train.prompts import Prompts, encode_prompts, run_rows
from fastrl.train.ranks import Ranks
from fastrl.train.reference_policy import ReferencePolicy, load_reference, offload_reference
from fastrl.train.rundir import RunDirectoryLock, lock_run_directory
from fastrl.train.samplers import SamplerContext, SamplerSpec, build_sampler, check_served_model, sampler_spec
from fastrl.train.score import GroupScorer
from fastrl.train.run.threads import ThreadGovernor
from fastrl.train.sft import WarmupPaused, WarmupResult
from fastrl.train.warmup import warm_up_on_answers
from fastrl.train.run.warmup_checkpoint import is_warmup_checkpoint, load_warmup_checkpoint, save_warmup_checkpoint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from fastrl.train.agent.score import TrajectoryScorer
    from fastrl.train.distributed import DistContext
    from fastrl.train.run.interrupt import StopRequests
    from fastrl.train.rewards.pool import RewardPool


__all__ = [
    "AUTO_CHECKPOINTING_TOKENS", "LoadedPolicy", "Loop", "Models", "RunInputs", "RunSite", "Scoring", "build_inputs",
    "build_loop", "build_models", "build_scoring", "connect_sampler", "load_policy", "open_run", "open_sampler",
    "uses_activation_checkpointing", "warm_up",
]

AUTO_CHECKPOINTING_TOKENS = 2048
"""activation_checkpointing=auto turns it on for trajectories at least this long."""


# ---------------------------------------------------------------------------- 1. the run's place
@dataclass
class RunSite:
    """Where a run trains: its processes, its device and its output folder."""

    ranks: Ranks
    out: Path
    run_lock: RunDirectoryLock | None
    """Rank 0's lock on ``out`` (one run per output folder); None on the other ranks."""
    resume_dir: Path | None
    """The checkpoint this run continues from (``resume``), else None."""
    autocast_dtype: torch.dtype | None
    """bf16 autocast around every forward (``dtype``), else None."""
    warmup_dir: Path | None = None
    """The paused warm-up's checkpoint this run continues (``resume`` found one, no RL checkpoint yet), else None."""
    threads: ThreadGovernor | None = None
    """What keeps torch's CPU threads at the free cores while the run goes on (``set_threads``), else None."""

    def release(self) -> None:
        """What the run holds of the machine, let go: the output folder's lock and the thread governor."""
        if self.run_lock is not None:
            self.run_lock.release()
        if self.threads is not None:
            self.threads.close()

    @property
    def device(self) -> torch.device:
        return self.ranks.device

    @property
    def is_main(self) -> bool:
        return self.ranks.is_main


def open_run(cfg: TrainConfig, *, run_files: Sequence[str]) -> RunSite:
    """Join the process group (torchrun; refusing on every rank what data parallel cannot
    run), lock and claim ``output_dir`` (``run_files``: what an earlier run's outputs are),
    seed the global RNG. Every rank waits until rank 0 has claimed the folder. First, a model
    or dataset named by a hub id that is not here and cannot be fetched is refused in one line
    (``fastrl.train.run.hub``)."""
    from fastrl.train.run.hub import check_run_sources

    check_run_sources(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    ranks = Ranks.join(cfg.device, local_device=device_of)
    if ranks.sharded:
        check_distributed(cfg, ranks.ctx)
    out = Path(cfg.output_dir)
    run_lock = lock_run_directory(out) if ranks.is_main else None
    out.mkdir(parents=True, exist_ok=True)
    autocast_dtype = torch.bfloat16 if cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and ranks.device.type == "cuda") else None
    torch.manual_seed(cfg.seed)
    resumed = resolve_resume(cfg.resume, cfg.output_dir) if cfg.resume else None
    warmup_dir = resumed if resumed is not None and is_warmup_checkpoint(resumed) else None
    if resumed is None and ranks.is_main:
        claim_output_dir(out, names=run_files, overwrite=cfg.overwrite)
    ranks.barrier()  # no rank writes into output_dir before rank 0 has claimed it
    return RunSite(ranks=ranks, out=out, run_lock=run_lock, resume_dir=None if warmup_dir is not None else resumed,
                   autocast_dtype=autocast_dtype, warmup_dir=warmup_dir)


def check_distributed(cfg: TrainConfig, ctx: DistContext) -> None:
    """What data parallel cannot run: a clear InputError on every rank before any work."""
    # first, so every later check sees the same config on every rank
    ctx.check_same("configuration", dist_mod.config_fingerprint(cfg))
    world = ctx.world_size
    refusal = sampler_spec(cfg.sampler).torchrun
    if refusal is not None:
        raise InputError(refusal)
    if cfg.env is not None:
        raise InputError("--env (agent training) runs in one process for now; start it without torchrun")
    if cfg.prompt_token_budget is not None:
        raise InputError("prompt_token_budget gives batches of varying prompt counts; under torchrun use prompts_per_step")
    if cfg.prompts_per_step % world:
        raise InputError(
            f"prompts_per_step={cfg.prompts_per_step} is not divisible by the world size {world}: every rank samples "
            f"whole groups of an equal share of the prompts (use a multiple of {world})"
        )
    per_rank = cfg.prompts_per_step // world
    if per_rank < cfg.mini_batches:
        raise InputError(
            f"mini_batches={cfg.mini_batches} but each of the {world} ranks has only {per_rank} prompts per step; "
            f"raise prompts_per_step to at least {world * cfg.mini_batches}"
        )


def set_threads(cfg: TrainConfig, site: RunSite, policy: torch.nn.Module) -> None:
    """torch's intra-op threads: ``--threads`` when given (set in ``open_run``), else
    ``OMP_NUM_THREADS`` when set, else the rule of ``fastrl.train.run.threads`` (the free cores) on
    this machine, kept true while the run goes on by a ``ThreadGovernor`` on the policy's
    forward (``site.threads``; ``site.release`` stops it); said on rank 0."""
    from fastrl.train.run.threads import (THREADS_ENV, ThreadGovernor, core_ids, machine_threads, others_busy_reader,
                                          threads_from_environment)

    choice = machine_threads(parameters=sum(p.numel() for p in policy.parameters()), device_type=site.device.type)
    given, source = cfg.threads, "--threads"
    if given is None and threads_from_environment() is not None:
        given, source = threads_from_environment(), THREADS_ENV
        torch.set_num_threads(given)
    if given is None and choice.threads is not None:
        torch.set_num_threads(choice.threads)
        cores = core_ids()
        reader = others_busy_reader(cores)
        if reader is not None:
            site.threads = ThreadGovernor(cores=len(cores), threads=choice.threads, read_others=reader)
            site.threads.attach(policy)
    if site.is_main:
        print(f"fastrl train: {choice.describe(given=given, source=source)}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- 2. the policy
@dataclass
class LoadedPolicy:
    """The tokenizer and the policy module (train mode, on the run's device)."""

    tokenizer: PreTrainedTokenizerBase
    module: torch.nn.Module
    builtin: bool
    """The built-in tiny model (no model given or named)."""


def load_policy(cfg: TrainConfig, site: RunSite, *, model: torch.nn.Module | None,
                tokenizer: PreTrainedTokenizerBase | None) -> LoadedPolicy:
    """``policy.load_model`` (a resumed checkpoint's, the given model, the built-in one or
    ``cfg.model``), checked against its tokenizer and, for packed layouts, its attention. A
    CPU policy large enough for it gets ``mmap_large_blocks`` (``fastrl.train.run.heap``: freed
    activations leave the process instead of staying resident)."""
    from fastrl.train.data import check_tokenizer_matches_model

    tok, policy = load_model(cfg, model=model, tokenizer=tokenizer, resume_dir=site.resume_dir, device=site.device)
    check_tokenizer_matches_model(tok, policy)
    set_threads(cfg, site, policy)
    if cfg.shared_prefix or cfg.prefix_tree is True:
        check_shared_prefix_support(policy)
    parameter_bytes = sum(p.numel() * p.element_size() for p in policy.parameters())
    if maps_large_blocks_for(device_type=site.device.type, parameter_bytes=parameter_bytes):
        mmap_large_blocks()
    return LoadedPolicy(tokenizer=tok, module=policy, builtin=model is None and cfg.model is None)


# ---------------------------------------------------------------------------- 3. the task
@dataclass
class RunInputs:
    """What the run trains on: its prompts, and an env run's environment side."""

    prompts: Prompts
    agent: AgentSetup | None
    """``fastrl train --env``'s environments, rows and renderer; None for a single-turn run."""

    @property
    def probe_prompt(self) -> list[int]:
        """The weight-sync probe's prompt: the first training prompt."""
        return self.prompts.train_ids[0]

    def longest(self, cfg: TrainConfig, *, held_out: bool) -> int:
        """The run's longest sequence: its longest training prompt (with ``held_out``, or
        held-out prompt) + ``max_new_tokens``; an env run's ``max_trajectory_tokens``."""
        if self.agent is not None:
            return cfg.max_trajectory_tokens
        ids = [*self.prompts.train_ids, *self.prompts.eval_ids] if held_out else self.prompts.train_ids
        return max(len(p) for p in ids) + cfg.max_new_tokens


def build_inputs(cfg: TrainConfig, site: RunSite, policy: LoadedPolicy, *, train_rows: Sequence[dict] | None,
                 eval_rows: Sequence[dict] | None) -> RunInputs:
    """An env run's ``AgentSetup`` and its prompts (``agent.build``), else the rows encoded
    against the model's context (``prompts.encode_prompts``)."""
    sharded = site.ranks.sharded
    if cfg.env is None:
        prompts = encode_prompts(cfg, policy.tokenizer, policy.module, *run_rows(cfg, train_rows, eval_rows), sharded=sharded)
        return RunInputs(prompts=prompts, agent=None)
    context = model_context_length(policy.module)
    agent = agent_build.build_agent(cfg, policy.tokenizer, train_rows=train_rows, eval_rows=eval_rows, max_length=context)
    return RunInputs(prompts=agent_build.agent_prompts(cfg, agent, max_length=context, sharded=sharded), agent=agent)


# ---------------------------------------------------------------------------- 4. a sampler to reach
def connect_sampler(cfg: TrainConfig, spec: SamplerSpec, policy: LoadedPolicy, inputs: RunInputs) -> GroupSampler | None:
    """A sampler that must be reached (a shared server): reachable and serving this
    architecture at this length before any long work. None for an in-process sampler."""
    if spec.connect is None:
        return None
    connected = spec.connect(cfg)
    check_served_model(connected, cfg=cfg, policy=policy.module, longest=inputs.longest(cfg, held_out=True))
    return connected


# ---------------------------------------------------------------------------- 5. rewards
@dataclass
class Scoring:
    """How a step's samples are scored."""

    rewards: RewardPool | None
    """The ``RewardPool`` (worker processes; closed with the run), or None: an env run without functions."""
    scorer: GroupScorer
    """The reward pool's call for a batch of single-turn samples (and the warm-up's probe)."""
    agent_scorer: TrajectoryScorer | None
    """An env run's ``TrajectoryScorer`` (the environment's outcome and the functions); None single-turn."""


def build_scoring(cfg: TrainConfig, policy: LoadedPolicy, inputs: RunInputs,
                  reward_functions: Sequence[Callable | str] | None) -> Scoring:
    """The reward pool on ``reward_functions`` (else ``cfg.rewards``), checked on real rows
    before any training work (an env run's: ``agent.build.agent_scorer``)."""
    from fastrl.train.rewards.pool import RewardPool

    specs = list(reward_functions) if reward_functions is not None else list(cfg.rewards)
    agent_scorer = None
    if inputs.agent is None:
        rewards = RewardPool(specs, weights=cfg.reward_weights, timeout_s=cfg.reward_timeout, num_workers=cfg.reward_workers)
    else:
        agent_scorer = agent_build.agent_scorer(cfg, inputs.agent, specs)
        rewards = agent_scorer.rewards
    scorer = GroupScorer(tokenizer=policy.tokenizer, rewards=rewards, prompt_column=cfg.prompt_column)
    if inputs.agent is None:
        probe_rows = inputs.prompts.train_rows[: min(2, len(inputs.prompts.train_rows))]
        rewards.validate([r[cfg.prompt_column] for r in probe_rows], ["" for _ in probe_rows], scorer.columns(probe_rows))
    return Scoring(rewards=rewards, scorer=scorer, agent_scorer=agent_scorer)


# ---------------------------------------------------------------------------- 6. the warm-up
def warm_up(cfg: TrainConfig, site: RunSite, policy: LoadedPolicy, inputs: RunInputs, scoring: Scoring, *,
            stop: StopRequests | None = None) -> WarmupResult:
    """The supervised warm-up (``sft_steps``; not on an RL resume: the checkpoint has the warmed-up
    policy): an env run's on its oracle's transcripts, else on the rows' answers. Returns its
    ``sft/...`` metrics and probes (empty without one). Under torchrun every rank ran the same seeded
    warm-up, and rank 0's weights make them bitwise equal.

    ``stop`` (``fastrl.train.run.interrupt.StopRequests``): a first signal during the warm-up ends it
    at the next step boundary: its state (``fastrl.train.run.warmup_checkpoint``, the process's RNG
    states included) is saved and ``RunInterrupted`` names it. A run resumed from that checkpoint
    (``site.warmup_dir``) continues the warm-up as if uninterrupted."""
    from fastrl.train.run.checkpoint import rng_state, set_rng_state
    from fastrl.train.run.interrupt import RunInterrupted

    result = WarmupResult(metrics={})
    if site.resume_dir is not None or (not cfg.sft_steps and site.warmup_dir is None):
        return result  # (a stopped warm-up resumed with sft_steps=0 ends at once, with its weights)
    progress = cfg.progress and site.is_main
    resume = None
    if site.warmup_dir is not None:
        resume = load_warmup_checkpoint(site.warmup_dir)
        try:
            policy.module.load_state_dict(resume.model)
        except RuntimeError as error:  # another model than the one whose warm-up stopped
            first = str(error).strip().splitlines()[-1].strip()
            raise InputError(f"resume: {site.warmup_dir}'s weights do not fit this run's model ({first}); resume with the "
                             "run's own --model, or start again with --overwrite true") from None
        if resume.global_rng is not None:
            set_rng_state(resume.global_rng)

    agreed = [0]  # the signal the warm-up stops for: under torchrun the largest any rank saw, so every rank stops at one step

    def pause() -> bool:
        signum = torch.tensor([float(stop.signum or 0)], dtype=torch.float64)
        agreed[0] = int(site.ranks.max(signum)[0]) if site.ranks.sharded else int(signum[0])
        return agreed[0] != 0

    run = dict(progress=progress, resume=resume, pause=pause if stop is not None else None)
    if stop is not None:
        stop.deferring = True  # a first signal from now on ends the warm-up at a step boundary
    try:
        if inputs.agent is not None:
            result = agent_build.warm_up_on_transcripts(cfg, policy.module, policy.tokenizer, inputs.agent, ranks=site.ranks, **run)
        else:
            result = warm_up_on_answers(cfg, policy.module, policy.tokenizer, inputs.prompts.train_rows,
                                        score_fn=scoring.scorer.answer_score, **run)
    except WarmupPaused as paused:
        paused.state.global_rng = rng_state()
        saved = save_warmup_checkpoint(site.out, paused.state) if site.is_main else None
        site.ranks.barrier()
        raise RunInterrupted(agreed[0], checkpoint=saved, step=None) from None
    finally:
        if stop is not None:
            stop.deferring = False
    if site.ranks.sharded:
        dist_mod.broadcast_module(policy.module)
    return result


# ---------------------------------------------------------------------------- 7. the trained models
def uses_activation_checkpointing(mode: str, *, longest: int) -> bool:
    """``activation_checkpointing``: ``layer`` always, ``auto`` for sequences of at least
    ``AUTO_CHECKPOINTING_TOKENS``, ``off`` never."""
    return mode == "layer" or (mode == "auto" and longest >= AUTO_CHECKPOINTING_TOKENS)


@dataclass
class Models:
    """What the update trains and compares against, and what a checkpoint holds."""

    checkpointing: bool
    """Activation checkpointing per decoder layer (``uses_activation_checkpointing``)."""
    reference: ReferencePolicy | None
    """The frozen reference (with a KL term), else None."""
    critic: ValueModel | None
    """PPO's critic, else None."""
    full_copy: torch.nn.Module | None
    """Under torchrun: the full copy of the sharded policy (the HF sampler runs it), else None."""
    optimizers: Optimizers
    checkpoint: RunCheckpoint


def build_models(cfg: TrainConfig, site: RunSite, policy: LoadedPolicy, inputs: RunInputs) -> Models:
    """The reference (saved once under ``out/reference``), the critic, FSDP2 sharding under
    torchrun, the optimisers and schedules, activation checkpointing on what is trained."""
    checkpointing = uses_activation_checkpointing(cfg.activation_checkpointing, longest=inputs.longest(cfg, held_out=False))
    if cfg.offload_activations and not checkpointing:
        raise ValueError("offload_activations offloads the layer inputs that checkpointing keeps: set activation_checkpointing=layer")
    device, sharded, module = site.device, site.ranks.sharded, policy.module
    reference = None
    if cfg.uses_reference:
        reference = load_reference(module, path=site.out / "reference", resume=site.resume_dir is not None, save=site.is_main,
                                   device=device, offload=offload_reference(cfg.reference_offload, device=device, sharded=sharded))
    critic = build_critic(cfg, module, resume_dir=site.resume_dir, device=device) if cfg.uses_critic else None
    full_copy = None
    if sharded:
        full_copy = dist_mod.shard_models(module, critic.body if critic is not None else None, param_dtype=site.autocast_dtype if device.type == "cuda" else None)
    opt = build_optimizers(cfg, module, critic)
    checkpoint = RunCheckpoint(policy=module, optimizer=opt.optimizer, scheduler=opt.scheduler, critic=critic,
                               critic_optimizer=opt.critic_optimizer, critic_scheduler=opt.critic_scheduler)
    if checkpointing:
        enable_checkpointing([module, critic.body if critic is not None else None])
    return Models(checkpointing=checkpointing, reference=reference, critic=critic, full_copy=full_copy, optimizers=opt,
                  checkpoint=checkpoint)


# ---------------------------------------------------------------------------- 8. the sampler
def open_sampler(cfg: TrainConfig, spec: SamplerSpec, site: RunSite, policy: LoadedPolicy, inputs: RunInputs, models: Models,
                 connected: GroupSampler | None) -> GroupSampler:
    """The registry entry's sampler (``samplers.SAMPLERS``) on the policy (under torchrun its
    full copy), or the server ``connect_sampler`` reached."""
    return build_sampler(spec, SamplerContext(
        cfg=cfg, policy=policy.module, full_copy=models.full_copy, pad_token_id=policy.tokenizer.pad_token_id,
        output_dir=site.out, max_length=inputs.prompts.max_length, connected=connected,
    ))


# ---------------------------------------------------------------------------- 9. the loop's collector and evaluator
@dataclass
class Loop:
    """The two objects the loop drives: each step's rollouts, and the held-out evaluation."""

    collector: Collector
    """``GroupCollector``, ``TreeCollector``, ``AsyncCollector``, ``AgentCollector``, ``AgentTreeCollector``."""
    evaluator: Evaluator
    """``HeldOutEvaluator`` or an env run's ``AgentEvaluator``; called with no argument."""


def _prompt_seeds(sampling: SamplingConfig, first: int, count: int) -> list[int] | None:
    """One sampling seed per prompt from its index in the whole (all-rank) batch."""
    return seeds.prompt_seeds(sampling.seed, first, count)


def build_loop(cfg: TrainConfig, site: RunSite, policy: LoadedPolicy, inputs: RunInputs, scoring: Scoring, models: Models, *,
               sampler: GroupSampler) -> Loop:
    """The step's collector (``collectors.make_collector``: single-turn, tree, async or agent;
    with ``async_steps`` its sampler process forked now from the current weights) and the
    evaluator: an env run's ``AgentEvaluator``, else the ``HeldOutEvaluator`` over the encoded
    held-out prompts."""
    pad_token_id = policy.tokenizer.pad_token_id
    collector = make_collector(cfg, batcher=inputs.prompts.batcher, ranks=site.ranks, scorer=scoring.scorer, agent=inputs.agent,
                               agent_scorer=scoring.agent_scorer,
                               weights=models.full_copy if models.full_copy is not None else policy.module,
                               pad_token_id=pad_token_id, device=site.device, resume_dir=site.resume_dir)
    if inputs.agent is not None:
        evaluator: Evaluator = agent_build.agent_evaluator(cfg, inputs.agent, sampler=sampler, ranks=site.ranks,
                                                           scorer=scoring.agent_scorer)
    else:
        evaluator = HeldOutEvaluator(
            sampler=sampler, scorer=scoring.scorer, ranks=site.ranks, rows=inputs.prompts.eval_rows,
            prompt_ids=inputs.prompts.eval_ids, max_new_tokens=cfg.max_new_tokens, pass_k=cfg.pass_k,
            temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, seed=cfg.seed, prompt_seeds=_prompt_seeds,
        )
    return Loop(collector=collector, evaluator=evaluator)
