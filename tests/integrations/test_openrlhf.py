"""fastrl.integrations.openrlhf against OpenRLHF's own PolicyLoss / ValueLoss classes.

``openrlhf/models/__init__.py`` imports the actor stack (flash-attn, CUDA only), so the test
imports the installed ``openrlhf.models.loss`` module alone: the ``openrlhf.models`` package
object is created without running its ``__init__``; ``loss.py`` and its one dependency
``openrlhf/models/utils.py`` (which imports deepspeed) are OpenRLHF's own code, unmodified.
"""

from __future__ import annotations

import importlib
import os
import sys
import types

import pytest
import torch

openrlhf = pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (pip install -e '.[openrlhf]' && pip install --no-deps openrlhf==0.11.2 deepspeed==0.19.8)")
pytest.importorskip("deepspeed", reason="openrlhf.models.utils imports deepspeed")


def _import_openrlhf_loss():
    if "openrlhf.models" not in sys.modules:
        pkg = types.ModuleType("openrlhf.models")
        pkg.__path__ = [os.path.join(os.path.dirname(openrlhf.__file__), "models")]
        sys.modules["openrlhf.models"] = pkg
    return importlib.import_module("openrlhf.models.loss")


ref_loss = _import_openrlhf_loss()

from fastrl.integrations import openrlhf as fo  # noqa: E402

B, T = 7, 10


def _inputs(seed: int, gspo: bool = False):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T)
    for b, n in enumerate([10, 7, 3, 1, 9, 5, 8]):
        mask[b, :n] = 1
    mask[0, 4:6] = 0
    old = -torch.rand(B, T, generator=g) * 3
    scale = 0.05 if gspo else 0.5
    logp = old + scale * torch.randn(B, T, generator=g)
    if not gspo:
        logp[1, 0] = old[1, 0] + 25.0  # beyond the +-20 log-ratio clamp
    rollout = old + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    if gspo:
        adv = adv[:, :1].expand(B, T).contiguous()
    return logp, old, adv * mask, mask, rollout


def _run(module, logp, old, adv, mask, rollout, **kw):
    lp = logp.clone().requires_grad_(True)
    out = module(lp, old, adv, mask, rollout_log_probs=rollout, **kw)
    out[0].backward()
    return out, lp.grad


POLICY_CASES = {
    "ppo": {},
    "ppo_clip_higher_dual": {"clip_eps_high": 0.28, "dual_clip": 3.0},
    "ppo_seq_loss": {"token_level_loss": False, "dual_clip": 2.0},
    "gspo": {"policy_loss_type": "gspo", "clip_eps_low": 3e-2, "clip_eps_high": 4e-2},
    "gspo_vs_rollout": {"policy_loss_type": "gspo", "clip_eps_low": 3e-2, "clip_eps_high": 4e-2,
                        "is_correction_level": "token"},
    "is_token_mask": {"is_correction_level": "token", "is_correction_threshold": (0.8, 1.25)},
    "is_token_clip": {"is_correction_level": "token", "is_correction_mode": "clip",
                      "is_correction_threshold": (0.8, 1.25)},
    "is_seq_mask": {"is_correction_level": "seq", "is_correction_threshold": (0.9, 1.1)},
    "is_token_binary_kl": {"is_correction_level": "token", "is_correction_gating": "binary_kl",
                           "is_correction_threshold": (0.0, 0.02)},
    "is_seq_tv": {"is_correction_level": "seq", "is_correction_gating": "tv", "is_correction_threshold": (0.0, 0.05)},
}


@pytest.mark.parametrize("case", list(POLICY_CASES))
@pytest.mark.parametrize("global_counts", [False, True])
def test_policy_loss_matches_openrlhf(case, global_counts):
    kw = POLICY_CASES[case]
    logp, old, adv, mask, rollout = _inputs(0, gspo=kw.get("policy_loss_type") == "gspo")
    fwd = dict(dp_size=2, batch_num_tokens=91.0, global_batch_size=13.0) if global_counts else {}
    ref_out, ref_grad = _run(ref_loss.PolicyLoss(**kw), logp, old, adv, mask, rollout, **fwd)
    got_out, got_grad = _run(fo.PolicyLoss(**kw), logp, old, adv, mask, rollout, **fwd)
    torch.testing.assert_close(got_grad, ref_grad, rtol=1e-5, atol=1e-7)
    for name, r, o in zip(["loss", "clip_ratio", "ppo_kl", "vllm_kl", "is_filter_ratio"], ref_out, got_out):
        if r is None:
            assert o is None, name
        else:
            torch.testing.assert_close(o.detach().float(), r.detach().float(), rtol=1e-5, atol=1e-7, msg=name)


def test_policy_loss_without_mask_matches_openrlhf():
    logp, old, adv, _, _ = _inputs(1)
    ref_l, ref_g = _run(ref_loss.PolicyLoss(), logp, old, adv, None, None)
    got_l, got_g = _run(fo.PolicyLoss(), logp, old, adv, None, None)
    torch.testing.assert_close(got_l[0], ref_l[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got_g, ref_g, rtol=1e-5, atol=1e-7)


def test_constructor_validation_matches_openrlhf():
    for bad in (
        {"is_correction_level": "bogus"},
        {"is_correction_mode": "clip", "is_correction_level": "seq"},
        {"is_correction_level": "token", "is_correction_gating": "tv"},
    ):
        with pytest.raises(ValueError):
            ref_loss.PolicyLoss(**bad)
        with pytest.raises(ValueError):
            fo.PolicyLoss(**bad)
    assert fo.PolicyLoss(policy_loss_type="gspo").token_level_loss is False


@pytest.mark.parametrize("clip_eps", [None, 0.2])
@pytest.mark.parametrize("token_level_loss", [True, False])
@pytest.mark.parametrize("global_counts", [False, True])
def test_value_loss_matches_openrlhf(clip_eps, token_level_loss, global_counts):
    g = torch.Generator().manual_seed(2)
    _, _, _, mask, _ = _inputs(2)
    old_values = torch.randn(B, T, generator=g)
    values = old_values + 0.5 * torch.randn(B, T, generator=g)
    returns = torch.randn(B, T, generator=g)
    fwd = dict(dp_size=2, batch_num_tokens=91.0, global_batch_size=13.0) if global_counts else {}
    outs = []
    for cls in (ref_loss.ValueLoss, fo.ValueLoss):
        v = values.clone().requires_grad_(True)
        loss = cls(clip_eps, token_level_loss)(v, old_values, returns, mask, **fwd)
        loss.backward()
        outs.append((loss.detach(), v.grad))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-5, atol=1e-7)
