"""Benchmark cases: ``policy_loss`` and ``kl_penalty`` (forward + backward) against the eager
multi-op PyTorch losses that trainers run today.

Baselines (our own code, mirroring each trainer's sequence of eager ops):

- ``trl``: TRL ``GRPOTrainer._compute_loss`` (token-level ratio, ``-min(coef_1 A, coef_2 A)``,
  k3 KL added per token, ``loss_type="grpo"`` per-row token mean then batch mean, or
  ``"dapo"`` sum / token count), with the metrics it logs (KL mean, entropy mean, low/high/
  region clip fractions).
- ``verl``: verl ``compute_policy_loss_vanilla`` (log-ratio clamp +-20, max/min dual clip
  c = 3, ``pg_clipfrac``, ``ppo_kl``, ``pg_clipfrac_lower``) + ``agg_loss``, and for GRPO the
  ``low_var_kl`` penalty (k3 clamped to +-10) aggregated the same way; entropy aggregated for
  its metric.

The fastrl entry of each case is configured to compute the same loss (the benchmark
tests check the values agree) and returns every metric of the contract.
"""

from __future__ import annotations

import torch

from fastrl.bench.harness import BenchCase
from fastrl.config import PolicyLossConfig
from fastrl.ops import kl_penalty, policy_loss


def make_inputs(B: int, T: int, device: torch.device, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded fp32 batch with lengths spread over [T/4, T] and per-sequence advantages."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    logp = -torch.rand(B, T, generator=g) * 2
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    out = dict(
        logp=logp,
        old_logp=logp + torch.randn(B, T, generator=g) * 0.05,
        ref_logp=logp + torch.randn(B, T, generator=g) * 0.1,
        entropy=torch.rand(B, T, generator=g) * 2,
        advantages=torch.randn(B, generator=g),
        mask=(torch.arange(T)[None, :] < lengths[:, None]).float(),
    )
    return {k: v.to(device) for k, v in out.items()}


# ---------------------------------------------------------------- baselines (eager PyTorch)


def trl_grpo_loss(logp, old_logp, ref_logp, entropy, advantages, mask, *, eps_low=0.2, eps_high=0.2, beta=0.04,
                  loss_type="grpo"):
    """The op sequence of TRL's GRPOTrainer._compute_loss (token-level IS, no vLLM correction)."""
    adv = advantages.unsqueeze(1)
    log_ratio = logp - old_logp
    coef_1 = torch.exp(log_ratio)
    if beta != 0.0:
        per_token_kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    else:  # dapo / bnpo: sum over the batch's tokens / their count
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    # the metrics it logs (without the cross-process gather and .item())
    with torch.no_grad():
        def masked_mean(x):
            return (x * mask).sum() / mask.sum().clamp(min=1.0)
        metrics = {}
        if beta != 0.0:
            metrics["kl"] = masked_mean(per_token_kl)
        metrics["entropy"] = masked_mean(entropy)
        low = (coef_1 < 1 - eps_low) & (adv < 0)
        high = (coef_1 > 1 + eps_high) & (adv > 0)
        metrics["low"] = masked_mean(low.float())
        metrics["high"] = masked_mean(high.float())
        metrics["region"] = masked_mean((low | high).float())
    return loss, metrics


def _verl_masked_mean(x, mask):
    return (x * mask).sum() / (mask.sum() + 1e-8)


def verl_agg_loss(loss_mat, mask, mode):
    """verl's agg_loss (single process, no global batch info)."""
    if mode == "token-mean":
        return (loss_mat * mask).sum() / mask.sum().clamp(min=1.0)
    seq_tok = mask.sum(-1)
    if mode == "seq-mean-token-mean":
        seq_losses = (loss_mat * mask).sum(-1) / (seq_tok + 1e-8)
    else:
        seq_losses = (loss_mat * mask).sum(-1)
    seq_mask = (seq_tok > 0).float()
    loss = (seq_losses * seq_mask).sum() / seq_mask.sum().clamp(min=1.0)
    if mode == "seq-mean-token-sum-norm":
        loss = loss / mask.shape[-1]
    return loss


def verl_policy_loss(logp, old_logp, ref_logp, entropy, advantages, mask, *, clip_low=0.2, clip_high=0.2,
                     clip_c=3.0, kl_coef=0.04, mode="seq-mean-token-mean"):
    """The op sequence of verl's compute_policy_loss_vanilla + agg_loss (+ low_var_kl when kl_coef)."""
    adv = advantages.unsqueeze(1).expand_as(logp)  # verl hands token-level advantages around
    negative_approx_kl = torch.clamp(logp - old_logp, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = _verl_masked_mean(-negative_approx_kl, mask)
    pg_losses1 = -adv * ratio
    pg_losses2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = _verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), mask)
    pg_losses3 = -adv * clip_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = _verl_masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (adv < 0).float(), mask)
    pg_losses = torch.where(adv < 0, clip_pg_losses2, clip_pg_losses1)
    loss = verl_agg_loss(pg_losses, mask, mode)
    metrics = {"pg_clipfrac": pg_clipfrac.detach(), "ppo_kl": ppo_kl.detach(), "pg_clipfrac_lower": pg_clipfrac_lower.detach()}
    if kl_coef:
        kl = torch.clamp(ref_logp - logp, min=-20, max=20)
        kld = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
        kl_loss = verl_agg_loss(kld, mask, mode)
        loss = loss + kl_loss * kl_coef
        metrics["kl_loss"] = kl_loss.detach()
    with torch.no_grad():
        metrics["entropy"] = verl_agg_loss(entropy, mask, mode)
    return loss, metrics


