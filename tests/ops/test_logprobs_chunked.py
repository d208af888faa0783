"""The token-chunked path (``backend="chunked"``: GEMMs + the Triton row kernels of
``csrc_triton.logprob_rows``, here under the interpreter) against float64 oracles: values and
gradients of ``linear_logprobs`` and of ``fused_linear_policy_loss`` for every loss option and
input dtype, garbage at masked rows, a vocabulary that is not a multiple of the row tile, and
chunked == unchunked (``chunk_tokens`` is the seam)."""

import importlib.util
import pathlib

import pytest
import torch

from fastrl.config import PolicyLossConfig
from fastrl.ops import fused_linear_policy_loss, linear_logprobs
from fastrl.ops.fused_policy_loss import which_path
from fastrl.ops.logprobs import chunked_rows, resolve_logprob_backend
from fastrl.reference.logprobs import linear_logprobs_reference

_spec = importlib.util.spec_from_file_location(
    "fused_cases", pathlib.Path(__file__).with_name("test_fused_linear_policy_loss.py"))
_fused = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fused)  # its data, configurations and float64 oracle: one definition

TOL = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 5e-3)}


def _lp_data(n, hd, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hd, generator=g)
    w = torch.randn(v, hd, generator=g) * 0.3
    b = torch.randn(v, generator=g) * 0.2
    y = torch.randint(0, v, (n,), generator=g)
    y[[1, n - 2]] = -100
    h[[1, n - 2]] = float("nan")  # garbage at ignored rows must change nothing
    h[1, 0] = float("inf")
    return h.to(dtype), w.to(dtype), b, y


def _rel(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_logprobs_chunked_matches_float64_reference(dtype):
    n, hd, v = 11, 16, 2051  # V > the row kernel's BLOCK_V (2048) and not a multiple of it
    h, w, b, y = _lp_data(n, hd, v, dtype)
    hh, ww, bb = (t.clone().requires_grad_() for t in (h, w, b))
    lp, ent = linear_logprobs(hh, ww, y, bias=bb, temperature=0.7, return_entropy=True, backend="chunked",
                              chunk_tokens=4)
    (1.3 * lp.sum() + 0.4 * ent.sum()).backward()
    assert lp.dtype == torch.float32 and hh.grad.dtype == dtype and ww.grad.dtype == dtype
    h64, w64, b64 = (t.detach().double().requires_grad_() for t in (h, w, b))
    rlp, rent = linear_logprobs_reference(h64, w64, y, bias=b64, temperature=0.7)
    (1.3 * rlp.sum() + 0.4 * rent.sum()).backward()
    atol, rtol = TOL[dtype]
    valid = y != -100
    torch.testing.assert_close(lp.double(), rlp.detach(), atol=atol, rtol=rtol)
    torch.testing.assert_close(ent.double(), rent.detach(), atol=atol, rtol=rtol)
    assert (lp[~valid] == 0).all() and (ent[~valid] == 0).all()
    assert (hh.grad[~valid] == 0).all()  # the NaN/inf rows get zero gradient and leak nowhere
    for got, want in ((hh.grad[valid], h64.grad[valid]), (ww.grad, w64.grad), (bb.grad, b64.grad)):
        assert torch.isfinite(got).all()
        assert _rel(got, want) < 2 * rtol


def test_linear_logprobs_chunking_does_not_change_the_result():
    h, w, b, y = _lp_data(13, 8, 70, torch.float32, seed=1)
    outs = []
    for chunk in (1, 5, None):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp = linear_logprobs(hh, ww, y, bias=b, backend="chunked", chunk_tokens=chunk)
        (lp * torch.arange(13.0)).sum().backward()
        outs.append((lp, hh.grad, ww.grad))
    for other in outs[:2]:
        for a, c in zip(other, outs[2]):
            torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-5)


def test_linear_logprobs_chunked_no_grad_and_bad_targets():
    h, w, b, y = _lp_data(6, 8, 30, torch.float32)
    with torch.no_grad():
        lp = linear_logprobs(h, w, y, backend="chunked", chunk_tokens=2)
    want, _ = linear_logprobs_reference(h.double(), w.double(), y)
    torch.testing.assert_close(lp.double(), want, atol=1e-5, rtol=1e-5)
    y_bad = y.clone()
    y_bad[0] = 30
    with pytest.raises(ValueError, match="targets"):
        linear_logprobs(h, w, y_bad, backend="chunked")
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_logprobs(h, w, y, backend="chunked", chunk_tokens=0)


