"""What a run is built from: the policy, datasets, reference, critic, optimisers and the sampler.

Each builder takes the config and what it needs, and returns one object; the trainer calls
them in a fixed order (the order the global RNG is drawn in, so a seed gives one run).

Samplers are a registry (``SAMPLERS``): each entry declares what it needs instead of the
trainer testing names. A new sampler is one entry here (plus its class in
``fastrl/rollout/`` implementing ``GroupSampler``); ``TrainConfig.sampler`` takes the
registry's names.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from fastrl.errors import InputError

from fastrl.rollout.base import GroupSampler
from fastrl.train.config import TrainConfig
from fastrl.train.critic import ValueModel
from fastrl.train.data import model_context_length
from fastrl.train.reference_policy import OFFLOAD_FILE, ReferencePolicy
from fastrl.train.schedule import warmup_cosine
from fastrl.train.sft import WarmupResult

__all__ = ["SAMPLERS", "Optimizers", "SamplerContext", "SamplerSpec", "build_sampler", "sampler_spec"]


# ---------------------------------------------------------------------------- samplers
@dataclass(frozen=True)
class SamplerContext:
    """What a sampler may be built from."""

    cfg: TrainConfig
    policy: torch.nn.Module
    """The trainer's policy (sharded under torchrun)."""
    full_copy: torch.nn.Module | None
    """Under torchrun, the unsharded copy of the policy that the trainer refreshes after each update."""
    pad_token_id: int
    output_dir: Path
    max_length: int | None
    connected: Any = None
    """What the entry's ``connect`` returned (a server client), else None."""


@dataclass(frozen=True)
class SamplerSpec:
    """A registry entry: how to build a sampler and what it needs from the trainer."""

    build: Callable[[SamplerContext], GroupSampler]
    own_weights: bool
    """The sampler holds a copy of the weights of its own: the trainer pushes the policy into
    it (``update_weights``) before the first rollout and after every update. False: it runs
    the trainer's module (the policy, or under torchrun the trainer's full copy)."""
    torchrun: str | None = None
    """None: usable under torchrun; else the reason it is not (an error before any work)."""
    needs_url: bool = False
    """Takes ``sampler_url`` (a server shared by every rank)."""
    connect: Callable[[TrainConfig], Any] | None = None
    """Reached before any long work (a server: is it up, what does it serve); its result is
    ``SamplerContext.connected``."""
    push_on_start: bool = False
    """Its weights come from elsewhere (a server started from a model folder): the trainer
    pushes the policy's (after warm-up or resume) before the first rollout."""


VLLM_BLOCK_SIZE = 32
"""KV-cache block size of the in-process vLLM engine (tokens)."""

SERVER_CONNECT_TIMEOUT_S = 30.0
"""Longest wait for a vllm-server to answer its first request (at most ``sampler_timeout``)."""


def _hf(ctx: SamplerContext) -> GroupSampler:
    from fastrl.rollout import HFGroupSampler

    return HFGroupSampler(ctx.full_copy if ctx.full_copy is not None else ctx.policy, pad_token_id=ctx.pad_token_id,
                          decode=ctx.cfg.sampler_decode)


def _vllm(ctx: SamplerContext) -> GroupSampler:
    from fastrl.rollout import VLLMGroupSampler

    init = ctx.output_dir / "sampler_init"
    ctx.policy.save_pretrained(init, safe_serialization=True)
    return VLLMGroupSampler(str(init), block_size=VLLM_BLOCK_SIZE, max_model_len=ctx.max_length, seed=ctx.cfg.seed)


def _connect_server(cfg: TrainConfig) -> GroupSampler:
    from fastrl.rollout.remote import VLLMServerSampler

    return VLLMServerSampler(cfg.sampler_url, timeout=cfg.sampler_timeout, connect_timeout=min(SERVER_CONNECT_TIMEOUT_S, cfg.sampler_timeout))


