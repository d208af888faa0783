"""The lean RL loop. One step, top to bottom:

1. prompts      ``PromptBatcher`` (by prompt count or token budget; resumable position)
2. rollout      ``GroupSampler.generate`` (HF shared-prefix sampler, or vLLM)
3. rewards      ``RewardPool.score`` (TRL-signature functions in a process pool with hard
                time limits); DAPO's dynamic sampling drops all-equal groups and refills
4. log-probs    old (skipped when the update is exactly on-policy), reference (only with a
                KL term) -- ``causal_lm_logprobs``: hidden states + LM head, no logits
5. advantages   ``group_advantages`` or, for PPO, critic values + ``gae``
6. update       ppo_epochs x mini-batches x micro-batches (token budget); the loss uses the
                mini-batch's global token/sequence counts, so the update does not depend on
                the micro-batch split; gradient clipping; AdamW; warm-up + cosine
7. weight sync  ``update_weights`` to the sampler, then a probe: the sampler's log-probs of
                a fixed greedy sequence must equal the trainer's
8. metrics, held-out evaluation, checkpoints

Every number is computed by a fastrl op; this file only moves tensors between them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from fastrl.errors import InputError
from fastrl.ops import PackedLayout, gae, group_advantages, kl_penalty, masked_whiten, policy_loss, value_loss
from fastrl.ops.hf import causal_lm_logprobs
from fastrl.rollout import HFGroupSampler, SamplingConfig
from fastrl.rollout.base import RolloutBatch, RolloutStats
from fastrl.train import distributed as dist_mod
from fastrl.train.checkpoint import (
    checkpoint_dir,
    is_distributed_checkpoint,
    load_checkpoint_state,
    load_distributed_checkpoint,
    save_distributed_checkpoint,
    resolve_resume,
    save_checkpoint,
    set_rng_state,
)
from fastrl.train.config import TrainConfig
from fastrl.train.critic import ValueModel, explained_variance
from fastrl.train.faults import TrainingDivergedError, divergence_message
from fastrl.train.metrics import MetricsLogger, histogram, peak_memory_bytes
from fastrl.train.progress import describe_evaluation, rl_progress_label
from fastrl.train.rundir import lock_run_directory
from fastrl.train.schedule import AdaptiveKLController, warmup_cosine

__all__ = ["Trainer", "TrainResult", "TrainingDivergedError", "WeightSyncError"]


class WeightSyncError(RuntimeError):
    """The sampler's log-probs disagree with the trainer's after a weight sync."""


@dataclass
class TrainResult:
    output_dir: Path
    steps: int
    eval_history: list[dict[str, float]] = field(default_factory=list)
    final_model_dir: Path | None = None

    @property
    def first_eval(self) -> dict[str, float]:
        return self.eval_history[0] if self.eval_history else {}

    @property
    def last_eval(self) -> dict[str, float]:
        return self.eval_history[-1] if self.eval_history else {}


@dataclass
class _MicroBatch:
    """Rows of one forward/backward and where their per-token values go in the [B, T-1] layout."""

    rows: torch.Tensor  # sample indices, batch order
    cols: slice
    input_ids: torch.Tensor | None = None  # padded layout
    attention_mask: torch.Tensor | None = None
    k: int = 0
    packed: Any = None  # shared-prefix layout: fastrl.ops.shared_prefix_attention.PackedGroups


@dataclass
class Rollout:
    """One step's experience: the sampler's batch plus what the trainer computed on it."""

    batch: RolloutBatch
    rows: list[dict[str, Any]]  # one dataset row per prompt
    completions: list[str]  # decoded, per sample
    rewards: torch.Tensor  # [B] fp32 outcome rewards (failures already 0)
    reward_metrics: dict[str, float]
    per_function: dict[str, torch.Tensor]


AUTO_CHECKPOINTING_TOKENS = 2048
"""activation_checkpointing=auto turns it on for trajectories at least this long."""


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available on this machine")
    return device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Timer:
    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str):
        _sync(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            _sync(self.device)
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0


class Trainer:
    """GRPO-family and PPO training of a Hugging Face causal LM.

    ``Trainer(config).train()`` runs what ``fastrl train`` runs. For use from Python, the
    model, tokenizer, datasets and reward callables can be passed directly instead of
    being named in the config.
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        model: torch.nn.Module | None = None,
        tokenizer: Any = None,
        train_rows: Sequence[dict[str, Any]] | None = None,
        eval_rows: Sequence[dict[str, Any]] | None = None,
        reward_functions: Sequence[Callable | str] | None = None,
    ):
        from fastrl.train import data as data_mod
        from fastrl.train.rewards import RewardPool

        self.cfg = cfg = config.resolved(model_given=model is not None)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        # torchrun: join the process group and refuse what data parallel cannot run, on every rank
        self.dist = dist_mod.init(cfg.device)
        if self.dist is not None:
            _check_distributed(cfg, self.dist)
        self.device = self.dist.device if self.dist is not None else _device(cfg.device)
        self.is_main = self.dist is None or self.dist.is_main
        self.out = Path(cfg.output_dir)
        self.run_lock = lock_run_directory(self.out) if self.is_main else None  # one run per output_dir
        self.out.mkdir(parents=True, exist_ok=True)
        self.loss_config = cfg.policy_loss_config()
        self.autocast_dtype = None
        if cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and self.device.type == "cuda"):
            self.autocast_dtype = torch.bfloat16
        torch.manual_seed(cfg.seed)

        self.resume_dir = resolve_resume(cfg.resume, cfg.output_dir) if cfg.resume else None
        self.timer = _Timer(self.device)
        if self.resume_dir is None and self.is_main:
            self._claim_output_dir()
        if self.dist is not None:
            self.dist.barrier()  # no rank writes into output_dir before rank 0 has claimed it

        # ---- model, tokenizer, data
        self.builtin = model is None and cfg.model is None
        self.tokenizer, self.policy = self._load_policy(model, tokenizer)
        data_mod.check_tokenizer_matches_model(self.tokenizer, self.policy)
        if cfg.shared_prefix:
            _check_shared_prefix_support(self.policy)
        self.train_rows, self.eval_rows = self._load_rows(train_rows, eval_rows)
        self.max_length = data_mod.model_context_length(self.policy)
        if cfg.max_prompt_length is not None:
            limit = cfg.max_prompt_length + cfg.max_new_tokens
            self.max_length = limit if self.max_length is None else min(self.max_length, limit)
        encode = dict(prompt_column=cfg.prompt_column, chat_template=cfg.chat_template, max_new_tokens=cfg.max_new_tokens,
                      max_length=self.max_length, drop_long_prompts=cfg.drop_long_prompts)
        train = data_mod.encode_rows(self.tokenizer, self.train_rows, **encode)
        self.dropped_prompts = len(train.dropped)
        self.train_rows, self.encoded = train.rows, train.prompt_ids
        self.eval_encoded: list[list[int]] = []
        if self.eval_rows:
            held_out = data_mod.encode_rows(self.tokenizer, self.eval_rows, **encode)
            self.eval_rows, self.eval_encoded = held_out.rows, held_out.prompt_ids
        self.batcher = data_mod.PromptBatcher(
            self.train_rows, self.encoded,
            batch_size=None if cfg.prompt_token_budget else cfg.prompts_per_step,
            token_budget=cfg.prompt_token_budget, group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
            seed=cfg.seed,
            # every rank takes an equal slice of each batch: no short batch at an epoch's end
            drop_last=self.dist is not None,
        )

        # ---- a shared vLLM server: reachable and serving this architecture before any long work
        self.server_client = self._connect_server() if cfg.sampler == "vllm-server" else None

        # ---- rewards: checked on real rows before any training work
        specs = list(reward_functions) if reward_functions is not None else list(cfg.rewards)
        self.rewards = RewardPool(specs, weights=cfg.reward_weights, timeout_s=cfg.reward_timeout, num_workers=cfg.reward_workers)
        probe_rows = self.train_rows[: min(2, len(self.train_rows))]
        self.rewards.validate(
            [r[cfg.prompt_column] for r in probe_rows],
            ["" for _ in probe_rows],
            self._columns(probe_rows),
        )

        # ---- warm-up (not on resume: the checkpoint has the warmed-up policy)
        self.sft_metrics: dict[str, float] = {}
        sft_steps = cfg.sft_steps
        if sft_steps and self.resume_dir is None:
            from fastrl.train.sft import sft_to_target, sft_warmup

            if not all("answer" in r for r in self.train_rows):
                raise ValueError("sft_steps > 0 needs an 'answer' column in the dataset (the warm-up targets)")
            from fastrl.train.progress import WarmupProgress

            warm = WarmupProgress(sft_steps, target_accuracy=cfg.sft_target_accuracy, enabled=cfg.progress and self.is_main)
            common = dict(steps=sft_steps, lr=cfg.sft_lr, batch_size=cfg.sft_batch_size, seed=cfg.seed, warmup_steps=cfg.sft_warmup_steps,
                          prompt_column=cfg.prompt_column, chat_template=cfg.chat_template, on_step=warm.on_step)
            if cfg.sft_target_accuracy is not None:
                common["max_steps"] = common.pop("steps")
                result = sft_to_target(
                    self.policy, self.tokenizer, self.train_rows, score_fn=self._answer_score,
                    target_accuracy=cfg.sft_target_accuracy, check_every=cfg.sft_check_every,
                    probe_rows=cfg.sft_probe_rows, max_new_tokens=cfg.max_new_tokens, on_probe=warm.on_probe, **common,
                )
            else:
                result = sft_warmup(self.policy, self.tokenizer, self.train_rows, **common)
            warm.close()
            self.policy.train()
            self.sft_metrics = {
                "sft/steps": float(result["steps"]), "sft/first_loss": float(result["first_loss"]),
                "sft/final_loss": float(result["final_loss"]), "sft/seconds": float(result["seconds"]),
            }
            if result.get("probe"):
                self.sft_metrics["sft/probe_accuracy"] = float(result["probe"][-1][1])

        if self.dist is not None:
            # every rank ran the same seeded warm-up; rank 0's weights make them bitwise equal
            dist_mod.broadcast_module(self.policy)

        # ---- memory at length
        longest = max(len(ids) for ids in self.encoded) + cfg.max_new_tokens
        self.checkpointing = cfg.activation_checkpointing == "layer" or (
            cfg.activation_checkpointing == "auto" and longest >= AUTO_CHECKPOINTING_TOKENS
        )
        if cfg.offload_activations and not self.checkpointing:
            raise ValueError("offload_activations offloads the layer inputs that checkpointing keeps: set activation_checkpointing=layer")

        # ---- reference policy (frozen), critic, optimizers
        self.reference = None
        if cfg.uses_reference:
            self.reference = self._load_reference()
        self.critic: ValueModel | None = None
        if cfg.uses_critic:
            self.critic = self._build_critic()
        self.sampler_model: torch.nn.Module | None = None
        if self.dist is not None:
            self._shard_models()
        total_updates = cfg.steps * cfg.ppo_epochs * cfg.mini_batches
        self.optimizer = torch.optim.AdamW(
            self.policy.parameters(), lr=cfg.lr, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay
        )
        self.scheduler = warmup_cosine(self.optimizer, total_steps=total_updates, warmup_steps=cfg.warmup_steps, min_lr_ratio=cfg.min_lr_ratio)
        self.critic_optimizer = self.critic_scheduler = None
        if self.critic is not None:
            self.critic_optimizer = torch.optim.AdamW(
                self.critic.parameters(), lr=cfg.critic_lr, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay
            )
            self.critic_scheduler = warmup_cosine(
                self.critic_optimizer, total_steps=total_updates, warmup_steps=cfg.warmup_steps, min_lr_ratio=cfg.min_lr_ratio
            )
        if self.checkpointing:
            for m in (self.policy, self.critic.body if self.critic is not None else None):
                if m is not None:
                    if not getattr(m, "supports_gradient_checkpointing", False):
                        raise ValueError(f"{type(m).__name__} does not support gradient checkpointing; set activation_checkpointing=off")
                    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.kl_ctl = AdaptiveKLController(float(cfg.kl_coef or 0.0), target=cfg.kl_target, horizon=cfg.kl_horizon)

        self.step = 0
        self.logger: MetricsLogger | None = None
        self._reward_histogram: dict[str, list[float]] = {}
        self.last_checkpoint: Path | None = None
        self.eval_history: list[dict[str, float]] = []
        self.sync_gaps: list[float] = []
        if self.resume_dir is not None:
            self._load_checkpoint(self.resume_dir)

        # ---- sampler (after the resume, so it starts from the restored weights)
        self.sampler = self._build_sampler()
        self.probe_prompt = self.encoded[0]
        self._write_config()

    # ================================================================== setup helpers
    def _claim_output_dir(self) -> None:
        """A new run never mixes its logs or checkpoints with an earlier run's."""
        previous = [self.out / n for n in ("metrics.jsonl", "checkpoints", "reference", "final", "samples.txt", "tensorboard",
                                           "sampler_init", "final_critic", "summary.json") if (self.out / n).exists()]
        if not previous:
            return
        if not self.cfg.overwrite:
            raise InputError(
                f"output_dir {str(self.out)!r} already holds a run ({', '.join(p.name for p in previous)}): rerun with "
                "--resume latest to continue it, --overwrite true to replace it, or another --output_dir "
                "(from Python: resume='latest', overwrite=True, output_dir=...)"
            )
        import shutil

        for p in previous:
            shutil.rmtree(p) if p.is_dir() else p.unlink()

    def _load_policy(self, model, tokenizer):
        import transformers

        cfg = self.cfg
        if self.resume_dir is not None and model is None:
            # the checkpoint holds the policy (after warm-up and the steps so far)
            path = self.resume_dir / "policy"
            tok = tokenizer or transformers.AutoTokenizer.from_pretrained(path)
            policy = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            return tok, policy.to(self.device).train()
        if model is not None:
            if tokenizer is None:
                raise ValueError("a model passed to Trainer needs its tokenizer too (tokenizer=...)")
            if self.resume_dir is not None:  # continue from the checkpoint's weights, not the given ones
                saved = transformers.AutoModelForCausalLM.from_pretrained(self.resume_dir / "policy", dtype=torch.float32)
                model.load_state_dict(saved.state_dict())
            return tokenizer, model.to(self.device).train()
        if cfg.model is None:
            from fastrl.train.task import DefaultTask, char_tokenizer, tiny_model

            default = DefaultTask()
            tok = char_tokenizer()
            policy = tiny_model(
                tok, hidden_size=cfg.model_hidden_size, layers=cfg.model_layers, heads=default.heads, arch=default.arch,
                max_position_embeddings=default.max_position_embeddings, seed=cfg.seed,
            )
            return tok, policy.to(self.device).train()
        tok = transformers.AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.model)
        policy = transformers.AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
        return tok, policy.to(self.device).train()

    def _load_rows(self, train_rows, eval_rows):
        from fastrl.train import data as data_mod

        cfg = self.cfg
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
        for i, r in enumerate(train[:1] + evals[:1]):
            if cfg.prompt_column not in r:
                raise InputError(f"dataset rows have no {cfg.prompt_column!r} column (columns: {sorted(r)})")
        return train, evals[: cfg.eval_prompts]

    def _load_reference(self) -> torch.nn.Module:
        import transformers

        path = self.out / "reference"
        if self.resume_dir is not None:
            if not (path / "config.json").exists():
                raise ValueError(f"resume: the reference policy of this run is missing ({path})")
            ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(self.device)
        else:
            ref = copy.deepcopy(self.policy)
            # saved once so a resumed run keeps the same reference (the policy at the start of RL)
            if self.is_main:
                ref.save_pretrained(path, safe_serialization=True)
        ref.eval().requires_grad_(False)
        return ref

    def _build_critic(self) -> ValueModel:
        cfg = self.cfg
        if self.resume_dir is not None and not is_distributed_checkpoint(self.resume_dir):
            return ValueModel.load(self.resume_dir / "critic", device=self.device).train()
        if cfg.critic_init is not None:
            return ValueModel.load(cfg.critic_init, device=self.device).train()
        return ValueModel.from_policy(self.policy).train()

    def _shard_models(self) -> None:
        """FSDP2 on the policy (and critic). The sampler gets a full, unsharded copy of the
        policy: generation runs a rank-dependent number of forwards (completions stop at
        different steps), which FSDP's per-forward all-gathers cannot follow, and a copy
        synced after each update costs one all-gather per step instead of one per token."""
        self.sampler_model = copy.deepcopy(self.policy).eval().requires_grad_(False)
        param_dtype = self.autocast_dtype if self.device.type == "cuda" else None
        dist_mod.shard_causal_lm(self.policy, param_dtype=param_dtype)
        if self.critic is not None:
            dist_mod.shard_causal_lm(self.critic.body, param_dtype=param_dtype)

    def _build_sampler(self):
        cfg = self.cfg
        if cfg.sampler == "vllm-server":
            self.sampler_shares_weights = False
            self.sampler = self.server_client
            self._push_weights()  # the policy's weights (after warm-up or resume) before the first rollout
            return self.sampler
        if self.sampler_model is not None:
            self.sampler_shares_weights = False
            return HFGroupSampler(self.sampler_model, pad_token_id=self.tokenizer.pad_token_id)
        if cfg.sampler == "hf":
            self.sampler_shares_weights = True
            return HFGroupSampler(self.policy, pad_token_id=self.tokenizer.pad_token_id)
        from fastrl.rollout import VLLMGroupSampler

        self.sampler_shares_weights = False
        init = self.out / "sampler_init"
        self.policy.save_pretrained(init, safe_serialization=True)
        max_len = self.max_length
        return VLLMGroupSampler(str(init), block_size=32, max_model_len=max_len, seed=cfg.seed)

    def _connect_server(self):
        """A client of the shared ``fastrl vllm-server`` (every rank its own), checked against
        the policy's architecture and the run's longest sequence."""
        from fastrl.rollout.remote import VLLMServerSampler

        cfg = self.cfg
        sampler = VLLMServerSampler(cfg.sampler_url, timeout=cfg.sampler_timeout,
                                    connect_timeout=min(30.0, cfg.sampler_timeout))
        served = sampler.info.get("model") or {}
        differ = [f"{k} {v!r} (policy: {getattr(self.policy.config, k, None)!r})" for k, v in served.items()
                  if v != getattr(self.policy.config, k, None)]
        if differ:
            raise ValueError(
                f"the vLLM server at {cfg.sampler_url} serves another architecture: {', '.join(differ)}; start it with "
                "the policy's model folder (`fastrl vllm-server --model DIR`)"
            )
        longest = max(len(ids) for ids in [*self.encoded, *self.eval_encoded]) + cfg.max_new_tokens
        if sampler.max_model_len < longest:
            raise ValueError(
                f"the vLLM server at {cfg.sampler_url} takes at most {sampler.max_model_len} tokens, this run needs "
                f"{longest} (longest prompt + max_new_tokens): restart it with --max-model-len {longest}"
            )
        return sampler

    def _push_weights(self) -> None:
        """The policy's current weights into a sampler that holds a copy of its own."""
        if self.sampler_model is None:  # one process
            if not self.sampler_shares_weights:
                self.sampler.update_weights(self.policy.state_dict().items())
            return
        # torchrun: refresh the full copy (the HF sampler runs it; checkpoints and the final
        # model read it)
        _copy_named_(self.sampler_model, dist_mod.full_named_tensors(self.policy))
        if self.cfg.sampler != "vllm-server":
            return
        # rank 0 uploads the copy to the shared server; the others wait for its version (or its failure)
        version, error = 0, None
        if self.is_main:
            try:
                version = self.sampler.update_weights(self.sampler_model.state_dict().items())
            except Exception as e:  # noqa: BLE001 - re-raised below, after every rank knows
                version, error = -(1 << 40), e
        version = int(self._sum(version))
        if error is not None:
            raise error
        if version < 0:
            raise RuntimeError("rank 0 could not push the weights to the vLLM server (see its error)")
        self.sampler.expect_weights_version(version)

    def _write_config(self) -> None:
        import yaml

        if not self.is_main:
            return
        (self.out / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(self.cfg), sort_keys=False))

    def _answer_score(self, prompts: list, completions: list[str], answers: list) -> list[float]:
        """The run's rewards with only the answer column (the warm-up's accuracy probe)."""
        return self.rewards.score(prompts, completions, columns={"answer": list(answers)}).rewards.tolist()

    def _columns(self, rows: Sequence[dict[str, Any]], repeat: int = 1) -> dict[str, list]:
        keys = [k for k in rows[0] if k != self.cfg.prompt_column] if rows else []
        return {k: [r.get(k) for r in rows for _ in range(repeat)] for k in keys}

    # ================================================================== the step
    def _sampling(self, *, salt: int) -> SamplingConfig:
        cfg = self.cfg
        return SamplingConfig(
            temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_new_tokens,
            seed=(cfg.seed * 1_000_003 + self.step * 101 + salt) % (2**31),
        )

    def _prompt_seeds(self, sampling: SamplingConfig, first: int, count: int) -> list[int] | None:
        """One sampling seed per prompt from its index in the whole (all-rank) batch, so a
        prompt's completions do not depend on the world size (nor, on a shared vLLM server,
        on which requests it batches together)."""
        if sampling.seed is None:
            return None
        return [sampling.seed * 65_537 + first + i for i in range(count)]

    def _next_prompts(self):
        """This rank's contiguous slice of the next batch of prompts, and where it starts."""
        batch = next(self.batcher)
        if self.dist is None:
            return batch, 0
        part = dist_mod.shard_slice(len(batch.rows), self.dist.rank, self.dist.world_size)
        local = dataclasses.replace(batch, rows=batch.rows[part], prompt_ids=batch.prompt_ids[part], indices=batch.indices[part])
        return local, part.start

    def _rollout(self, shard, *, salt: int) -> Rollout:
        """Sample and score ``shard = (prompt batch, index of its first prompt in the whole batch)``."""
        cfg = self.cfg
        G = cfg.group_size
        prompt_batch, first = shard
        rows, prompts = prompt_batch.rows, prompt_batch.prompt_ids
        with self.timer("generate"):
            sampling = self._sampling(salt=salt)
            seeds = self._prompt_seeds(sampling, first, len(prompts))
            extra = {"prompt_seeds": seeds} if seeds is not None else {}
            batch = self.sampler.generate(prompts, group_size=G, sampling=sampling, **extra)
        with self.timer("reward"):
            completions = self.tokenizer.batch_decode(batch.completion_ids, skip_special_tokens=True)
            prompt_values = [r[cfg.prompt_column] for r in rows for _ in range(G)]
            if prompt_values and isinstance(prompt_values[0], list):  # chat prompts: TRL's conversational form
                completions_arg: list = [[{"role": "assistant", "content": c}] for c in completions]
            else:
                completions_arg = completions
            result = self.rewards.score(
                prompt_values, completions_arg, completion_ids=batch.completion_ids, columns=self._columns(rows, G)
            )
        return Rollout(batch, rows, completions, result.rewards.float(), dict(result.metrics), dict(result.per_function))

    def _collect(self) -> tuple[Rollout, dict[str, float]]:
        """Roll out one step's prompts; with dynamic sampling, drop all-equal groups and refill."""
        cfg = self.cfg
        G = cfg.group_size
        first = self._rollout(self._next_prompts(), salt=0)
        info = {"dynamic/rounds": 0.0, "dynamic/dropped_groups": 0.0}
        if not cfg.dynamic_sampling:
            return first, info
        target = len(first.rows)
        kept: list[tuple[Rollout, list[int]]] = []
        n_kept = 0
        current = first
        dropped = 0
        for round_ in range(cfg.max_resample_rounds + 1):
            r = current.rewards.view(-1, G)
            informative = [g for g in range(r.shape[0]) if bool((r[g] != r[g, 0]).any())]
            dropped += r.shape[0] - len(informative)
            kept.append((current, informative))
            n_kept += len(informative)
            info["dynamic/rounds"] = float(round_)
            # under torchrun every rank takes the same decision (the batcher stays in step)
            if self._sum(n_kept) >= self._sum(target) or round_ == cfg.max_resample_rounds:
                break
            current = self._rollout(self._next_prompts(), salt=round_ + 1)
        info["dynamic/dropped_groups"] = float(self._sum(dropped))
        if n_kept == 0:
            # nothing informative: train on the first batch (all advantages are 0; the step only logs)
            return first, info
        return _merge_rollouts(kept, group_size=G, limit=target, pad_token_id=self.sampler.pad_token_id), info

    # ------------------------------------------------------------------ forward passes
    # Two layouts, one interface. Padded: rows of the [B, T] batch, trimmed per micro-batch.
    # Shared prefix (default): whole groups packed as [prompt | c1 | ... | cG], the prompt run
    # once per group (fastrl.ops.hf_packed). Either way a micro-batch returns per-token values
    # for its rows at columns ``cols`` of the [B, T-1] layout (column c scores token c + 1).
    def _micro_batches(self, batch: RolloutBatch, groups: list[int]):
        """Split whole groups into micro-batches of at most ``micro_batch_tokens`` tokens:
        padded tokens of the rows, or with shared prefixes the packed tokens ``P + sum(L_i)``.

        Yields ``_MicroBatch``es whose rows are the groups' samples in batch order.
        """
        G = self.cfg.group_size
        lengths = batch.attention_mask.sum(1).tolist()
        budget = self.cfg.micro_batch_tokens
        chunk: list[int] = []
        cost = 0
        for g in groups:
            rows = range(g * G, (g + 1) * G)
            if self.cfg.shared_prefix:
                add = len(batch.prompt_ids[g]) + sum(len(batch.completion_ids[r]) for r in rows)
                new_cost = cost + add
            else:
                longest = max([lengths[r] for r in rows] + [lengths[r] for c in chunk for r in range(c * G, (c + 1) * G)])
                new_cost = longest * G * (len(chunk) + 1)
            if chunk and new_cost > budget:
                yield self._make_micro_batch(batch, chunk)
                chunk, cost = [], 0
                new_cost = (len(batch.prompt_ids[g]) + sum(len(batch.completion_ids[r]) for r in rows)) if self.cfg.shared_prefix else 0
            chunk.append(g)
            cost = new_cost
        if chunk:
            yield self._make_micro_batch(batch, chunk)

    def _make_micro_batch(self, batch: RolloutBatch, groups: list[int]) -> "_MicroBatch":
        G = self.cfg.group_size
        rows = torch.tensor([r for g in groups for r in range(g * G, (g + 1) * G)])
        if self.cfg.shared_prefix:
            from fastrl.ops.shared_prefix_attention import PackedGroups

            packed = PackedGroups.from_groups(
                [(batch.prompt_ids[g], batch.completion_ids[g * G : (g + 1) * G]) for g in groups], device=self.device
            )
            return _MicroBatch(rows, slice(0, packed.max_seq_len - 1), packed=packed)
        Tm = int(batch.attention_mask[rows].sum(1).max())
        k = max(1, Tm - min(len(batch.prompt_ids[g]) for g in groups))
        ids = batch.input_ids[rows, :Tm].to(self.device)
        attn = batch.attention_mask[rows, :Tm].to(self.device)
        return _MicroBatch(rows, slice(Tm - 1 - k, Tm - 1), input_ids=ids, attention_mask=attn, k=k)

    def _offload(self):
        """During the policy/critic forward with grad: saved tensors (with checkpointing, just each
        layer's input) go to CPU memory, pinned on a GPU so the copies are asynchronous."""
        if not (self.cfg.offload_activations and torch.is_grad_enabled()):
            return contextlib.nullcontext()
        return torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda")

    def _logprobs(self, model: torch.nn.Module, mb: "_MicroBatch", *, entropy: bool, packed_out: bool = False):
        """Log-probs (and entropies) of the micro-batch's rows at columns ``mb.cols``; with
        ``packed_out`` and shared prefixes, the ``[1, M]`` packed completion tokens as they come."""
        temperature = self.cfg.temperature
        with self._autocast(), self._offload():
            if mb.packed is not None:
                from fastrl.ops.hf_packed import packed_causal_lm_logprobs

                out = packed_causal_lm_logprobs(model, mb.packed, temperature=temperature, return_entropy=entropy)
                if packed_out:
                    return (out[0].float()[None], out[1].float()[None]) if entropy else (out.float()[None], None)
                width = mb.cols.stop
                if entropy:
                    lp, ent = out
                    return (mb.packed.to_batch_layout(lp.float(), seq_len=width, shift=1),
                            mb.packed.to_batch_layout(ent.float(), seq_len=width, shift=1))
                return mb.packed.to_batch_layout(out.float(), seq_len=width, shift=1), None
            out = causal_lm_logprobs(model, mb.input_ids, mb.attention_mask, temperature=temperature, logits_to_keep=mb.k,
                                     return_entropy=entropy)
        if entropy:
            return out[0].float(), out[1].float()
        return out.float(), None

    def _values(self, mb: "_MicroBatch", *, packed_out: bool = False) -> torch.Tensor:
        with self._autocast(), self._offload():
            if mb.packed is not None:
                from fastrl.ops.hf_packed import packed_causal_lm_hidden_states

                hidden = packed_causal_lm_hidden_states(self.critic.body, mb.packed)
                values = self.critic.head(hidden)
                if packed_out:  # [1, M] packed completion tokens
                    return values[None]
                return mb.packed.to_batch_layout(values, seq_len=mb.cols.stop, shift=1)
            return self.critic.values(mb.input_ids, mb.attention_mask, mb.k)

    def _all_groups(self, batch: RolloutBatch) -> list[int]:
        return list(range(len(batch.prompt_ids)))

    @torch.no_grad()
    def _per_token(self, module: torch.nn.Module, batch: RolloutBatch, compute) -> torch.Tensor:
        """``[B, T-1]`` fp32 values of ``compute(micro_batch)`` for every completion token (0
        elsewhere), with ``module`` in eval mode: the no-grad passes over a whole rollout."""
        B, T = batch.input_ids.shape
        out = torch.zeros(B, T - 1, dtype=torch.float32, device=self.device)
        was_training = module.training
        module.eval()
        try:
            micro = list(self._micro_batches(batch, self._all_groups(batch)))
            for mb in micro:
                out[mb.rows.to(self.device), mb.cols] = compute(mb)
            if module is self.policy or module is self.critic:
                for _ in range(self._missing_passes(len(micro))):
                    compute(micro[-1])  # FSDP all-gathers per forward: keep in step with the other ranks
        finally:
            module.train(was_training)
        return out * batch.response_mask[:, 1:].to(self.device)

    def _token_logprobs(self, model: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
        """Log-probs of ``input_ids[:, 1:]`` under ``model`` (old or reference policy)."""
        return self._per_token(model, batch, lambda mb: self._logprobs(model, mb, entropy=False)[0])

    def _critic_values(self, batch: RolloutBatch) -> torch.Tensor:
        """The critic's values of the states before each completion token."""
        return self._per_token(self.critic, batch, self._values)

    # ------------------------------------------------------------------ across ranks (torchrun)
    # Each is the identity in a single process, so the step reads the same either way.
    def _sum(self, value):
        """``value`` (a number or tensor) summed over ranks."""
        return self._reduce(value, "sum")

    def _reduce(self, value, op: str):
        if self.dist is None:
            return value
        t = torch.as_tensor(value).to(self.device).clone()
        dtype = t.dtype
        if not t.is_floating_point():
            t = t.to(torch.float64)
        self.dist.all_reduce(t, op)
        t = t.to(dtype)
        if isinstance(value, torch.Tensor):
            return t
        return type(value)(t.item())

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0 in rank order (= batch order)."""
        if self.dist is None:
            return tensor
        return self.dist.all_gather_cat(tensor.to(self.device)).to(tensor.device)

    def _reward_metrics_over_ranks(self, local: dict[str, float]) -> dict[str, float]:
        """The reward pool's per-function metrics of the whole batch: counts (failures,
        timeouts, ...) summed, seconds the slowest rank's, means averaged and standard
        deviations combined from the ranks' moments (shards are equal-sized; exact when every
        sample was scored)."""
        if self.dist is None:
            return local
        names = self._names_on_any_rank(local)  # a rank whose functions logged nothing of a kind adds 0
        local = {k: local.get(k, 0.0) for k in names}
        world = self.dist.world_size
        values = torch.tensor([float(local[k]) for k in names], dtype=torch.float64)
        second = torch.tensor([float(local[k]) ** 2 + float(local.get(k[: -len("std")] + "mean", 0.0)) ** 2
                               if k.endswith("/std") else 0.0 for k in names], dtype=torch.float64)
        sums = self._sum(torch.cat([values, second]))
        slowest = self._reduce(values.clone(), "max")
        out: dict[str, float] = {}
        for i, k in enumerate(names):
            if k.endswith("/std"):
                mean = float(sums[names.index(k[: -len("std")] + "mean")]) / world if k[: -len("std")] + "mean" in local else 0.0
                out[k] = max(float(sums[len(names) + i]) / world - mean**2, 0.0) ** 0.5
            elif k.endswith("/mean") or "/user/" in k:
                out[k] = float(sums[i]) / world
            elif k.endswith("seconds"):
                out[k] = float(slowest[i])
            else:
                out[k] = float(sums[i])
        return out

    def _names_on_any_rank(self, names) -> list[str]:
        """The sorted union of ``names`` over ranks (every rank then reduces the same list)."""
        if self.dist is None:
            return sorted(names)
        import torch.distributed

        every: list[Any] = [None] * self.dist.world_size
        torch.distributed.all_gather_object(every, sorted(names))
        return sorted(set().union(*every))

    def _missing_passes(self, count: int) -> int:
        """Forward passes this rank must add to match the rank with the most (FSDP collectives
        are per forward/backward; every rank must run as many)."""
        if self.dist is None:
            return 0
        return int(self._reduce(count, "max")) - count

    def _group_advantages(self, rewards: torch.Tensor, group_ids: torch.Tensor, mode: str):
        """``group_advantages`` over the whole batch: under torchrun the rewards of every rank
        are gathered (a scalar per sample), so batch-level modes (batch_std,
        group_mean_batch_std_floor, reinforce_pp) see the single-process batch exactly."""
        if self.dist is None:
            return group_advantages(rewards, group_ids, mode=mode)
        n_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
        group_offset = self.dist.offset(n_groups)
        start = self.dist.offset(rewards.numel())
        all_rewards = self._gather(rewards.float())
        all_ids = self._gather(group_ids + group_offset)
        advantages, stats = group_advantages(all_rewards, all_ids, mode=mode)
        return advantages[start : start + rewards.numel()], stats

    def _whiten_over_ranks(self, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """GAE advantages whitened with the statistics of every rank's completion tokens
        (what ``gae(whiten=True)`` does on the single-process batch)."""
        from fastrl.reference.scans import WHITEN_EPS

        keep = mask > 0
        local = advantages[keep]
        start = self.dist.offset(local.numel())
        everything = self._gather(local)
        whitened = masked_whiten(everything, torch.ones_like(everything), eps=WHITEN_EPS)
        out = torch.zeros_like(advantages)
        out[keep] = whitened[start : start + local.numel()].to(out.dtype)
        return out

    def _explained_variance(self, values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
        if self.dist is None:
            return float(explained_variance(values, returns, mask))
        keep = mask > 0
        return float(explained_variance(self._gather(values[keep].float()), self._gather(returns[keep].float()),
                                        self._gather(torch.ones(int(keep.sum()), device=values.device))))

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def train_step(self) -> dict[str, float]:
        """One RL step; returns its metrics."""
        cfg = self.cfg
        self.timer = _Timer(self.device)
        t_step = time.perf_counter()
        rollout, metrics = self._collect()
        batch = rollout.batch
        B, T = batch.input_ids.shape
        mask = batch.response_mask[:, 1:].to(self.device).float()  # [B, T-1] aligned with input_ids[:, 1:]
        sampler_logp = batch.sampler_logp[:, 1:].to(self.device)
        outcome = rollout.rewards.to(self.device)

        # ---- log-probs of the behaviour and reference policies
        need_old = not cfg.on_policy or cfg.kl_in_reward or cfg.rollout_correction == "is"
        old_logp = None
        if cfg.rollout_correction == "bypass":
            old_logp = sampler_logp
        elif need_old:
            with self.timer("old_logp"):
                old_logp = self._token_logprobs(self.policy, batch)
        ref_logp = None
        if self.reference is not None:
            with self.timer("ref_logp"):
                ref_logp = self._token_logprobs(self.reference, batch)

        # ---- advantages
        with self.timer("advantages"):
            advantages, returns, old_values, token_kl, adv_metrics = self.compute_advantages(
                batch, outcome, mask, old_logp=old_logp, ref_logp=ref_logp, sampler_logp=sampler_logp
            )
        metrics.update(adv_metrics)

        # ---- update
        with self.timer("update"):
            update_metrics = self._update(batch, mask, advantages, old_logp, ref_logp, sampler_logp, old_values, returns)
        metrics.update(update_metrics)
        if token_kl is not None:
            self.kl_ctl.update(metrics["kl/ref_seq"], int(self._sum(B)))

        # ---- weight sync + probe
        with self.timer("sync"):
            gap = self._sync_weights()
        if gap is not None:
            metrics["sync/probe_gap"] = gap

        self.step += 1
        # ---- metrics
        self._rollout_metrics(rollout, metrics)
        metrics["time/step"] = time.perf_counter() - t_step
        for stage, s in self.timer.seconds.items():
            metrics[f"time/{stage}"] = s
        gen_s = self.timer.seconds.get("generate", 0.0)
        metrics["throughput/generate_tokens_per_s"] = metrics["rollout/generated_tokens"] / gen_s if gen_s > 0 else 0.0
        upd_s = self.timer.seconds.get("update", 0.0)
        trained = float(self._sum(batch.attention_mask.sum()))
        metrics["throughput/train_tokens_per_s"] = trained * cfg.ppo_epochs / upd_s if upd_s > 0 else 0.0
        metrics["memory/peak_gb"] = peak_memory_bytes(self.device) / 2**30
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def compute_advantages(self, batch: RolloutBatch, outcome: torch.Tensor, mask: torch.Tensor, *, old_logp, ref_logp, sampler_logp):
        """Advantages of one rollout: ``group_advantages`` of the (optionally KL-shaped) outcome
        rewards, or for PPO, GAE over per-token rewards and critic values.

        KL in the reward (``kl_in_reward``): per token ``-beta * KL_t`` with the outcome on the
        last completion token (PPO); for group estimators, the sequence reward
        ``outcome - beta * sum_t KL_t``. ``KL_t`` is the chosen estimator between the
        behaviour policy (old log-probs, or the sampler's) and the reference.

        Returns ``(advantages [B] or [B, T-1], returns | None, old_values | None, token_kl | None, metrics)``.
        """
        cfg = self.cfg
        B, Tm1 = mask.shape
        metrics: dict[str, float] = {}
        beta = self.kl_ctl.value
        token_kl = None
        if ref_logp is not None:
            behaviour = old_logp if old_logp is not None else sampler_logp
            token_kl = torch.where(mask > 0, kl_penalty(behaviour, ref_logp, estimator=cfg.kl_estimator), 0.0)
            metrics["kl/ref_seq"] = float(self._sum(token_kl.sum(1).sum()) / self._sum(B))
            metrics["kl/coef"] = beta
        group_ids = batch.group_ids.to(self.device)
        old_values = returns = None
        if cfg.uses_critic:
            token_rewards = torch.zeros(B, Tm1, device=self.device)
            last = (mask.cumsum(1) == mask.sum(1, keepdim=True)) & (mask > 0)
            token_rewards[last] = outcome[last.any(1)]
            if cfg.kl_in_reward and token_kl is not None:
                token_rewards = token_rewards - beta * token_kl
            with self.timer("values"):
                old_values = self._critic_values(batch)
            local_whiten = cfg.whiten_advantages and self.dist is None
            advantages, returns = gae(token_rewards, old_values, mask, gamma=cfg.gamma, lam=cfg.lam, whiten=local_whiten)
            if cfg.whiten_advantages and self.dist is not None:
                advantages = self._whiten_over_ranks(advantages, mask)
            # group statistics for monitoring only (how many prompts carry signal)
            adv_stats = self._group_advantages(outcome, group_ids, "dr_grpo")[1]
        else:
            shaped = outcome
            if cfg.kl_in_reward and token_kl is not None:
                shaped = outcome - beta * token_kl.sum(1)
            advantages, adv_stats = self._group_advantages(shaped, group_ids, cfg.advantage_mode)
        adv_tok = advantages if advantages.dim() == 2 else advantages[:, None].expand(B, Tm1)
        n_tok = self._sum(mask.sum()).clamp(min=1)
        mean = self._sum((adv_tok * mask).sum()) / n_tok
        metrics["advantage/mean"] = float(mean)
        metrics["advantage/std"] = float(self._sum(((adv_tok - mean) ** 2 * mask).sum()).div(n_tok).sqrt())
        metrics["groups/frac_all_equal"] = float(adv_stats["frac_all_equal_groups"])
        metrics["groups/effective_ratio"] = float(adv_stats["effective_group_ratio"])
        return advantages, returns, old_values, token_kl, metrics

    def _update(self, batch, mask, advantages, old_logp, ref_logp, sampler_logp, old_values, returns) -> dict[str, float]:
        cfg = self.cfg
        agg: dict[str, list[tuple[float, float]]] = {}
        grad_norms, critic_grad_norms = [], []
        padding_passes = 0
        g = torch.Generator().manual_seed(cfg.seed * 7919 + self.step)
        n_groups = len(batch.prompt_ids)
        for epoch in range(cfg.ppo_epochs):
            # mini-batches of whole groups (the shared-prefix layout packs a group as one document)
            order = torch.randperm(n_groups, generator=g) if cfg.mini_batches > 1 else torch.arange(n_groups)
            # under torchrun every rank takes exactly mini_batches optimizer steps (some may be empty)
            minis = order.chunk(cfg.mini_batches) if self.dist is None else order.tensor_split(cfg.mini_batches)
            for mini in minis:
                mini_groups = mini.sort().values.tolist()
                mini_rows = torch.tensor([r for q in mini_groups for r in range(q * cfg.group_size, (q + 1) * cfg.group_size)],
                                         dtype=torch.long)
                mb_dev = mini_rows.to(self.device)
                # the denominators of the whole (all-rank) mini-batch
                tokens = self._sum(mask[mb_dev].sum())
                seqs = self._sum((mask[mb_dev].sum(1) > 0).sum())
                losses: list[torch.Tensor] = []
                micro = list(self._micro_batches(batch, mini_groups))
                padding = self._missing_passes(len(micro))
                padding_passes += padding
                if padding and not micro:
                    micro_pad = [self._make_micro_batch(batch, [0])] * padding
                else:
                    micro_pad = micro[-1:] * padding
                zero_mask = torch.zeros_like(mask) if padding else mask
                for mb, dummy in [(mb, False) for mb in micro] + [(mb, True) for mb in micro_pad[:padding]]:
                    # the attention switch stays on through the backward: checkpointed layers
                    # recompute their forward there and must see the same attention
                    with self._packed_attention(mb):
                        # a dummy (zero mask: zero loss and gradient) keeps FSDP's collectives in step
                        loss, lm = self._micro_batch_loss(mb, zero_mask if dummy else mask, advantages, old_logp, ref_logp,
                                                          sampler_logp, old_values, returns, tokens, seqs)
                    if dummy:
                        continue
                    losses.append(loss)
                    weight = float(mask[mb.rows.to(self.device), mb.cols].sum())
                    for name, v in lm.items():
                        agg.setdefault(name, []).append((float(v), weight))
                total = self._sum(torch.stack(losses).sum() if losses else torch.zeros((), device=self.device))
                if self.dist is not None:
                    dist_mod.sync_replicated_grads(self.policy.parameters())
                grad_norm = dist_mod.clip_grad_norm(self.policy.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else float("inf"),
                                                    distributed=self.dist is not None)
                if not (torch.isfinite(total) and torch.isfinite(grad_norm)):
                    self._diverged(batch, "loss" if not torch.isfinite(total) else "gradient norm", float(total), float(grad_norm))
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                grad_norms.append(float(grad_norm))
                agg.setdefault("loss", []).append((float(total), 1.0))
                if self.critic is not None:
                    if self.dist is not None:
                        dist_mod.sync_replicated_grads(self.critic.parameters())
                    cg = dist_mod.clip_grad_norm(self.critic.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else float("inf"),
                                                 distributed=self.dist is not None)
                    if not torch.isfinite(cg):
                        self._diverged(batch, "critic gradient norm", float(total), float(cg))
                    self.critic_optimizer.step()
                    self.critic_scheduler.step()
                    self.critic_optimizer.zero_grad(set_to_none=True)
                    critic_grad_norms.append(float(cg))
        out: dict[str, float] = {}
        for name, value in self._reduce_metrics(agg, updates=len(grad_norms)).items():
            out[_metric_name(name)] = value
        out["grad_norm"] = max(grad_norms) if grad_norms else 0.0
        if self.dist is not None:  # zero-weight micro-batches that kept FSDP's collectives in step
            out["dist/padding_micro_batches"] = float(self._sum(padding_passes))
        if self.critic is not None:
            out["critic/grad_norm"] = max(critic_grad_norms) if critic_grad_norms else 0.0
            out["critic/explained_variance"] = self._explained_variance(old_values, returns, mask)
        return out

    def _reduce_metrics(self, agg: dict[str, list[tuple[float, float]]], *, updates: int) -> dict[str, float]:
        """Metrics of the update, averaged over its ``updates`` optimizer steps: loss terms
        (each micro-batch's share of its mini-batch's loss, normalised by the global count)
        summed, other means weighted by tokens, minima and maxima; under torchrun over every
        rank's micro-batches (``loss`` is already global)."""
        out: dict[str, float] = {}
        for name in self._names_on_any_rank(agg):
            # a name another rank saw: this rank contributes the neutral element
            neutral = float("inf") if name.endswith("_min") else float("-inf") if name.endswith("_max") else 0.0
            vals = agg.get(name) or [(neutral, 0.0)]
            if name in _LOSS_SHARES:
                out[name] = float(self._sum(torch.tensor(sum(v for v, _ in vals), dtype=torch.float64))) / max(updates, 1)
            elif name.endswith("_min"):
                out[name] = float(self._reduce(torch.tensor(min(v for v, _ in vals), dtype=torch.float64), "min"))
            elif name.endswith("_max"):
                out[name] = float(self._reduce(torch.tensor(max(v for v, _ in vals), dtype=torch.float64), "max"))
            elif name == "loss":
                out[name] = sum(v for v, _ in vals) / len(vals)
            else:
                sums = self._sum(torch.tensor([sum(v * w for v, w in vals), sum(w for _, w in vals)], dtype=torch.float64))
                out[name] = float(sums[0] / (sums[1] if sums[1] else 1.0))
        return out

    def _micro_batch_loss(self, mb, mask, advantages, old_logp, ref_logp, sampler_logp, old_values, returns, tokens, seqs):
        """Forward + backward of one micro-batch; returns its (detached) share of the policy loss and its metrics."""
        cfg = self.cfg
        r = mb.rows.to(self.device)
        packed = mb.packed
        if packed is None:  # padded rows: every per-token input at the rows' columns
            def take(x: torch.Tensor) -> torch.Tensor:
                return x[r, mb.cols]
            cu_seqlens = None
        else:
            # packed: the loss takes the model's [M] completion tokens as they come, as one
            # [1, M] row with a sequence per sample (no padded round trip); the other inputs
            # are gathered from the [B, T-1] batch layout at those tokens' columns
            tok_rows, tok_cols = r[packed.sample_index], packed.batch_pos - 1

            def take(x: torch.Tensor) -> torch.Tensor:
                return x[tok_rows, tok_cols][None]
            cu_seqlens = PackedLayout.from_lengths(packed.completion_lens, device=self.device)
        m = take(mask)
        logp, entropy = self._logprobs(self.policy, mb, entropy=True, packed_out=packed is not None)
        old = take(old_logp) if old_logp is not None else logp.detach()
        adv = take(advantages) if advantages.dim() == 2 else advantages[r]
        loss_config = self.loss_config if not self.loss_config.kl_coef else self.loss_config.replace(kl_coef=self.kl_ctl.value)
        loss, metrics = policy_loss(
            logp, old, adv, m,
            ref_logp=take(ref_logp) if (ref_logp is not None and self.loss_config.kl_coef) else None,
            entropy=entropy,
            rollout_logp=take(sampler_logp) if cfg.rollout_correction == "is" else None,
            config=loss_config,
            **self._global_count(tokens, seqs),
            cu_seqlens=cu_seqlens,
        )
        total = loss
        if self.critic is not None:
            values = self._values(mb, packed_out=packed is not None)
            vloss, vm = value_loss(
                values.float(), take(old_values), take(returns), m,
                clip=cfg.value_clip, loss_agg="token-mean", global_token_count=tokens, cu_seqlens=cu_seqlens,
            )
            total = loss + vloss
            metrics = {**metrics, **{f"critic_{k}": v for k, v in vm.items()}, "critic_loss": vloss.detach()}
        total.backward()
        return loss.detach(), metrics

    def _packed_attention(self, mb: "_MicroBatch"):
        if mb.packed is None:
            return contextlib.nullcontext()
        from fastrl.ops.hf_packed import shared_prefix_attention_enabled

        stack = contextlib.ExitStack()
        stack.enter_context(shared_prefix_attention_enabled(self.policy))
        if self.critic is not None:
            stack.enter_context(shared_prefix_attention_enabled(self.critic.body))
        return stack

    def _global_count(self, tokens: torch.Tensor, seqs: torch.Tensor) -> dict[str, torch.Tensor]:
        """The mini-batch's denominator for the loss's aggregation, so micro-batches add up to it."""
        if self.loss_config.loss_agg == "token-mean":
            return {"global_token_count": tokens}
        return {"global_seq_count": seqs}

    def _diverged(self, batch: RolloutBatch, what: str, loss: float, grad_norm: float) -> None:
        rank = f"-rank{self.dist.rank}" if self.dist is not None else ""
        path = self.out / f"diverged-step-{self.step + 1:06d}{rank}.pt"  # the step being taken, as the metrics number it
        torch.save({"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "response_mask": batch.response_mask,
                    "completion_ids": batch.completion_ids, "prompt_ids": batch.prompt_ids}, path)
        self.optimizer.zero_grad(set_to_none=True)
        raise TrainingDivergedError(divergence_message(
            step=self.step + 1, what=what, loss=loss, grad_norm=grad_norm, batch_path=path,
            last_checkpoint=self.last_checkpoint, save_every=self.cfg.save_every,
        ))

    @torch.no_grad()
    def _sync_weights(self) -> float | None:
        """Push the policy's weights to the sampler, then (every ``sync_probe_every`` steps)
        compare the sampler's log-probs of a fixed greedy sequence with the trainer's."""
        self._push_weights()
        every = self.cfg.sync_probe_every or (10 if self.sampler_shares_weights else 1)
        if self.step % every:
            return None
        probe = self.sampler.generate(
            [self.probe_prompt], group_size=1,
            sampling=SamplingConfig(greedy=True, temperature=1.0, max_new_tokens=min(8, self.cfg.max_new_tokens)),
        )
        was_training = self.policy.training
        self.policy.eval()
        try:
            ids = probe.input_ids.to(self.device)
            k = len(probe.completion_ids[0])
            lp = causal_lm_logprobs(self.policy, ids, probe.attention_mask.to(self.device), logits_to_keep=k)
        finally:
            self.policy.train(was_training)
        gap = float((lp[0].float().cpu() - probe.completion_logp[0].float()).abs().max())
        self.sync_gaps.append(gap)
        if not math.isfinite(gap) or gap > self.cfg.sync_probe_tolerance:
            raise WeightSyncError(
                f"step {self.step}: after the weight sync the sampler's log-probs differ from the trainer's by {gap:.3g} "
                f"(tolerance {self.cfg.sync_probe_tolerance:g}); the sampler is not running the trained weights"
            )
        return gap

    def _rollout_metrics(self, rollout: Rollout, metrics: dict[str, float]) -> None:
        batch = rollout.batch
        r = self._gather(rollout.rewards.float())  # every rank's samples
        metrics["reward/mean"] = float(r.mean())
        metrics["reward/std"] = float(r.std()) if r.numel() > 1 else 0.0
        metrics["reward/min"] = float(r.min())
        metrics["reward/max"] = float(r.max())
        reward_metrics = self._reward_metrics_over_ranks(rollout.reward_metrics)
        metrics.update({k if k.startswith("reward") else f"reward/{k}": v for k, v in reward_metrics.items()})
        lengths = self._gather(torch.tensor([len(c) for c in batch.completion_ids], dtype=torch.float32))
        truncated = self._gather(torch.tensor([f == "length" for f in batch.finish_reasons], dtype=torch.float32))
        metrics["response/length_mean"] = float(lengths.mean())
        metrics["response/length_max"] = float(lengths.max())
        metrics["response/truncated_frac"] = float(truncated.mean())
        metrics["rollout/samples"] = float(lengths.numel())
        metrics["rollout/generated_tokens"] = float(self._sum(batch.stats.generated_tokens))
        metrics["rollout/prefill_tokens"] = float(self._sum(batch.stats.prefill_tokens_computed))
        self._reward_histogram = histogram(r)
        r = rollout.rewards  # the logged samples are this rank's (rank 0 logs)
        best, worst = int(r.argmax()), int(r.argmin())
        if self.dropped_prompts:
            metrics["data/dropped_long_prompts"] = float(self.dropped_prompts)
        if self.logger is None:
            return
        G = self.cfg.group_size
        text = lambda b: self.tokenizer.decode(batch.prompt_ids[b // G], skip_special_tokens=True)  # noqa: E731
        self.logger.write_samples(
            self.step, (text(best), rollout.completions[best], float(r[best])), (text(worst), rollout.completions[worst], float(r[worst]))
        )

    # ================================================================== evaluation
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out greedy accuracy, mean reward and pass@k (k samples at the training temperature).

        A completion succeeds when its total reward is at least 1 (the built-in rewards give 1
        for a right answer).
        """
        cfg = self.cfg
        if not self.eval_rows:
            return {}
        t0 = time.perf_counter()
        rows, prompts, first = self.eval_rows, self.eval_encoded, 0
        if self.dist is not None:  # each rank scores a contiguous share; the scores are gathered
            n, world, rank = len(rows), self.dist.world_size, self.dist.rank
            first, stop = n * rank // world, n * (rank + 1) // world
            rows, prompts = rows[first:stop], prompts[first:stop]
        greedy = self._eval_scores(rows, prompts, SamplingConfig(greedy=True, temperature=1.0, max_new_tokens=cfg.max_new_tokens), 1,
                                   first=first)
        out = {"eval/accuracy": float((greedy >= 1.0 - 1e-6).float().mean()), "eval/reward_mean": float(greedy.mean())}
        if cfg.pass_k > 1:
            sampled = self._eval_scores(
                rows, prompts,
                SamplingConfig(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, max_new_tokens=cfg.max_new_tokens,
                               seed=cfg.seed + 17),
                cfg.pass_k, first=first,
            ).view(-1, cfg.pass_k)
            ok = sampled >= 1.0 - 1e-6
            out[f"eval/pass@{cfg.pass_k}"] = float(ok.any(1).float().mean())
            out["eval/sampled_accuracy"] = float(ok.float().mean())
        out["time/eval"] = time.perf_counter() - t0
        return out

    def _eval_scores(self, rows, prompts, sampling: SamplingConfig, k: int, *, first: int = 0) -> torch.Tensor:
        """Total reward of every completion (k per prompt); under torchrun of every rank's
        rows (this rank's start at ``first``), in row order."""
        cfg = self.cfg
        scores = [torch.zeros(0)]
        chunk = max(1, 256 // k)
        for s in range(0, len(rows), chunk):
            r, p = rows[s : s + chunk], prompts[s : s + chunk]
            seeds = self._prompt_seeds(sampling, first + s, len(p))
            extra = {"prompt_seeds": seeds} if seeds is not None else {}
            batch = self.sampler.generate(p, group_size=k, sampling=sampling, **extra)
            completions = self.tokenizer.batch_decode(batch.completion_ids, skip_special_tokens=True)
            prompt_values = [x[cfg.prompt_column] for x in r for _ in range(k)]
            if prompt_values and isinstance(prompt_values[0], list):
                completions = [[{"role": "assistant", "content": c}] for c in completions]
            res = self.rewards.score(prompt_values, completions, completion_ids=batch.completion_ids, columns=self._columns(r, k))
            scores.append(res.rewards.float())
        return self._gather(torch.cat(scores))

    # ================================================================== checkpoints
    def save_checkpoint(self) -> Path:
        if self.dist is not None:
            return self._save_distributed_checkpoint()
        models: dict[str, Any] = {"policy": self.policy}
        objects: dict[str, Any] = {"optimizer": self.optimizer, "scheduler": self.scheduler}
        if self.critic is not None:
            models["critic"] = self.critic
            objects.update(critic_optimizer=self.critic_optimizer, critic_scheduler=self.critic_scheduler)
        self.last_checkpoint = save_checkpoint(
            checkpoint_dir(self.out, self.step), models=models, tokenizer=self.tokenizer, objects=objects, state=self._trainer_state(),
            keep=self.cfg.keep_checkpoints,
        )
        return self.last_checkpoint

    def _trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "batcher": self.batcher.state_dict(),
            "kl_controller": self.kl_ctl.state_dict(),
            "eval_history": self.eval_history,
            "algorithm": self.cfg.algorithm,
        }

    def _save_distributed_checkpoint(self) -> Path:
        """torchrun: model and optimizer shards through torch.distributed.checkpoint, every
        rank's RNG, and (rank 0) the policy as a Hugging Face directory from the sampler's
        full copy, schedulers and the trainer state. Loads in any world size, 1 included."""
        models: dict[str, torch.nn.Module] = {"policy": self.policy}
        optimizers: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {"optimizer": (self.policy, self.optimizer)}
        schedulers: dict[str, Any] = {"scheduler": self.scheduler}
        if self.critic is not None:
            models["critic"] = self.critic
            optimizers["critic_optimizer"] = (self.critic, self.critic_optimizer)
            schedulers["critic_scheduler"] = self.critic_scheduler
        self.last_checkpoint = save_distributed_checkpoint(
            checkpoint_dir(self.out, self.step), models=models, optimizers=optimizers, schedulers=schedulers,
            state={**self._trainer_state(), "world_size": self.dist.world_size},
            hf_policy=self.sampler_model, tokenizer=self.tokenizer, rank=self.dist.rank, barrier=self.dist.barrier,
            keep=self.cfg.keep_checkpoints,
        )
        return self.last_checkpoint

    def _load_checkpoint(self, directory: Path) -> None:
        if is_distributed_checkpoint(directory):
            models: dict[str, torch.nn.Module] = {"policy": self.policy}
            optimizers = {"optimizer": (self.policy, self.optimizer)}
            schedulers: dict[str, Any] = {"scheduler": self.scheduler}
            if self.critic is not None:
                models["critic"] = self.critic
                optimizers["critic_optimizer"] = (self.critic, self.critic_optimizer)
                schedulers["critic_scheduler"] = self.critic_scheduler
            state, rng = load_distributed_checkpoint(
                directory, models=models, optimizers=optimizers, schedulers=schedulers, rank=self.dist.rank if self.dist else 0,
            )
            self._restore_trainer_state(directory, state)
            set_rng_state(rng)
            return
        if self.dist is not None:
            raise ValueError(
                f"resume: {directory} is a single-process checkpoint; resume it without torchrun (a torchrun run "
                "writes sharded checkpoints that resume in any number of processes)"
            )
        state, objects, rng = load_checkpoint_state(directory)
        if state.get("algorithm") != self.cfg.algorithm:
            raise ValueError(f"resume: the checkpoint was written by algorithm {state.get('algorithm')!r}, this run is {self.cfg.algorithm!r}")
        self.optimizer.load_state_dict(objects["optimizer"])
        self.scheduler.load_state_dict(objects["scheduler"])
        if self.critic is not None:
            self.critic_optimizer.load_state_dict(objects["critic_optimizer"])
            self.critic_scheduler.load_state_dict(objects["critic_scheduler"])
        self._restore_trainer_state(directory, state)
        set_rng_state(rng)

    def _restore_trainer_state(self, directory: Path, state: dict[str, Any]) -> None:
        if state.get("algorithm") != self.cfg.algorithm:
            raise ValueError(f"resume: the checkpoint was written by algorithm {state.get('algorithm')!r}, this run is {self.cfg.algorithm!r}")
        self.batcher.load_state_dict(state["batcher"])
        self.kl_ctl.load_state_dict(state["kl_controller"])
        self.eval_history = list(state.get("eval_history", []))
        self.step = int(state["step"])
        self.last_checkpoint = directory

    # ================================================================== the run
    def train(self, *, stop_after: int | None = None) -> TrainResult:
        """Run to ``config.steps``; evaluate, log and checkpoint on the way; save the final model.

        ``stop_after=n`` pauses after step ``n`` instead (a checkpoint is written, no final
        model): the run continues from there with ``resume``, exactly as if uninterrupted.
        A budget (``max_seconds``, ``max_generated_tokens``) ends the run early instead: final
        evaluation, model and summary as at the last step; ``summary.json`` says what stopped it.
        """
        cfg = self.cfg
        end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
        spent_seconds = spent_tokens = 0.0
        out_of_budget: str | None = None
        if self.is_main:
            self.logger = MetricsLogger(self.out, total_steps=cfg.steps, tensorboard=cfg.tensorboard, progress=cfg.progress,
                                        start_step=self.step, progress_desc=rl_progress_label(cfg))
        else:  # under torchrun rank 0 writes the logs (its metrics are already over every rank)
            self.logger = _SilentLogger()
        try:
            if self.sft_metrics:
                self.logger.log_eval(self.step, self.sft_metrics)
            if cfg.eval_every and self.step == 0:
                self._run_eval()
            while self.step < end:
                metrics = self.train_step()
                self.logger.log(self.step, metrics, extra={"reward/histogram": self._reward_histogram})
                # every rank must stop at the same step (FSDP2 collectives): the slowest rank's clock
                step_seconds = metrics["time/step"]
                if self.dist is not None and cfg.max_seconds is not None:
                    step_seconds = float(self.dist.all_reduce(torch.tensor([step_seconds], dtype=torch.float64, device=self.dist.device), op="max")[0])
                spent_seconds += step_seconds
                spent_tokens += metrics["rollout/generated_tokens"]
                out_of_budget = _budget_spent(cfg, seconds=spent_seconds, generated_tokens=spent_tokens)
                if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == cfg.steps or out_of_budget):
                    self._run_eval()
                if out_of_budget:
                    break
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.steps:
                    self.save_checkpoint()
            self.save_checkpoint()
            if self.step < cfg.steps and not out_of_budget:
                return TrainResult(self.out, self.step, list(self.eval_history), None)
            final = self.out / "final"
            self._save_final(final)
            if self.is_main:
                summary = {"steps": self.step, "eval_history": self.eval_history, "final_model": str(final),
                           "stopped_by": out_of_budget or "steps"}
                (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
            if self.dist is not None:
                self.dist.barrier()
            return TrainResult(self.out, self.step, list(self.eval_history), final)
        finally:
            self.logger.close()

    def _save_final(self, final: Path) -> None:
        if self.dist is None:
            self.policy.save_pretrained(final, safe_serialization=True)
            self.tokenizer.save_pretrained(final)
            if self.critic is not None:
                self.critic.save(self.out / "final_critic")
            return
        # torchrun: the sampler's copy holds the full, synced policy; the critic is gathered
        critic_state = None
        if self.critic is not None:
            critic_state = dict(dist_mod.full_named_tensors(self.critic))
        if self.is_main:
            self.sampler_model.save_pretrained(final, safe_serialization=True)
            self.tokenizer.save_pretrained(final)
            if critic_state is not None:
                critic = ValueModel(copy.deepcopy(self.sampler_model))
                critic.load_state_dict(critic_state, strict=False)
                critic.save(self.out / "final_critic")

    def _run_eval(self) -> None:
        if not self.eval_rows:
            return
        if self.logger is not None and self.cfg.progress:  # an evaluation can take a while: say what runs now
            self.logger.message(describe_evaluation(self.cfg, len(self.eval_rows), self.step))
        metrics = self.evaluate()
        metrics["step"] = float(self.step)
        if not self.eval_history or self.eval_history[-1].get("step") != float(self.step):
            self.eval_history.append(metrics)
        if self.logger is not None:
            self.logger.log_eval(self.step, metrics)

    def close(self) -> None:
        if self.run_lock is not None:
            self.run_lock.release()
        self.rewards.close()
        if hasattr(self.sampler, "close"):
            self.sampler.close()
        if self.dist is not None and self.dist.owns_process_group:
            import torch.distributed

            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _SilentLogger:
    """The logger of ranks other than 0 under torchrun: writes nothing."""

    def log(self, *args, **kwargs) -> None: ...
    def log_eval(self, *args, **kwargs) -> None: ...
    def write_samples(self, *args, **kwargs) -> None: ...
    def message(self, *args, **kwargs) -> None: ...
    def close(self) -> None: ...


def _check_distributed(cfg: TrainConfig, ctx: "dist_mod.DistContext") -> None:
    """What data parallel cannot run: a clear ValueError on every rank before any work."""
    # first, so every later check sees the same config on every rank
    ctx.check_same("configuration", dist_mod.config_fingerprint(cfg))
    world = ctx.world_size
    if cfg.sampler == "vllm":
        raise ValueError(
            "sampler='vllm' (an engine inside the training process) is single-process only; under torchrun the ranks "
            "share one engine through `fastrl vllm-server` (--sampler vllm-server URL), or each samples with sampler=hf"
        )
    if cfg.prompt_token_budget is not None:
        raise ValueError("prompt_token_budget gives batches of varying prompt counts; under torchrun use prompts_per_step")
    if cfg.prompts_per_step % world:
        raise ValueError(
            f"prompts_per_step={cfg.prompts_per_step} is not divisible by the world size {world}: every rank samples "
            f"whole groups of an equal share of the prompts (use a multiple of {world})"
        )
    per_rank = cfg.prompts_per_step // world
    if per_rank < cfg.mini_batches:
        raise ValueError(
            f"mini_batches={cfg.mini_batches} but each of the {world} ranks has only {per_rank} prompts per step; "
            f"raise prompts_per_step to at least {world * cfg.mini_batches}"
        )


def _budget_spent(cfg: TrainConfig, *, seconds: float, generated_tokens: float) -> str | None:
    """The budget field this run has used up (``max_seconds`` / ``max_generated_tokens``), or None."""
    if cfg.max_seconds is not None and seconds >= cfg.max_seconds:
        return "max_seconds"
    if cfg.max_generated_tokens is not None and generated_tokens >= cfg.max_generated_tokens:
        return "max_generated_tokens"
    return None


def _check_shared_prefix_support(model: torch.nn.Module) -> None:
    from fastrl.ops.hf_packed import check_shared_prefix_support

    try:
        check_shared_prefix_support(model)
    except ValueError as e:
        raise ValueError(f"{e}; set shared_prefix=false to train on padded rows") from None


_LOSS_SHARES = frozenset({"pg_loss", "kl_loss", "entropy_loss", "critic_loss"})
"""Loss terms a micro-batch reports as its share of the mini-batch loss (global count): they add up."""

_METRIC_NAMES = {
    "pg_loss": "loss/pg", "clip_frac": "loss/clip_frac", "clip_frac_low": "loss/clip_frac_low",
    "clip_frac_high": "loss/clip_frac_high", "dual_clip_frac": "loss/dual_clip_frac", "approx_kl": "kl/approx_old",
    "ratio_mean": "ratio/mean", "ratio_min": "ratio/min", "ratio_max": "ratio/max", "kl_loss": "loss/kl",
    "kl_ref_mean": "kl/ref", "entropy_loss": "loss/entropy", "entropy_mean": "entropy/mean",
    "is_weight_mean": "rollout/is_weight_mean", "critic_loss": "critic/loss", "loss": "loss/total",
}


def _metric_name(name: str) -> str:
    if name in _METRIC_NAMES:
        return _METRIC_NAMES[name]
    if name.startswith("critic_"):
        return "critic/" + name[len("critic_"):]
    return "loss/" + name


def _merge_rollouts(kept: list[tuple[Rollout, list[int]]], *, group_size: int, limit: int, pad_token_id: int) -> Rollout:
    """One rollout from the informative groups of several (dynamic sampling), at most ``limit`` groups."""
    G = group_size
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
            sl = slice(g * G, (g + 1) * G)
            comps.extend(ro.batch.completion_ids[sl])
            logps.extend(ro.batch.completion_logp[sl])
            reasons.extend(ro.batch.finish_reasons[sl])
            texts.extend(ro.completions[sl])
            rewards.append(ro.rewards[sl])
            for name, v in ro.per_function.items():
                per_fn.setdefault(name, []).append(v[sl])
    stats.prompts, stats.samples = len(prompts), len(comps)
    batch = RolloutBatch.from_samples(prompts, comps, logps, reasons, group_size=G, pad_token_id=pad_token_id, stats=stats)
    return Rollout(
        batch, rows, texts, torch.cat(rewards),
        {k: sum(v) / len(v) for k, v in metrics.items()},
        {k: torch.cat(v) for k, v in per_fn.items()},
    )


@torch.no_grad()
def _copy_named_(module: torch.nn.Module, named) -> None:
    """Copy ``(name, tensor)`` pairs into ``module``'s parameters of those names."""
    params = dict(module.named_parameters())
    for name, t in named:
        params[name].copy_(t)
