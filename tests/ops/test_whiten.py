"""fastrl.ops.masked_whiten (Triton kernels and torch path) vs the reference: values and grads."""

from __future__ import annotations

import pytest
import torch

from csrc_triton.whiten import whiten_backward, whiten_forward
from fastrl.ops import masked_whiten
from fastrl.reference.whiten import masked_whiten_reference

BACKENDS = ["torch", "triton"]


def _check(backend, x, mask, *, rtol=1e-5, atol=1e-5, **kw):
    y = masked_whiten(x, mask, backend=backend, **kw)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).to(x.device)
    (gx,) = torch.autograd.grad(y, x, g)
    xr = x.detach().double().cpu().requires_grad_()
    yr = masked_whiten_reference(xr, mask.cpu(), **kw)
    (gr,) = torch.autograd.grad(yr, xr, g.double().cpu())
    assert y.dtype == torch.float32 and y.shape == x.shape and gx.dtype == x.dtype
    torch.testing.assert_close(y.double().cpu(), yr, rtol=rtol, atol=atol)
    torch.testing.assert_close(gx.double().cpu(), gr, rtol=rtol, atol=atol)


def _x(shape, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (3.0 + 2.0 * torch.randn(shape, generator=g)).to(dtype).to(device).requires_grad_()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shift_mean", [True, False])
def test_matches_reference(backend, shift_mean, device):
    x = _x((6, 37), device)
    mask = (torch.rand(6, 37) > 0.3).to(device)
    mask[2] = False  # fully masked row
    _check(backend, x, mask, shift_mean=shift_mean)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(backend, dtype, device):
    # Upcast on load; the gradient comes back in the input dtype (its rounding: rtol 1e-2).
    x = _x((4, 50), device, dtype=dtype, seed=1)
    mask = (torch.rand(4, 50) > 0.3).to(torch.int32).to(device)
    _check(backend, x, mask, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shapes_and_degenerate_masks(backend, device):
    _check(backend, _x((41,), device), (torch.rand(41) > 0.5).float().to(device))
    _check(backend, _x((2, 3, 7), device), (torch.rand(2, 3, 7) > 0.5).to(device), shift_mean=False)
    _check(backend, _x((3, 1), device), torch.ones(3, 1, device=device))  # length-1 rows
    for mask in (torch.zeros(2, 5), torch.eye(1, 10).reshape(2, 5)):  # n = 0 and n = 1
        y = masked_whiten(_x((2, 5), device), mask.to(device), backend=backend)
        assert torch.equal(y.detach().cpu(), torch.zeros(2, 5))


def test_kernel_multi_block(device):
    x = _x((301,), device, seed=2).detach()
    mask = (torch.rand(301) > 0.2).to(torch.uint8).to(device)
    g = torch.randn(301).to(device)
    y_ref, mu, rstd, n = whiten_forward(x, mask, shift_mean=True, eps=1e-8, block=1024)
    gx_ref = whiten_backward(g, x, mask, mu, rstd, n, shift_mean=True, block=1024)
    for block in (16, 128):
        y, mu_b, rstd_b, n_b = whiten_forward(x, mask, shift_mean=True, eps=1e-8, block=block)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(n_b, n)
        gx = whiten_backward(g, x, mask, mu_b, rstd_b, n_b, shift_mean=True, block=block)
        torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-6)
    yr = masked_whiten_reference(x.double().cpu(), mask.cpu())
    torch.testing.assert_close(y_ref.double().cpu(), yr, rtol=1e-5, atol=1e-5)


def test_bad_inputs():
    x = torch.randn(2, 3)
    m = torch.ones(2, 3)
    with pytest.raises(ValueError, match="mask"):
        masked_whiten(x, m[:, :2])
    with pytest.raises(TypeError, match="x"):
        masked_whiten(x.long(), m)
    with pytest.raises(ValueError, match="x"):
        masked_whiten(torch.zeros(0), torch.zeros(0))
    with pytest.raises(ValueError, match="eps"):
        masked_whiten(x, m, eps=float("nan"))
    with pytest.raises(ValueError, match="eps"):
        masked_whiten(x, m, eps=-1.0)
    with pytest.raises(TypeError, match="shift_mean"):
        masked_whiten(x, m, shift_mean=1)
    with pytest.raises(TypeError, match="mask"):
        masked_whiten(x, [1, 1])
