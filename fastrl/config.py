"""Configuration dataclasses for the loss ops.

Each field documents what it does and where it comes from. ``PolicyLossConfig.preset``
gives the published settings of the common algorithms; any field can be overridden.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from fastrl._checks import check_choice, check_scalar


@dataclass(frozen=True)
class SurrogateSpec:
    """One policy-gradient surrogate: its one definition. Every table that lists surrogates is
    derived from ``SURROGATE_SPECS`` (the PyTorch backend's and the reference's entries, the
    sets of surrogates that go through the ratio or fold the rollout weight, the metric names,
    the ``Surrogate`` choices); the Triton kernel's id table, which cannot import this module, is
    held equal to it by ``tests/ops/test_surrogates.py``. A new surrogate is a record here, its
    formula in ``fastrl.reference.surrogates``, its entry in ``fastrl.ops.surrogates`` and its
    branch in ``csrc_triton.policy_loss`` (the id below)."""

    name: str
    """``PolicyLossConfig.surrogate``; its formula is ``fastrl.reference.surrogates.<name>`` and
    its PyTorch backend entry ``fastrl.ops.surrogates.SURROGATES[name]``."""
    kernel_id: int
    """The Triton kernel's ``SURROGATE`` constexpr (``csrc_triton.policy_loss.SURROGATE_IDS``)."""
    options: tuple[str, ...]
    """The ``PolicyLossConfig`` fields it reads (a field of another surrogate's is unused)."""
    params: Callable[[PolicyLossConfig], tuple[float, ...]]  # (the config class comes below)
    """Its scalars as the kernel (``p0..p3``) and the PyTorch backend read them, at most four."""
    through_ratio: bool
    """Its gradient flows through the ratio (in sequence mode: the row's mean log-ratio); else
    it differentiates ``logp`` alone, its ratio weight detached."""
    folds_rollout_weight: bool
    """It takes the rollout log-weight ``old_logp - rollout_logp`` into its own formula instead
    of being multiplied by ``exp`` of it (so ``is_cap`` does not apply)."""
    sequence_weight: bool
    """Its per-token term carries a weight of the row's summed log-ratios: the loss of a token
    depends on its whole row (``ratio_level`` must be ``token``; no token-local pass)."""
    metric: str | None
    """The name its own per-token metric is reported under (its masked token mean), or None."""


SURROGATE_SPECS: dict[str, SurrogateSpec] = {spec.name: spec for spec in (
    SurrogateSpec("ppo_clip", kernel_id=0, options=("clip_low", "clip_high", "dual_clip"),
                  params=lambda c: (1.0 - c.clip_low, 1.0 + c.clip_high, float(c.dual_clip or 0.0)),
                  through_ratio=True, folds_rollout_weight=False, sequence_weight=False, metric="dual_clip_frac"),
    SurrogateSpec("cispo", kernel_id=1, options=("cispo_max",), params=lambda c: (c.cispo_max,),
                  through_ratio=False, folds_rollout_weight=False, sequence_weight=False, metric="cispo_clip_frac"),
    SurrogateSpec("sapo", kernel_id=2, options=("sapo_tau_pos", "sapo_tau_neg"),
                  params=lambda c: (c.sapo_tau_pos, c.sapo_tau_neg),
                  through_ratio=True, folds_rollout_weight=False, sequence_weight=False, metric=None),
    SurrogateSpec("vespo", kernel_id=3, options=("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
                  params=lambda c: (c.vespo_k_pos, c.vespo_lambda_pos, c.vespo_k_neg, c.vespo_lambda_neg),
                  through_ratio=False, folds_rollout_weight=True, sequence_weight=True, metric="vespo_phi_mean"),
)}
"""Every policy-gradient surrogate by name (``PolicyLossConfig.surrogate``), in the order of the choices."""

# One list per vocabulary: each Literal is the list; the tuples below are derived from it
# (the surrogates' list is the records' names).
RatioLevel = Literal["token", "sequence"]
IsLevel = Literal["token", "sequence"]
KLEstimator = Literal["k1", "k2", "k3"]
SURROGATES: tuple[str, ...] = tuple(SURROGATE_SPECS)
Surrogate = Literal[SURROGATES]  # type: ignore[valid-type]  (the choices, derived from the records)
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]

NORM_LENGTH_REQUIRED = (
    "norm_length is required with loss_agg='seq-mean-token-sum-norm' (Dr. GRPO's constant, e.g. the maximum "
    "completion length: PolicyLossConfig.preset('dr_grpo', norm_length=...)); normalising each micro-batch by "
    "its own padded length would make gradient accumulation differ from the full-batch update"
)

