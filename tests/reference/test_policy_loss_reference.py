"""The reference policy loss and KL penalty against hand-computed cases and a literal
Python loop over rows and tokens (float64 throughout)."""

import math

import pytest
import torch

from fastrl import PolicyLossConfig
from fastrl.reference.kl import kl_penalty_reference
from fastrl.reference.policy_loss import policy_loss_reference

D64 = torch.float64


# ----------------------------------------------------------------------------------------
# the formula, written as a loop over rows and tokens with Python floats
# ----------------------------------------------------------------------------------------


def loop_kl(lp: float, rf: float, est: str, clamp: float | None) -> float:
    d = rf - lp
    k = {"k1": -d, "k2": d * d / 2, "k3": math.exp(d) - d - 1}[est]
    if clamp is not None:
        k = min(max(k, -clamp), clamp)
    return k


def loop_policy_loss(logp, old, adv, mask, ref=None, ent=None, roll=None, cfg=PolicyLossConfig(), gtok=None, gseq=None):
    B, T = logp.shape
    L = lambda x: x.tolist() if x is not None else None  # noqa: E731
    logp, old, adv, mask, ref, ent, roll = map(L, (logp, old, adv, mask, ref, ent, roll))
    per_row_adv = not isinstance(adv[0], list)
    sums = dict(pg=0.0, kl=0.0, ent=0.0)
    N = 0
    cnt = dict(low=0, high=0, dual=0)
    akl = kl_sum = ent_sum = r_sum = w_sum = 0.0
    r_all = []
    S = 0
    for b in range(B):
        toks = [t for t in range(T) if mask[b][t] != 0]
        n = len(toks)
        if n == 0:
            continue
        S += 1
        N += n
        lrs = {}
        for t in toks:
            x = logp[b][t] - old[b][t]
            if cfg.log_ratio_clamp is not None:
                x = min(max(x, -cfg.log_ratio_clamp), cfg.log_ratio_clamp)
            lrs[t] = x
        seq_r = math.exp(sum(lrs.values()) / n)
        if roll is not None:
            seq_w = math.exp(sum(old[b][t] - roll[b][t] for t in toks))
        if cfg.loss_agg == "token-mean":
            row_f = 1.0
        elif cfg.loss_agg == "seq-mean-token-mean":
            row_f = 1.0 / n
        elif cfg.loss_agg == "seq-mean-token-sum":
            row_f = 1.0
        else:
            row_f = 1.0 / cfg.norm_length
        for t in toks:
            A = adv[b] if per_row_adv else adv[b][t]
            r = math.exp(lrs[t]) if cfg.ratio_level == "token" else seq_r
            pg = max(-A * r, -A * min(max(r, 1 - cfg.clip_low), 1 + cfg.clip_high))
            if cfg.dual_clip is not None and A < 0:
                if pg > -A * cfg.dual_clip:
                    cnt["dual"] += 1
                pg = min(pg, -A * cfg.dual_clip)
            if roll is not None:
                w = math.exp(old[b][t] - roll[b][t]) if cfg.is_level == "token" else seq_w
                if cfg.is_cap is not None:
                    w = min(w, cfg.is_cap)
                pg *= w
                w_sum += w
            sums["pg"] += row_f * pg
            if ref is not None:
                k = loop_kl(logp[b][t], ref[b][t], cfg.kl_estimator, cfg.kl_clamp)
                sums["kl"] += row_f * k
                kl_sum += k
            if ent is not None:
                sums["ent"] += row_f * ent[b][t]
                ent_sum += ent[b][t]
            cnt["low"] += (r < 1 - cfg.clip_low) and A < 0
            cnt["high"] += (r > 1 + cfg.clip_high) and A > 0
            akl += (math.exp(lrs[t]) - 1) - lrs[t]
            r_sum += r
            r_all.append(r)
    if cfg.loss_agg == "token-mean":
        D = N if gtok is None else float(gtok)
    else:
        D = S if gseq is None else float(gseq)
    D = D if D > 0 else 1.0
    loss = (sums["pg"] + cfg.kl_coef * sums["kl"] * (ref is not None) - cfg.entropy_coef * sums["ent"] * (ent is not None)) / D
    Nd = N if N > 0 else 1
    m = {
        "pg_loss": sums["pg"] / D,
        "clip_frac_low": cnt["low"] / Nd,
        "clip_frac_high": cnt["high"] / Nd,
        "clip_frac": (cnt["low"] + cnt["high"]) / Nd,
        "approx_kl": akl / Nd,
        "ratio_mean": r_sum / Nd,
        "ratio_min": min(r_all) if r_all else 0.0,
        "ratio_max": max(r_all) if r_all else 0.0,
    }
    if cfg.dual_clip is not None:
        m["dual_clip_frac"] = cnt["dual"] / Nd
    if ref is not None:
        m["kl_loss"] = sums["kl"] / D
        m["kl_ref_mean"] = kl_sum / Nd
    if ent is not None:
        m["entropy_loss"] = sums["ent"] / D
        m["entropy_mean"] = ent_sum / Nd
    if roll is not None:
        m["is_weight_mean"] = w_sum / Nd
    return loss, m


