"""``fastrl.ops.kl_penalty`` (Triton under the interpreter, and the PyTorch path) against the
float64 reference: values and gradients wrt both inputs.

Tolerances: fp32 1e-5 relative (k3 keeps it also for |d| << 1: the Triton kernel uses a
Taylor series there, the PyTorch path evaluates expm1(d) - d in float64). bf16/fp16 inputs: values vs the reference on the same rounded inputs
at 1e-5; gradients are returned in the input dtype (bf16 rtol 1e-2, fp16 rtol 2e-3).
"""

import pytest
import torch

import csrc_triton.kl as kernels
from fastrl.ops import kl_penalty
from fastrl.reference.kl import kl_penalty_reference

BACKENDS = ["torch", "triton"]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(shape=(3, 5, 71), dtype=torch.float32, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(shape, generator=g) * 3).to(dtype)
    ref = (logp.float() + torch.randn(shape, generator=g) * scale).to(dtype)
    return logp.to(DEVICE), ref.to(DEVICE)


def _run(fn, logp, ref, gout, **kw):
    lp = logp.clone().requires_grad_()
    rf = ref.clone().requires_grad_()
    out = fn(lp, rf, **kw)
    gl, gr = torch.autograd.grad(out, [lp, rf], gout)
    return out.detach(), gl, gr


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("clamp", [None, 0.5])
def test_matches_reference(backend, estimator, clamp):
    logp, ref = _inputs()  # 1065 elements: two programs, the second partial
    gout = torch.randn(logp.shape, device=DEVICE)
    out, gl, gr = _run(kl_penalty, logp, ref, gout, estimator=estimator, clamp=clamp, backend=backend)
    rout, rgl, rgr = _run(kl_penalty_reference, logp.double(), ref.double(), gout.double(), estimator=estimator, clamp=clamp)
    assert out.dtype == torch.float32 and out.shape == logp.shape
    torch.testing.assert_close(out.double(), rout, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gl.double(), rgl, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gr.double(), rgr, rtol=1e-5, atol=1e-7)
    if clamp is not None:
        assert out.abs().max() <= clamp


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [1e-2, 1e-3, 1e-5])
def test_k3_small_differences_keep_relative_precision(backend, scale):
    """k3 = exp(d) - 1 - d ~ d^2 / 2 for small d: non-negative and with full relative
    precision (an fp32 exp(d) - 1 gave small negative values and no correct digit)."""
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(1000, generator=g)
    ref = logp + torch.randn(1000, generator=g) * scale
    logp, ref = logp.to(DEVICE), ref.to(DEVICE)
    ones = torch.ones(1000, device=DEVICE)
    out, gl, _ = _run(kl_penalty, logp, ref, ones, backend=backend)
    rout, rgl, _ = _run(kl_penalty_reference, logp.double(), ref.double(), ones.double())
    assert (out >= 0).all()
    torch.testing.assert_close(out.double(), rout, rtol=1e-5, atol=0)
    torch.testing.assert_close(gl.double(), rgl, rtol=1e-5, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,grad_rtol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_low_precision_inputs(backend, dtype, grad_rtol):
    logp, ref = _inputs(shape=(4, 50), dtype=dtype)
    gout = torch.randn(4, 50, device=DEVICE)
    out, gl, gr = _run(kl_penalty, logp, ref, gout, backend=backend)
    rout, rgl, rgr = _run(kl_penalty_reference, logp.double(), ref.double(), gout.double())
    assert gl.dtype == dtype and gr.dtype == dtype and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), rout, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gl.double(), rgl, rtol=grad_rtol, atol=1e-5)
    torch.testing.assert_close(gr.double(), rgr, rtol=grad_rtol, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_extreme_differences_finite_where_the_formula_is(backend):
    logp = torch.tensor([0.0, 0.0, -50.0, -80.0, 0.0], device=DEVICE)
    ref = torch.tensor([50.0, -50.0, 0.0, 0.0, 0.0], device=DEVICE)
    out = kl_penalty(logp, ref, estimator="k3", backend=backend)
    rout = kl_penalty_reference(logp.double(), ref.double(), estimator="k3")
    assert out.isfinite().all()
    torch.testing.assert_close(out.double(), rout, rtol=1e-5, atol=0)
    assert out[-1].item() == 0.0
    clamped = kl_penalty(logp, ref, estimator="k3", clamp=10.0, backend=backend)
    assert clamped.max().item() == 10.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_and_grad_of_one_input(backend):
    base_l, base_r = _inputs(shape=(6, 40))
    logp, ref = base_l[:, ::2], base_r.t().contiguous().t()[:, 5:25]
    rf = ref.clone()  # no grad wanted
    lp = logp.clone().requires_grad_()
    out = kl_penalty(lp, rf, estimator="k2", backend=backend)
    out.sum().backward()
    torch.testing.assert_close(out.double(), kl_penalty_reference(logp.double(), ref.double(), estimator="k2"))
    torch.testing.assert_close(lp.grad, (logp - ref).float())


def test_auto_backend_and_single_program_block(monkeypatch):
    logp, ref = _inputs(shape=(7,))
    auto = "triton" if DEVICE.type == "cuda" else "torch"
    assert torch.equal(kl_penalty(logp, ref), kl_penalty(logp, ref, backend=auto))
    monkeypatch.setattr(kernels, "BLOCK", 16)
    torch.testing.assert_close(kl_penalty(logp, ref, backend="triton"), kl_penalty(logp, ref, backend="torch"))


@pytest.mark.parametrize("args,kw,exc,name", [
    ((torch.zeros(3, dtype=torch.long), torch.zeros(3)), {}, TypeError, "logp"),
    ((torch.zeros(3), torch.zeros(4)), {}, ValueError, "ref_logp"),
    ((torch.zeros(3), [0.0, 0.0, 0.0]), {}, TypeError, "ref_logp"),
    ((torch.zeros(0), torch.zeros(0)), {}, ValueError, "logp"),
    ((torch.zeros(3), torch.zeros(3)), dict(estimator="k4"), ValueError, "estimator"),
    ((torch.zeros(3), torch.zeros(3)), dict(clamp=0.0), ValueError, "clamp"),
    ((torch.zeros(3), torch.zeros(3)), dict(clamp=float("inf")), ValueError, "clamp"),
    ((torch.zeros(3), torch.zeros(3)), dict(backend="gpu"), ValueError, "backend"),
    ((torch.zeros(3), torch.zeros(3, device="meta")), {}, ValueError, "ref_logp"),
])
def test_bad_input_names_the_argument(args, kw, exc, name):
    with pytest.raises(exc, match=name):
        kl_penalty(*args, **kw)