RATIO_LEVELS: tuple[str, ...] = get_args(RatioLevel)
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
LOSS_AGGS: tuple[str, ...] = get_args(LossAgg)
IS_LEVELS: tuple[str, ...] = get_args(IsLevel)


@dataclass(frozen=True)
class PolicyLossConfig:
    """Settings of the clipped policy-gradient loss (``fastrl.ops.policy_loss``).

    Per token (masked-in tokens only), with ``log_ratio = logp - old_logp``:

        ratio      = exp(log_ratio)                        (ratio_level="token")
                   = exp(masked_mean_t(log_ratio)) per row  (ratio_level="sequence")
        pg         = surrogate(ratio, A, logp)             (``surrogate``; PPO clip by default:)
                   = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
        pg         = min(pg, -A * dual_clip)               where A < 0, if dual_clip is set
        pg         = pg * w                                importance weights: rollout_logp / is_weight
        loss_t     = pg + kl_coef * KL_t(logp, ref_logp) - entropy_coef * entropy_t

    and the loss is ``loss_t`` aggregated by ``loss_agg``. The surrogates are specified in
    ``fastrl.reference.surrogates``.
    """

    surrogate: Surrogate = "ppo_clip"
    """The per-token policy-gradient term (specified in ``fastrl.reference.surrogates``):

    - ``ppo_clip``: PPO's clipped ratio (Schulman et al. 2017, arXiv:1707.06347), with
      ``clip_low``/``clip_high``/``dual_clip``; GSPO is this with ``ratio_level="sequence"``.
    - ``cispo``: ``-sg(min(ratio, cispo_max)) * A * logp``: the importance weight is
      truncated and detached, every token keeps a gradient (MiniMax-M1, arXiv:2506.13585;
      ScaleRL, arXiv:2510.13786).
    - ``sapo``: ``-(4 / tau) * sigmoid(tau * (ratio - 1)) * A``, a smooth gate in place of the
      hard clip, ``tau = sapo_tau_pos`` for A > 0 else ``sapo_tau_neg`` (SAPO, arXiv:2511.20347).
    - ``vespo``: ``-sg(phi(w)) * A * logp`` with the gamma weight ``phi`` of the sequence
      importance ratio ``w`` (VESPO, as TRL 1.16 implements it; see ``vespo_k_pos``).
    """

    cispo_max: float = 5.0
    """CISPO's cap epsilon_max on the detached importance ratio (TRL's ``epsilon_high`` with
    ``loss_type="cispo"``; ScaleRL, arXiv:2510.13786, recommends 5). Unused by the others."""

    sapo_tau_pos: float = 1.0
    """SAPO's gate temperature for tokens with a positive advantage (arXiv:2511.20347)."""

    sapo_tau_neg: float = 1.05
    """SAPO's gate temperature for tokens with a non-positive advantage (arXiv:2511.20347)."""

    vespo_k_pos: float = 2.0
    """VESPO's power k for A >= 0 in ``phi(w) = exp(lam) * w**k * exp(-lam * w)``: how hard
    sequences with a small ratio w < 1 are down-weighted."""

    vespo_lambda_pos: float = 3.0
    """VESPO's decay lambda for A >= 0: how hard sequences with a large ratio w > 1 are
    down-weighted (taken as at least 1e-4, as TRL)."""

    vespo_k_neg: float = 3.0
    """VESPO's power k for A < 0."""

    vespo_lambda_neg: float = 2.0
    """VESPO's decay lambda for A < 0 (taken as at least 1e-4)."""

    ratio_level: RatioLevel = "token"
    """``token``: one importance ratio per token (PPO, Schulman et al. 2017). ``sequence``:
    GSPO (Zheng et al. 2025, arXiv:2507.18071): the ratio of a row is
    exp(masked mean of the token log-ratios), shared by its tokens, with the gradient
    flowing through the mean."""

    clip_low: float = 0.2
    """Lower clip range epsilon_low: ratios below 1 - clip_low stop contributing gradient
    when the advantage is negative (PPO, arXiv:1707.06347)."""

    clip_high: float = 0.2
    """Upper clip range epsilon_high. DAPO's clip-higher (Yu et al. 2025, arXiv:2503.14476)
    sets it above clip_low (0.28) to keep exploration tokens from being clipped."""

    dual_clip: float | None = None
    """Dual-clip constant c > 1 (Ye et al. 2020, arXiv:1912.09729): for negative
    advantages the per-token loss is capped at -c * A, bounding the update from tokens
    whose ratio has grown far above 1. ``None`` disables it."""

    log_ratio_clamp: float | None = None
    """If set, ``logp - old_logp`` is clamped to [-c, c] per token before exp (verl uses 20)
    so a stale or corrupted old_logp cannot overflow the ratio; with
    ``ratio_level="sequence"`` the token log-ratios are clamped before the row mean. Clamped
    tokens get no gradient through the ratio. ``None`` (the default) applies the formula as
    written."""

    kl_coef: float = 0.0
    """Weight beta of the token-level KL penalty to the reference policy (needs ``ref_logp``).
    GRPO (Shao et al. 2024, arXiv:2402.03300) uses 0.04 with the k3 estimator."""

    kl_estimator: KLEstimator = "k3"
    """Estimator of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL
    divergence", 2020), with d = ref_logp - logp: k1 = -d, k2 = d^2 / 2,
    k3 = exp(d) - d - 1 (unbiased and non-negative; GRPO's choice)."""

    kl_clamp: float | None = None
    """If set, the per-token KL estimate is clamped to [-c, c] (verl clamps its
    low-variance k3 to [-10, 10]). ``None`` leaves it unclamped."""

    entropy_coef: float = 0.0
    """Weight of the entropy bonus: ``entropy_coef * entropy_t`` is subtracted from each
    token's loss (needs the per-token ``entropy`` tensor)."""

    is_cap: float | None = None
    """Truncated importance sampling for rollout/trainer mismatch (Yao et al. 2025, "Your
    efficient RL framework secretly brings you off-policy RL training"): when
    ``rollout_logp`` (the sampler's log-probs) is given, the policy-gradient term is
    weighted by min(exp(old_logp - rollout_logp), is_cap), without gradient. ``None``
    means no truncation. (With ``surrogate="vespo"`` the log-weight enters VESPO's sequence
    weight instead of multiplying the loss, and ``is_cap`` must be None.)"""

    is_level: IsLevel = "token"
    """``token``: one weight per token. ``sequence``: one weight per row,
    exp(sum of the masked token log-differences), truncated at ``is_cap``."""

    loss_agg: LossAgg = "token-mean"
    """How per-token losses become one number:

    - ``token-mean``: sum over all masked-in tokens / their count (DAPO; TRL's bnpo).
    - ``seq-mean-token-mean``: mean over tokens in each row, then mean over rows
      (the original GRPO objective).
    - ``seq-mean-token-sum``: sum over tokens in each row, then mean over rows.
    - ``seq-mean-token-sum-norm``: sum over tokens in each row / ``norm_length``, then
      mean over rows (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783: a constant
      normaliser removes the length bias).

    Row means count only rows with at least one masked-in token. ``policy_loss``'s
    ``global_token_count`` / ``global_seq_count`` replace the local denominators so
    that micro-batches and data-parallel ranks add up to the loss of one big batch.
    """

    norm_length: float | None = None
    """The constant of ``seq-mean-token-sum-norm`` (Dr. GRPO uses the maximum completion
    length), required with that mode: a default of "the padded length T of the batch" would
    normalise each micro-batch by its own length, so gradient accumulation would silently
    stop adding up to the full-batch update. Unused by the other modes."""

    def __post_init__(self) -> None:
        check_choice("surrogate", self.surrogate, SURROGATES)
        check_scalar("cispo_max", self.cispo_max, low=0.0, low_inclusive=False)
        check_scalar("sapo_tau_pos", self.sapo_tau_pos, low=0.0, low_inclusive=False)
        check_scalar("sapo_tau_neg", self.sapo_tau_neg, low=0.0, low_inclusive=False)
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            check_scalar(name, getattr(self, name), low=0.0)
        check_choice("ratio_level", self.ratio_level, RATIO_LEVELS)
        check_scalar("clip_low", self.clip_low, low=0.0, high=1.0, high_inclusive=False)
        check_scalar("clip_high", self.clip_high, low=0.0)
        check_scalar("dual_clip", self.dual_clip, low=1.0, low_inclusive=False, allow_none=True)
        check_scalar("log_ratio_clamp", self.log_ratio_clamp, low=0.0, low_inclusive=False, allow_none=True)
        check_scalar("kl_coef", self.kl_coef)
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        check_scalar("kl_clamp", self.kl_clamp, low=0.0, low_inclusive=False, allow_none=True)
        check_scalar("entropy_coef", self.entropy_coef)
        check_scalar("is_cap", self.is_cap, low=0.0, low_inclusive=False, allow_none=True)
        check_choice("is_level", self.is_level, IS_LEVELS)
        check_choice("loss_agg", self.loss_agg, LOSS_AGGS)
        check_scalar("norm_length", self.norm_length, low=0.0, low_inclusive=False, allow_none=True)
        if self.loss_agg == "seq-mean-token-sum-norm" and self.norm_length is None:
            raise ValueError(NORM_LENGTH_REQUIRED)
        spec = SURROGATE_SPECS[self.surrogate]
        if self.dual_clip is not None and "dual_clip" not in spec.options:
            owner = next(other.name for other in SURROGATE_SPECS.values() if "dual_clip" in other.options)
            raise ValueError(f"dual_clip is a setting of surrogate={owner!r}, got surrogate={self.surrogate!r}")
        if spec.sequence_weight and self.ratio_level != "token":
            raise ValueError(f"surrogate={spec.name!r} builds its own sequence weight from the summed token "
                             "log-ratios: use ratio_level='token'")
        if spec.folds_rollout_weight and self.is_cap is not None:
            raise ValueError(f"surrogate={spec.name!r} folds the rollout log-ratio into its sequence weight, which "
                             "bounds it: is_cap must be None (truncate the rollout log-probs beforehand)")

    def replace(self, **changes: object) -> "PolicyLossConfig":
        return dataclasses.replace(self, **changes)

    @staticmethod
    def preset_settings(name: str) -> dict[str, object]:
        """The fields a preset sets (a copy), e.g. to see its ``loss_agg`` before building it."""
        check_choice("preset", name, tuple(_PRESETS))
        return dict(_PRESETS[name])

    @classmethod
    def preset(cls, name: str, **overrides: object) -> "PolicyLossConfig":
        """The published settings of a known algorithm, with optional overrides.

        - ``ppo``: PPO-clip, epsilon 0.2, token-mean (Schulman et al. 2017, arXiv:1707.06347).
        - ``grpo``: epsilon 0.2, k3 KL to the reference with beta 0.04, per-sequence
          token mean (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).
        - ``dapo``: clip-higher (0.2, 0.28), token-mean, no KL (Yu et al. 2025, arXiv:2503.14476).
        - ``dr_grpo``: epsilon 0.2, no KL, token sum / constant (Liu et al. 2025, arXiv:2503.20783);
          pair it with ``group_advantages(mode="dr_grpo")`` (no std division). The constant
          is required: ``preset("dr_grpo", norm_length=max_completion_length)``.
        - ``gspo``: sequence-level ratio, clip (3e-4, 4e-4), per-sequence token mean
          (Zheng et al. 2025, arXiv:2507.18071).
        - ``cispo``: truncated detached IS weight, epsilon_max 5, token-mean (ScaleRL,
          arXiv:2510.13786; MiniMax-M1, arXiv:2506.13585).
        - ``sapo``: soft gate, temperatures (1.0, 1.05), per-sequence token mean (arXiv:2511.20347).
        - ``vespo``: gamma-weighted sequence ratio, TRL 1.16's defaults, token-mean.
        """
        check_choice("preset", name, tuple(_PRESETS))
        return cls(**{**_PRESETS[name], **overrides})


_PRESETS: dict[str, dict[str, object]] = {
    "ppo": dict(clip_low=0.2, clip_high=0.2, loss_agg="token-mean"),
    "grpo": dict(clip_low=0.2, clip_high=0.2, kl_coef=0.04, kl_estimator="k3", loss_agg="seq-mean-token-mean"),
    "dapo": dict(clip_low=0.2, clip_high=0.28, kl_coef=0.0, loss_agg="token-mean"),
    "dr_grpo": dict(clip_low=0.2, clip_high=0.2, kl_coef=0.0, loss_agg="seq-mean-token-sum-norm"),
    "gspo": dict(ratio_level="sequence", clip_low=3e-4, clip_high=4e-4, loss_agg="seq-mean-token-mean"),
    "cispo": dict(surrogate="cispo", cispo_max=5.0, loss_agg="token-mean"),
    "sapo": dict(surrogate="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05, loss_agg="seq-mean-token-mean"),
    "vespo": dict(surrogate="vespo", loss_agg="token-mean"),
}