@pytest.mark.parametrize("name", list(_fused.CONFIGS))
def test_fused_chunked_matches_float64_reference(name):
    """Every loss option of the fused-loss suite; the token-level ones take the one pass
    (three GEMMs), the sequence-level ones (GSPO, sequence IS weights) the two-pass form."""
    cfg, opts = _fused.CONFIGS[name]
    h, w, b, y, mask, old, ref, roll, adv = _fused._data()
    h[mask == 0] = float("nan")  # garbage at masked positions changes nothing
    kw = {}
    if opts.get("ref"):
        kw["ref_logp"] = ref
    if opts.get("rollout"):
        kw["rollout_logp"] = roll
    for key in ("global_token_count", "global_seq_count"):
        if key in opts:
            kw[key] = opts[key]
    with_entropy = cfg.entropy_coef != 0 or name == "ppo"
    hh, ww, bb = (t.clone().requires_grad_() for t in (h, w, b))
    loss, metrics = fused_linear_policy_loss(hh, ww, y, old, adv, mask, bias=bb, config=cfg, temperature=0.8,
                                             entropy=(name == "ppo"), backend="chunked", chunk_tokens=4, **kw)
    loss.backward()
    h_clean = torch.where(mask[..., None] != 0, h, 0.0)
    rloss, rmetrics, gh, gw, gb = _fused._reference(h_clean, w, b, y, mask, old, adv, cfg, 0.8, with_entropy, **kw)
    torch.testing.assert_close(loss.double(), rloss.double(), atol=1e-5, rtol=1e-5)
    assert metrics.keys() == rmetrics.keys()
    for k in rmetrics:
        torch.testing.assert_close(metrics[k].double(), rmetrics[k].double(), atol=1e-5, rtol=1e-5, msg=k)
    assert (hh.grad[mask == 0] == 0).all()
    for got, want in ((hh.grad, gh), (ww.grad, gw), (bb.grad, gb)):
        assert _rel(got, want) < 1e-4
    path = which_path("chunked", "cpu", config=cfg, has_rollout_logp="rollout_logp" in kw)
    assert path == ("chunked/two-pass" if name in ("gspo_sequence_ratio", "seq_is_global_seqs") else "chunked/one-pass")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_chunked_low_precision_inputs(dtype):
    cfg = PolicyLossConfig(clip_high=0.28, dual_clip=2.5, kl_coef=0.1, entropy_coef=0.05)
    h, w, b, y, mask, old, ref, roll, adv = _fused._data(3)
    hq, wq = h.to(dtype), w.to(dtype)
    hh, ww = hq.clone().requires_grad_(), wq.clone().requires_grad_()
    loss, _ = fused_linear_policy_loss(hh, ww, y, old, adv, mask, ref_logp=ref, config=cfg, backend="chunked",
                                       chunk_tokens=5)
    loss.backward()
    assert hh.grad.dtype == dtype and ww.grad.dtype == dtype
    rloss, _, gh, gw, _ = _fused._reference(hq.float(), wq.float(), torch.zeros_like(b), y, mask, old, adv, cfg, 1.0,
                                            True, ref_logp=ref)
    torch.testing.assert_close(loss.double(), rloss.double(), atol=1e-4, rtol=1e-4)
    assert _rel(hh.grad, gh) < 1e-2 and _rel(ww.grad, gw) < 1e-2


def test_fused_chunked_one_pass_equals_unchunked_and_two_pass():
    cfg = PolicyLossConfig(clip_high=0.28, kl_coef=0.1, log_ratio_clamp=1.0, entropy_coef=0.02,
                           loss_agg="seq-mean-token-mean")
    h, w, b, y, mask, old, ref, roll, adv = _fused._data(5)
    results = []
    for chunk, one_pass in ((1, True), (None, True), (2, False)):
        hh, ww, bb = (t.clone().requires_grad_() for t in (h, w, b))
        loss, metrics = fused_linear_policy_loss(hh, ww, y, old, adv, mask, bias=bb, ref_logp=ref, rollout_logp=roll,
                                                 config=cfg.replace(is_cap=1.5), temperature=1.3, backend="chunked",
                                                 chunk_tokens=chunk, one_pass=one_pass)
        (2.0 * loss).backward()
        results.append((loss, hh.grad, ww.grad, bb.grad))
    for other in results[:2]:
        for a, c in zip(other, results[2]):
            torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-5)


