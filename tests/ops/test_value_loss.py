"""fastrl.ops.value_loss (Triton kernel and torch path) vs the reference: values, grads, metrics."""

from __future__ import annotations

import pytest
import torch

from csrc_triton.value_loss import value_loss_fused
from fastrl.config import LOSS_AGGS
from fastrl.ops import value_loss
from fastrl.ops.value_loss import _row_scale
from fastrl.reference.value_loss import value_loss_reference

BACKENDS = ["torch", "triton"]
METRICS = ("vf_clip_frac", "explained_variance", "value_mean", "return_mean")


def _case(B, T, device, *, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(B, T, generator=g)
    v_old = v + 0.3 * torch.randn(B, T, generator=g)  # ~half the tokens outside clip=0.2
    R = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.25).to(torch.float32)
    if B > 1:
        mask[1] = 0  # a fully masked row
    return (v.to(dtype).to(device).requires_grad_(), v_old.to(dtype).to(device), R.to(dtype).to(device), mask.to(device))


def _check(backend, v, v_old, R, mask, *, rtol=1e-5, atol=1e-6, **kw):
    loss, metrics = value_loss(v, v_old, R, mask, backend=backend, **kw)
    (grad,) = torch.autograd.grad(loss, v)
    vr = v.detach().double().cpu().requires_grad_()
    ref_loss, ref_metrics = value_loss_reference(vr, v_old.double().cpu(), R.double().cpu(), mask.cpu(), **kw)
    (ref_grad,) = torch.autograd.grad(ref_loss, vr)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert grad.dtype == v.dtype
    torch.testing.assert_close(loss.double().cpu(), ref_loss, rtol=rtol, atol=atol)
    torch.testing.assert_close(grad.double().cpu(), ref_grad, rtol=rtol, atol=atol)
    for k in METRICS:
        assert metrics[k].dim() == 0 and metrics[k].dtype == torch.float32
        torch.testing.assert_close(metrics[k].double().cpu(), ref_metrics[k].double(), rtol=1e-5, atol=1e-5)
    return loss, metrics


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
@pytest.mark.parametrize("clip", [None, 0.2])
def test_matches_reference(backend, loss_agg, clip, device):
    v, v_old, R, mask = _case(5, 37, device)
    norm = dict(norm_length=50.0) if loss_agg == "seq-mean-token-sum-norm" else {}
    _, metrics = _check(backend, v, v_old, R, mask, clip=clip, loss_agg=loss_agg, **norm)
    if clip is not None:
        assert 0.05 < metrics["vf_clip_frac"].item() < 0.95  # both branches exercised


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(backend, dtype, device):
    # Inputs are upcast on load; the reference runs on the same rounded values in fp64.
    # The gradient is returned in the input dtype, so it carries that dtype's rounding.
    v, v_old, R, mask = _case(4, 29, device, dtype=dtype, seed=1)
    _check(backend, v, v_old, R, mask, clip=0.2, loss_agg="seq-mean-token-mean", rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_global_counts_and_norm_length(backend, device):
    v, v_old, R, mask = _case(3, 11, device, seed=2)
    _check(backend, v, v_old, R, mask, clip=0.2, loss_agg="token-mean", global_token_count=100)
    _check(backend, v, v_old, R, mask, loss_agg="token-mean", global_token_count=torch.tensor(64, device=device))
    _check(backend, v, v_old, R, mask, loss_agg="seq-mean-token-sum", global_seq_count=torch.tensor(8.0, device=device))
    _check(backend, v, v_old, R, mask, loss_agg="seq-mean-token-sum-norm", norm_length=32.0, global_seq_count=6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_edges(backend, device):
    # length-1 sequences
    v, v_old, R, mask = _case(6, 1, device, seed=3)
    _check(backend, v, v_old, R, mask, clip=0.1, loss_agg="seq-mean-token-mean")
    # everything masked: loss, grad and metrics are 0
    v, v_old, R, _ = _case(2, 5, device)
    loss, metrics = value_loss(v, v_old, R, torch.zeros(2, 5, device=device), clip=0.2, backend=backend)
    (grad,) = torch.autograd.grad(loss, v)
    assert loss.item() == 0.0 and torch.equal(grad.cpu(), torch.zeros(2, 5))
    assert all(metrics[k].item() == 0.0 for k in METRICS)
    # bool mask, no old values without clip, constant returns (explained variance 0)
    v, _, _, _ = _case(2, 5, device)
    mask = torch.ones(2, 5, dtype=torch.bool, device=device)
    loss, metrics = value_loss(v, None, torch.ones(2, 5, device=device), mask, backend=backend)
    assert metrics["explained_variance"].item() == 0.0
    loss_ref, _ = value_loss_reference(v.detach().cpu(), v.detach().cpu(), torch.ones(2, 5), mask.cpu())
    assert loss.item() == pytest.approx(loss_ref.item(), rel=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_scaling_and_no_grad(backend, device):
    v, v_old, R, mask = _case(3, 9, device, seed=4)
    loss, _ = value_loss(v, v_old, R, mask, clip=0.2, backend=backend)
    (g1,) = torch.autograd.grad(loss, v)
    loss, _ = value_loss(v, v_old, R, mask, clip=0.2, backend=backend)
    (g3,) = torch.autograd.grad(3.0 * loss, v)
    torch.testing.assert_close(g3, 3.0 * g1)
    with torch.no_grad():
        loss_ng, _ = value_loss(v, v_old, R, mask, clip=0.2, backend=backend)
    assert not loss_ng.requires_grad
    assert loss_ng.item() == pytest.approx(loss.item(), rel=1e-6)


def test_kernel_multi_block(device):
    """Several kernel blocks with a ragged tail: per-block partials merge exactly."""
    v, v_old, R, mask = _case(7, 19, device, seed=5)
    row_scale = _row_scale(mask, "seq-mean-token-mean", None, None)
    for block in (16, 64):
        loss, grad, sums = value_loss_fused(v.detach(), v_old, R, mask, row_scale, clip=0.2, write_grad=True, block=block)
        ref_loss, ref_grad, ref_sums = value_loss_fused(v.detach(), v_old, R, mask, row_scale, clip=0.2, write_grad=True, block=256)
        torch.testing.assert_close(loss, ref_loss)
        torch.testing.assert_close(grad, ref_grad)
        for k in ref_sums:
            torch.testing.assert_close(sums[k], ref_sums[k], rtol=1e-5, atol=1e-6)
    vr = v.detach().double().cpu().requires_grad_()
    ref, _ = value_loss_reference(vr, v_old.double().cpu(), R.double().cpu(), mask.cpu(), clip=0.2, loss_agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)


def test_bad_inputs():
    v, v_old, R, mask = _case(2, 4, "cpu")
    with pytest.raises(ValueError, match="old_values"):
        value_loss(v, v_old[:, :3], R, mask)
    with pytest.raises(ValueError, match="returns"):
        value_loss(v, v_old, R.reshape(4, 2), mask)
    with pytest.raises(ValueError, match="mask"):
        value_loss(v, v_old, R, mask[:1])
    with pytest.raises(ValueError, match="values"):
        value_loss(v.reshape(-1), v_old.reshape(-1), R.reshape(-1), mask.reshape(-1))
    with pytest.raises(TypeError, match="returns"):
        value_loss(v, v_old, R.long(), mask)
    with pytest.raises(ValueError, match="values"):
        value_loss(torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, 4))
    with pytest.raises(ValueError, match="clip"):
        value_loss(v, v_old, R, mask, clip=0.0)
    with pytest.raises(ValueError, match="clip"):
        value_loss(v, v_old, R, mask, clip=float("nan"))
    with pytest.raises(ValueError, match="old_values"):
        value_loss(v, None, R, mask, clip=0.2)
    with pytest.raises(ValueError, match="loss_agg"):
        value_loss(v, v_old, R, mask, loss_agg="sum")
    with pytest.raises(ValueError, match="global_token_count"):
        value_loss(v, v_old, R, mask, loss_agg="seq-mean-token-mean", global_token_count=10)
    with pytest.raises(ValueError, match="global_seq_count"):
        value_loss(v, v_old, R, mask, global_seq_count=10)
    with pytest.raises(ValueError, match="global_token_count"):
        value_loss(v, v_old, R, mask, global_token_count=torch.ones(2))
    with pytest.raises(ValueError, match="global_token_count"):
        value_loss(v, v_old, R, mask, global_token_count=-1)  # (0 is allowed: taken as 1)
    with pytest.raises(ValueError, match="norm_length"):
        value_loss(v, v_old, R, mask, norm_length=10.0)
    with pytest.raises(ValueError, match="norm_length is required"):
        value_loss(v, v_old, R, mask, loss_agg="seq-mean-token-sum-norm")
