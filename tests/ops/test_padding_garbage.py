"""The padding contract, for every op and backend (reference, torch, Triton): whatever sits at
a masked-out position -- NaN, +-inf, +-3e38 -- changes no output, metric or gradient.

Each case runs an op twice on the same masked-in values: once with clean padding (zeros)
and once with garbage in every masked-out slot of every input, and compares everything the
op returns, plus the gradients of its differentiable inputs. Ops without a mask
(``kl_penalty``) must keep the garbage to its own elements.
"""

from __future__ import annotations

import pytest
import torch

from fastrl.config import PolicyLossConfig
from fastrl.ops import (
    discounted_returns,
    fused_linear_policy_loss,
    gae,
    kl_penalty,
    linear_logprobs,
    masked_whiten,
    policy_loss,
    step_advantages,
    turn_advantages,
    turn_gae,
    value_loss,
)
from fastrl.reference import scans as scans_ref
from fastrl.reference.advantages import step_advantages_reference
from fastrl.reference.kl import kl_penalty_reference
from fastrl.reference.logprobs import linear_logprobs_reference
from fastrl.reference.policy_loss import policy_loss_reference
from fastrl.reference.turn_advantages import turn_advantages_reference, turn_gae_reference
from fastrl.reference.value_loss import value_loss_reference
from fastrl.reference.whiten import masked_whiten_reference

from conftest import DEVICE  # tests/ is on sys.path; the Triton backend needs CUDA tensors on a GPU

B, T = 4, 9
GARBAGE = {
    "nan": [float("nan")],
    "inf": [float("inf"), float("-inf")],
    "huge": [3e38, -3e38],  # finite, but their differences and exponentials overflow
    "mixed": [float("nan"), float("inf"), -3e38, float("-inf"), 3e38],
}


def _mask(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(B, T, generator=g) > 0.35
    m[0, :] = True
    m[1, :] = False  # a fully masked row
    m[2, 5:] = False  # right padding
    m[3, 2:4] = False  # an observation block inside the row
    m[3, 0] = True
    return m.to(DEVICE)


def _fill(x: torch.Tensor, keep: torch.Tensor, kind: str | None) -> torch.Tensor:
    """``x`` with the positions outside ``keep`` set to 0 (kind None) or to the garbage
    values of ``kind`` (cycled over the positions)."""
    if kind is None:
        pad = torch.zeros_like(x)
    else:
        vals = torch.tensor(GARBAGE[kind], dtype=x.dtype, device=x.device)
        idx = torch.arange(x.numel(), device=x.device).reshape(x.shape) % len(vals)
        pad = vals[idx]
    return torch.where(keep, x, pad)


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _grads(out: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out, inputs, allow_unused=True))


# ---------------------------------------------------------------- cases: backend, kind -> dict


POLICY_CONFIGS = {
    "token_dual_kl3_ent_is": (
        PolicyLossConfig(dual_clip=3.0, kl_coef=0.1, kl_estimator="k3", entropy_coef=0.01, is_cap=2.0),
        "token",
    ),
    "sequence_ratio_seq_is_clamped": (
        PolicyLossConfig(ratio_level="sequence", is_level="sequence", log_ratio_clamp=5.0, kl_coef=0.05,
                         kl_estimator="k2", loss_agg="seq-mean-token-mean", entropy_coef=0.02),
        "row",
    ),
    "sum_norm_k1_clamp": (
        PolicyLossConfig(loss_agg="seq-mean-token-sum-norm", norm_length=16.0, kl_coef=0.1, kl_estimator="k1",
                         kl_clamp=0.5, entropy_coef=0.01),
        "token",
    ),
}


def _policy_case(backend, kind, cfg_name):
    cfg, adv_level = POLICY_CONFIGS[cfg_name]
    m = _mask()
    lp = -_rand(B, T, seed=1).abs()
    old = lp + 0.3 * _rand(B, T, seed=2)
    ref = lp + 0.2 * _rand(B, T, seed=3)
    roll = old + 0.1 * _rand(B, T, seed=4)
    ent = _rand(B, T, seed=5).abs()
    adv = _rand(B, T, seed=6) if adv_level == "token" else _rand(B, seed=6)
    if adv.dim() == 1:
        adv = torch.where(m.any(1), adv, float("nan") if kind else 0.0)  # a fully masked row's advantage is padding
    else:
        adv = _fill(adv, m, kind)
    lp, old, ref, roll, ent = (_fill(x, m, kind) for x in (lp, old, ref, roll, ent))
    lp.requires_grad_()
    ent.requires_grad_()
    kw = dict(ref_logp=ref, entropy=ent, rollout_logp=roll, config=cfg)
    if backend == "reference":
        loss, metrics = policy_loss_reference(lp, old, adv, m, **kw)
    else:
        loss, metrics = policy_loss(lp, old, adv, m, backend=backend, **kw)
    g_lp, g_ent = _grads(loss, [lp, ent])
    return {"loss": loss, **metrics, "grad_logp": g_lp, "grad_entropy": g_ent}