def test_auto_backend_and_chunk_rows(monkeypatch):
    import fastrl.ops.logprobs as lp_mod

    assert resolve_logprob_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_logprob_backend("auto", torch.device("cuda"), hidden=3584, vocab=151936,
                                   dtype=torch.bfloat16) == "chunked"
    monkeypatch.setitem(lp_mod.MEASURED_FASTEST, (3584, 151936, "bfloat16"), "triton")
    assert resolve_logprob_backend("auto", torch.device("cuda"), hidden=3584, vocab=151936,
                                   dtype=torch.bfloat16) == "triton"
    assert which_path("auto", "cpu") == "torch/one-pass"
    assert which_path("chunked", "cpu", needs_grad=False) == "chunked/forward"
    assert which_path("chunked", "cpu", tensor_parallel=True) == "chunked/two-pass"
    assert which_path("chunked", "cpu", config=PolicyLossConfig(surrogate="vespo")) == "chunked/two-pass"
    assert chunked_rows(151936, 8192) == 2048
    assert chunked_rows(128256, 8192) % 256 == 0 and chunked_rows(128256, 100) == 100
    assert chunked_rows(70, 13, 5) == 5
    with pytest.raises(ValueError, match="backend"):
        resolve_logprob_backend("cublas", torch.device("cpu"))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the NaN row, in the interpreter's numpy
def test_row_kernels_against_float64_formulas():
    """The row kernels alone: several blocks per row (a short last one), several rows per
    program, bias and temperature, a row without a target in this shard (-1), a dead row
    (gl = ge = 0) full of NaN that must write zeros, fp32 in place and a bf16 output."""
    from csrc_triton.logprob_rows import row_grad, row_grid, row_stats

    g = torch.Generator().manual_seed(3)
    n, v, t = 7, 150, 0.8
    z = torch.randn(n, v, generator=g) * 3
    bias = torch.randn(v, generator=g)
    y = torch.randint(0, v, (n,), generator=g)
    y[2] = -1
    gl, ge = torch.randn(n, generator=g), torch.randn(n, generator=g)
    gl[5] = ge[5] = 0.0
    z[5] = float("nan")
    assert row_grid(n, z.device) == (3, 3)  # 3 programs of 3 rows (the last one 1)
    m, s, w, tt = row_stats(z, bias, y, 1 / t, True, block_v=64)
    u = ((z.double() + bias.double()) / t)
    lse = torch.logsumexp(u, 1)
    p = torch.softmax(u, 1)
    ent = -(p * torch.log_softmax(u, 1)).sum(1)
    live = torch.arange(n) != 5
    torch.testing.assert_close((m + s.log())[live].double(), lse[live], atol=1e-5, rtol=1e-6)
    torch.testing.assert_close((s.log() - w / s)[live].double(), ent[live], atol=1e-5, rtol=1e-5)
    want_t = torch.where(y >= 0, u.gather(1, y.clamp(min=0)[:, None])[:, 0], 0.0)
    torch.testing.assert_close(tt[live].double(), want_t[live], atol=1e-5, rtol=1e-6)
    lse32, ent32 = lse.float().nan_to_num(), ent.float().nan_to_num()
    onehot = torch.zeros(n, v, dtype=torch.float64).scatter_(1, y.clamp(min=0)[:, None], (y >= 0).double()[:, None])
    want = (gl.double()[:, None] * (onehot - p) - ge.double()[:, None] * p * (torch.log_softmax(u, 1) + ent[:, None])) / t
    want[5] = 0.0
    out_bf16 = row_grad(z, torch.empty(n, v, dtype=torch.bfloat16), bias, y, lse32, ent32, gl, ge, 1 / t, block_v=64)
    zz = z.clone()
    got = row_grad(zz, zz, bias, y, lse32, ent32, gl, ge, 1 / t, block_v=64)  # in place over the logits
    assert got.data_ptr() == zz.data_ptr() and (got[5] == 0).all()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out_bf16.double(), want, atol=1e-2, rtol=1e-2)