# ----------------------------------------------------------------------------------------
# hand-computed cases
# ----------------------------------------------------------------------------------------


def _t(x):
    return torch.tensor(x, dtype=D64)


def test_hand_token_mean_unclipped_and_clipped():
    # row 0: ratios e^0.1 (in range, A=1) and e^0.5 (above 1.2, A=1 -> clipped, no gradient)
    # row 1: ratio e^-0.5 (below 0.8, A=-2 -> clipped), padding token ignored
    logp = _t([[0.1, 0.5], [-0.5, 7.0]]).requires_grad_()
    old = torch.zeros(2, 2, dtype=D64)
    adv = _t([[1.0, 1.0], [-2.0, 5.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, m = policy_loss_reference(logp, old, adv, mask)
    pg = [-math.exp(0.1), -1.2, 2 * 0.8]
    assert loss.item() == pytest.approx(sum(pg) / 3, rel=1e-12)
    loss.backward()
    expected = torch.tensor([[-math.exp(0.1) / 3, 0.0], [0.0, 0.0]], dtype=D64)
    torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=0)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 3)
    assert m["clip_frac_low"].item() == pytest.approx(1 / 3)
    assert m["clip_frac"].item() == pytest.approx(2 / 3)
    assert m["ratio_max"].item() == pytest.approx(math.exp(0.5))
    assert m["ratio_min"].item() == pytest.approx(math.exp(-0.5))
    akl = sum(math.expm1(x) - x for x in (0.1, 0.5, -0.5)) / 3
    assert m["approx_kl"].item() == pytest.approx(akl, rel=1e-12)


def test_hand_dual_clip():
    # A = -1, ratio e^2 = 7.39 > c = 3: the loss is capped at -A c = 3 with no gradient
    logp = _t([[2.0, 0.05]]).requires_grad_()
    old = torch.zeros(1, 2, dtype=D64)
    adv = _t([[-1.0, -1.0]])
    cfg = PolicyLossConfig(dual_clip=3.0)
    loss, m = policy_loss_reference(logp, old, adv, torch.ones(1, 2), config=cfg)
    assert loss.item() == pytest.approx((3.0 + math.exp(0.05)) / 2, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, _t([[0.0, math.exp(0.05) / 2]]))
    assert m["dual_clip_frac"].item() == pytest.approx(0.5)


def test_hand_gspo_gradient_through_the_mean():
    # one row of 3 tokens, per-sequence advantage 1, ratio exp(mean lr) inside the clip range
    cfg = PolicyLossConfig(ratio_level="sequence", clip_low=0.5, clip_high=0.5, loss_agg="seq-mean-token-mean")
    lr = [0.1, -0.2, 0.4]
    logp = _t([lr + [9.0]]).requires_grad_()
    old = torch.zeros(1, 4, dtype=D64)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, m = policy_loss_reference(logp, old, _t([1.0]), mask, config=cfg)
    s = math.exp(sum(lr) / 3)
    assert loss.item() == pytest.approx(-s, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, _t([[-s / 3] * 3 + [0.0]]))
    assert m["ratio_mean"].item() == pytest.approx(s)


def test_hand_truncated_importance_weights():
    # token weights exp(old - rollout) = e^1 (capped at 2) and e^-1; sequence weight e^0 = 1
    logp = _t([[0.0, 0.0]]).requires_grad_()
    old = torch.zeros(1, 2, dtype=D64)
    roll = _t([[-1.0, 1.0]])
    adv = _t([[1.0, 1.0]])
    loss, m = policy_loss_reference(logp, old, adv, torch.ones(1, 2), rollout_logp=roll,
                                    config=PolicyLossConfig(is_cap=2.0))
    assert loss.item() == pytest.approx(-(2.0 + math.exp(-1)) / 2, rel=1e-12)
    assert m["is_weight_mean"].item() == pytest.approx((2.0 + math.exp(-1)) / 2)
    loss.backward()
    torch.testing.assert_close(logp.grad, _t([[-1.0, -math.exp(-1) / 2]]))
    loss, m = policy_loss_reference(logp, old, adv, torch.ones(1, 2), rollout_logp=roll,
                                    config=PolicyLossConfig(is_level="sequence", is_cap=2.0))
    assert loss.item() == pytest.approx(-1.0, rel=1e-12)


def decoupled_hand_case():
    """Decoupled PPO on three tokens (clip 0.2, token-mean), by hand: the ratio against the
    proximal policy, the behaviour weight exp(proximal - behaviour) times the clipped term.
    token 0: r = e^0.1 inside [0.8, 1.2], A = 1, w = e^0.5:  pg = -e^0.1 e^0.5, grad -e^0.1 e^0.5 / 3
    token 1: r = e^0.5 > 1.2 (clipped), A = 1, w = 1:       pg = -1.2, grad 0
    token 2: r = e^-0.3 < 0.8 (clipped), A = -2, w = e^0.2: pg = 2 * 0.8 * e^0.2, grad 0
    Returns (logp, behaviour, proximal, advantages, loss, grad, weight mean)."""
    logp = [[0.1, 0.5, 0.0]]
    proximal = [[0.0, 0.0, 0.3]]
    behaviour = [[-0.5, 0.0, 0.1]]
    adv = [[1.0, 1.0, -2.0]]
    e = math.exp
    loss = (-e(0.1) * e(0.5) - 1.2 + 1.6 * e(0.2)) / 3
    grad = [[-e(0.1) * e(0.5) / 3, 0.0, 0.0]]
    return logp, behaviour, proximal, adv, loss, grad, (e(0.5) + 1.0 + e(0.2)) / 3


def test_hand_decoupled_ppo():
    lp, behaviour, proximal, adv, want_loss, want_grad, want_w = decoupled_hand_case()
    logp = _t(lp).requires_grad_()
    loss, m = policy_loss_reference(logp, _t(behaviour), _t(adv), torch.ones(1, 3), proximal_logp=_t(proximal))
    assert loss.item() == pytest.approx(want_loss, rel=1e-12)
    assert m["is_weight_mean"].item() == pytest.approx(want_w, rel=1e-12)
    assert m["clip_frac_high"].item() == pytest.approx(1 / 3) and m["clip_frac_low"].item() == pytest.approx(1 / 3)
    loss.backward()
    torch.testing.assert_close(logp.grad, _t(want_grad))
    # the weight is truncated at is_cap like the rollout weight: token 0's e^0.5 becomes 1.5
    logp.grad = None
    loss, m = policy_loss_reference(logp, _t(behaviour), _t(adv), torch.ones(1, 3), proximal_logp=_t(proximal),
                                    config=PolicyLossConfig(is_cap=1.5))
    assert loss.item() == pytest.approx((-math.exp(0.1) * 1.5 - 1.2 + 1.6 * math.exp(0.2)) / 3, rel=1e-12)
    # naive PPO on the same stale tokens (ratio against the behaviour policy) is another loss
    naive, _ = policy_loss_reference(logp, _t(behaviour), _t(adv), torch.ones(1, 3))
    assert abs(naive.item() - want_loss) > 0.1


def test_hand_aggregations_and_global_counts():
    # per-token loss is -A when ratio = 1; rows of length 1, 3 and 0
    adv = _t([[1.0, 0.0, 0.0], [2.0, 2.0, 2.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0]])
    z = torch.zeros(3, 3, dtype=D64)
    expected = {
        "token-mean": -(1 + 6) / 4,
        "seq-mean-token-mean": -(1 + 2) / 2,
        "seq-mean-token-sum": -(1 + 6) / 2,
        "seq-mean-token-sum-norm": -(1 + 6) / 2 / 3,
    }
    for agg, value in expected.items():
        norm = dict(norm_length=3) if agg == "seq-mean-token-sum-norm" else {}
        loss, _ = policy_loss_reference(z, z, adv, mask, config=PolicyLossConfig(loss_agg=agg, **norm))
        assert loss.item() == pytest.approx(value, rel=1e-12), agg
    loss, _ = policy_loss_reference(z, z, adv, mask, config=PolicyLossConfig(loss_agg="seq-mean-token-sum-norm", norm_length=10))
    assert loss.item() == pytest.approx(-(1 + 6) / 2 / 10)
    loss, _ = policy_loss_reference(z, z, adv, mask, global_token_count=14)
    assert loss.item() == pytest.approx(-7 / 14)
    loss, _ = policy_loss_reference(z, z, adv, mask, config=PolicyLossConfig(loss_agg="seq-mean-token-mean"),
                                    global_seq_count=torch.tensor(6))
    assert loss.item() == pytest.approx(-3 / 6)


def test_hand_kl_and_entropy_terms():
    logp = _t([[-1.0, -2.0]]).requires_grad_()
    ref = _t([[-1.5, -1.0]])
    ent = _t([[0.7, 1.3]]).requires_grad_()
    z = torch.zeros(1, 2, dtype=D64)
    cfg = PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01)
    loss, m = policy_loss_reference(logp, logp.detach(), z, torch.ones(1, 2), ref_logp=ref, entropy=ent, config=cfg)
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1 - 1]
    assert m["kl_ref_mean"].item() == pytest.approx(sum(k3) / 2, rel=1e-12)
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 2 - 0.01 * 1.0, rel=1e-12)
    loss.backward()
    # d k3 / d logp = 1 - exp(ref - logp)
    torch.testing.assert_close(logp.grad, _t([[0.1 * (1 - math.exp(-0.5)) / 2, 0.1 * (1 - math.e) / 2]]))
    torch.testing.assert_close(ent.grad, _t([[-0.005, -0.005]]))


