"""fused_linear_policy_loss == policy_loss(log-probs from full float64 logits), values,
metrics and gradients of hidden / weight / bias, over the PolicyLossConfig options."""

import pytest
import torch

from fastrl.config import PolicyLossConfig
from fastrl.ops import fused_linear_policy_loss, linear_logprobs, policy_loss

B, T, H, V = 3, 6, 24, 67


def _data(seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.3
    b = torch.randn(V, generator=g) * 0.2
    y = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[0, 4:] = 0
    mask[2, 1:] = 0  # a one-token row
    y[mask == 0] = V + 5  # padding ids may be anything: they are ignored
    with torch.no_grad():
        lp = torch.log_softmax((h @ w.T + b).double(), -1).gather(-1, y.clamp(max=V - 1)[..., None])[..., 0].float()
    old = lp + 0.3 * torch.randn(B, T, generator=g)
    ref = lp + 0.2 * torch.randn(B, T, generator=g)
    roll = old + 0.1 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    return tuple(t.to(device) for t in (h, w, b, y, mask, old, ref, roll, adv))


def _reference(h, w, b, y, mask, old, adv, cfg, temperature, with_entropy, **kw):
    """policy_loss on log-probs/entropy from explicit float64 logits (autograd to h, w, b)."""
    hh, ww, bb = (t.detach().double().requires_grad_() for t in (h, w, b))
    u = (hh @ ww.T + bb) / temperature
    logq = torch.log_softmax(u, -1)
    logp = logq.gather(-1, torch.where(mask != 0, y, 0)[..., None])[..., 0]
    ent = -(logq.exp() * logq).sum(-1) if with_entropy else None
    loss, metrics = policy_loss(logp, old, adv, mask, entropy=ent, config=cfg, backend="torch", **kw)
    loss.backward()
    return loss, metrics, hh.grad, ww.grad, bb.grad


CONFIGS = {
    "ppo": (PolicyLossConfig.preset("ppo"), {}),
    "grpo_kl": (PolicyLossConfig.preset("grpo"), {"ref": True}),
    "dapo_global_tokens": (PolicyLossConfig.preset("dapo"), {"global_token_count": 20.0}),
    "dr_grpo": (PolicyLossConfig.preset("dr_grpo", norm_length=10.0), {}),
    "gspo_sequence_ratio": (PolicyLossConfig.preset("gspo", clip_low=0.1, clip_high=0.1), {}),
    "dual_clip_is_cap_entropy": (
        PolicyLossConfig(dual_clip=3.0, is_cap=2.0, entropy_coef=0.01, kl_coef=0.02, kl_estimator="k2"),
        {"ref": True, "rollout": True},
    ),
    "seq_is_global_seqs": (
        PolicyLossConfig(loss_agg="seq-mean-token-mean", is_level="sequence", is_cap=5.0),
        {"rollout": True, "global_seq_count": 4.0},
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_policy_loss_on_logits_path(name):
    cfg, opts = CONFIGS[name]
    h, w, b, y, mask, old, ref, roll, adv = _data()
    kw = {}
    if opts.get("ref"):
        kw["ref_logp"] = ref
    if opts.get("rollout"):
        kw["rollout_logp"] = roll
    for key in ("global_token_count", "global_seq_count"):
        if key in opts:
            kw[key] = opts[key]
    temperature = 0.8
    with_entropy = cfg.entropy_coef != 0 or name == "ppo"
    hh, ww, bb = (t.clone().requires_grad_() for t in (h, w, b))
    loss, metrics = fused_linear_policy_loss(
        hh, ww, y, old, adv, mask, bias=bb, config=cfg, temperature=temperature,
        entropy=(name == "ppo"), backend="torch", **kw,
    )
    loss.backward()
    rloss, rmetrics, gh, gw, gb = _reference(h, w, b, y, mask, old, adv, cfg, temperature, with_entropy, **kw)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss.double(), rloss.double(), atol=1e-5, rtol=1e-5)
    assert metrics.keys() == rmetrics.keys()
    if with_entropy:
        assert "entropy_mean" in metrics
    for k in rmetrics:
        torch.testing.assert_close(metrics[k].double(), rmetrics[k].double(), atol=1e-5, rtol=1e-5, msg=k)
    for got, want in ((hh.grad, gh), (ww.grad, gw), (bb.grad, gb)):
        assert ((got.double() - want).abs().max() / want.abs().max()) < 1e-4


def test_equals_composition_of_the_two_ops_triton_backend(device):
    cfg = PolicyLossConfig.preset("grpo")
    h, w, b, y, mask, old, ref, _, adv = _data(1, device)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, metrics = fused_linear_policy_loss(hh, ww, y, old, adv, mask, ref_logp=ref, config=cfg, backend="triton")
    loss.backward()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp = linear_logprobs(h2, w2, torch.where(mask != 0, y, -100), backend="torch")
    rloss, rmetrics = policy_loss(logp, old, adv, mask, ref_logp=ref, config=cfg, backend="torch")
    rloss.backward()
    torch.testing.assert_close(loss, rloss, atol=1e-5, rtol=1e-5)
    for k in rmetrics:
        torch.testing.assert_close(metrics[k], rmetrics[k], atol=1e-5, rtol=1e-5, msg=k)
    torch.testing.assert_close(hh.grad, h2.grad, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(ww.grad, w2.grad, atol=1e-6, rtol=1e-4)


def test_bad_input():
    h, w, b, y, mask, old, ref, _, adv = _data()
    with pytest.raises(ValueError, match="hidden"):
        fused_linear_policy_loss(h[0], w, y, old, adv, mask)
    with pytest.raises(ValueError, match="targets"):
        fused_linear_policy_loss(h, w, y[:, :-1], old, adv, mask)
    with pytest.raises(ValueError, match="mask"):
        fused_linear_policy_loss(h, w, y, old, adv, mask[:, :-1])
    with pytest.raises(ValueError, match="weight"):
        fused_linear_policy_loss(h, w[:, :-1], y, old, adv, mask)
    y_bad = y.clone()
    y_bad[1, 1] = V  # inside the mask: must be a real token id
    with pytest.raises(ValueError, match="targets"):
        fused_linear_policy_loss(h, w, y_bad, old, adv, mask)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.05])
def test_one_pass_cpu_path_equals_composition(entropy_coef):
    # the CPU path forms the gradients during the forward pass; it must match the composed path
    cfg = PolicyLossConfig(clip_high=0.28, dual_clip=2.5, kl_coef=0.1, log_ratio_clamp=1.0,
                           entropy_coef=entropy_coef, loss_agg="seq-mean-token-mean")
    h, w, b, y, mask, old, ref, roll, adv = _data(3)
    adv_tok = adv[:, None] + 0.1 * torch.randn(B, T)
    results = []
    for eager in (True, False):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        bb = b.clone()  # bias without gradient
        loss, metrics = fused_linear_policy_loss(hh, ww, y, old, adv_tok, mask, bias=bb, ref_logp=ref,
                                                 rollout_logp=roll, config=cfg.replace(is_cap=1.5),
                                                 temperature=1.3, entropy=True, backend="torch", one_pass=eager)
        (2.0 * loss).backward()
        results.append((loss, metrics, hh.grad, ww.grad))
    (l1, m1, gh1, gw1), (l2, m2, gh2, gw2) = results
    torch.testing.assert_close(l1, l2, atol=1e-6, rtol=1e-5)
    for k in m2:
        torch.testing.assert_close(m1[k], m2[k], atol=1e-6, rtol=1e-5, msg=k)
    torch.testing.assert_close(gh1, gh2, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(gw1, gw2, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("surrogate", ["cispo", "sapo", "vespo"])
def test_surrogates_and_is_weight_one_pass_equals_composition(surrogate):
    # every surrogate and a per-sequence is_weight: the one-pass CPU path (vespo: never taken, its
    # weight needs the whole row) equals the composed path
    cfg = PolicyLossConfig(surrogate=surrogate, cispo_max=1.1, kl_coef=0.1, loss_agg="seq-mean-token-mean")
    h, w, b, y, mask, old, ref, roll, adv = _data(4)
    is_weight = torch.tensor([0.5, 0.0, 1.5])
    results = []
    for eager in (True, False):
        hh = h.clone().requires_grad_()
        loss, metrics = fused_linear_policy_loss(hh, w, y, old, adv, mask, bias=b, ref_logp=ref, rollout_logp=roll,
                                                 is_weight=is_weight, config=cfg, backend="torch", one_pass=eager)
        loss.backward()
        results.append((loss, metrics, hh.grad))
    (l1, m1, g1), (l2, m2, g2) = results
    torch.testing.assert_close(l1, l2, atol=1e-6, rtol=1e-5)
    assert m1.keys() == m2.keys() and "is_weight_mean" in m1
    torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-4)


def test_no_grad_and_bf16_inputs():
    cfg = PolicyLossConfig.preset("dapo")
    h, w, b, y, mask, old, ref, _, adv = _data(4)
    with torch.no_grad():
        loss, _ = fused_linear_policy_loss(h, w, y, old, adv, mask, config=cfg, backend="torch")
    hh, ww = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    lb, _ = fused_linear_policy_loss(hh, ww, y, old, adv, mask, config=cfg, backend="torch")
    lb.backward()
    assert hh.grad.dtype == torch.bfloat16 and ww.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lb, loss, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ["old_logp", "advantages", "ref_logp", "rollout_logp"])
@pytest.mark.parametrize("change", ["shorter", "longer", "extra_row"])
def test_wrong_shapes_are_value_errors_before_any_work(backend, name, change, monkeypatch, device):
    """Every per-token input is checked before the log-probs are computed (the one-pass CPU
    path used to index them after its work: IndexError, or silent mis-indexing if larger)."""
    import fastrl.ops.logprobs as lp_mod

    def no_work(*args, **kwargs):
        raise AssertionError("log-prob work started before the inputs were validated")

    monkeypatch.setattr(lp_mod, "_torch_logits", no_work)
    monkeypatch.setattr(lp_mod._LinearLogprobs, "apply", no_work)
    # the torch backend on CPU tensors: the one-pass path; Triton on the GPU when there is one
    h, w, b, y, mask, old, ref, roll, adv = _data(device=device if backend == "triton" else "cpu")
    args = dict(old_logp=old, advantages=adv[:, None].expand(B, T).contiguous(), ref_logp=ref, rollout_logp=roll)
    x = args[name]
    if change == "shorter":
        x = x[:, :-1]
    elif change == "longer":
        x = torch.cat([x, x[:, :1]], dim=1)
    else:
        x = torch.cat([x, x[:1]], dim=0)
    args[name] = x
    hh = h.clone().requires_grad_()
    cfg = PolicyLossConfig(kl_coef=0.1, is_cap=2.0)
    with pytest.raises(ValueError, match=name):
        fused_linear_policy_loss(hh, w, y, args.pop("old_logp"), args.pop("advantages"), mask, config=cfg,
                                 backend=backend, **args)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_double_backward_with_retain_graph(backend, device):
    """autograd.grad(..., retain_graph=True) then a second backward gives the same gradients
    (the one-pass CPU path used to clear and scale its saved gradients in place)."""
    # the torch backend on CPU tensors: the one-pass path; Triton on the GPU when there is one
    h, w, b, y, mask, old, ref, roll, adv = _data(5, device if backend == "triton" else "cpu")
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, _ = fused_linear_policy_loss(hh, ww, y, old, adv, mask, ref_logp=ref,
                                       config=PolicyLossConfig(kl_coef=0.1), backend=backend)
    g1 = torch.autograd.grad(2.0 * loss, [hh, ww], retain_graph=True)
    g2 = torch.autograd.grad(loss, [hh, ww], retain_graph=True)
    (3.0 * loss).backward()
    for a, b_, c in zip(g1, g2, (hh.grad, ww.grad)):
        torch.testing.assert_close(a, 2.0 * b_)
        torch.testing.assert_close(c, 3.0 * b_)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("count", [None, 0.0, 7.0, "tensor"])
def test_token_aggregation_weights_are_the_gradient_of_the_aggregation(loss_agg, count):
    """The one-pass path's explicit aggregation weight c_t equals d loss / d l_t of
    policy_loss itself (oracle: autograd through a k1 KL term, whose d l_t / d logp_t is 1),
    with an empty row, a one-token row and every global-count form."""
    from fastrl.ops.fused_policy_loss import _token_agg_weights

    g = torch.Generator().manual_seed(7)
    mask = (torch.rand(4, 5, generator=g) > 0.4).float()
    mask[1] = 0.0  # an empty row: no weight, not counted as a sequence
    mask[2] = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0])
    norm = 3.0 if loss_agg == "seq-mean-token-sum-norm" else None
    global_count = torch.tensor(5.0) if count == "tensor" else count
    key = "global_token_count" if loss_agg == "token-mean" else "global_seq_count"
    cfg = PolicyLossConfig(kl_coef=1.0, kl_estimator="k1", loss_agg=loss_agg, norm_length=norm)
    lp = torch.zeros(4, 5, requires_grad=True)
    zeros = torch.zeros(4, 5)
    loss, _ = policy_loss(lp, zeros, torch.zeros(4), mask, ref_logp=zeros, config=cfg, backend="torch",
                          **{key: global_count})
    (want,) = torch.autograd.grad(loss, lp)
    got = _token_agg_weights(mask, loss_agg=loss_agg, norm_length=norm, global_count=global_count)
    assert got.dtype == torch.float32 and got.shape == mask.shape
    assert (got[mask == 0] == 0).all() and (got[mask != 0] > 0).all()
    torch.testing.assert_close(got, want, atol=0, rtol=1e-7)
    # and the bool mask gives the same weights
    got_bool = _token_agg_weights(mask != 0, loss_agg=loss_agg, norm_length=norm, global_count=global_count)
    torch.testing.assert_close(got_bool, got, atol=0, rtol=0)


def test_misplaced_global_count_is_an_error_before_any_work(monkeypatch):
    """The one-pass CPU path checks the global count before its chunk loop (the count that
    does not apply to loss_agg, a negative count)."""
    import fastrl.ops.logprobs as lp_mod

    def no_work(*args, **kwargs):
        raise AssertionError("log-prob work started before the inputs were validated")

    monkeypatch.setattr(lp_mod, "_torch_logits", no_work)
    h, w, b, y, mask, old, ref, roll, adv = _data()
    hh = h.clone().requires_grad_()
    with pytest.raises(ValueError, match="global_token_count"):
        fused_linear_policy_loss(hh, w, y, old, adv, mask, config=PolicyLossConfig.preset("grpo"), ref_logp=ref,
                                 global_token_count=10.0, backend="torch")
    with pytest.raises(ValueError, match="global_seq_count"):
        fused_linear_policy_loss(hh, w, y, old, adv, mask, config=PolicyLossConfig.preset("grpo"), ref_logp=ref,
                                 global_seq_count=torch.tensor([-1.0]), backend="torch")