SAMPLERS: dict[str, SamplerSpec] = {
    # the shared-prefix HF sampler on the policy module itself: no copy, no push
    "hf": SamplerSpec(build=_hf, own_weights=False),
    # an in-process vLLM engine from a saved copy of the policy
    "vllm": SamplerSpec(
        build=_vllm, own_weights=True,
        torchrun="sampler='vllm' (an engine inside the training process) is single-process only; under torchrun the ranks "
                 "share one engine through `fastrl vllm-server` (--sampler vllm-server URL), or each samples with sampler=hf",
    ),
    # one `fastrl vllm-server` shared by every rank; rank 0 uploads the weights
    "vllm-server": SamplerSpec(build=lambda ctx: ctx.connected, own_weights=True, needs_url=True, connect=_connect_server,
                               push_on_start=True),
}


def sampler_spec(name: str) -> SamplerSpec:
    if name not in SAMPLERS:
        raise InputError(f"sampler must be one of {sorted(SAMPLERS)}, got {name!r}")
    return SAMPLERS[name]


def build_sampler(spec: SamplerSpec, ctx: SamplerContext) -> GroupSampler:
    return spec.build(ctx)


def check_served_model(sampler: Any, *, cfg: TrainConfig, policy: torch.nn.Module, longest: int) -> None:
    """A server sampler serves the policy's architecture and takes the run's longest sequence."""
    served = getattr(sampler, "info", {}).get("model") or {}
    differ = [f"{k} {v!r} (policy: {getattr(policy.config, k, None)!r})" for k, v in served.items()
              if v != getattr(policy.config, k, None)]
    if differ:
        raise InputError(
            f"the vLLM server at {cfg.sampler_url} serves another architecture: {', '.join(differ)}; start it with "
            "the policy's model folder (`fastrl vllm-server --model DIR`)"
        )
    if sampler.max_model_len < longest:
        raise InputError(
            f"the vLLM server at {cfg.sampler_url} takes at most {sampler.max_model_len} tokens, this run needs "
            f"{longest} (longest prompt + max_new_tokens): restart it with --max-model-len {longest}"
        )


# ---------------------------------------------------------------------------- models and data
def device_of(name: str) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda[:N]`` (``TrainConfig.device``)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device={name!r} but CUDA is not available on this machine")
    return device


def load_policy(cfg: TrainConfig, *, model: torch.nn.Module | None, tokenizer: Any, resume_dir: Path | None,
                device: torch.device) -> tuple[Any, torch.nn.Module]:
    """``(tokenizer, policy)`` in train mode on ``device``: a resumed checkpoint's policy, the
    given model, the built-in tiny model, or ``cfg.model``."""
    import transformers

    if resume_dir is not None and model is None:
        # the checkpoint holds the policy (after warm-up and the steps so far)
        path = resume_dir / "policy"
        tok = tokenizer or transformers.AutoTokenizer.from_pretrained(path)
        policy = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return tok, policy.to(device).train()
    if model is not None:
        if tokenizer is None:
            raise InputError("a model passed to Trainer needs its tokenizer too (tokenizer=...)")
        if resume_dir is not None:  # continue from the checkpoint's weights, not the given ones
            saved = transformers.AutoModelForCausalLM.from_pretrained(resume_dir / "policy", dtype=torch.float32)
            model.load_state_dict(saved.state_dict())
        return tokenizer, model.to(device).train()
    if cfg.model is None:
        from fastrl.train.task import DefaultTask, char_tokenizer, tiny_model

        default = DefaultTask()
        tok = char_tokenizer()
        # an agent run's tiny model takes its longest trajectory
        positions = default.max_position_embeddings if cfg.env is None else cfg.max_trajectory_tokens
        policy = tiny_model(
            tok, hidden_size=cfg.model_hidden_size, layers=cfg.model_layers, heads=cfg.model_heads, arch=default.arch,
            max_position_embeddings=positions, seed=cfg.seed,
        )
        return tok, policy.to(device).train()
    tok = transformers.AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.model)
    policy = transformers.AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
    return tok, policy.to(device).train()