def test_hand_no_token_at_all_is_zero_not_nan():
    logp = torch.full((2, 3), float("nan"), dtype=D64, requires_grad=True)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        loss, m = policy_loss_reference(logp, logp.detach(), torch.ones(2, dtype=D64), torch.zeros(2, 3),
                                        ref_logp=logp.detach(),
                                        config=PolicyLossConfig(loss_agg=agg, kl_coef=0.1, norm_length=4.0 if "norm" in agg else None))
        assert loss.item() == 0.0
        assert all(v.item() == 0.0 for v in m.values()), m
        (g,) = torch.autograd.grad(loss, logp)
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("est,d,value", [("k1", math.log(2), -math.log(2)), ("k2", 0.3, 0.045),
                                         ("k3", math.log(2), 1 - math.log(2))])
def test_hand_kl_estimators(est, d, value):
    logp = _t([0.0]).requires_grad_()
    ref = _t([d]).requires_grad_()
    k = kl_penalty_reference(logp, ref, estimator=est)
    assert k.item() == pytest.approx(value, rel=1e-12)
    k.backward()
    dlogp = {"k1": 1.0, "k2": -d, "k3": 1 - math.exp(d)}[est]
    assert logp.grad.item() == pytest.approx(dlogp, rel=1e-12)
    assert ref.grad.item() == pytest.approx(-dlogp, rel=1e-12)


