"""The lean RL loop. One step, top to bottom (``Trainer.train_step``):

1. prompts      ``PromptBatcher`` (by prompt count or token budget; resumable position)
2. rollout      ``GroupSampler.generate`` (HF shared-prefix sampler, vLLM, a shared server)
                with ``async_steps``: sampled steps ahead by a sampler process of its own
                (``async_collect.py``), the loss told through ``rollout_correction``
3. rewards      ``RewardPool.score`` (TRL-signature functions in a process pool with hard
                time limits); DAPO's dynamic sampling drops all-equal groups and refills
4. log-probs    old (skipped when the update is exactly on-policy), reference (only with a
                KL term), on the step's ``Experience``
5. advantages   ``group_advantages`` or, for PPO, critic values + ``gae``
6. update       ppo_epochs x mini-batches x micro-batches (token budget); the loss takes the
                mini-batch's global token/sequence counts, so the update does not depend on
                the micro-batch split; gradient clipping; AdamW; warm-up + cosine
7. weight sync  ``push_weights`` to the sampler, then a probe: the sampler's log-probs of a
                fixed greedy sequence must equal the trainer's
8. metrics, held-out evaluation, checkpoints

The rooms around the loop: ``assemble.py`` (``__init__``'s stages, in order, each returning
the named object the loop uses), ``experience.py`` (the step's tensors by name), ``batching.py``
(padded rows or packed groups: micro-batches, forwards, gather/scatter), ``ranks.py``
(everything cross-process; the identity in one process), ``samplers.py`` (the sampler
registry), ``policy.py``, ``optimizers.py``, ``weights.py`` (sync and probe), ``evaluate.py``, ``checkpoint.py``,
``seeds.py``, ``score.py``, ``metrics.py``. Every number is computed by a fastrl op
(``fastrl.ops``); this file only moves tensors between them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import operator
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from fastrl.ops import GlobalCounts, policy_loss, value_loss
from fastrl.ops.stats import every_kth, sampled_mean
from fastrl.rollout.base import RolloutBatch, SamplingConfig
from fastrl.rollout.metric_names import GENERATED_TOKENS
from fastrl.train import advantages, assemble, seeds
from fastrl.train.run.checkpoint import check_algorithm, checkpoint_dir, save_final, set_rng_state
from fastrl.train.collect import rollout_sampling
from fastrl.train.config import TrainConfig
from fastrl.train.correction import rollout_correction
from fastrl.train.experience import Experience
from fastrl.train.run.faults import TrainingDivergedError, divergence_message
from fastrl.train.batching import MicroBatch, make_batching
from fastrl.train.run.metrics import (
    LOSS_SHARES, LogpGap, MetricsLogger, SilentLogger, StageTimer, peak_memory_bytes, update_metric_name,
)
from fastrl.train.run.progress import describe_evaluation, rl_progress_label
from fastrl.train.samplers import sampler_spec
from fastrl.train.schedule import AdaptiveKLController
from fastrl.train.run.warmup_checkpoint import remove_warmup_checkpoints
from fastrl.train.weights import WeightSyncError, check_gap, probe_gap, push_weights

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler
    from transformers import PreTrainedTokenizerBase

    from fastrl.train.run.interrupt import StopRequests


__all__ = ["Trainer", "TrainResult", "TrainingDivergedError", "WeightSyncError"]


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


ENTROPY_METRIC_STRIDE = 7
"""Without an entropy term in the loss, the ``entropy/mean`` metric is the mean entropy of
every 7th trained token of each micro-batch (the first included), computed in the training
forward's own log-prob pass from the logits it already holds (``linear_logprobs``'s
``entropy_rows``): no full-vocabulary entropy pass. A prime, so the sampled positions shift
from one sequence to the next."""

SHARED_WEIGHTS_PROBE_EVERY = 10
"""Default steps between weight-sync probes for a sampler that runs the policy module itself
(nothing is copied, so the probe only guards against regressions); 1 for a sampler with a copy."""

RUN_FILES = ("metrics.jsonl", "checkpoints", "reference", "final", "samples.txt", "tensorboard", "sampler_init",
             "final_critic", "summary.json")
"""What a run writes into output_dir: a new run refuses (or with overwrite, removes) an earlier run's."""