# ---------------------------------------------------------------- fastrl entries

FASTRL_CONFIGS = {
    "trl-grpo": PolicyLossConfig.preset("grpo"),
    "trl-dapo": PolicyLossConfig.preset("dapo"),
    "verl-grpo": PolicyLossConfig.preset("grpo", dual_clip=3.0, log_ratio_clamp=20.0, kl_clamp=10.0),
    "verl-dapo": PolicyLossConfig.preset("dapo", dual_clip=3.0, log_ratio_clamp=20.0),
}
BASELINES = {
    "trl-grpo": lambda x: trl_grpo_loss(**x),
    "trl-dapo": lambda x: trl_grpo_loss(**x, eps_high=0.28, beta=0.0, loss_type="dapo"),
    "verl-grpo": lambda x: verl_policy_loss(**x),
    "verl-dapo": lambda x: verl_policy_loss(**x, clip_high=0.28, kl_coef=0.0, mode="token-mean"),
}


def fastrl_loss(x: dict[str, torch.Tensor], cfg: PolicyLossConfig):
    ref = x["ref_logp"] if cfg.kl_coef else None
    return policy_loss(x["logp"], x["old_logp"], x["advantages"], x["mask"], ref_logp=ref,
                       entropy=x["entropy"], config=cfg)


def _fwd_bwd(loss_fn, x):
    def run():
        loss, _ = loss_fn(x)
        (g,) = torch.autograd.grad(loss, [x["logp"]])
        return loss.detach(), g
    return run


def _kl_fwd_bwd(fn, x, gout):
    def run():
        k = fn(x["logp"], x["ref_logp"])
        gl, gr = torch.autograd.grad(k, [x["logp"], x["ref_logp"]], gout)
        return k.detach(), gl
    return run


def _eager_k3(logp, ref_logp):
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def shapes(quick: bool) -> list[tuple[int, int]]:
    return [(16, 512), (64, 1024)] if quick else [(64, 1024), (256, 2048), (32, 8192)]


def cases(device: torch.device, quick: bool) -> list[BenchCase]:
    out: list[BenchCase] = []
    for B, T in shapes(quick):
        x = make_inputs(B, T, device)
        x["logp"].requires_grad_(True)
        for name, cfg in FASTRL_CONFIGS.items():
            base_label = name.split("-")[0]
            out.append(BenchCase(
                op=f"policy_loss[{name}]", shape=f"B={B} T={T}",
                impls={"fastrl": _fwd_bwd(lambda x, cfg=cfg: fastrl_loss(x, cfg), x),
                       f"{base_label}_eager": _fwd_bwd(BASELINES[name], x)},
                note="fwd+bwd wrt logp, metrics included", repeats=3 if quick else 10,
            ))
        xk = {"logp": x["logp"], "ref_logp": x["ref_logp"].detach().clone().requires_grad_(True)}
        gout = torch.randn(B, T, device=device)
        out.append(BenchCase(
            op="kl_penalty[k3]", shape=f"B={B} T={T}",
            impls={"fastrl": _kl_fwd_bwd(lambda a, b: kl_penalty(a, b, estimator="k3"), xk, gout),
                   "eager": _kl_fwd_bwd(_eager_k3, xk, gout)},
            note="fwd+bwd wrt logp and ref_logp", repeats=3 if quick else 10,
        ))
    return out