def test_kl_clamp_zero_gradient_outside():
    logp = _t([0.0, 0.0]).requires_grad_()
    k = kl_penalty_reference(logp, _t([5.0, 0.1]), estimator="k3", clamp=1.0)
    assert k[0].item() == 1.0
    k.sum().backward()
    assert logp.grad[0].item() == 0.0 and logp.grad[1].item() != 0.0


def test_k3_small_difference_keeps_relative_precision():
    d = 1e-6
    k = kl_penalty_reference(_t([0.0]), _t([d]), estimator="k3")
    assert k.item() == pytest.approx(d * d / 2, rel=1e-6)


# ----------------------------------------------------------------------------------------
# reference == literal loop, every option
# ----------------------------------------------------------------------------------------

CONFIGS = [
    dict(),
    dict(clip_low=0.2, clip_high=0.28),
    dict(dual_clip=3.0),
    dict(log_ratio_clamp=0.3),
    dict(kl_coef=0.05, kl_estimator="k1"),
    dict(kl_coef=0.05, kl_estimator="k2", kl_clamp=0.02),
    dict(kl_coef=0.05, kl_estimator="k3", kl_clamp=0.05),
    dict(entropy_coef=0.01),
    dict(is_cap=1.5),
    dict(is_level="sequence", is_cap=1.1),
    dict(is_level="sequence"),
    dict(ratio_level="sequence", clip_low=0.05, clip_high=0.05),
    dict(ratio_level="sequence", log_ratio_clamp=0.2, dual_clip=1.5),
    dict(loss_agg="seq-mean-token-mean", dual_clip=2.0, kl_coef=0.1),
    dict(loss_agg="seq-mean-token-sum", entropy_coef=0.02),
    dict(loss_agg="seq-mean-token-sum-norm", norm_length=9),
    dict(loss_agg="seq-mean-token-sum-norm", norm_length=64),
]
PRESETS = ["ppo", "grpo", "dapo", "dr_grpo", "gspo"]