def load_rows(cfg: TrainConfig, train_rows: Sequence[dict] | None, eval_rows: Sequence[dict] | None) -> tuple[list[dict], list[dict]]:
    """``(train rows, held-out rows)``: given, the built-in task's, or from ``cfg.dataset``."""
    from fastrl.train import data as data_mod

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


def load_reference(policy: torch.nn.Module, *, path: Path, resume: bool, save: bool, device: torch.device,
                   offload: bool = False) -> ReferencePolicy:
    """The frozen reference policy: the policy at the start of RL, saved once to ``path`` so a
    resumed run keeps the same one. ``offload``: its weights stay in a file under ``path``
    between its passes (``fastrl.train.reference_policy``)."""
    import transformers

    if resume:
        if not (path / "config.json").exists():
            raise InputError(f"resume: the reference policy of this run is missing ({path})")
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    else:
        ref = copy.deepcopy(policy)
        if save:
            ref.save_pretrained(path, safe_serialization=True)
    restore = None
    if (path / "config.json").exists():  # the saved copy (every single-process run's main rank saves it)
        def restore() -> dict[str, torch.Tensor]:
            saved = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            return {name: p.detach() for name, p in saved.named_parameters()}
    return ReferencePolicy(ref, offload_path=path / OFFLOAD_FILE if offload else None, restore=restore)


def build_critic(cfg: TrainConfig, policy: torch.nn.Module, *, resume_dir: Path | None, device: torch.device) -> ValueModel:
    """PPO's critic: a single-process checkpoint's, ``critic_init``'s, or a copy of the policy
    with a new value head (a torchrun checkpoint's shards load after sharding)."""
    from fastrl.train.checkpoint import is_distributed_checkpoint

    if resume_dir is not None and not is_distributed_checkpoint(resume_dir):
        return ValueModel.load(resume_dir / "critic", device=device).train()
    if cfg.critic_init is not None:
        return ValueModel.load(cfg.critic_init, device=device).train()
    return ValueModel.from_policy(policy).train()


def shard_models(policy: torch.nn.Module, critic: ValueModel | None, *, param_dtype: torch.dtype | None) -> torch.nn.Module:
    """FSDP2 on the policy (and critic); returns a full, unsharded copy of the policy for the
    sampler. Generation runs a rank-dependent number of forwards (completions stop at
    different steps), which FSDP's per-forward all-gathers cannot follow, and a copy synced
    after each update costs one all-gather per step instead of one per token."""
    from fastrl.train import distributed as dist_mod

    full_copy = copy.deepcopy(policy).eval().requires_grad_(False)
    dist_mod.shard_causal_lm(policy, param_dtype=param_dtype)
    if critic is not None:
        dist_mod.shard_causal_lm(critic.body, param_dtype=param_dtype)
    return full_copy


@dataclass
class Optimizers:
    """AdamW and its warm-up + cosine schedule for the policy, and for the critic when there is one."""

    optimizer: torch.optim.Optimizer
    scheduler: Any
    critic_optimizer: torch.optim.Optimizer | None = None
    critic_scheduler: Any = None


FUSED_ADAMW_DEVICES = ("cpu", "cuda")
"""Devices of torch's fused AdamW kernel."""


def fused_adamw(params: Sequence[torch.Tensor]) -> bool:
    """Whether ``params`` take torch's fused AdamW: plain (not FSDP-sharded) floating-point
    tensors on a ``FUSED_ADAMW_DEVICES`` device. The fused kernel updates each parameter and
    both moments in one in-place pass; the default CPU path (one tensor at a time) forms
    ``sqrt(exp_avg_sq)`` and its quotient as two temporaries of the parameter's size (311 MB
    at the LM head and embedding of a V = 151,936, H = 256 model, at the step's memory peak)
    and CUDA's default (foreach) forms them for every parameter at once."""
    from torch.distributed.tensor import DTensor

    return bool(params) and all(
        p.device.type in FUSED_ADAMW_DEVICES and p.is_floating_point() and not isinstance(p, DTensor) for p in params
    )


