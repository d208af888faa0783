"""fastrl.ops.linear_logprobs vs a float64 logits-based reference.

Both backends are tested on CPU: "triton" runs the kernels in the Triton interpreter
(small shapes: it is slow), "torch" the chunked PyTorch path (also on larger shapes).

Documented bounds for low-precision inputs (reference = float64 math on the same
bf16/fp16-rounded inputs), the same on both backends (fp32 accumulation of the products,
fp32 logits -- the torch path never rounds the logits to bf16): logp/entropy abs 1e-5,
grads rel 2e-2 (the grad of the logits is rounded to the input dtype before the grad GEMMs).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastrl.ops.logprobs as lp_mod
from fastrl.ops.logprobs import linear_logprobs
from fastrl.ops.stats import every_kth
from fastrl.reference.logprobs import linear_logprobs_reference

BACKENDS = ["torch", "triton"]
# Kernel tests run on the GPU when there is one (Triton compiled), else on the CPU (the
# Triton interpreter; conftest sets TRITON_INTERPRET=1). Inputs are made on the CPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(n_shape, hdim, vocab, *, dtype=torch.float32, bias=False, scale=1.0, n_ignore=0):
    h = torch.randn(*n_shape, hdim).to(dtype)
    w = (torch.randn(vocab, hdim) * (scale / hdim**0.5) * 2.0).to(dtype)
    b = (torch.randn(vocab) * 0.5).to(dtype) if bias else None
    y = torch.randint(0, vocab, n_shape)
    flat = y.view(-1)
    if n_ignore:
        flat[torch.randperm(flat.numel())[:n_ignore]] = -100
    return h, w, b, y


def _run(fn_backend, h, w, b, y, *, temperature=1.0, entropy=True, gl=None, ge=None, device=None):
    """(logp, entropy, grad_h, grad_w, grad_b) from fastrl (backend str) or the float64 reference (None),
    computed on ``device`` (default DEVICE) and returned on the CPU."""
    dev = DEVICE if device is None else torch.device(device)
    gl = torch.randn(y.shape) if gl is None else gl
    h, w, y, gl = h.to(dev), w.to(dev), y.to(dev), gl.to(dev)
    b = b.to(dev) if b is not None else None
    ge = ge.to(dev) if ge is not None else None
    if fn_backend is None:
        hh, ww = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        bb = b.detach().double().requires_grad_() if b is not None else None
        logp, ent = linear_logprobs_reference(hh, ww, y, bias=bb, temperature=temperature)
    else:
        hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        bb = b.detach().clone().requires_grad_() if b is not None else None
        out = linear_logprobs(hh, ww, y, bias=bb, temperature=temperature, return_entropy=entropy, backend=fn_backend)
        logp, ent = out if entropy else (out, None)
    loss = (logp * gl.to(logp.dtype)).sum()
    if entropy and ge is not None:
        loss = loss + (ent * ge.to(ent.dtype)).sum()
    loss.backward()
    out = (logp, ent, hh.grad, ww.grad, (bb.grad if bb is not None else None))
    return tuple(t.detach().cpu() if t is not None else None for t in out)


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _compare(got, ref, *, val_atol=1e-5, grad_rel=1e-4):
    logp, ent, gh, gw, gb = got
    rlogp, rent, rgh, rgw, rgb = ref
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp.double(), rlogp, atol=val_atol, rtol=0)
    if ent is not None:
        assert ent.dtype == torch.float32
        torch.testing.assert_close(ent.double(), rent, atol=val_atol, rtol=0)
    assert _rel(gh, rgh) < grad_rel
    assert _rel(gw, rgw) < grad_rel
    if gb is not None:
        assert _rel(gb, rgb) < grad_rel


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_values_and_grads_bias_temperature_entropy(backend):
    # V=257 (prime, several 32-wide tiles), H=40 (not a multiple of the K tile), ignored tokens
    h, w, b, y = _inputs((3, 7), 40, 257, bias=True, n_ignore=4)
    gl, ge = torch.randn(3, 7), torch.randn(3, 7)
    got = _run(backend, h, w, b, y, temperature=0.7, gl=gl, ge=ge)
    ref = _run(None, h, w, b, y, temperature=0.7, gl=gl, ge=ge)
    _compare(got, ref)
    ignored = y == -100
    assert (got[0][ignored] == 0).all() and (got[1][ignored] == 0).all()
    assert (got[2][ignored] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_logp_only_no_bias(backend):
    h, w, _, y = _inputs((50,), 64, 300)
    gl = torch.randn(50)
    got = _run(backend, h, w, None, y, entropy=False, gl=gl)
    ref = _run(None, h, w, None, y, gl=gl)
    _compare(got, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_through_entropy_only(backend):
    h, w, _, y = _inputs((9,), 24, 70)
    gl, ge = torch.zeros(9), torch.randn(9)
    _compare(_run(backend, h, w, None, y, gl=gl, ge=ge), _run(None, h, w, None, y, gl=gl, ge=ge))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_documented_bounds(backend, dtype):
    h, w, b, y = _inputs((2, 9), 48, 100, dtype=dtype, bias=True)
    gl, ge = torch.randn(2, 9), torch.randn(2, 9)
    got = _run(backend, h, w, b, y, gl=gl, ge=ge)
    ref = _run(None, h, w, b, y, gl=gl, ge=ge)  # float64 math on the rounded inputs
    assert got[2].dtype == dtype and got[3].dtype == dtype
    _compare(got, ref, val_atol=1e-5, grad_rel=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vocab_of_one(backend):
    h, w, _, y = _inputs((5,), 8, 1)
    logp, ent, gh, gw, _ = _run(backend, h, w, None, y, gl=torch.randn(5), ge=torch.randn(5))
    assert torch.equal(logp, torch.zeros(5)) and ent.abs().max() < 1e-6
    assert gh.abs().max() < 1e-6 and gw.abs().max() < 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_token(backend):
    h, w, b, y = _inputs((1,), 16, 33, bias=True)
    gl, ge = torch.randn(1), torch.randn(1)
    _compare(_run(backend, h, w, b, y, gl=gl, ge=ge), _run(None, h, w, b, y, gl=gl, ge=ge))


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_tokens_ignored(backend):
    h, w, b, y = _inputs((2, 4), 16, 40, bias=True)
    y.fill_(-100)
    logp, ent, gh, gw, gb = _run(backend, h, w, b, y, gl=torch.randn(2, 4), ge=torch.randn(2, 4))
    for t in (logp, ent, gh, gw, gb):
        assert torch.isfinite(t).all() and (t == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_logits_stay_finite(backend):
    # logits of magnitude ~1e4: no inf/NaN, and still the reference (fp32 relative precision)
    h, w, _, y = _inputs((12,), 32, 90, scale=4000.0)
    gl, ge = torch.randn(12), torch.randn(12)
    got = _run(backend, h, w, None, y, gl=gl, ge=ge)
    ref = _run(None, h, w, None, y, gl=gl, ge=ge)
    logits = h @ w.T
    assert logits.abs().max() > 1e4
    for t in got:
        if t is not None:
            assert torch.isfinite(t).all()
    torch.testing.assert_close(got[0].double(), ref[0], atol=1e4 * 1e-6, rtol=1e-6)
    assert _rel(got[3], ref[3]) < 1e-3


def test_torch_path_large_prime_vocab_many_chunks(monkeypatch):
    monkeypatch.setattr(lp_mod, "TORCH_CHUNK_BYTES", 32003 * 4 * 24)  # 24-token chunks
    h, w, b, y = _inputs((4, 25), 32, 32003, bias=True, n_ignore=7)
    gl, ge = torch.randn(4, 25), torch.randn(4, 25)
    got = _run("torch", h, w, b, y, temperature=1.3, gl=gl, ge=ge)
    ref = _run(None, h, w, b, y, temperature=1.3, gl=gl, ge=ge)
    _compare(got, ref)


@pytest.mark.parametrize("vocab", [1, 7, 4096, 32000, 32003, 151936, 262144, 2**20])
def test_chunk_rows_fill_a_fixed_byte_budget(vocab):
    """The PyTorch path's token chunk is as many rows as fit one fp32 [rows, V] buffer in
    TORCH_CHUNK_BYTES, whatever the token count: the logits memory bound is the budget,
    for every vocabulary (one row at least)."""
    rows = lp_mod.chunk_rows(vocab)
    budget = lp_mod.TORCH_CHUNK_BYTES
    assert rows >= 1
    assert rows * vocab * 4 <= budget or rows == 1
    assert (rows + 1) * vocab * 4 > budget  # no smaller chunk than the budget allows



class _LargestVocabRows(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the most rows any op output with ``vocab`` columns has (the logits chunks)."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.most_rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] == self.vocab and not func.is_view:  # (not weight.T)
                self.most_rows = max(self.most_rows, t.shape[0])
        return out


@pytest.mark.parametrize("op", ["linear_logprobs", "fused_linear_policy_loss"])
def test_torch_path_never_holds_more_logits_rows_than_the_chunk(monkeypatch, op):
    """Memory bound of the PyTorch path, by construction: every [rows, V] tensor it makes
    (forward and backward) has at most chunk_rows(V) rows, so the logits work buffers
    are bounded by the byte budget and not by the token count."""
    from fastrl.config import PolicyLossConfig
    from fastrl.ops import fused_linear_policy_loss

    B, T, H, V = 4, 50, 16, 257
    monkeypatch.setattr(lp_mod, "TORCH_CHUNK_BYTES", 4 * V * 37)  # 37-row chunks for 200 tokens
    rows = lp_mod.chunk_rows(V)
    assert rows == 37
    h, w, b, y = _inputs((B, T), H, V, bias=True)
    hh, ww, bb = (t.clone().requires_grad_() for t in (h, w, b))
    mask = torch.ones(B, T)
    cfg = PolicyLossConfig(entropy_coef=0.01)  # with the entropy: two [rows, V] buffers per chunk
    with _LargestVocabRows(V) as seen:
        if op == "linear_logprobs":
            logp, ent = linear_logprobs(hh, ww, y, bias=bb, return_entropy=True, backend="torch")
            (logp.sum() + ent.sum()).backward()
        else:
            old = torch.full((B, T), -5.0)
            loss, _ = fused_linear_policy_loss(hh, ww, y, old, torch.randn(B), mask, bias=bb, config=cfg,
                                               backend="torch")
            loss.backward()
    assert hh.grad is not None and ww.grad is not None and bb.grad is not None
    assert 0 < seen.most_rows <= rows, (seen.most_rows, rows)


def test_backends_agree_and_leading_dims_are_kept():
    h, w, _, y = _inputs((2, 3, 5), 20, 45)
    h, w, y = h.to(DEVICE), w.to(DEVICE), y.to(DEVICE)
    a = linear_logprobs(h, w, y, backend="torch", return_entropy=True)
    t = linear_logprobs(h, w, y, backend="triton", return_entropy=True)
    assert a[0].shape == (2, 3, 5) and t[1].shape == (2, 3, 5)
    torch.testing.assert_close(a[0], t[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(a[1], t[1], atol=1e-5, rtol=0)


def test_triton_tiles_are_tunable():
    h, w, _, y = _inputs((20,), 24, 130)
    h, w, y = h.to(DEVICE), w.to(DEVICE), y.to(DEVICE)
    tiles = {k: dict(BLOCK_N=16, BLOCK_V=64, BLOCK_K=32, num_warps=1, num_stages=1) for k in ("fwd", "bwd_hidden", "bwd_weight")}
    ref = linear_logprobs(h, w, y, backend="torch")
    torch.testing.assert_close(linear_logprobs(h, w, y, backend="triton", tiles=tiles), ref, atol=1e-5, rtol=0)


def test_no_grad_inputs_and_custom_ignore_index():
    h, w, _, y = _inputs((6,), 8, 12)
    y[2] = 11
    out = linear_logprobs(h, w, y, ignore_index=11, backend="torch")
    assert out[2] == 0 and out.requires_grad is False
    ref, _ = linear_logprobs_reference(h.double(), w.double(), y, ignore_index=11)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "case, exc, match",
    [
        ("h_mismatch", ValueError, "weight"),
        ("target_range", ValueError, "targets"),
        ("negative_target", ValueError, "targets"),
        ("float_targets", TypeError, "targets"),
        ("target_shape", ValueError, "targets"),
        ("device", ValueError, "weight"),
        ("temperature", ValueError, "temperature"),
        ("int_hidden", TypeError, "hidden"),
        ("bias_shape", ValueError, "bias"),
        ("backend", ValueError, "backend"),
        ("empty", ValueError, "targets"),
    ],
)
def test_bad_input(case, exc, match):
    h, w, _, y = _inputs((4,), 8, 10)
    kw = {}
    if case == "h_mismatch":
        w = torch.randn(10, 9)
    elif case == "target_range":
        y[1] = 10
    elif case == "negative_target":
        y[1] = -1
    elif case == "float_targets":
        y = y.float()
    elif case == "target_shape":
        y = y[:3]
    elif case == "device":
        w = w.to("meta")
    elif case == "temperature":
        kw["temperature"] = 0.0
    elif case == "int_hidden":
        h = h.long()
    elif case == "bias_shape":
        kw["bias"] = torch.randn(9)
    elif case == "backend":
        kw["backend"] = "cuda"
    elif case == "empty":
        h, y = h[:0], y[:0]
    with pytest.raises(exc, match=match):
        linear_logprobs(h, w, y, **kw)


def test_triton_vocab_split_over_programs():
    # the vocabulary split over 3 programs per token tile: merged statistics and atomic grad_hidden
    h, w, b, y = _inputs((2, 11), 40, 257, bias=True, n_ignore=3)
    gl, ge = torch.randn(2, 11), torch.randn(2, 11)
    tiles = {k: dict(BLOCK_N=16, BLOCK_V=32, BLOCK_K=16, num_warps=1, num_stages=1, SPLITS=3)
             for k in ("fwd", "bwd_hidden", "bwd_weight")}
    hh, ww, bb = (t.to(DEVICE).requires_grad_() for t in (h, w, b))
    logp, ent = linear_logprobs(hh, ww, y.to(DEVICE), bias=bb, temperature=0.9, return_entropy=True,
                                backend="triton", tiles=tiles)
    ((logp * gl.to(DEVICE)).sum() + (ent * ge.to(DEVICE)).sum()).backward()
    ref = _run(None, h, w, b, y, temperature=0.9, gl=gl, ge=ge)
    _compare(tuple(t.detach().cpu() for t in (logp, ent, hh.grad, ww.grad, bb.grad)), ref)


def test_ignored_tokens_are_not_computed(monkeypatch):
    # padding costs nothing: the PyTorch path only ever sees the non-ignored rows
    seen = []
    orig_stats, orig_grads = lp_mod._torch_stats, lp_mod._torch_grads
    monkeypatch.setattr(lp_mod, "_torch_stats", lambda h, *a: seen.append(h.shape[0]) or orig_stats(h, *a))
    monkeypatch.setattr(lp_mod, "_torch_grads", lambda h, *a: seen.append(h.shape[0]) or orig_grads(h, *a))
    h, w, _, y = _inputs((4, 8), 16, 50, n_ignore=13)
    h.requires_grad_()
    linear_logprobs(h, w, y, backend="torch").sum().backward()  # CPU tensors: compaction is free
    assert seen == [19, 19]


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(1, 40), hdim=st.integers(1, 33), vocab=st.integers(1, 90),
    temperature=st.floats(0.25, 4.0), n_ignore=st.integers(0, 5), seed=st.integers(0, 2**16),
)
def test_torch_path_property_matches_reference(n, hdim, vocab, temperature, n_ignore, seed):
    torch.manual_seed(seed)
    h, w, b, y = _inputs((n,), hdim, vocab, bias=True, n_ignore=min(n_ignore, n))
    gl, ge = torch.randn(n), torch.randn(n)
    got = _run("torch", h, w, b, y, temperature=temperature, gl=gl, ge=ge, device="cpu")
    ref = _run(None, h, w, b, y, temperature=temperature, gl=gl, ge=ge, device="cpu")
    torch.testing.assert_close(got[0].double(), ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1].double(), ref[1], atol=1e-5, rtol=0)
    for g, r in zip(got[2:], ref[2:]):
        torch.testing.assert_close(g.double(), r, atol=1e-5 * max(1.0, r.abs().max().item()), rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_entropy_rows_are_a_subsample_of_the_full_entropy_and_leave_logp_and_grads_alone(backend, monkeypatch):
    """entropy_rows: the entropy of those tokens (here every 3rd scored one), equal to the full
    entropy there; NaN at the other scored tokens, 0 at ignored ones, no gradient; logp and
    its gradients bitwise those of a call without entropy. The torch path, in 4-row chunks,
    computes no other row's entropy (they stay NaN)."""
    if backend == "torch":
        monkeypatch.setattr(lp_mod, "TORCH_CHUNK_BYTES", 4 * 97 * 4)  # 4-row chunks: the subsample spans chunks
    torch.manual_seed(3)
    h, w, b, y = _inputs((3, 7), 16, 97, bias=True, n_ignore=5)
    dev = DEVICE
    h, w, b, y = h.to(dev), w.to(dev), b.to(dev), y.to(dev)
    full = linear_logprobs(h, w, y, bias=b, return_entropy=True, backend=backend)[1]

    def call(**kw):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = linear_logprobs(hh, ww, y, bias=b, temperature=1.3, backend=backend, **kw)
        logp, ent = out if kw.get("return_entropy") else (out, None)
        logp.sum().backward()
        return logp.detach(), ent, hh.grad, ww.grad

    logp0, _, gh0, gw0 = call()
    scored = y != -100
    picked = every_kth(scored, 3)
    logp, ent, gh, gw = call(return_entropy=True, entropy_rows=picked)
    assert torch.equal(logp, logp0) and torch.equal(gh, gh0) and torch.equal(gw, gw0)
    assert not ent.requires_grad
    full = linear_logprobs(h, w, y, bias=b, temperature=1.3, return_entropy=True, backend=backend)[1]
    e, f = ent.reshape(-1).cpu(), full.reshape(-1).cpu()
    picked, scored = picked.reshape(-1).cpu(), scored.reshape(-1).cpu()
    assert int(picked.sum()) == (int(scored.sum()) + 2) // 3
    torch.testing.assert_close(e[picked], f[picked], atol=1e-6, rtol=0)
    assert torch.isnan(e[scored & ~picked]).all()
    assert (e[~scored] == 0).all()
    with pytest.raises(ValueError, match="entropy_rows must be a bool tensor"):
        linear_logprobs(h, w, y, return_entropy=True, entropy_rows=picked.reshape(-1), backend=backend)