def _batch(B=4, T=9, per_row_adv=False, seed=0, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=D64) * 2
    old = logp + torch.randn(B, T, generator=g, dtype=D64) * spread
    ref = logp + torch.randn(B, T, generator=g, dtype=D64) * 0.2
    roll = old + torch.randn(B, T, generator=g, dtype=D64) * 0.1
    ent = torch.rand(B, T, generator=g, dtype=D64) * 3
    adv = torch.randn(B, generator=g, dtype=D64) if per_row_adv else torch.randn(B, T, generator=g, dtype=D64)
    lengths = torch.tensor([T, 1, 0, T // 2][:B] + [T] * max(0, B - 4))
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float32)
    return logp, old, adv, mask, ref, ent, roll


def _compare_with_loop(cfg, per_row_adv, with_all=True):
    logp, old, adv, mask, ref, ent, roll = _batch(per_row_adv=per_row_adv)
    kwargs = dict(ref_logp=ref, entropy=ent, rollout_logp=roll) if with_all else {}
    loss, m = policy_loss_reference(logp, old, adv, mask, config=cfg, **kwargs)
    ref_loop, m_loop = loop_policy_loss(logp, old, adv, mask, ref if with_all else None, ent if with_all else None,
                                        roll if with_all else None, cfg)
    assert loss.item() == pytest.approx(ref_loop, rel=1e-10, abs=1e-12)
    assert set(m) == set(m_loop)
    for k in m:
        assert m[k].item() == pytest.approx(m_loop[k], rel=1e-10, abs=1e-12), k
    # gradient wrt logp and entropy: central differences of the loop
    lp = logp.clone().requires_grad_()
    e = ent.clone().requires_grad_()
    loss, _ = policy_loss_reference(lp, old, adv, mask, config=cfg, **(dict(kwargs, entropy=e) if with_all else {}))
    grads = torch.autograd.grad(loss, [lp, e] if (with_all and cfg.entropy_coef != 0) else [lp])
    h = 1e-6
    for which, grad in zip(("logp", "ent"), grads):
        num = torch.zeros_like(logp)
        for b in range(logp.shape[0]):
            for t in range(logp.shape[1]):
                vals = []
                for sgn in (1, -1):
                    lp2, e2 = logp.clone(), ent.clone()
                    (lp2 if which == "logp" else e2)[b, t] += sgn * h
                    vals.append(loop_policy_loss(lp2, old, adv, mask, ref if with_all else None,
                                                 e2 if with_all else None, roll if with_all else None, cfg)[0])
                num[b, t] = (vals[0] - vals[1]) / (2 * h)
        torch.testing.assert_close(grad, num, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_reference_matches_loop(cfg):
    _compare_with_loop(PolicyLossConfig(**cfg), per_row_adv=False)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("per_row_adv", [False, True])
def test_reference_matches_loop_presets(preset, per_row_adv):
    norm = dict(norm_length=12.0) if preset == "dr_grpo" else {}
    _compare_with_loop(PolicyLossConfig.preset(preset, **norm), per_row_adv=per_row_adv, with_all=preset == "grpo")


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_reference_global_counts_match_loop(agg):
    logp, old, adv, mask, *_ = _batch()
    cfg = PolicyLossConfig(loss_agg=agg)
    kw = dict(global_token_count=37) if agg == "token-mean" else dict(global_seq_count=11)
    loss, _ = policy_loss_reference(logp, old, adv, mask, config=cfg, **kw)
    expected, _ = loop_policy_loss(logp, old, adv, mask, cfg=cfg, gtok=kw.get("global_token_count"),
                                   gseq=kw.get("global_seq_count"))
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_reference_kl_matches_loop():
    g = torch.Generator().manual_seed(1)
    lp = torch.randn(50, generator=g, dtype=D64)
    rf = lp + torch.randn(50, generator=g, dtype=D64)
    for est in ("k1", "k2", "k3"):
        for clamp in (None, 0.3):
            out = kl_penalty_reference(lp, rf, estimator=est, clamp=clamp)
            expected = [loop_kl(a, b, est, clamp) for a, b in zip(lp.tolist(), rf.tolist())]
            torch.testing.assert_close(out, torch.tensor(expected, dtype=D64), rtol=1e-12, atol=1e-14)