def build_optimizers(cfg: TrainConfig, policy: torch.nn.Module, critic: ValueModel | None) -> Optimizers:
    total_updates = cfg.steps * cfg.ppo_epochs * cfg.mini_batches

    def adamw(params, lr: float) -> torch.optim.Optimizer:
        params = list(params)
        return torch.optim.AdamW(params, lr=lr, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay,
                                 fused=fused_adamw(params) or None)

    def schedule(opt: torch.optim.Optimizer) -> Any:
        return warmup_cosine(opt, total_steps=total_updates, warmup_steps=cfg.warmup_steps, min_lr_ratio=cfg.min_lr_ratio)

    optimizer = adamw(policy.parameters(), cfg.lr)
    out = Optimizers(optimizer, schedule(optimizer))
    if critic is not None:
        out.critic_optimizer = adamw(critic.parameters(), cfg.critic_lr)
        out.critic_scheduler = schedule(out.critic_optimizer)
    return out


def enable_checkpointing(models: Sequence[torch.nn.Module | None]) -> None:
    """Activation checkpointing per decoder layer (non-reentrant) on every model given."""
    for m in models:
        if m is None:
            continue
        if not getattr(m, "supports_gradient_checkpointing", False):
            raise InputError(f"{type(m).__name__} does not support gradient checkpointing; set activation_checkpointing=off")
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def check_shared_prefix_support(model: torch.nn.Module) -> None:
    from fastrl.ops.hf_packed import check_shared_prefix_support as check

    try:
        check(model)
    except ValueError as e:
        raise InputError(f"{e}; set shared_prefix=false (and prefix_tree=false) to train on padded rows") from None


def check_distributed(cfg: TrainConfig, ctx: Any) -> None:
    """What data parallel cannot run: a clear InputError on every rank before any work."""
    from fastrl.train import distributed as dist_mod

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


def warm_up(cfg: TrainConfig, policy: torch.nn.Module, tokenizer: Any, rows: Sequence[dict], *,
            score_fn: Callable[[list, list[str], list], list[float]], progress: bool, resume: Any = None,
            pause: Callable[[], bool] | None = None) -> WarmupResult:
    """The supervised warm-up (``sft_steps``; to ``sft_target_accuracy`` when set, probing with
    ``score_fn``); returns its ``sft/...`` metrics and probes, the policy back in train mode. ``progress``:
    show its progress (``WarmupProgress``). ``resume`` (a paused warm-up's ``WarmupState``) and
    ``pause`` as for ``fastrl.train.sft.sft_batches``."""
    from fastrl.train.progress import WarmupProgress
    from fastrl.train.sft import sft_to_target, sft_warmup

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
    batcher: Any


def encode_prompts(cfg: TrainConfig, tokenizer: Any, policy: torch.nn.Module, train_rows: list[dict], eval_rows: list[dict], *,
                   sharded: bool) -> Prompts:
    """Tokenise the prompts against the model's context (``max_prompt_length`` + ``max_new_tokens``)
    and batch the training ones (by prompt count or token budget; under torchrun no short batch)."""
    from fastrl.train import data as data_mod

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
    batcher = data_mod.PromptBatcher(
        train.rows, train.prompt_ids,
        batch_size=None if cfg.prompt_token_budget else cfg.prompts_per_step,
        token_budget=cfg.prompt_token_budget, group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
        seed=cfg.seed,
        drop_last=sharded,  # every rank takes an equal slice of each batch: no short batch at an epoch's end
    )
    return Prompts(train_rows=train.rows, train_ids=train.prompt_ids, eval_rows=eval_rows, eval_ids=eval_ids, max_length=max_length,
                   dropped=len(train.dropped), batcher=batcher)
