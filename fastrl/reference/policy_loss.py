"""Reference clipped policy-gradient loss (the oracle of ``fastrl.ops.policy_loss``).

Notation: rows b = 1..B, tokens t = 1..T, ``m[b,t] = (mask[b,t] != 0)``, ``n_b = sum_t m``,
``N = sum_b n_b`` and ``S = #{b : n_b > 0}``. Values at masked-out positions are never
read into the result (they may be NaN or inf, e.g. padding log-probs of -inf).

Ratio (``config.ratio_level``), with the optional ``log_ratio_clamp`` c applied per token:

    lr[b,t]   = clamp(logp - old_logp, -c, c)                  (no clamp if c is None)
    r[b,t]    = exp(lr[b,t])                                    "token"
    r[b,t]    = exp(sum_t m lr[b,t] / max(n_b, 1))              "sequence" (GSPO): shared by
                                                                the row, gradient through the mean

Surrogate (``config.surrogate``, specified in ``fastrl.reference.surrogates``; A = advantage
of the token, a ``[B]`` advantage is the advantage of every token of its row), by default
PPO's clipped ratio with asymmetric clip and optional dual clip:

    pg  = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
    pg  = min(pg, -A dual_clip)                 where A < 0, if dual_clip is set
    pg  = pg * w                                if rollout_logp or is_weight is given

Importance weight (no gradient), ``is_cap`` = None means no truncation, ``v`` the given
``is_weight`` (``[B, T]``, or ``[B]``/``[B, 1]`` per row; 1 when not given):

    w[b,t] = v[b,t] min(exp(old_logp - rollout_logp), is_cap)                 is_level="token"
    w[b,t] = v[b,t] min(exp(sum_t m (old_logp - rollout_logp)), is_cap)       is_level="sequence"

(``surrogate="vespo"`` takes ``old_logp - rollout_logp`` into its own sequence weight
instead, and then w = v.)

Decoupled PPO (AReaL, Fu et al. 2025, arXiv 2505.24298), when ``proximal_logp`` is given:
``old_logp`` is then the *behaviour* policy (the sampler that drew the tokens, possibly some
updates behind) and ``proximal_logp`` the *proximal* policy (the trainer's at the start of
the update). The ratio is taken and clipped against the proximal policy, and the behaviour
importance weight (no gradient) corrects for the staleness of the sample:

    lr[b,t]   = clamp(logp - proximal_logp, -c, c)             (the ratio as above, from it)
    w[b,t]    = v[b,t] min(exp(proximal_logp - old_logp), is_cap)       (is_level as above)

That is the rollout-weight formula with ``(old_logp, rollout_logp) := (proximal_logp,
old_logp)``: one loss, the behaviour weight is the rollout weight, so ``rollout_logp`` must
not be given with it. The metrics are those of that loss (``is_weight_mean`` is the mean
behaviour weight).

Per-token loss, KL_t from ``fastrl.reference.kl`` with d = ref_logp - logp (optionally
clamped by ``kl_clamp``), H_t the given entropy:

    loss_t = pg_t + kl_coef KL_t - entropy_coef H_t      (a term whose coefficient is 0 is left out)

Aggregation (``config.loss_agg``), for any per-token quantity x:

    token-mean               agg(x) = sum_bt m x / D,              D = N  or global_token_count
    seq-mean-token-mean      agg(x) = sum_b (sum_t m x / max(n_b,1)) / D,   D = S or global_seq_count
    seq-mean-token-sum       agg(x) = sum_b  sum_t m x / D,         D = S or global_seq_count
    seq-mean-token-sum-norm  agg(x) = sum_b  sum_t m x / (L D),     L = norm_length (required)

A denominator that is 0 is replaced by 1, so a batch without any masked-in token has a
loss of 0 (not NaN). ``loss = agg(loss_t) = pg_loss + kl_coef kl_loss - entropy_coef
entropy_loss``.

Sub-gradient conventions (they matter only at exact ties): ``max(a, b)`` passes the
gradient to ``a`` when ``a >= b``; the dual clip takes over only when the clipped loss is
strictly above ``-A dual_clip``; clamps pass the gradient on the closed interval. A token
whose loss is the clipped or dual-clipped term has gradient exactly 0 through the ratio,
also when its ratio overflowed to inf (never 0 * inf = NaN); in sequence mode such tokens
add nothing to the gradient of their row's mean log-ratio.

Metrics (0-dim, detached; means over masked-in tokens, all 0 when there are none):
``pg_loss = agg(pg)``, ``kl_loss = agg(KL)`` and ``entropy_loss = agg(H)`` (unscaled by their
coefficients), ``clip_frac_low`` (r < 1 - clip_low and A < 0), ``clip_frac_high`` (r > 1 +
clip_high and A > 0), ``clip_frac`` (their sum), ``dual_clip_frac`` (A < 0 and the dual clip
is active), ``approx_kl`` (mean of (rho - 1) - log rho with rho = exp(lr) the token ratio, also
in sequence mode), ``kl_ref_mean``, ``ratio_mean``/``ratio_min``/``ratio_max`` (of r, the
ratio the loss uses), ``entropy_mean``, ``is_weight_mean`` (of w).
"""

from __future__ import annotations

import torch

from fastrl.config import PolicyLossConfig
from fastrl.reference.kl import kl_penalty_reference
from fastrl.reference.surrogates import FOLDS_ROLLOUT_WEIGHT, SURROGATES