def test_chunk_rule_gives_a_weight_gradient_pass_at_least_hidden_rows():
    """rows = max(budget // 4V, H) in a pass that forms the weight gradient: at V = 151,936 and
    H = 256 a 2,048-token micro-batch adds into the [V, H] gradient 8 times, not 25."""
    budget_rows = lp_mod.chunk_rows(151936)
    assert budget_rows == lp_mod.TORCH_CHUNK_BYTES // (4 * 151936)
    assert lp_mod.chunk_rows(151936, weight_grad_hidden=256) == max(budget_rows, 256)
    assert lp_mod.chunk_rows(32000, weight_grad_hidden=64) == lp_mod.chunk_rows(32000)  # the budget already exceeds H
    assert lp_mod.chunk_rows(2**20, weight_grad_hidden=0) >= 1


class _LargestTile(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the most elements of any 2-D op output other than the ``skip`` shapes (the gradients)."""

    def __init__(self, skip):
        super().__init__()
        self.skip, self.most = set(skip), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() == 2 and tuple(t.shape) not in self.skip and not func.is_view:
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize("tokens, vocab", [(1, 1), (2048, 151936), (200, 257), (10_000, 151936), (50, 2**20), (7, 3)])
def test_backward_tile_fits_the_budget_and_takes_every_token_that_fits(tokens, vocab):
    rows, cols = lp_mod.backward_tile(tokens, vocab)
    budget = lp_mod.TORCH_CHUNK_BYTES
    side = math.isqrt(budget // 4)
    assert 1 <= rows <= tokens and 1 <= cols <= vocab
    assert rows * cols * 4 <= budget
    assert rows == min(tokens, side)  # all the tokens when they fit the square's side
    assert cols == vocab or (rows * (cols + 1) * 4 > budget)  # no narrower tile than the budget allows
    if (tokens, vocab) == (2048, 151936):  # the real shape: one column of tiles, the weight gradient written once
        assert (rows, cols) == (2048, budget // (4 * 2048))


@pytest.mark.parametrize("need_weight_grad", [True, False])
@pytest.mark.parametrize("entropy", [False, True])
def test_torch_backward_tiles_stay_in_the_budget_and_match_the_reference(monkeypatch, need_weight_grad, entropy):
    """The backward's work buffers are tiles of at most TORCH_CHUNK_BYTES (tokens x vocabulary
    entries), several per dimension here (budget of 37 x 257 fp32 entries: 97 x 98 tiles for
    200 tokens), and the gradients equal the reference's."""
    B, T, H, V = 4, 50, 64, 257
    monkeypatch.setattr(lp_mod, "TORCH_CHUNK_BYTES", 4 * V * 37)
    rows, cols = lp_mod.backward_tile(B * T, V)
    assert rows < B * T and cols < V
    h, w, b, y = _inputs((B, T), H, V, bias=True, n_ignore=9)
    hh, ww, bb = h.clone().requires_grad_(), w.clone().requires_grad_(need_weight_grad), b.clone().requires_grad_(need_weight_grad)
    gl, ge = torch.randn(B, T), torch.randn(B, T)
    logp, ent = linear_logprobs(hh, ww, y, bias=bb, temperature=1.3, return_entropy=True, backend="torch")
    n_valid = int((y != -100).sum())
    with _LargestTile({(V, H), (n_valid, H), (B * T, H)}) as seen:
        ((logp * gl).sum() + ((ent * ge).sum() if entropy else 0)).backward()
    assert 0 < seen.most <= lp_mod.TORCH_CHUNK_BYTES // 4, (seen.most, rows, cols)
    ref = _run(None, h, w, b, y, temperature=1.3, gl=gl, ge=ge if entropy else None)
    torch.testing.assert_close(hh.grad.double(), ref[2], atol=1e-5, rtol=1e-4)
    if need_weight_grad:
        torch.testing.assert_close(ww.grad.double(), ref[3], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(bb.grad.double(), ref[4], atol=1e-5, rtol=1e-4)