def _value_case(backend, kind, loss_agg):
    m = _mask(1)
    v = _fill(_rand(B, T, seed=1), m, kind).requires_grad_()
    vold = _fill(_rand(B, T, seed=2), m, kind)
    R = _fill(_rand(B, T, seed=3), m, kind)
    kw = dict(clip=0.2, loss_agg=loss_agg)
    fn = value_loss_reference if backend == "reference" else value_loss
    if backend != "reference":
        kw["backend"] = backend
    loss, metrics = fn(v, vold, R, m, **kw)
    (g,) = _grads(loss, [v])
    return {"loss": loss, **metrics, "grad_values": g}


def _gae_case(backend, kind, whiten):
    m = _mask(2)
    r = _fill(_rand(B, T, seed=1), m, kind)
    v = _fill(_rand(B, T, seed=2), m, kind)
    if backend == "reference":
        adv, ret = scans_ref.gae(r, v, m, gamma=0.99, lam=0.95, whiten=whiten)
    else:
        adv, ret = gae(r, v, m, gamma=0.99, lam=0.95, whiten=whiten, backend=backend)
    return {"advantages": adv, "returns": ret}


def _discounted_case(backend, kind):
    m = _mask(3)
    r = _fill(_rand(B, T, seed=1), m, kind)
    if backend == "reference":
        return {"returns": scans_ref.discounted_returns(r, m, gamma=0.9)}
    return {"returns": discounted_returns(r, m, gamma=0.9, backend=backend)}


def _whiten_case(backend, kind, shift_mean):
    m = _mask(4)
    x = _fill(_rand(B, T, seed=1), m, kind).requires_grad_()
    if backend == "reference":
        y = masked_whiten_reference(x, m, shift_mean=shift_mean)
    else:
        y = masked_whiten(x, m, shift_mean=shift_mean, backend=backend)
    w = _rand(B, T, seed=2)  # a generic upstream gradient (finite everywhere)
    (g,) = _grads((y * w).sum(), [x])
    return {"y": y, "grad_x": g}


def _step_adv_case(backend, kind):
    S = 3
    m = _mask(5)
    end = torch.tensor([[8, 3, -1], [-1, -1, -1], [4, -1, 1], [6, 0, -1]], device=DEVICE)
    r = _fill(_rand(B, S, seed=1), end >= 0, kind)
    ids = torch.tensor([7, 7, 3, 3], device=DEVICE)
    if backend == "reference":
        return {"advantages": step_advantages_reference(r, end, ids, m)}
    return {"advantages": step_advantages(r, end, ids, m, backend=backend)}


def _turn_layout(kind):
    """Agent trajectories on ``_mask(9)``: each run of policy tokens is one turn; K = 4 turns
    (absent ones hold garbage), turn_index off the policy tokens is garbage too."""
    m = _mask(9)
    starts = m & ~torch.nn.functional.pad(m, (1, 0))[:, :-1]
    ti = torch.cumsum(starts.long(), 1) - 1
    nt = starts.sum(1)
    ti = torch.where(m, ti, -1 if kind is None else 10**9)
    present = torch.arange(4, device=DEVICE)[None] < nt[:, None]
    return m, ti, nt, present


def _turn_case(backend, kind, mode):
    m, ti, nt, present = _turn_layout(kind)
    r = _fill(_rand(B, 4, seed=1).round(), present, kind)
    outcome = _rand(B, seed=2)
    keys = torch.where(present, torch.tensor([[1, 2, 1, 2]], device=DEVICE).expand(B, 4), 0 if kind is None else 2**61)
    ids = torch.tensor([7, 7, 3, 7], device=DEVICE)
    kw = dict(mode=mode, gamma=0.9, outcome_coef=0.5, state_keys=keys if mode == "gigpo" else None)
    if backend == "reference":
        adv, stats = turn_advantages_reference(ti, m, r, nt, outcome, ids, **kw)
    else:
        adv, stats = turn_advantages(ti, m, r, nt, outcome, ids, backend=backend, **kw)
    return {"advantages": adv.float(), **stats}


def _turn_gae_case(backend, kind):
    m, ti, nt, present = _turn_layout(kind)
    r = _fill(_rand(B, 4, seed=1), present, kind)
    v = _fill(_rand(B, T, seed=3), m, kind)
    tok = _fill(0.1 * _rand(B, T, seed=4), m, kind)
    fn = turn_gae_reference if backend == "reference" else turn_gae
    kw = {} if backend == "reference" else {"backend": backend}
    adv, ret = fn(ti, m, r, nt, v, gamma=0.9, lam=0.95, outcome_rewards=_rand(B, seed=2), token_rewards=tok, **kw)
    return {"advantages": adv.float(), "returns": ret.float()}


