"""The policy-loss surrogates (``PolicyLossConfig.surrogate``): the reference against TRL 1.16's
own formulas, and both backends (Triton under the interpreter, PyTorch) against the float64
reference: loss, metrics, gradients; ``is_weight``; padding garbage; overflowed ratios."""

from __future__ import annotations

import ast
import functools
import importlib.util
import math
from pathlib import Path

import pytest
import torch

import csrc_triton.policy_loss as kernels
from fastrl import PolicyLossConfig
from fastrl.ops import policy_loss
from fastrl.ops import surrogates as op_surrogates
from fastrl.reference import surrogates as ref_surrogates
from fastrl.reference.policy_loss import policy_loss_reference

D64 = torch.float64
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = ["torch", "triton"]


SMALL_TILES = {"block_t": 8, "block_b": 2}
"""8-token chunks: rows of T=13 span two programs, the second one partial."""


def make_batch(B=4, T=13, *, seed=0, spread=0.4, per_row_adv=True):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=D64) * 2
    old = logp + torch.randn(B, T, generator=g, dtype=D64) * spread
    roll = old + torch.randn(B, T, generator=g, dtype=D64) * 0.2
    ref = logp + torch.randn(B, T, generator=g, dtype=D64) * 0.2
    adv = torch.randn(B, generator=g, dtype=D64) if per_row_adv else torch.randn(B, T, generator=g, dtype=D64)
    adv[0] = 0.0 if per_row_adv else adv[0]
    lengths = torch.tensor([T, 1, T - 4, 0][:B])
    mask = (torch.arange(T)[None] < lengths[:, None]).to(D64)
    return dict(logp=logp, old_logp=old, advantages=adv, mask=mask, rollout_logp=roll, ref_logp=ref)