def _part(path: str) -> property:
    """A read-only attribute that is a part of one of the trainer's stage objects
    (``"models.critic"``: ``self.models.critic``)."""
    return property(operator.attrgetter(path), doc=f"``self.{path}``")


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
        tokenizer: PreTrainedTokenizerBase | None = None,
        train_rows: Sequence[dict[str, Any]] | None = None,
        eval_rows: Sequence[dict[str, Any]] | None = None,
        reward_functions: Sequence[Callable | str] | None = None,
        stop: StopRequests | None = None,
    ):
        """``stop``: a ``fastrl.train.run.interrupt.StopRequests`` (the command line's signal
        handlers): a signal during the warm-up saves its state at the next warm-up step and raises
        ``RunInterrupted`` naming it (``--resume latest`` continues the warm-up); ``train`` uses it
        too unless given its own."""
        self._stop = stop
        # the stages of ``assemble.py``, in its order (the order the global RNG is drawn in)
        self.cfg = cfg = config.resolved(model_given=model is not None)
        self.spec = sampler_spec(cfg.sampler)
        self.loss_config = cfg.policy_loss_config()
        self.site = site = assemble.open_run(cfg, run_files=RUN_FILES)
        self.timer = StageTimer(site.device)
        self.loaded = loaded = assemble.load_policy(cfg, site, model=model, tokenizer=tokenizer)
        self.inputs = inputs = assemble.build_inputs(cfg, site, loaded, train_rows=train_rows, eval_rows=eval_rows)
        connected = assemble.connect_sampler(cfg, self.spec, loaded, inputs)
        self.scoring = scoring = assemble.build_scoring(cfg, loaded, inputs, reward_functions)
        try:
            self.warmup = assemble.warm_up(cfg, site, loaded, inputs, scoring, stop=stop)
        except BaseException:  # a stopped (or failed) warm-up: its worker processes and the folder's lock go now
            site.release()
            if scoring.rewards is not None:
                scoring.rewards.close()
            if inputs.agent is not None:
                inputs.agent.close()
            raise
        self.models = models = assemble.build_models(cfg, site, loaded, inputs)
        self.kl_ctl = AdaptiveKLController(float(cfg.kl_coef or 0.0), target=cfg.kl_target, horizon=cfg.kl_horizon)
        self.layout = make_batching(shared_prefix=cfg.shared_prefix, prefix_tree=cfg.prefix_tree,
                                    token_budget=cfg.micro_batch_tokens, device=site.device,
                                    temperature=cfg.temperature, forward_context=self._forward_context)

        # ---- the loop's own state, restored on resume (before the sampler: it starts from the restored weights)
        self.step = 0
        self.logger: Any = None
        self._reward_histogram: dict[str, list[float]] = {}
        self.last_checkpoint: Path | None = None
        self.eval_history: list[dict[str, float]] = []
        self.sync_gaps: list[float] = []
        if site.resume_dir is not None:
            self._load_checkpoint(site.resume_dir)

        self.sampler = assemble.open_sampler(cfg, self.spec, site, loaded, inputs, models, connected)
        self.sampler_shares_weights = not self.spec.own_weights and models.full_copy is None
        """The sampler runs the policy module itself: nothing to push, the probe is a guard."""
        if self.spec.push_on_start:
            self._push_weights()  # the policy's weights (after warm-up or resume) before the first rollout
        loop = assemble.build_loop(cfg, site, loaded, inputs, scoring, models, sampler=self.sampler)
        self.collector, self.evaluator = loop.collector, loop.evaluator  # attributes: tests wrap or swap them
        self._write_config()

    # ---- the stages' parts by the names the loop, tests and callers read
    ranks = _part("site.ranks")
    device = _part("site.device")
    is_main = _part("site.is_main")
    out = _part("site.out")
    resume_dir = _part("site.resume_dir")
    policy = _part("loaded.module")
    tokenizer = _part("loaded.tokenizer")
    builtin = _part("loaded.builtin")
    train_rows = _part("inputs.prompts.train_rows")
    encoded = _part("inputs.prompts.train_ids")
    eval_rows = _part("inputs.prompts.eval_rows")
    rewards = _part("scoring.rewards")
    checkpointing = _part("models.checkpointing")
    reference = _part("models.reference")
    critic = _part("models.critic")
    optimizer = _part("models.optimizers.optimizer")

    # ================================================================== the run
    def train(self, *, stop_after: int | None = None, stop: StopRequests | None = None) -> TrainResult:
        """Run to ``config.steps``; evaluate, log and checkpoint on the way; save the final model.

        ``stop_after=n`` pauses after step ``n`` instead (a checkpoint is written, no final
        model): the run continues from there with ``resume``, exactly as if uninterrupted.
        A budget (``max_seconds``, ``max_generated_tokens``) ends the run early instead: final
        evaluation, model and summary as at the last step; ``summary.json`` says what stopped it.

        Checkpoints: after the warm-up (step 0, so an interruption never loses it), every
        ``save_every`` steps, and at the end of the first step ``save_every_minutes`` after the
        last one. ``stop``: a ``fastrl.train.run.interrupt.StopRequests`` (the command line's
        signal handlers): once it is ``requested``, the loop ends the step in progress,
        checkpoints and raises ``RunInterrupted`` naming the checkpoint.
        """
        cfg = self.cfg
        stop = self._stop if stop is None else stop
        end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
        spent_seconds = spent_tokens = 0.0
        out_of_budget: str | None = None
        if self.is_main:
            self.logger = MetricsLogger(self.out, total_steps=cfg.steps, tensorboard=cfg.tensorboard, progress=cfg.progress,
                                        start_step=self.step, progress_desc=rl_progress_label(cfg))
        else:  # under torchrun rank 0 writes the logs (its metrics are already over every rank)
            self.logger = SilentLogger()
        if stop is not None:
            stop.deferring = True  # a signal from now on ends the step in progress, then checkpoints
        self._last_save_time = time.monotonic()
        try:
            if self.warmup.metrics:
                self.logger.log_eval(self.step, self.warmup.metrics, probes=self.warmup.probes)
                if self.step == 0 and self.resume_dir is None:
                    self.save_checkpoint()  # the warm-up's policy: what --resume latest starts RL from
                    if self.is_main:  # it supersedes a paused warm-up's checkpoints
                        remove_warmup_checkpoints(self.out)
            if cfg.eval_every and self.step == 0:
                self._run_eval()
            early = self._stop_or_overdue(stop)[0] if self.last_checkpoint is not None else 0
            if early:  # a signal during the first evaluation: the checkpoint of this step exists, stop here
                from fastrl.train.run.interrupt import RunInterrupted

                raise RunInterrupted(early, checkpoint=self.last_checkpoint, step=self.step)
            while self.step < end:
                metrics = self.train_step()
                self.logger.log(self.step, metrics, extra={"reward/histogram": self._reward_histogram})
                # every rank must stop at the same step (FSDP2 collectives): the slowest rank's clock
                step_seconds = torch.tensor(metrics["time/step"], dtype=torch.float64)
                spent_seconds += float(self.ranks.max(step_seconds)) if cfg.max_seconds is not None else metrics["time/step"]
                spent_tokens += metrics[GENERATED_TOKENS]
                out_of_budget = _budget_spent(cfg, seconds=spent_seconds, generated_tokens=spent_tokens)
                if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == cfg.steps or out_of_budget):
                    self._run_eval()
                if out_of_budget:
                    break
                stop_signal, overdue = self._stop_or_overdue(stop)
                saved = False
                if self.step < cfg.steps and ((cfg.save_every and self.step % cfg.save_every == 0) or overdue or stop_signal):
                    self.save_checkpoint()
                    saved = True
                if stop_signal and self.step < end:  # (a signal during the last step lets the run finish)
                    from fastrl.train.run.interrupt import RunInterrupted

                    raise RunInterrupted(stop_signal, checkpoint=self.last_checkpoint if saved else None, step=self.step)
            self.save_checkpoint()
            if self.step < cfg.steps and not out_of_budget:
                return TrainResult(self.out, self.step, list(self.eval_history), None)
            final = self.out / "final"
            self._save_final(final)
            if self.is_main:
                summary = {"steps": self.step, "eval_history": self.eval_history, "final_model": str(final),
                           "stopped_by": out_of_budget or "steps"}
                (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
            self.ranks.barrier()
            return TrainResult(self.out, self.step, list(self.eval_history), final)
        finally:
            if stop is not None:
                stop.deferring = False
            self.logger.close()

    def _stop_or_overdue(self, stop: StopRequests | None) -> tuple[int, bool]:
        """After a step: the signal that asks the run to stop (0: none) and whether a
        wall-time checkpoint is due (``save_every_minutes``); under torchrun every rank takes
        the largest of each, so all stop and save at the same step."""
        minutes = self.cfg.save_every_minutes
        elapsed = time.monotonic() - self._last_save_time
        signum = float(stop.signum or 0) if stop is not None else 0.0
        agreed = self.ranks.max(torch.tensor([signum, elapsed], dtype=torch.float64)) if self.ranks.sharded else (signum, elapsed)
        return int(agreed[0]), bool(minutes) and float(agreed[1]) >= minutes * 60.0

    def train_step(self) -> dict[str, float]:
        """One RL step; returns its metrics."""
        cfg = self.cfg
        self.timer = StageTimer(self.device)
        t_step = time.perf_counter()
        rollout, metrics = self.collector.collect(sampler=self.sampler, step=self.step, timer=self.timer)
        exp = self.collector.experience(rollout, device=self.device)
        metrics.update(self.layout.describe(exp))  # which layout this step trains on (layout/tree)

        # ---- log-probs of the behaviour and reference policies
        correction = rollout_correction(cfg.rollout_correction)
        if correction.sampler_is_old:
            exp.old_logp = exp.sampler_logp
        elif not cfg.on_policy or cfg.kl_in_reward or correction.recompute:
            with self.timer("old_logp"):
                exp.old_logp = self._token_logprobs(self.policy, exp)
        gap = LogpGap()  # sampler vs trainer on trained tokens: from the trainer's own pass, else from the update's
        trainer_pass = exp.old_logp is not None and not correction.sampler_is_old
        if trainer_pass:
            gap.add(exp.old_logp, exp.sampler_logp, exp.loss_mask)
        if self.reference is not None:
            with self.timer("ref_logp"), self.reference.resident() as reference:
                exp.ref_logp = self._token_logprobs(reference, exp)

        # ---- advantages
        with self.timer("advantages"):
            metrics.update(self._advantages(exp))

        # ---- update
        with self.timer("update"):
            metrics.update(self._update(exp, gap=None if trainer_pass else gap))
        metrics.update(gap.metrics(self.ranks))
        if exp.token_kl is not None:
            self.kl_ctl.update(metrics["kl/ref_seq"], int(self.ranks.sum(exp.num_samples)))

        # ---- weight sync + probe
        with self.timer("sync"):
            gap = self._sync_weights()
        if gap is not None:
            metrics["sync/probe_gap"] = gap

        self.step += 1
        # ---- metrics
        step_metrics, self._reward_histogram = self.collector.step_metrics(rollout, exp)
        metrics.update(step_metrics)
        if self.inputs.prompts.dropped:
            metrics["data/dropped_long_prompts"] = float(self.inputs.prompts.dropped)
        if self.logger is not None:  # the logged samples are this rank's (rank 0 logs)
            self.logger.write_samples(self.step, *self.collector.samples(rollout, self.tokenizer))
        metrics["time/step"] = time.perf_counter() - t_step
        for stage, s in self.timer.seconds.items():
            metrics[f"time/{stage}"] = s
        gen_s = self.timer.seconds.get("generate", 0.0)
        metrics["throughput/generate_tokens_per_s"] = metrics[GENERATED_TOKENS] / gen_s if gen_s > 0 else 0.0
        upd_s = self.timer.seconds.get("update", 0.0)
        trained = float(self.ranks.sum(exp.trained_tokens))
        metrics["throughput/train_tokens_per_s"] = trained * cfg.ppo_epochs / upd_s if upd_s > 0 else 0.0
        metrics["memory/peak_gb"] = peak_memory_bytes(self.device) / 2**30
        metrics["lr"] = self.models.optimizers.scheduler.get_last_lr()[0]
        return metrics

    def _update(self, exp: Experience, *, gap: LogpGap | None = None) -> dict[str, float]:
        """ppo_epochs x mini-batches (whole groups) x micro-batches; one optimizer step per mini-batch.
        ``gap``: fed the forwards before the first optimizer step (the policy is still the sampler's)."""
        cfg, ranks, layout, opt = self.cfg, self.ranks, self.layout, self.models.optimizers
        agg: dict[str, list[tuple[float, float]]] = {}
        grad_norms, critic_grad_norms = [], []
        padding_passes = 0
        g = torch.Generator().manual_seed(seeds.shuffle_seed(cfg.seed, self.step))
        for _epoch in range(cfg.ppo_epochs):
            order = torch.randperm(exp.num_groups, generator=g) if cfg.mini_batches > 1 else torch.arange(exp.num_groups)
            for mini in ranks.split(order, cfg.mini_batches):
                groups = mini.sort().values.tolist()
                counts = ranks.global_counts(exp.counts(exp.rows(groups)))  # the whole (all-rank) mini-batch's
                micro = layout.micro_batches(exp, groups)
                # (micro-batch, live): zero-weight extra passes keep FSDP's collectives in step across ranks
                passes = ranks.padded_passes(micro, spare=lambda: layout.make(exp, [0]))
                padding_passes += len(passes) - len(micro)
                losses: list[torch.Tensor] = []
                for mb, live in passes:
                    with layout.attention(mb, self._trained_models()):
                        loss, lm = self._micro_batch_loss(mb, exp, counts=counts, live=live, gap=gap)
                    if live:
                        losses.append(loss)
                        weight = float(layout.gather(mb, exp.loss_mask).sum())
                        for name, v in lm.items():
                            agg.setdefault(name, []).append((float(v), weight))
                total = ranks.sum(torch.stack(losses).sum() if losses else torch.zeros((), device=self.device))
                grad_norm = ranks.clip_grad_norm(self.policy.parameters(), cfg.grad_clip)
                if not (torch.isfinite(total) and torch.isfinite(grad_norm)):
                    self._diverged(exp.batch, "loss" if not torch.isfinite(total) else "gradient norm", float(total), float(grad_norm))
                self._optimizer_step(opt.optimizer, opt.scheduler)
                gap = None  # the policy has moved: later forwards are not the sampler's policy
                grad_norms.append(float(grad_norm))
                agg.setdefault("loss", []).append((float(total), 1.0))
                if self.critic is not None:
                    cg = ranks.clip_grad_norm(self.critic.parameters(), cfg.grad_clip)
                    if not torch.isfinite(cg):
                        self._diverged(exp.batch, "critic gradient norm", float(total), float(cg))
                    self._optimizer_step(opt.critic_optimizer, opt.critic_scheduler)
                    critic_grad_norms.append(float(cg))
        pooled = ranks.pool_update_metrics(agg, updates=len(grad_norms), loss_shares=LOSS_SHARES)
        out = {update_metric_name(name): value for name, value in pooled.items()}
        out["grad_norm"] = max(grad_norms) if grad_norms else 0.0
        out.update(ranks.padding_metrics(padding_passes))
        if self.critic is not None:
            out["critic/grad_norm"] = max(critic_grad_norms) if critic_grad_norms else 0.0
            out["critic/explained_variance"] = ranks.explained_variance(exp.values, exp.returns, exp.loss_mask)
        return out

    # ================================================================== the step's stages
    def _sampling(self, *, salt: int) -> SamplingConfig:
        return rollout_sampling(self.cfg, step=self.step, salt=salt)

    def _experience(self, exp_or_batch: Experience | RolloutBatch) -> Experience:
        if isinstance(exp_or_batch, Experience):
            return exp_or_batch
        return Experience.from_rollout(exp_or_batch, group_size=self.cfg.group_size, device=self.device)

    @torch.no_grad()
    def _per_token(self, module: torch.nn.Module, exp: Experience, compute: Callable[[MicroBatch], torch.Tensor]) -> torch.Tensor:
        """``[B, T-1]`` fp32 values of ``compute(micro_batch)`` for every trained token (0
        elsewhere), with ``module`` in eval mode: the no-grad passes over a whole rollout."""
        B, T = exp.batch.input_ids.shape
        out = torch.zeros(B, T - 1, dtype=torch.float32, device=self.device)
        was_training = module.training
        module.eval()
        try:
            micro = self.layout.micro_batches(exp)
            for mb in micro:
                self.layout.scatter(mb, compute(mb), out)
            if module is self.policy or module is self.critic:
                for _ in range(self.ranks.pad_passes(len(micro))):
                    compute(micro[-1])  # FSDP all-gathers per forward: keep in step with the other ranks
        finally:
            module.train(was_training)
        return out * exp.loss_mask

    def _token_logprobs(self, model: torch.nn.Module, exp: Experience | RolloutBatch) -> torch.Tensor:
        """Log-probs of ``input_ids[:, 1:]`` under ``model`` (old or reference policy), ``[B, T-1]``."""
        return self._per_token(model, self._experience(exp), lambda mb: self.layout.logprobs(model, mb, entropy=False)[0])

    def _advantages(self, exp: Experience) -> dict[str, float]:
        """``advantages.estimate`` with the critic's no-grad pass (PPO) timed as ``values``."""
        def critic_values(exp: Experience) -> torch.Tensor:
            with self.timer("values"):
                return self._per_token(self.critic, exp, lambda mb: self.layout.values(self.critic, mb))

        return advantages.estimate(exp, cfg=self.cfg, ranks=self.ranks, kl_coef=self.kl_ctl.value,
                                   critic_values=critic_values if self.critic is not None else None)

    def compute_advantages(self, batch: RolloutBatch, outcome: torch.Tensor, mask: torch.Tensor, *, old_logp, ref_logp, sampler_logp):
        """``_advantages`` on a bare batch (tests and notebooks): returns ``(advantages,
        returns, values, token_kl, metrics)``."""
        exp = self._experience(batch)
        exp.rewards, exp.loss_mask = outcome.to(self.device), mask.to(self.device).float()
        exp.old_logp, exp.ref_logp = old_logp, ref_logp
        if sampler_logp is not None:
            exp.sampler_logp = sampler_logp
        metrics = self._advantages(exp)
        return exp.advantages, exp.returns, exp.values, exp.token_kl, metrics

    def _micro_batch_loss(self, mb: MicroBatch, exp: Experience, *, counts: GlobalCounts,
                          live: bool, gap: LogpGap | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward + backward of one micro-batch; returns its (detached) share of the policy
        loss and its metrics. ``live=False``: a zero-weight pass (zero loss and gradient).
        ``gap``: given the current log-probs against the sampler's on this micro-batch's trained tokens."""
        cfg = self.cfg

        def take(x: torch.Tensor) -> torch.Tensor:
            return self.layout.gather(mb, x)

        mask = take(exp.loss_mask) if live else torch.zeros_like(take(exp.loss_mask))
        cu_seqlens = self.layout.cu_seqlens(mb)
        uses_entropy = self.loss_config.entropy_coef != 0  # else: the metric's subsample only
        logp, entropy = self.layout.logprobs(self.policy, mb, entropy=True,
                                             entropy_rows=None if uses_entropy else every_kth(mask, ENTROPY_METRIC_STRIDE))
        if gap is not None and live:
            gap.add(logp, take(exp.sampler_logp), mask)
        loss_config = self.loss_config if not self.loss_config.kl_coef else self.loss_config.replace(kl_coef=self.kl_ctl.value)
        logp_inputs = rollout_correction(cfg.rollout_correction).loss_inputs(  # old/rollout/proximal log-probs
            sampler=take(exp.sampler_logp), trainer=take(exp.old_logp) if exp.old_logp is not None else None,
            current=logp.detach())
        loss, metrics = policy_loss(
            logp, advantages=take(exp.advantages), mask=mask,
            ref_logp=take(exp.ref_logp) if (exp.ref_logp is not None and self.loss_config.kl_coef) else None,
            entropy=entropy if uses_entropy else None,
            **logp_inputs,
            config=loss_config,
            global_counts=counts,
            cu_seqlens=cu_seqlens,
        )
        if not uses_entropy:
            metrics = {**metrics, "entropy_mean": sampled_mean(entropy.detach(), mask)}
        total = loss
        if self.critic is not None:
            values = self.layout.values(self.critic, mb)
            vloss, vm = value_loss(
                values.float(), take(exp.values), take(exp.returns), mask,
                clip=cfg.value_clip, loss_agg="token-mean", global_counts=counts, cu_seqlens=cu_seqlens,
            )
            total = loss + vloss
            metrics = {**metrics, **{f"critic_{k}": v for k, v in vm.items()}, "critic_loss": vloss.detach()}
        total.backward()
        return loss.detach(), metrics

    def _optimizer_step(self, optimizer: torch.optim.Optimizer, scheduler: LRScheduler) -> None:
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    def _trained_models(self) -> list[torch.nn.Module]:
        return [self.policy] + ([self.critic.body] if self.critic is not None else [])

    def _forward_context(self):
        """Around every model forward: bf16 autocast (``dtype``), and during forwards with grad
        activation offload (``offload_activations``: saved tensors -- with checkpointing, just
        each layer's input -- go to CPU memory, pinned on a GPU so the copies are asynchronous)."""
        stack = contextlib.ExitStack()
        if self.site.autocast_dtype is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.site.autocast_dtype))
        if self.cfg.offload_activations and torch.is_grad_enabled():
            stack.enter_context(torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda"))
        return stack

    def _diverged(self, batch: RolloutBatch, what: str, loss: float, grad_norm: float) -> None:
        rank = f"-rank{self.ranks.rank}" if self.ranks.sharded else ""
        path = self.out / f"diverged-step-{self.step + 1:06d}{rank}.pt"  # the step being taken, as the metrics number it
        torch.save({"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "response_mask": batch.response_mask,
                    "completion_ids": batch.completion_ids, "prompt_ids": batch.prompt_ids}, path)
        self.optimizer.zero_grad(set_to_none=True)
        raise TrainingDivergedError(divergence_message(
            step=self.step + 1, what=what, loss=loss, grad_norm=grad_norm, batch_path=path,
            last_checkpoint=self.last_checkpoint, save_every=self.cfg.save_every,
        ))

    def _push_weights(self) -> None:
        # one process: a sampler that runs the policy module itself needs nothing. torchrun:
        # the trainer's full copy is refreshed (the HF sampler runs it), a server gets rank 0's upload
        own_weights = self.spec.own_weights if self.ranks.sharded else not self.sampler_shares_weights
        push_weights(self.sampler, policy=self.policy, full_copy=self.models.full_copy, own_weights=own_weights, ranks=self.ranks)

    @torch.no_grad()
    def _sync_weights(self) -> float | None:
        """Push the policy's weights to the sampler, then (every ``sync_probe_every`` steps)
        compare the sampler's log-probs of a fixed greedy sequence with the trainer's."""
        self._push_weights()
        every = self.cfg.sync_probe_every or (SHARED_WEIGHTS_PROBE_EVERY if self.sampler_shares_weights else 1)
        if self.step % every:
            return None
        gap = probe_gap(self.sampler, self.policy, self.inputs.probe_prompt, max_new_tokens=self.cfg.max_new_tokens, device=self.device)
        self.sync_gaps.append(gap)
        check_gap(gap, tolerance=self.cfg.sync_probe_tolerance, step=self.step)
        return gap

    # ================================================================== evaluation
    def evaluate(self) -> dict[str, float]:
        """Held-out greedy accuracy, mean reward and pass@k (``evaluate.HeldOutEvaluator``)."""
        self.evaluator.sampler = self.sampler  # the trainer's sampler of the moment (tests may swap it)
        return self.evaluator()

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
            self.logger.log_eval(self.step, metrics, row_success=self.evaluator.last_row_success)

    # ================================================================== setup, checkpoints, the end
    def _write_config(self) -> None:
        import yaml

        if self.is_main:
            (self.out / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(self.cfg), sort_keys=False))

    def save_checkpoint(self) -> Path:
        """The policy, critic, optimizers, schedulers, RNG and trainer state (``checkpoint.RunCheckpoint``)."""
        state = {"step": self.step, "batcher": self.inputs.prompts.batcher.state_dict(), "kl_controller": self.kl_ctl.state_dict(),
                 "eval_history": self.eval_history, "algorithm": self.cfg.algorithm}
        self.last_checkpoint = self.models.checkpoint.save(
            checkpoint_dir(self.out, self.step), tokenizer=self.tokenizer, state=state, keep=self.cfg.keep_checkpoints,
            sharded=self.ranks.sharded, full_policy=self.models.full_copy, rank=self.ranks.rank, world_size=self.ranks.world_size,
            barrier=self.ranks.barrier, extra=self.collector.checkpoint_extra(),
        )
        self._last_save_time = time.monotonic()
        return self.last_checkpoint

    def _load_checkpoint(self, directory: Path) -> None:
        state, rng = self.models.checkpoint.load(directory, algorithm=self.cfg.algorithm, sharded=self.ranks.sharded, rank=self.ranks.rank)
        check_algorithm(state, self.cfg.algorithm)
        self.inputs.prompts.batcher.load_state_dict(state["batcher"])
        self.kl_ctl.load_state_dict(state["kl_controller"])
        self.eval_history = list(state.get("eval_history", []))
        self.step = int(state["step"])
        self.last_checkpoint = directory
        set_rng_state(rng)

    def _save_final(self, final: Path) -> None:
        save_final(final, policy=self.policy, critic=self.critic, critic_dir=self.out / "final_critic", tokenizer=self.tokenizer,
                   sharded=self.ranks.sharded, full_policy=self.models.full_copy, is_main=self.is_main)

    def close(self) -> None:
        self.site.release()
        if self.rewards is not None:
            self.rewards.close()
        self.collector.close()
        if self.inputs.agent is not None:
            self.inputs.agent.close()
        if hasattr(self.sampler, "close"):
            self.sampler.close()
        self.ranks.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _budget_spent(cfg: TrainConfig, *, seconds: float, generated_tokens: float) -> str | None:
    """The budget field this run has used up (``max_seconds`` / ``max_generated_tokens``), or None."""
    if cfg.max_seconds is not None and seconds >= cfg.max_seconds:
        return "max_seconds"
    if cfg.max_generated_tokens is not None and generated_tokens >= cfg.max_generated_tokens:
        return "max_generated_tokens"
    return None