def _kl_case(backend, kind, estimator):
    """No mask: garbage at some elements must stay there (values and gradients elsewhere unchanged)."""
    keep = _mask(6)
    lp = _fill(-_rand(B, T, seed=1).abs(), keep, kind).requires_grad_()
    ref = _fill(-_rand(B, T, seed=2).abs(), keep, kind).requires_grad_()
    if backend == "reference":
        k = kl_penalty_reference(lp, ref, estimator=estimator)
    else:
        k = kl_penalty(lp, ref, estimator=estimator, backend=backend)
    g_lp, g_ref = _grads(torch.where(keep, k, 0.0).sum(), [lp, ref])
    return {"kl": k[keep], "grad_logp": g_lp[keep], "grad_ref": g_ref[keep]}


H, V = 8, 19


def _logprobs_case(backend, kind):
    m = _mask(7)
    h = _fill(_rand(B, T, H, seed=1), m[..., None], kind).requires_grad_()
    w = (0.5 * _rand(V, H, seed=2)).requires_grad_()
    y = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    y = torch.where(m, y, -100)
    if backend == "reference":
        lp, ent = linear_logprobs_reference(h, w, y)
    else:
        lp, ent = linear_logprobs(h, w, y, return_entropy=True, backend=backend)
    g_h, g_w = _grads(lp.sum() + 0.1 * ent.sum(), [h, w])
    return {"logp": lp, "entropy": ent, "grad_hidden": g_h, "grad_weight": g_w}


def _fused_case(backend, kind):
    m = _mask(8)
    h = _fill(_rand(B, T, H, seed=1), m[..., None], kind).requires_grad_()
    w = (0.5 * _rand(V, H, seed=2)).requires_grad_()
    y = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    y = torch.where(m, y, V + 7)  # padding ids may be anything
    with torch.no_grad():
        lp0 = torch.log_softmax(torch.where(m[..., None], h, 0.0) @ w.T, -1).gather(-1, torch.where(m, y, 0)[..., None])[..., 0]
    old = _fill(lp0 + 0.3 * _rand(B, T, seed=4), m, kind)
    ref = _fill(lp0 + 0.2 * _rand(B, T, seed=5), m, kind)
    roll = _fill(old + 0.1 * _rand(B, T, seed=6), m, kind)
    adv = _fill(_rand(B, T, seed=7), m, kind)
    cfg = PolicyLossConfig(dual_clip=3.0, kl_coef=0.1, entropy_coef=0.01, is_cap=2.0)
    loss, metrics = fused_linear_policy_loss(h, w, y, old, adv, m, ref_logp=ref, rollout_logp=roll, config=cfg,
                                             backend=backend)
    g_h, g_w = _grads(loss, [h, w])
    return {"loss": loss, **metrics, "grad_hidden": g_h, "grad_weight": g_w}


CASES = {
    **{f"policy_loss[{c}]": (lambda b, k, c=c: _policy_case(b, k, c)) for c in POLICY_CONFIGS},
    "value_loss[token-mean]": lambda b, k: _value_case(b, k, "token-mean"),
    "value_loss[seq-mean-token-mean]": lambda b, k: _value_case(b, k, "seq-mean-token-mean"),
    "gae": lambda b, k: _gae_case(b, k, False),
    "gae[whiten]": lambda b, k: _gae_case(b, k, True),
    "discounted_returns": _discounted_case,
    "masked_whiten": lambda b, k: _whiten_case(b, k, True),
    "masked_whiten[scale_only]": lambda b, k: _whiten_case(b, k, False),
    "step_advantages": _step_adv_case,
    "turn_advantages[gigpo]": lambda b, k: _turn_case(b, k, "gigpo"),
    "turn_advantages[turn_discounted]": lambda b, k: _turn_case(b, k, "turn_discounted"),
    "turn_gae": _turn_gae_case,
    "kl_penalty[k3]": lambda b, k: _kl_case(b, k, "k3"),
    "kl_penalty[k2]": lambda b, k: _kl_case(b, k, "k2"),
    "linear_logprobs": _logprobs_case,
}
CASES["fused_linear_policy_loss"] = _fused_case  # composed of the ops above: no reference of its own
RUNS = [(c, b) for c in CASES for b in ("reference", "torch", "triton") if not (b == "reference" and c == "fused_linear_policy_loss")]


@pytest.mark.parametrize("kind", list(GARBAGE))
@pytest.mark.parametrize(("case", "backend"), RUNS)
def test_garbage_in_padding_changes_nothing(case, backend, kind):
    clean = CASES[case](backend, None)
    dirty = CASES[case](backend, kind)
    assert clean.keys() == dirty.keys()
    for name, want in clean.items():
        got = dirty[name]
        if want is None:
            assert got is None, name
            continue
        assert torch.isfinite(want).all(), f"{name}: clean padding gave a non-finite value"
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=lambda s, n=name: f"{case} {n}: {s}")