def _run(impl, batch, cfg, **kw):
    b = dict(batch)
    dtype = D64 if impl == "ref" else torch.float32
    b = {k: (v.to(dtype) if k != "mask" else v).to(DEVICE) for k, v in b.items()}
    kw = {k: (v.to(dtype).to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    logp = b.pop("logp").requires_grad_()
    if impl == "ref":
        loss, metrics = policy_loss_reference(logp, config=cfg, **b, **kw)
    else:
        loss, metrics = policy_loss(logp, config=cfg, backend=impl, tiles=SMALL_TILES, **b, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), {k: v.detach() for k, v in metrics.items()}, grad


def _assert_close(out, ref, rtol=2e-5, atol=1e-6):
    loss, metrics, grad = out
    rloss, rmetrics, rgrad = ref
    torch.testing.assert_close(loss.double().cpu(), rloss.cpu(), rtol=rtol, atol=atol)
    assert set(metrics) == set(rmetrics)
    for k in rmetrics:
        torch.testing.assert_close(metrics[k].double().cpu(), rmetrics[k].cpu(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{k}: {m}")
    torch.testing.assert_close(grad.double().cpu(), rgrad.cpu(), rtol=rtol, atol=1e-7)


# ------------------------------------------------------------------------ TRL 1.16's formulas


@functools.cache
def _trl_gamma_weights():
    """TRL 1.16's own ``GRPOTrainer.get_gamma_weights`` (VESPO's phi), taken from its source file:
    importing ``trl.GRPOTrainer`` costs a minute on a loaded 2-core machine."""
    spec = importlib.util.find_spec("trl")
    if spec is None:
        pytest.skip("TRL is not installed")
    path = Path(spec.origin).parent / "trainer" / "grpo_trainer.py"
    tree = ast.parse(path.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GRPOTrainer"]
    (fn,) = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "get_gamma_weights"]
    fn.decorator_list = []
    namespace = {"torch": torch, "math": math}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), namespace)
    return torch.no_grad()(namespace["get_gamma_weights"])


def _trl_per_token_loss(loss_type, logp, old, adv, mask, *, level, eps_low, eps_high, delta, tau_pos, tau_neg,
                        vespo, is_ratio):
    """The per-token loss of TRL 1.16's ``GRPOTrainer._compute_loss`` (before the vLLM ratio,
    KL and aggregation), restated here; VESPO's weight is TRL's own ``get_gamma_weights``."""
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    log_ratio = logp - old
    if level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    r = torch.exp(log_w)
    if loss_type == "cispo":
        return -torch.clamp(r, max=eps_high).detach() * adv * logp
    if loss_type == "sapo":
        tau = torch.where(adv > 0, tau_pos, tau_neg)
        return -torch.sigmoid(tau * (r - 1)) * 4 / tau * adv
    if loss_type == "vespo":
        phi = _trl_gamma_weights()(adv, log_ratio, mask, is_ratio, **vespo)
        return -phi * adv * logp
    r2 = torch.clamp(r, 1 - eps_low, 1 + eps_high)
    r1 = torch.clamp(r, max=delta) if delta is not None else r
    return -torch.min(r1 * adv, r2 * adv)


TRL_CASES = [
    # (loss_type, importance_sampling_level, vLLM IS ratio given)
    ("cispo", "token", False), ("cispo", "sequence", True),
    ("sapo", "token", True), ("sapo", "sequence", False),
    ("vespo", "token", False), ("vespo", "token", True),
    ("grpo", "token", True), ("grpo", "sequence", False),
]


@pytest.mark.parametrize("loss_type,level,with_is", TRL_CASES)
def test_reference_and_backends_match_trl_formula(loss_type, level, with_is):
    """Same tensors through TRL's expression (token-sum / token count) and through fastrl's
    config: equal loss and equal gradient wrt logp, on every backend."""
    batch = make_batch(seed=1, spread=0.6)
    mask = batch["mask"]
    logp = batch["logp"].clone().requires_grad_()
    is_ratio = torch.exp(batch["old_logp"] - batch["rollout_logp"]) * mask if with_is else None
    if is_ratio is not None:
        is_ratio = torch.where(mask > 0, is_ratio, 1.0)  # TRL's ratio is exp(0) = 1 at padding
    hp = dict(eps_low=0.2, eps_high=5.0 if loss_type == "cispo" else 0.28, delta=None if loss_type != "grpo" else 3.0,
              tau_pos=1.0, tau_neg=1.05, vespo=dict(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0))
    per_token = _trl_per_token_loss(loss_type, logp, batch["old_logp"], batch["advantages"], mask, level=level,
                                    is_ratio=is_ratio, **hp)
    if is_ratio is not None and loss_type != "vespo":
        per_token = per_token * is_ratio
    trl_loss = (per_token * mask).sum() / mask.sum()
    (trl_grad,) = torch.autograd.grad(trl_loss, logp)

    surrogate = "ppo_clip" if loss_type == "grpo" else loss_type
    cfg = PolicyLossConfig(
        surrogate=surrogate, ratio_level=level, clip_low=hp["eps_low"], clip_high=hp["eps_high"] if surrogate == "ppo_clip" else 0.2,
        dual_clip=hp["delta"], cispo_max=hp["eps_high"], sapo_tau_pos=hp["tau_pos"], sapo_tau_neg=hp["tau_neg"],
        vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, loss_agg="token-mean",
    )
    b = {k: v for k, v in batch.items() if k != "ref_logp" and (with_is or k != "rollout_logp")}
    ref = _run("ref", b, cfg)  # on DEVICE; TRL's formula ran on the CPU tensors of the batch
    torch.testing.assert_close(ref[0].cpu(), trl_loss.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ref[2].cpu(), trl_grad, rtol=1e-10, atol=1e-12)
    for backend in BACKENDS:
        _assert_close(_run(backend, b, cfg), ref)
    if loss_type == "cispo":  # TRL's cispo_clip_ratio
        flags = ((torch.exp(_log_w(batch, level)) > hp["eps_high"]) & (batch["advantages"][:, None] > 0)).to(D64)
        torch.testing.assert_close(ref[1]["cispo_clip_frac"].cpu(), (flags.expand_as(mask) * mask).sum() / mask.sum())


def _log_w(batch, level):
    lr, m = batch["logp"] - batch["old_logp"], batch["mask"]
    return lr if level == "token" else ((lr * m).sum(-1) / m.sum(-1).clamp(min=1.0))[:, None]


def test_registries_agree():
    assert set(ref_surrogates.SURROGATES) == set(op_surrogates.SURROGATES) == set(kernels.SURROGATE_IDS)
    assert ref_surrogates.FOLDS_ROLLOUT_WEIGHT == op_surrogates.FOLDS_ROLLOUT_WEIGHT
    from fastrl.config import SURROGATES
    assert set(SURROGATES) == set(op_surrogates.SURROGATES)


def test_every_table_is_the_one_derived_from_the_surrogate_records():
    """One record per surrogate (``fastrl.config.SURROGATE_SPECS``): every table that lists
    surrogates equals the one derived from the records, the kernel's too (csrc_triton cannot import
    fastrl), so a record added, or a property changed, without its entry or kernel branch fails here."""
    import dataclasses
    import typing

    from fastrl.config import SURROGATE_SPECS, SURROGATES, Surrogate

    specs = list(SURROGATE_SPECS.values())
    names = tuple(spec.name for spec in specs)
    assert tuple(SURROGATE_SPECS) == names == SURROGATES == typing.get_args(Surrogate)
    assert typing.get_args(typing.get_type_hints(PolicyLossConfig)["surrogate"]) == names
    assert tuple(ref_surrogates.SURROGATES) == tuple(op_surrogates.SURROGATES) == names
    assert all(ref_surrogates.SURROGATES[name].__name__ == name for name in names)  # the formula of its name
    assert all(op_surrogates.SURROGATES[name].__name__ == f"_{name}" for name in names)  # the backend's entry
    assert kernels.SURROGATE_IDS == {spec.name: spec.kernel_id for spec in specs}
    assert kernels.LOGP_ONLY_SURROGATES == {spec.name for spec in specs if not spec.through_ratio}
    assert op_surrogates.THROUGH_RATIO == {spec.name for spec in specs if spec.through_ratio}
    assert (op_surrogates.FOLDS_ROLLOUT_WEIGHT == ref_surrogates.FOLDS_ROLLOUT_WEIGHT
            == {spec.name for spec in specs if spec.folds_rollout_weight})
    assert op_surrogates.METRIC_NAME == {spec.name: spec.metric for spec in specs if spec.metric}
    fields = {f.name for f in dataclasses.fields(PolicyLossConfig)}
    for spec in specs:
        # its options are config fields, and its scalars read those and no other field
        assert set(spec.options) <= fields, spec.name
        cfg = PolicyLossConfig(surrogate=spec.name, **({"dual_clip": 3.0} if "dual_clip" in spec.options else {}))
        read: list[str] = []

        class Recorder:
            def __getattr__(self, field):
                read.append(field)
                return getattr(cfg, field)

        assert 1 <= len(spec.params(Recorder())) <= 4 and set(read) == set(spec.options), spec.name
        # the reference reports the metric the record names, under that name
        z = torch.zeros(2, 3)
        _, metrics = ref_surrogates.SURROGATES[spec.name](lr=z, rlr=z, logp=z, A=torch.ones(2, 3), m=z == 0,
                                                          log_is=None, cfg=cfg)
        assert spec.metric is None or spec.metric in metrics, spec.name
    # the config's checks follow the records' properties
    for name in {spec.name for spec in specs if spec.sequence_weight}:
        with pytest.raises(ValueError, match="ratio_level='token'"):
            PolicyLossConfig(surrogate=name, ratio_level="sequence")
    for name in {spec.name for spec in specs if spec.folds_rollout_weight}:
        with pytest.raises(ValueError, match="is_cap must be None"):
            PolicyLossConfig(surrogate=name, is_cap=2.0)


# ------------------------------------------------------------------------ backends vs reference

CONFIGS = [
    dict(surrogate="cispo", cispo_max=1.1),
    dict(surrogate="cispo", ratio_level="sequence", kl_coef=0.05, loss_agg="seq-mean-token-mean"),
    dict(surrogate="sapo", sapo_tau_pos=2.0, sapo_tau_neg=0.5, entropy_coef=0.0),
    dict(surrogate="sapo", ratio_level="sequence", log_ratio_clamp=0.3, loss_agg="seq-mean-token-sum"),
    dict(surrogate="vespo", kl_coef=0.05, kl_estimator="k2"),
    dict(surrogate="vespo", log_ratio_clamp=0.2, vespo_k_pos=1.0, vespo_lambda_neg=0.0,
         loss_agg="seq-mean-token-sum-norm", norm_length=16),
    dict(surrogate="ppo_clip", dual_clip=2.0, is_level="sequence", is_cap=1.2),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_backends_match_reference(backend, cfg):
    cfg = PolicyLossConfig(**cfg)
    batch = make_batch(per_row_adv=cfg.surrogate != "sapo")
    _assert_close(_run(backend, batch, cfg), _run("ref", batch, cfg))


@pytest.mark.parametrize("backend,shape", [("torch", "token"), ("torch", "row"), ("torch", "row1"),
                                           ("triton", "row")])
@pytest.mark.parametrize("surrogate", ["ppo_clip", "cispo", "sapo", "vespo"])
def test_is_weight(backend, surrogate, shape):
    """``is_weight`` multiplies the policy term (any surrogate, any of its shapes); with
    ``rollout_logp`` too, the two multiply; ``exp(old - rollout)`` as ``is_weight`` equals
    ``rollout_logp`` for the surrogates that multiply it."""
    batch = make_batch(seed=3)
    B, T = batch["logp"].shape
    g = torch.Generator().manual_seed(5)
    v = {"token": torch.rand(B, T, generator=g, dtype=D64), "row": torch.rand(B, generator=g, dtype=D64),
         "row1": torch.rand(B, 1, generator=g, dtype=D64)}[shape]
    v[0] = 0.0  # a zero weight (a masked-out row of a trainer's token mask)
    cfg = PolicyLossConfig(surrogate=surrogate)
    ref = _run("ref", batch, cfg, is_weight=v)
    _assert_close(_run(backend, batch, cfg, is_weight=v), ref)
    # against the definition: the pg term of each row scaled by its weight
    no_w = {k: x for k, x in batch.items() if k != "rollout_logp"}
    per_tok = v.reshape(B, -1).expand(B, T)
    if surrogate != "vespo":
        plain = _run("ref", no_w, cfg, is_weight=per_tok * torch.exp(batch["old_logp"] - batch["rollout_logp"]))
        _assert_close(ref, plain, rtol=1e-10, atol=1e-12)
    only_w = _run("ref", no_w, cfg, is_weight=per_tok)
    assert "is_weight_mean" in only_w[1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("surrogate", ["cispo", "sapo", "vespo"])
def test_garbage_padding_and_overflowed_ratios(backend, surrogate):
    """NaN/inf at masked-out positions change nothing; a log-ratio of +-100 (ratio overflow in
    fp32) gives finite gradients that equal the float64 reference."""
    batch = make_batch(seed=7)
    for k in ("old_logp", "rollout_logp"):  # the ratio overflows, the rollout weight stays moderate
        batch[k][0, :3] -= 100.0  # ratio e^100: inf in fp32 (A = 0 on row 0)
        batch[k][2, 2:4] -= 100.0  # (A != 0 on row 2)
    cfg = PolicyLossConfig(surrogate=surrogate, kl_coef=0.02)
    clean = _run(backend, batch, cfg)
    assert all(torch.isfinite(x).all() for x in (clean[0], clean[2]))
    dirty = {k: v.clone() for k, v in batch.items()}
    pad = batch["mask"] == 0
    for k, bad in (("logp", float("nan")), ("old_logp", float("inf")), ("rollout_logp", -float("inf")),
                   ("ref_logp", 3e38)):
        dirty[k][pad] = bad
    got = _run(backend, dirty, cfg)
    torch.testing.assert_close(got[0], clean[0], rtol=0, atol=0)
    torch.testing.assert_close(got[2], clean[2], rtol=0, atol=0)
    ref = _run("ref", batch, cfg)  # (its ratio metrics are finite in float64: compare loss and gradient)
    torch.testing.assert_close(clean[0].double().cpu(), ref[0].cpu(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(clean[2].double().cpu(), ref[2].cpu(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("bad,msg", [
    (dict(surrogate="trpo"), "surrogate"),
    (dict(surrogate="cispo", dual_clip=3.0), "dual_clip"),
    (dict(surrogate="vespo", ratio_level="sequence"), "ratio_level"),
    (dict(surrogate="vespo", is_cap=2.0), "is_cap"),
    (dict(cispo_max=0.0), "cispo_max"),
    (dict(sapo_tau_neg=-1.0), "sapo_tau_neg"),
    (dict(vespo_k_pos=float("nan")), "vespo_k_pos"),
])
def test_bad_config(bad, msg):
    with pytest.raises(ValueError, match=msg):
        PolicyLossConfig(**bad)


def test_is_weight_bad_shape():
    batch = make_batch()
    with pytest.raises(ValueError, match="is_weight"):
        _run("torch", batch, PolicyLossConfig(), is_weight=torch.ones(3, dtype=D64))
