"""One rule for global token/sequence counts, on every loss op and backend
(``fastrl._checks.check_global_count``): numbers >= 0 or 1-element tensors of any real
dtype on the inputs' device; 0 is taken as 1 (a fully masked batch has loss 0, not NaN);
wrong device, negative, non-finite, several elements or bool are errors."""

from __future__ import annotations

import pytest
import torch

from fastrl.config import PolicyLossConfig
from fastrl.ops import fused_linear_policy_loss, policy_loss, value_loss
from fastrl.reference.policy_loss import policy_loss_reference
from fastrl.reference.value_loss import value_loss_reference

B, T = 3, 7
COUNT_FORMS = {  # (count, device of the inputs) -> the count in that form (a tensor on that device)
    "int": lambda c, d: int(c),
    "float": lambda c, d: float(c),
    "tensor0d_int": lambda c, d: torch.tensor(int(c), device=d),
    "tensor0d_float": lambda c, d: torch.tensor(float(c), device=d),
    "tensor1_int": lambda c, d: torch.tensor([int(c)], device=d),
    "tensor11_float": lambda c, d: torch.tensor([[float(c)]], device=d),
}


def _batch(masked_out: bool, device="cpu"):
    g = torch.Generator().manual_seed(0)
    x = {k: torch.randn(B, T, generator=g).to(device) for k in ("a", "b", "c")}
    mask = torch.zeros(B, T) if masked_out else (torch.rand(B, T, generator=g) > 0.3).float()
    return x, mask.to(device)


def _policy(backend, mask, x, agg, **count):
    lp = (-x["a"].abs()).requires_grad_()
    cfg = PolicyLossConfig(loss_agg=agg, kl_coef=0.1)
    kw = dict(ref_logp=-x["c"].abs(), config=cfg, **count)
    if backend == "reference":
        loss, _ = policy_loss_reference(lp, lp.detach() + 0.1 * x["b"], x["b"], mask, **kw)
    else:
        loss, _ = policy_loss(lp, lp.detach() + 0.1 * x["b"], x["b"], mask, backend=backend, **kw)
    (g,) = torch.autograd.grad(loss, lp)
    return loss, g


def _value(backend, mask, x, agg, **count):
    v = x["a"].clone().requires_grad_()
    kw = dict(clip=0.2, loss_agg=agg, **count)
    if backend == "reference":
        loss, _ = value_loss_reference(v, x["b"], x["c"], mask, **kw)
    else:
        loss, _ = value_loss(v, x["b"], x["c"], mask, backend=backend, **kw)
    (g,) = torch.autograd.grad(loss, v)
    return loss, g


def _fused(backend, mask, x, agg, **count):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(B, T, 8, generator=g).to(mask.device).requires_grad_()
    w = torch.randn(11, 8, generator=g).to(mask.device)
    y = torch.randint(0, 11, (B, T), generator=g).to(mask.device)
    cfg = PolicyLossConfig(loss_agg=agg)
    loss, _ = fused_linear_policy_loss(h, w, y, -x["a"].abs(), x["b"], mask, config=cfg, backend=backend, **count)
    (gh,) = torch.autograd.grad(loss, h)
    return loss, gh


OPS = {"policy_loss": _policy, "value_loss": _value, "fused_linear_policy_loss": _fused}
RUNS = [(op, b) for op in OPS for b in ("reference", "torch", "triton") if not (op == "fused_linear_policy_loss" and b == "reference")]


@pytest.mark.parametrize(("op", "backend"), RUNS)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_every_count_form_gives_the_same_loss(op, backend, agg, device):
    x, mask = _batch(masked_out=False, device=device)
    key = "global_token_count" if agg == "token-mean" else "global_seq_count"
    want = OPS[op](backend, mask, x, agg, **{key: 11.0})
    for form, make in COUNT_FORMS.items():
        got = OPS[op](backend, mask, x, agg, **{key: make(11, device)})
        torch.testing.assert_close(got[0], want[0], msg=lambda m, f=form: f"{form}: {m}")
        torch.testing.assert_close(got[1], want[1], msg=lambda m, f=form: f"{form}: {m}")


@pytest.mark.parametrize(("op", "backend"), RUNS)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_count_of_zero_on_a_fully_masked_batch_gives_zero(op, backend, agg, device):
    x, mask = _batch(masked_out=True, device=device)
    key = "global_token_count" if agg == "token-mean" else "global_seq_count"
    for form, make in COUNT_FORMS.items():
        loss, grad = OPS[op](backend, mask, x, agg, **{key: make(0, device)})
        assert loss.item() == 0.0, form
        assert torch.count_nonzero(grad) == 0, form


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize(
    ("count", "exc", "match"),
    [
        (-1, ValueError, ">= 0"),
        (-2.5, ValueError, ">= 0"),
        (float("nan"), ValueError, "finite"),
        (float("inf"), ValueError, "finite"),
        (torch.tensor(-3.0), ValueError, ">= 0"),
        (torch.tensor(float("inf")), ValueError, "finite"),
        (torch.tensor([1.0, 2.0]), ValueError, "1-element"),
        (torch.tensor(True), TypeError, "real number"),
        (True, TypeError, "number"),
        (torch.tensor(4.0, device="meta"), ValueError, "meta"),
    ],
)
def test_bad_counts_are_errors_naming_the_argument(op, count, exc, match):
    x, mask = _batch(masked_out=False)
    with pytest.raises(exc, match=match) as info:
        OPS[op]("torch", mask, x, "token-mean", global_token_count=count)
    assert "global_token_count" in str(info.value)