def _denominator(count: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """A count as a 0-dim tensor, 0 taken as 1 (``fastrl._checks.check_global_count``'s rule)."""
    count = torch.as_tensor(count, dtype=like.dtype, device=like.device).reshape(())
    return torch.where(count > 0, count, torch.ones_like(count))


def policy_loss_reference(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    is_weight: torch.Tensor | None = None,
    proximal_logp: torch.Tensor | None = None,
    config: PolicyLossConfig = PolicyLossConfig(),
    global_token_count: torch.Tensor | float | None = None,
    global_seq_count: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and metrics of the module docstring; gradients by autograd.

    Computed in float64 when ``logp`` is float64, else in float32. No input validation.
    """
    if proximal_logp is not None:  # decoupled PPO: old_logp is the behaviour policy
        old_logp, rollout_logp = proximal_logp, old_logp
    cfg = config
    dtype = torch.promote_types(logp.dtype, torch.float32)
    B, T = logp.shape
    m = mask != 0
    mf = m.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=logp.device)

    def masked(x: torch.Tensor) -> torch.Tensor:
        # broadcast to [B, T] and zero the masked-out positions (without touching their values)
        return torch.where(m, x.to(dtype).expand(B, T), zero)

    lp = masked(logp)
    old = masked(old_logp)
    adv = advantages.to(dtype)
    A = masked(adv[:, None] if adv.dim() == 1 else adv)

    n = mf.sum(-1)
    N = n.sum()
    S = (n > 0).to(dtype).sum()

    # --- ratio ---
    lr = lp - old
    if cfg.log_ratio_clamp is not None:
        lr = torch.clamp(lr, -cfg.log_ratio_clamp, cfg.log_ratio_clamp)
    if cfg.ratio_level == "token":
        tok_lr = lr
    else:
        tok_lr = ((lr * mf).sum(-1) / n.clamp(min=1))[:, None].expand(B, T)

    # --- surrogate and importance weights (no gradient through the weights) ---
    folds = cfg.surrogate in FOLDS_ROLLOUT_WEIGHT
    log_is = masked(old - masked(rollout_logp)) if rollout_logp is not None else None
    pg, sur_metrics = SURROGATES[cfg.surrogate](
        lr=lr, rlr=tok_lr, logp=lp, A=A, m=m, log_is=log_is if folds else None, cfg=cfg)
    w = None
    with torch.no_grad():
        if log_is is not None and not folds:
            w = torch.exp(log_is) if cfg.is_level == "token" else torch.exp(log_is.sum(-1))[:, None].expand(B, T)
            if cfg.is_cap is not None:
                w = torch.clamp(w, max=cfg.is_cap)
        if is_weight is not None:
            v = masked(is_weight.reshape(B, -1))
            w = v if w is None else w * v
        elif w is None and log_is is not None:
            w = mf  # vespo folded the rollout weight: nothing multiplies pg
    if w is not None:
        pg = pg * w

    # --- KL and entropy ---
    kl = None
    if ref_logp is not None:
        kl = masked(kl_penalty_reference(torch.where(m, logp, 0), torch.where(m, ref_logp, 0),
                                         estimator=cfg.kl_estimator, clamp=cfg.kl_clamp))
    ent = masked(entropy) if entropy is not None else None

    # --- aggregation ---
    if cfg.loss_agg == "token-mean":
        D = _denominator(N if global_token_count is None else global_token_count, n)
        row_w = torch.ones_like(n)
    else:
        D = _denominator(S if global_seq_count is None else global_seq_count, n)
        if cfg.loss_agg == "seq-mean-token-mean":
            row_w = 1.0 / n.clamp(min=1)
        elif cfg.loss_agg == "seq-mean-token-sum":
            row_w = torch.ones_like(n)
        else:
            L = float(cfg.norm_length)  # required by the config for this mode
            row_w = torch.full_like(n, 1.0 / L)

    def agg(x: torch.Tensor) -> torch.Tensor:
        return ((x * mf).sum(-1) * row_w).sum() / D

    pg_loss = agg(pg)
    loss = pg_loss
    if kl is not None:
        kl_loss = agg(kl)
        if cfg.kl_coef != 0:
            loss = loss + cfg.kl_coef * kl_loss
    if ent is not None:
        entropy_loss = agg(ent)
        if cfg.entropy_coef != 0:
            loss = loss - cfg.entropy_coef * entropy_loss

    # --- metrics ---
    with torch.no_grad():
        Nd = _denominator(N, n)

        def tok_mean(x: torch.Tensor) -> torch.Tensor:
            return (x.to(dtype) * mf).sum() / Nd

        r = torch.exp(tok_lr.detach())
        tok_lr = lr.detach()
        metrics: dict[str, torch.Tensor] = {
            "pg_loss": pg_loss.detach(),
            **{k: tok_mean(v) for k, v in sur_metrics.items()},
            "approx_kl": tok_mean(kl_penalty_reference(torch.zeros_like(tok_lr), tok_lr, estimator="k3")),
            "ratio_mean": tok_mean(r),
            "ratio_min": torch.where(m, r, torch.inf).min() if B * T > 0 else zero,
            "ratio_max": torch.where(m, r, -torch.inf).max() if B * T > 0 else zero,
        }
        metrics["ratio_min"] = torch.where(N > 0, metrics["ratio_min"], zero)
        metrics["ratio_max"] = torch.where(N > 0, metrics["ratio_max"], zero)
        if "clip_frac_low" in metrics:
            metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
        if kl is not None:
            metrics["kl_loss"] = kl_loss.detach()
            metrics["kl_ref_mean"] = tok_mean(kl)
        if ent is not None:
            metrics["entropy_loss"] = entropy_loss.detach()
            metrics["entropy_mean"] = tok_mean(ent)
        if w is not None:
            metrics["is_weight_mean"] = tok_mean(w)
    return loss, metrics
