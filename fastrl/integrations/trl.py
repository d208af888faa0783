"""fastrl loss backend for TRL's ``GRPOTrainer``.

Switch an existing TRL script with one line::

    from fastrl.integrations.trl import GRPOTrainer   # was: from trl import GRPOTrainer

``GRPOTrainer`` here is :class:`FastRLGRPOTrainer`, a subclass of TRL's trainer that only
replaces the loss: the completion log-probabilities, the clipped policy loss, the KL term
and the vLLM importance-sampling correction are computed by
``fastrl.ops.fused_linear_policy_loss`` from the backbone's last hidden states and the LM
head weight, so the ``[tokens, vocab]`` logits are never materialised and the per-token
log-prob tensor is not kept for backward. Generation, rewards, advantages, optimiser,
logging and checkpointing are TRL's own.

The loss equals TRL's own ``_compute_loss`` (same value, same gradients up to float
rounding) for every combination below; ``tests/integrations/test_trl.py`` checks it
against the installed TRL.

============================  =========================================================
TRL setting                   fastrl mapping
============================  =========================================================
``loss_type="grpo"``          ``loss_agg="seq-mean-token-mean"``, ``global_seq_count=B*GA``
``loss_type="bnpo"``          ``token-mean``, ``global_token_count=max(mask.sum(),1)*GA``
``loss_type="dr_grpo"``       ``seq-mean-token-sum-norm``, ``norm_length=max_completion_length``,
                              ``global_seq_count=B*GA``
``loss_type="dapo"``          ``token-mean``, ``global_token_count`` = TRL's
                              ``num_items_in_batch / num_processes * GA / steps_per_generation``
``loss_type="luspo"``         ``seq-mean-token-sum``, ``global_seq_count=B*GA``
``epsilon``, ``epsilon_high``  ``clip_low``, ``clip_high``
``delta`` (> 1+epsilon_high)  ``dual_clip=delta`` (identical objective and gradient)
``importance_sampling_level``  ``ratio_level`` (``"sequence"``: gradient through the mean, as TRL)
``beta``                      ``kl_coef=beta``, k3, unclamped
``use_bias_correction_kl``    KL weighted by the differentiable ratio: computed on
                              ``fastrl.ops.linear_logprobs`` + ``policy_loss`` (still tiled)
vLLM IS correction            ``is_weight=`` TRL's ``importance_sampling_ratio`` (multiplies the
                              policy term)
top_entropy_quantile < 1,     ``is_weight=`` the mask (times the vLLM ratio), as TRL multiplies
off_policy_mask_threshold     them (two-stage path: ``linear_logprobs`` + ``policy_loss``)
``loss_type="cispo"``         ``surrogate="cispo"``, ``cispo_max=epsilon_high``; dapo's normalisation
``loss_type="sapo"``          ``surrogate="sapo"``, ``sapo_tau_pos/neg=sapo_temperature_pos/neg``;
                              grpo's normalisation
``loss_type="vespo"``         ``surrogate="vespo"``, ``vespo_*`` as TRL's; the vLLM ratio enters
                              VESPO's weight as ``rollout_logp = old - clamp(log ratio, log 1e-8, 20)``;
                              dapo's normalisation (two-stage: the logged ``phi`` needs the log-probs)
``entropy_coef`` /            two-stage (``linear_logprobs(return_entropy=True)``, entropy
``use_adaptive_entropy``      differentiable): ``- coef * mean(entropy) / GA`` over the (entropy-
                              masked) tokens for every loss type, with TRL's adaptive controller
============================  =========================================================

The surrogates are ``PolicyLossConfig.surrogate`` entries (``fastrl.reference.surrogates``,
checked there against TRL 1.16's formulas). Only the bias-corrected KL is computed here
(``fastrl.ops.kl_penalty`` (k3) times the ratio, with the loss type's normalisation in
``_fastrl_aggregate``). Only ``[tokens]``-sized tensors are materialised.

GA is ``current_gradient_accumulation_steps`` in training and 1 in evaluation, exactly as
TRL normalises. Settings fastrl cannot express exactly run TRL's own loss (a warning says
why, and ``trainer.fastrl_fallback_reason`` holds the reason): ``delta <= 1 +
epsilon_high``; MoE router aux loss; multimodal inputs; LM heads with logit soft-capping or
scaling, or heads that are not a plain ``nn.Linear`` (e.g. a LoRA-wrapped ``lm_head``).

Metrics: ``entropy``, ``kl`` and ``clip_ratio/{low,high,region}_mean`` are logged as TRL
logs them (token-weighted means over all processes; with ``importance_sampling_level=
"sequence"`` TRL averages the clip indicators per sequence instead). ``clip_ratio/low_min``
and ``clip_ratio/high_max`` need per-sequence statistics the fused loss does not return
and are not logged on the fused path. ``cispo_clip_ratio``, ``vespo/phi_seq_mean``,
``policy_loss`` and ``entropy_coef`` (entropy bonus) are logged as TRL logs them.

Tested with TRL 1.16.0 (``SUPPORTED_TRL``): the subclass overrides TRL's private
``_compute_loss`` and reads trainer attributes of that release.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import torch
from torch import nn

import fastrl.ops as _ops
from fastrl.config import PolicyLossConfig
from fastrl.ops.surrogates import surrogate_params as _surrogate_params
from fastrl.ops.surrogates import vespo_phi as _vespo_phi

try:
    import trl as _trl
    from trl import GRPOTrainer as _TRLGRPOTrainer
except ImportError as exc:  # pragma: no cover - exercised only without TRL
    raise ImportError("fastrl.integrations.trl needs TRL: pip install 'trl>=1.16,<1.17'") from exc

__all__ = ["FastRLGRPOTrainer", "GRPOTrainer", "SUPPORTED_TRL", "trl_loss_config"]

SUPPORTED_TRL = ">=1.16,<1.17"
"""TRL releases this adapter is tested against (it overrides a private method)."""

_LOSS_AGG = {
    # TRL loss_type -> (surrogate, loss_agg); the denominators come from the global counts of _compute_loss
    "grpo": ("ppo_clip", "seq-mean-token-mean"),
    "bnpo": ("ppo_clip", "token-mean"),
    "dr_grpo": ("ppo_clip", "seq-mean-token-sum-norm"),
    "dapo": ("ppo_clip", "token-mean"),
    "luspo": ("ppo_clip", "seq-mean-token-sum"),
    "cispo": ("cispo", "token-mean"),
    "sapo": ("sapo", "seq-mean-token-mean"),
    "vespo": ("vespo", "token-mean"),
}
_TOKEN_COUNT_TYPES = ("dapo", "cispo", "vespo")  # normalised by TRL's num_items_in_batch
_MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
    "spatial_shapes",
    "num_tiles",
)


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


if not ((1, 16) <= _version_tuple(_trl.__version__) < (1, 17)):
    warnings.warn(
        f"fastrl.integrations.trl is tested with TRL {SUPPORTED_TRL}; found {_trl.__version__}. "
        "Run tests/integrations/test_trl.py before trusting the results.",
        stacklevel=2,
    )


def trl_loss_config(
    *,
    loss_type: str,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None,
    importance_sampling_level: str,
    beta: float,
    max_completion_length: int,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
) -> PolicyLossConfig:
    """The ``PolicyLossConfig`` equivalent to TRL's GRPO loss settings.

    Raises ``ValueError`` for settings fastrl cannot express exactly (see module docs).
    """
    if loss_type not in _LOSS_AGG:
        raise ValueError(f"loss_type={loss_type!r} has no PolicyLossConfig equivalent (supported: {tuple(_LOSS_AGG)})")
    surrogate, agg = _LOSS_AGG[loss_type]
    dual_clip = None
    if delta is not None and surrogate == "ppo_clip":
        if not delta > 1.0 + epsilon_high:
            raise ValueError(
                f"delta={delta} <= 1 + epsilon_high={1 + epsilon_high}: TRL's two-sided clip then also bounds "
                "positive-advantage tokens, which fastrl's dual_clip does not"
            )
        dual_clip = float(delta)
    if not 0.0 <= epsilon_low < 1.0:
        raise ValueError(f"epsilon={epsilon_low} outside [0, 1)")
    return PolicyLossConfig(
        surrogate=surrogate,
        # VESPO's loss does not use TRL's importance_sampling_level (only its bias-corrected KL does, computed here)
        ratio_level="token" if surrogate == "vespo" else importance_sampling_level,
        clip_low=float(epsilon_low),
        clip_high=float(epsilon_high) if surrogate == "ppo_clip" else 0.2,
        dual_clip=dual_clip,
        cispo_max=float(epsilon_high) if surrogate == "cispo" else 5.0,
        sapo_tau_pos=float(sapo_temperature_pos),
        sapo_tau_neg=float(sapo_temperature_neg),
        vespo_k_pos=float(vespo_k_pos),
        vespo_lambda_pos=float(vespo_lambda_pos),
        vespo_k_neg=float(vespo_k_neg),
        vespo_lambda_neg=float(vespo_lambda_neg),
        kl_coef=float(beta),
        kl_estimator="k3",
        loss_agg=agg,
        norm_length=float(max_completion_length) if loss_type == "dr_grpo" else None,
    )


_LOG_1E8 = math.log(1e-8)  # TRL's VESPO clamps each log importance ratio to [log 1e-8, 20]
_VESPO_LOG_RATIO_MAX = 20.0


def _add_hidden_states_forward(model: nn.Module) -> None:
    """Let ``model(..., fastrl_hidden_states=True)`` return the backbone's last hidden states.

    Calling through the top-level model (rather than ``model.base_model`` directly) keeps
    DDP/FSDP/DeepSpeed forward hooks working. Without the flag, the forward is unchanged.
    """
    if getattr(model, "_fastrl_hidden_states_forward", False):
        return
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, fastrl_hidden_states: bool = False, **kwargs):
        if not fastrl_hidden_states:
            return inner(*args, **kwargs)
        kwargs["use_cache"] = False
        return model.base_model(*args, **kwargs).last_hidden_state

    model.forward = forward
    model._fastrl_hidden_states_forward = True


class FastRLGRPOTrainer(_TRLGRPOTrainer):
    """TRL's ``GRPOTrainer`` with its loss computed by fastrl's fused kernels.

    Takes every argument of ``trl.GRPOTrainer`` plus ``fastrl_backend`` ("auto", "triton" or
    "torch"; auto = Triton on CUDA). See the module docstring for the option mapping.
    """

    def __init__(self, *args: Any, fastrl_backend: str = "auto", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fastrl_backend = fastrl_backend
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        self._fastrl_base_model = base
        _add_hidden_states_forward(base)
        reason = self.fastrl_fallback_reason
        if reason is not None:
            warnings.warn(f"fastrl: using TRL's own loss because {reason}", stacklevel=2)

    # ------------------------------------------------------------------ support checks
    def _fastrl_loss_config(self) -> PolicyLossConfig:
        """The fastrl config of the trainer's current settings (read on every call, like TRL)."""
        args = self.args
        return trl_loss_config(
            loss_type=self.loss_type,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            delta=args.delta,
            importance_sampling_level=self.importance_sampling_level,
            beta=self.beta,
            max_completion_length=self.max_completion_length,
            sapo_temperature_pos=args.sapo_temperature_pos,
            sapo_temperature_neg=args.sapo_temperature_neg,
            vespo_k_pos=args.vespo_k_pos,
            vespo_lambda_pos=args.vespo_lambda_pos,
            vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg,
        )

    @property
    def fastrl_fallback_reason(self) -> str | None:
        """Why the loss runs on TRL's own code, or ``None`` when fastrl computes it."""
        try:
            self._fastrl_loss_config()
        except ValueError as exc:
            return str(exc)
        if self.aux_loss_enabled:
            return "the MoE router aux loss is enabled"
        cfg = self._fastrl_base_model.config.get_text_config()
        if getattr(cfg, "final_logit_softcapping", None) is not None:
            return "the LM head applies logit soft-capping"
        for name in ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"):
            if getattr(cfg, name, None) not in (None, 1, 1.0):
                return f"the LM head scales its logits ({name})"
        head = self._fastrl_base_model.get_output_embeddings()
        if type(head) is not nn.Linear:
            return f"the LM head is a {type(head).__name__}, not a plain nn.Linear"
        return None

    def _fastrl_needs_logp(self) -> bool:
        """Settings that need the per-token log-probs before the loss (two-stage path)."""
        return (
            self.loss_type == "vespo"  # the logged phi needs the log-probs
            or self._entropy_bonus_enabled
            or (self.beta != 0.0 and self.args.use_bias_correction_kl)
            or self.top_entropy_quantile < 1.0
            or self.off_policy_mask_threshold is not None
        )

    # ------------------------------------------------------------------ the loss
    def _compute_loss(self, model, inputs):
        if self.fastrl_fallback_reason is not None or any(inputs.get(k) is not None for k in _MULTIMODAL_KEYS):
            return super()._compute_loss(model, inputs)

        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        n_completion = completion_ids.size(1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]

        with self.accelerator.autocast():
            hidden = model(input_ids=input_ids, attention_mask=attention_mask, fastrl_hidden_states=True)
            device_type = hidden.device.type
            autocast_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
        # position t predicts token t+1: the completion tokens are predicted by the K positions before the last
        hidden = hidden[:, -n_completion - 1 : -1]
        head = self._fastrl_base_model.get_output_embeddings()
        weight, bias = head.weight, head.bias
        if type(weight).__name__ == "DTensor":  # FSDP2: gather the head once, as TRL does
            weight = weight.full_tensor()
            bias = None if bias is None else bias.full_tensor()
        hidden = hidden.to(weight.device)
        if self.args.cast_lm_head_to_fp32:
            hidden = hidden.float()
        elif autocast_dtype is not None:
            # TRL's head matmul runs under autocast: feed fastrl the same low-precision operands (fastrl then
            # accumulates and keeps the logits in fp32, where autocast would round them to autocast_dtype)
            hidden, weight = hidden.to(autocast_dtype), weight.to(autocast_dtype)
            bias = None if bias is None else bias.to(autocast_dtype)
        targets = completion_ids.to(weight.device)
        mask = mask.to(weight.device)

        mode = "train" if self.model.training else "eval"
        ga = self.current_gradient_accumulation_steps if mode == "train" else 1
        n_rows = completion_ids.size(0)
        cfg = self._fastrl_loss_config()
        gtc = None  # the token count of the loss types that normalise by tokens (TRL's own counts)
        if self.loss_type == "bnpo":
            gtc = mask.sum().to(torch.float32).clamp(min=1.0) * ga
        elif self.loss_type in _TOKEN_COUNT_TYPES:
            gtc = inputs["num_items_in_batch"].to(torch.float32).clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                gtc = gtc * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        # grpo, sapo, dr_grpo, luspo: mean over all rows of the micro-batch (empty rows count), / GA;
        # the aggregation rule picks the count cfg.loss_agg uses
        counts = _ops.GlobalCounts(tokens=gtc, sequences=float(n_rows * ga))

        advantages = inputs["advantages"]
        old_logp = inputs.get("old_per_token_logps")
        ref_logp = inputs["ref_per_token_logps"] if self.beta != 0.0 else None
        is_ratio = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            is_ratio = inputs["importance_sampling_ratio"]
        # VESPO folds TRL's vLLM ratio into its sequence weight (in log space, clamped as TRL); every other
        # loss type multiplies its policy term by it
        weight_pg = None if is_ratio is None or self.loss_type == "vespo" else is_ratio.to(torch.float32)
        vespo_is = is_ratio if self.loss_type == "vespo" else None
        common = dict(config=cfg, global_counts=counts, backend=self.fastrl_backend)

        if not self._fastrl_needs_logp():
            if old_logp is None:  # on-policy: TRL uses the current log-probs, detached
                with torch.no_grad():
                    old_logp = _ops.linear_logprobs(
                        hidden.detach(), weight.detach(), targets, bias=None if bias is None else bias.detach(),
                        temperature=self.temperature, backend=self.fastrl_backend,
                    )
            loss, metrics = _ops.fused_linear_policy_loss(
                hidden, weight, targets, old_logp, advantages, mask, bias=bias, ref_logp=ref_logp,
                is_weight=weight_pg, temperature=self.temperature, entropy=True, **common,
            )
        else:
            logp, entropy = _ops.linear_logprobs(
                hidden, weight, targets, bias=bias, temperature=self.temperature, return_entropy=True,
                backend=self.fastrl_backend,
            )
            old_logp = logp.detach() if old_logp is None else old_logp
            adv2d = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
            if self.off_policy_mask_threshold is not None:
                sampling = inputs.get("sampling_per_token_logps", old_logp)
                opm = self.get_off_policy_mask(adv2d, logp, sampling, mask, self.off_policy_mask_threshold)
                weight_pg = opm.to(torch.float32) if weight_pg is None else weight_pg * opm
            if self.top_entropy_quantile < 1.0:
                em = self.get_high_entropy_mask(entropy.detach(), mask, 1 - self.top_entropy_quantile)
                weight_pg = em.to(torch.float32) if weight_pg is None else weight_pg * em
            loss, metrics = self._fastrl_two_stage_loss(
                logp, old_logp, advantages, mask, ref_logp, entropy, weight_pg, vespo_is, common
            )
            metrics["entropy_mean"] = (entropy.detach() * mask).sum() / mask.sum().clamp(min=1)
            if self._entropy_bonus_enabled:
                keep = mask if self.top_entropy_quantile >= 1.0 else mask * em
                loss = self._fastrl_entropy_bonus(loss, entropy, keep, mode, ga)

        self._fastrl_log(mode, metrics, mask)
        return loss

    # ------------------------------------------------------------------ two-stage pieces (per-token log-probs given)
    def _fastrl_kl(self, logp, old_logp, ref_logp, mask) -> torch.Tensor:
        """TRL's per-token k3 KL, times the importance ratio when ``use_bias_correction_kl``."""
        kl = _ops.kl_penalty(logp, ref_logp, estimator="k3", backend=self.fastrl_backend)
        if self.args.use_bias_correction_kl:
            kl = kl * torch.exp(self._fastrl_log_weights(logp - old_logp, mask))
        return kl

    def _fastrl_log_weights(self, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """TRL's log importance weights: per token, or the masked row mean ([B, 1]) at sequence level."""
        if self.importance_sampling_level != "sequence":
            return log_ratio
        m = mask.to(log_ratio.dtype)
        return ((log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)

    def _fastrl_two_stage_loss(
        self, logp, old_logp, advantages, mask, ref_logp, entropy, weight_pg, vespo_is, common
    ):
        """The loss on given log-probs: ``policy_loss`` (any surrogate), plus the bias-corrected KL."""
        bias_kl = self.beta != 0.0 and self.args.use_bias_correction_kl
        if bias_kl:
            common = dict(common, config=common["config"].replace(kl_coef=0.0))
        rollout = None
        if vespo_is is not None:  # TRL: log w += sum_t clamp(log ratio_t, log 1e-8, 20)
            rollout = old_logp - torch.log(vespo_is.to(torch.float32)).clamp(_LOG_1E8, _VESPO_LOG_RATIO_MAX)
        loss, metrics = _ops.policy_loss(
            logp, old_logp, advantages, mask, ref_logp=None if bias_kl else ref_logp,
            entropy=entropy.detach(), rollout_logp=rollout, is_weight=weight_pg, **common,
        )
        if bias_kl:
            kl = self._fastrl_kl(logp, old_logp, ref_logp, mask)
            loss = loss + self.beta * self._fastrl_aggregate(kl, mask, common["global_counts"])
            metrics["kl_ref_mean"] = (kl.detach() * mask).sum() / mask.sum().clamp(min=1)
        if self.loss_type == "vespo":  # TRL logs phi once per row: recompute the row weights (no grad)
            metrics["vespo/phi_seq_mean"] = self._fastrl_vespo_row_phi(logp, old_logp, advantages, mask, rollout)
        return loss, metrics

    @torch.no_grad()
    def _fastrl_vespo_row_phi(self, logp, old_logp, advantages, mask, rollout) -> torch.Tensor:
        """VESPO's per-row weight phi ([B, 1]), as ``fastrl.ops.surrogates.vespo_phi`` computes it in the op."""
        m = mask.to(torch.float32)
        lr = torch.where(m > 0, logp.float() - old_logp.float(), 0.0)
        log_is = None if rollout is None else torch.where(m > 0, old_logp.float() - rollout, 0.0)
        adv = advantages.float().reshape(advantages.shape[0], -1)
        return _vespo_phi(lr, adv, m, log_is, _surrogate_params(self._fastrl_loss_config()))

    def _fastrl_aggregate(self, x: torch.Tensor, mask: torch.Tensor, counts: "_ops.GlobalCounts") -> torch.Tensor:
        """TRL's loss-type normalisation of a per-token term ([B, T] or [B, 1]): the house rule
        (``fastrl.ops.aggregate_loss``) with the global counts of ``_compute_loss``."""
        cfg = self._fastrl_loss_config()
        return _ops.aggregate_loss(x, mask, loss_agg=cfg.loss_agg, norm_length=cfg.norm_length, global_counts=counts)

    def _fastrl_entropy_bonus(self, loss, entropy, keep, mode: str, ga: int) -> torch.Tensor:
        """TRL 1.16's entropy bonus: ``loss - coef * mean(entropy over keep) / GA`` (the same for every
        loss type), with its adaptive coefficient controller and its ``policy_loss``/``entropy_coef`` logs."""
        keep = keep.to(entropy.dtype)
        token_sum, token_count = (entropy * keep).sum(), keep.sum()
        coef = self.entropy_coef
        if self.use_adaptive_entropy and not self._last_world_entropy <= self.args.entropy_target:
            coef = 0.0  # the coefficient of the previous step applies, and only below the entropy target
        policy_loss = loss.detach() * (1 if self.loss_type in _TOKEN_COUNT_TYPES else ga)
        loss = loss - coef * (token_sum / token_count.clamp(min=1.0) / ga)
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
        if self.use_adaptive_entropy and mode == "train":
            stats = torch.stack([token_sum, token_count]).detach()
            window = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
            self._entropy_window_stats = window
            if self.accelerator.sync_gradients:
                total = self.accelerator.reduce(window, reduction="sum")
                world = (total[0] / total[1].clamp(min=1.0)).item()
                step = self.args.entropy_coef_delta
                if world <= self.args.entropy_target:
                    self.entropy_coef = min(self.entropy_coef + step, self.args.entropy_coef_max)
                else:
                    self.entropy_coef = max(self.entropy_coef - step, self.args.entropy_coef_min)
                self._last_world_entropy = world
                self._entropy_window_stats = None
        if mode == "train" and self.accelerator.sync_gradients:
            self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
        return loss

    def _fastrl_log(self, mode: str, metrics: dict[str, torch.Tensor], mask: torch.Tensor) -> None:
        count = mask.sum().to(torch.float32)

        def global_mean(value: torch.Tensor) -> float:
            totals = self.accelerator.reduce(torch.stack([value.detach().float() * count, count]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        if self.beta != 0.0 and "kl_ref_mean" in metrics:
            self._metrics[mode]["kl"].append(global_mean(metrics["kl_ref_mean"]))
        if "entropy_mean" in metrics:
            self._metrics[mode]["entropy"].append(global_mean(metrics["entropy_mean"]))
        if "cispo_clip_frac" in metrics:
            self._metrics[mode]["cispo_clip_ratio"].append(global_mean(metrics["cispo_clip_frac"]))
        for key in ("vespo/phi_seq_mean",):  # TRL's masked mean; [B, 1] values count per row
            if key in metrics:
                x = metrics[key]
                m = mask.to(torch.float32) if x.shape[-1] != 1 else torch.ones_like(x)
                totals = self.accelerator.reduce(torch.stack([(x * m).sum(), m.sum()]), reduction="sum")
                self._metrics[mode][key].append((totals[0] / totals[1].clamp(min=1.0)).item())
        if "clip_frac_low" not in metrics:
            return
        low, high = metrics["clip_frac_low"], metrics["clip_frac_high"]
        self._metrics[mode]["clip_ratio/low_mean"].append(global_mean(low))
        self._metrics[mode]["clip_ratio/high_mean"].append(global_mean(high))
        self._metrics[mode]["clip_ratio/region_mean"].append(global_mean(low + high))


GRPOTrainer = FastRLGRPOTrainer
"""Alias so that ``from fastrl.integrations.trl import GRPOTrainer`` is the whole switch."""