# ----------------------------------------------------------------------------- GlobalCounts
# The caller passes a rule's inputs (both counts); the aggregation rule picks the one loss_agg uses.
from fastrl.ops import GlobalCounts, aggregate_loss  # noqa: E402
from fastrl.ops.aggregation import global_count_for  # noqa: E402

ALL_AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
TOKENS, SEQS = 11.0, 5.0  # deliberately different, so picking the wrong one changes the loss


def _agg_kw(agg):
    return {"norm_length": 4.0} if agg == "seq-mean-token-sum-norm" else {}


def _policy_n(backend, mask, x, agg, **count):
    lp = (-x["a"].abs()).requires_grad_()
    cfg = PolicyLossConfig(loss_agg=agg, kl_coef=0.1, **_agg_kw(agg))
    loss, _ = policy_loss(lp, lp.detach() + 0.1 * x["b"], x["b"], mask, ref_logp=-x["c"].abs(), config=cfg,
                          backend=backend, **count)
    (g,) = torch.autograd.grad(loss, lp)
    return loss, g


def _value_n(backend, mask, x, agg, **count):
    v = x["a"].clone().requires_grad_()
    loss, _ = value_loss(v, x["b"], x["c"], mask, clip=0.2, loss_agg=agg, backend=backend, **_agg_kw(agg), **count)
    (g,) = torch.autograd.grad(loss, v)
    return loss, g


def _fused_n(backend, mask, x, agg, **count):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(B, T, 8, generator=g).to(mask.device).requires_grad_()
    w = torch.randn(11, 8, generator=g).to(mask.device)
    y = torch.randint(0, 11, (B, T), generator=g).to(mask.device)
    cfg = PolicyLossConfig(loss_agg=agg, **_agg_kw(agg))
    loss, _ = fused_linear_policy_loss(h, w, y, -x["a"].abs(), x["b"], mask, config=cfg, backend=backend, **count)
    (gh,) = torch.autograd.grad(loss, h)
    return loss, gh


def _aggregate_n(backend, mask, x, agg, **count):
    lm = x["a"].clone().requires_grad_()
    loss = aggregate_loss(lm, mask, loss_agg=agg, **_agg_kw(agg), **count)
    (g,) = torch.autograd.grad(loss, lm)
    return loss, g


OPS_N = {"policy_loss": _policy_n, "value_loss": _value_n, "fused_linear_policy_loss": _fused_n,
         "aggregate_loss": _aggregate_n}
RUNS_N = [(op, b) for op in OPS_N for b in ("torch", "triton") if not (op == "aggregate_loss" and b == "triton")]


@pytest.mark.parametrize(("op", "backend"), RUNS_N)
@pytest.mark.parametrize("agg", ALL_AGGS)
@pytest.mark.parametrize("tensor", [False, True])
def test_global_counts_equal_the_explicit_count_of_the_mode(op, backend, agg, tensor, device):
    x, mask = _batch(masked_out=False, device=device)
    make = (lambda c: torch.tensor(c, device=device)) if tensor else float
    explicit = {"global_token_count": make(TOKENS)} if agg == "token-mean" else {"global_seq_count": make(SEQS)}
    want = OPS_N[op](backend, mask, x, agg, **explicit)
    got = OPS_N[op](backend, mask, x, agg, global_counts=GlobalCounts(tokens=make(TOKENS), sequences=make(SEQS)))
    assert torch.equal(got[0], want[0]), (got[0], want[0])
    assert torch.equal(got[1], want[1])
    local = OPS_N[op](backend, mask, x, agg)
    assert not torch.equal(got[0], local[0])  # the count was used (it differs from the local one)


@pytest.mark.parametrize("op", list(OPS_N))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_a_missing_field_of_global_counts_is_the_local_count(op, agg):
    x, mask = _batch(masked_out=False)
    unused = GlobalCounts(sequences=SEQS) if agg == "token-mean" else GlobalCounts(tokens=TOKENS)
    got = OPS_N[op]("torch", mask, x, agg, global_counts=unused)
    want = OPS_N[op]("torch", mask, x, agg)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_global_count_for_is_the_one_choice():
    c = GlobalCounts(tokens=TOKENS, sequences=SEQS)
    assert global_count_for("token-mean", c) == ("tokens", TOKENS)
    for agg in ALL_AGGS[1:]:
        assert global_count_for(agg, c) == ("sequences", SEQS)
    with pytest.raises(ValueError, match="loss_agg"):
        global_count_for("token-sum", c)


@pytest.mark.parametrize("op", list(OPS_N))
def test_global_counts_and_an_explicit_count_together_are_an_error(op):
    x, mask = _batch(masked_out=False)
    with pytest.raises(ValueError, match="either global_counts"):
        OPS_N[op]("torch", mask, x, "token-mean", global_counts=GlobalCounts(tokens=TOKENS), global_token_count=TOKENS)
    with pytest.raises(TypeError, match="GlobalCounts"):
        OPS_N[op]("torch", mask, x, "token-mean", global_counts=(TOKENS, SEQS))
    with pytest.raises(ValueError, match="global_counts.tokens"):
        OPS_N[op]("torch", mask, x, "token-mean", global_counts=GlobalCounts(tokens=-1.0))
