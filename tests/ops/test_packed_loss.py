"""Packed ``[1, N]`` inputs with ``cu_seqlens`` (``fastrl.ops.packing``) give what the padded
``[S, T]`` rows give: ``policy_loss`` (every ``loss_agg`` mode, GSPO's sequence ratio,
sequence-level IS weights, global counts), ``value_loss``, ``gae``, ``discounted_returns`` --
values, metrics and gradients, float64 on the torch backend and float32 on Triton (the
interpreter on CPU, small shapes).

The padded twin of every packed batch is built here by slicing the packed row sequence by
sequence (not with ``PackedLayout``), wider than the longest sequence and with NaN/inf at
every masked-out position, so the check does not lean on the code under test.
"""

from __future__ import annotations

import pytest
import torch

from fastrl import PolicyLossConfig
from fastrl.ops import PackedLayout, discounted_returns, gae, policy_loss, value_loss

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = [("torch", torch.float64), ("triton", torch.float32)]
# the losses accumulate in fp32 for every input dtype (float64 inputs are exercised, not
# float64 arithmetic), and the padded twin is wider: only the summation order differs
TOL = {torch.float64: dict(rtol=2e-6, atol=1e-7), torch.float32: dict(rtol=2e-6, atol=1e-7)}
LENGTHS = {
    "mixed": [5, 1, 0, 9, 3, 1],  # with a zero-length and length-1 sequences
    "length_one": [1, 1, 1],
    "single": [11],
}
POLICY_CONFIGS = {
    "token-mean": dict(dual_clip=3.0, kl_coef=0.05, entropy_coef=0.01, is_cap=2.0),
    "seq-mean-token-mean": dict(loss_agg="seq-mean-token-mean", kl_coef=0.1, kl_estimator="k2"),
    "seq-mean-token-sum": dict(loss_agg="seq-mean-token-sum", entropy_coef=0.02),
    "seq-mean-token-sum-norm": dict(loss_agg="seq-mean-token-sum-norm", norm_length=16, log_ratio_clamp=0.3),
    "gspo": dict(ratio_level="sequence", clip_low=0.05, clip_high=0.05, loss_agg="seq-mean-token-mean",
                 kl_coef=0.05, entropy_coef=0.01),
    "seq_is": dict(is_level="sequence", is_cap=1.2, loss_agg="seq-mean-token-sum"),
    "gspo_seq_is": dict(ratio_level="sequence", is_level="sequence", log_ratio_clamp=0.2, dual_clip=1.5,
                        loss_agg="seq-mean-token-sum", kl_coef=0.05),
}
# Triton under the interpreter is slow: mixed lengths only, and these four cover every
# aggregation mode, GSPO and sequence-level IS
TRITON_POLICY = ("token-mean", "seq-mean-token-sum-norm", "gspo", "gspo_seq_is")


SMALL_TILES = {"block_t": 8, "block_b": 4}
"""8-token chunks: the longer sequences span several Triton programs."""


def cu_of(lengths: list[int]) -> list[int]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu


def packed_batch(lengths, dtype, *, seed=0, garbage=True):
    """Per-token packed [1, N] inputs (a few masked-out tokens inside the sequences, holding
    NaN/inf when ``garbage``) and per-sequence advantages [S]."""
    g = torch.Generator().manual_seed(seed)
    N, S = sum(lengths), len(lengths)
    rnd = lambda scale=1.0: (torch.randn(1, N, generator=g, dtype=torch.float64) * scale)
    mask = torch.rand(1, N, generator=g) > 0.25
    for s, a in enumerate(cu_of(lengths)[:-1]):
        if lengths[s]:
            mask[0, a] = True  # every non-empty sequence keeps a token (and some lose more)
    logp = -torch.rand(1, N, generator=g, dtype=torch.float64) * 2
    b = dict(
        logp=logp, old_logp=logp + rnd(0.3), advantages=rnd(), ref_logp=logp + rnd(0.2),
        entropy=torch.rand(1, N, generator=g, dtype=torch.float64) * 3, rollout_logp=logp + rnd(0.4),
        values=rnd(), old_values=rnd(), returns=rnd(), rewards=rnd(),
    )
    if garbage:
        bad = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38])
        fill = bad[torch.arange(N) % 4][None].to(torch.float64)
        b = {k: torch.where(mask, v, fill) for k, v in b.items()}
    b = {k: v.to(dtype) for k, v in b.items()}
    b["mask"] = mask
    b["seq_advantages"] = torch.randn(S, generator=g, dtype=torch.float64).to(dtype)
    return {k: v.to(DEVICE) for k, v in b.items()}


def padded_twin(batch, lengths, *, extra=2):
    """[S, T + extra] rows of every per-token tensor, NaN past each sequence's end (mask 0 there)."""
    S, T = len(lengths), max(lengths) + extra
    cu = cu_of(lengths)
    out = {}
    for k, v in batch.items():
        if k == "seq_advantages":
            out[k] = v
            continue
        rows = torch.full((S, T), False if k == "mask" else float("nan"), dtype=v.dtype, device=v.device)
        for s in range(S):
            rows[s, : lengths[s]] = v[0, cu[s] : cu[s + 1]]
        out[k] = rows
    return out


def packed_of(rows, lengths):
    """The packed [1, N] tokens of [S, T] rows (the inverse of ``padded_twin``)."""
    return torch.cat([rows[s, :n] for s, n in enumerate(lengths)])[None]


def _policy(b, cfg, backend, *, per_seq_adv, cu_seqlens=None, **kw):
    logp = b["logp"].clone().requires_grad_()
    ent = b["entropy"].clone().requires_grad_()
    adv = b["seq_advantages"] if per_seq_adv else b["advantages"]
    loss, metrics = policy_loss(logp, b["old_logp"], adv, b["mask"], ref_logp=b["ref_logp"], entropy=ent,
                                rollout_logp=b["rollout_logp"], config=cfg, backend=backend, cu_seqlens=cu_seqlens,
                                tiles=SMALL_TILES, **kw)
    glogp, gent = torch.autograd.grad(loss, [logp, ent], allow_unused=True)
    return loss.detach(), {k: v.detach() for k, v in metrics.items()}, glogp, gent


def assert_same(a, b, tol):
    torch.testing.assert_close(a, b, **tol, equal_nan=False)


POLICY_CASES = [(b, d, n, ls) for b, d in BACKENDS for n in POLICY_CONFIGS for ls in LENGTHS
                if b == "torch" or (ls == "mixed" and n in TRITON_POLICY)]


@pytest.mark.parametrize("backend,dtype,name,lengths", POLICY_CASES, ids=["-".join(c[2:] + c[:1]) for c in POLICY_CASES])
def test_policy_loss_packed_equals_padded(backend, dtype, name, lengths):
    lens = LENGTHS[lengths]
    cfg = PolicyLossConfig(**POLICY_CONFIGS[name])
    b = packed_batch(lens, dtype, seed=len(name))
    rows = padded_twin(b, lens)
    # per-sequence advantages for the seq-level modes, per-token ones for the others
    per_seq = name.startswith(("gspo", "seq"))
    layout = PackedLayout.from_cu_seqlens(torch.tensor(cu_of(lens), dtype=torch.int32), device=DEVICE)
    # a prebuilt layout, or host cu_seqlens (the same path after the layout is built)
    for cu in (layout, cu_of(lens)) if backend == "torch" else (layout,):
        loss, metrics, glogp, gent = _policy(b, cfg, backend, per_seq_adv=per_seq, cu_seqlens=cu)
        rloss, rmetrics, rglogp, rgent = _policy(rows, cfg, backend, per_seq_adv=per_seq)
        tol = TOL[dtype]
        assert torch.isfinite(loss) and loss.dtype == torch.float32
        assert_same(loss, rloss, tol)
        assert metrics.keys() == rmetrics.keys()
        for k in rmetrics:
            assert_same(metrics[k], rmetrics[k], tol)
        assert glogp.shape == b["logp"].shape and glogp.dtype == dtype
        assert_same(glogp, packed_of(rglogp, lens), tol)
        if rgent is None:  # entropy_coef = 0: no entropy gradient
            assert gent is None or torch.count_nonzero(gent) == 0
        else:
            assert_same(gent, packed_of(rgent, lens), tol)
        assert torch.count_nonzero(glogp[~b["mask"]]) == 0


COUNT_CASES = [("torch", torch.float64, "token-mean", "global_token_count"),
               ("torch", torch.float64, "seq-mean-token-mean", "global_seq_count"),
               ("torch", torch.float64, "seq-mean-token-sum-norm", "global_seq_count"),
               ("triton", torch.float32, "token-mean", "global_token_count")]


@pytest.mark.parametrize("backend,dtype,agg,count_kw", COUNT_CASES, ids=[f"{c[0]}-{c[2]}" for c in COUNT_CASES])
def test_global_counts_and_1d_packed_inputs(backend, dtype, agg, count_kw):
    """[N] inputs (no leading 1) and a device count: micro-batch losses add up like padded ones."""
    lens = LENGTHS["mixed"]
    cfg = PolicyLossConfig(loss_agg=agg, norm_length=8 if agg.endswith("norm") else None, kl_coef=0.1)
    b = packed_batch(lens, dtype, seed=3)
    rows = padded_twin(b, lens)
    flat = {k: (v[0] if v.dim() == 2 else v) for k, v in b.items()}
    count = {count_kw: torch.tensor(17.0, device=DEVICE)}
    loss, metrics, glogp, _ = _policy(flat, cfg, backend, per_seq_adv=False, cu_seqlens=cu_of(lens), **count)
    rloss, rmetrics, rglogp, _ = _policy(rows, cfg, backend, per_seq_adv=False, **count)
    assert glogp.shape == flat["logp"].shape
    assert_same(loss, rloss, TOL[dtype])
    assert_same(glogp, packed_of(rglogp, lens)[0], TOL[dtype])
    for k in rmetrics:
        assert_same(metrics[k], rmetrics[k], TOL[dtype])


# the aggregation weights are computed outside the kernel: Triton runs two of the cases
VALUE_CASES = [(b, d, agg, clip) for b, d in BACKENDS
               for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
               for clip in (None, 0.2)
               if b == "torch" or (agg, clip) in (("token-mean", None), ("seq-mean-token-mean", 0.2))]


@pytest.mark.parametrize("backend,dtype,agg,clip", VALUE_CASES, ids=[f"{c[0]}-{c[2]}-clip{c[3]}" for c in VALUE_CASES])
def test_value_loss_packed_equals_padded(backend, dtype, agg, clip):
    lens = LENGTHS["mixed"]
    b = packed_batch(lens, dtype, seed=7)
    rows = padded_twin(b, lens)
    kw = dict(clip=clip, loss_agg=agg, norm_length=12.0 if agg.endswith("norm") else None, backend=backend)

    def run(t, **extra):
        v = t["values"].clone().requires_grad_()
        loss, metrics = value_loss(v, t["old_values"], t["returns"], t["mask"], **kw, **extra)
        (g,) = torch.autograd.grad(loss, [v])
        return loss, metrics, g

    layout = PackedLayout.from_lengths(lens, device=DEVICE)
    loss, metrics, g = run(b, cu_seqlens=layout)
    rloss, rmetrics, rg = run(rows)
    assert torch.isfinite(loss)
    assert_same(loss, rloss, TOL[dtype])
    for k in rmetrics:
        assert_same(metrics[k], rmetrics[k], TOL[dtype])
    assert_same(g, packed_of(rg, lens), TOL[dtype])


SCAN_CASES = [(b, d, ls, w) for b, d in BACKENDS for ls in LENGTHS for w in (False, True) if b == "torch" or ls == "mixed"]


@pytest.mark.parametrize("backend,dtype,lengths,whiten", SCAN_CASES, ids=[f"{c[0]}-{c[2]}-whiten{c[3]}" for c in SCAN_CASES])
def test_scans_packed_equal_padded(backend, dtype, lengths, whiten):
    lens = LENGTHS[lengths]
    b = packed_batch(lens, dtype, seed=11)
    rows = padded_twin(b, lens)
    layout = PackedLayout.from_lengths(lens)
    adv, ret = gae(b["rewards"], b["values"], b["mask"], gamma=0.9, lam=0.8, whiten=whiten, backend=backend,
                   cu_seqlens=layout)
    radv, rret = gae(rows["rewards"], rows["values"], rows["mask"], gamma=0.9, lam=0.8, whiten=whiten, backend=backend)
    assert adv.shape == b["rewards"].shape and adv.dtype == torch.float32
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert_same(adv, packed_of(radv, lens), TOL[torch.float32])
    assert_same(ret, packed_of(rret, lens), TOL[torch.float32])
    G = discounted_returns(b["rewards"][0], b["mask"][0], gamma=0.7, backend=backend, cu_seqlens=cu_of(lens))
    rG = discounted_returns(rows["rewards"], rows["mask"], gamma=0.7, backend=backend)
    assert G.shape == (sum(lens),)
    assert_same(G, packed_of(rG, lens)[0], TOL[torch.float32])


def test_scans_stop_at_sequence_ends():
    """Hand-checked: the return of a sequence's last token does not see the next sequence."""
    r = torch.tensor([[1.0, 2.0, 4.0, 8.0]])
    m = torch.ones(1, 4, dtype=torch.bool)
    G = discounted_returns(r, m, gamma=0.5, cu_seqlens=[0, 2, 4], backend="torch")
    torch.testing.assert_close(G, torch.tensor([[2.0, 2.0, 8.0, 8.0]]))


@pytest.mark.parametrize("kind", ["nan", "inf", "huge"])
def test_garbage_at_masked_positions_changes_nothing(kind):
    """Same contract as tests/ops/test_padding_garbage.py, on packed inputs."""
    lens = LENGTHS["mixed"]
    clean = packed_batch(lens, torch.float64, seed=5, garbage=False)
    dirty = dict(clean)
    val = {"nan": float("nan"), "inf": float("inf"), "huge": -3e38}[kind]
    for k, v in clean.items():
        if k not in ("mask", "seq_advantages"):
            dirty[k] = torch.where(clean["mask"], v, val)
    cfg = PolicyLossConfig(ratio_level="sequence", is_level="sequence", kl_coef=0.1, entropy_coef=0.01,
                           loss_agg="seq-mean-token-mean")
    cu = cu_of(lens)
    a = _policy(clean, cfg, "torch", per_seq_adv=False, cu_seqlens=cu)
    z = _policy(dirty, cfg, "torch", per_seq_adv=False, cu_seqlens=cu)
    assert_same(a[0], z[0], TOL[torch.float64])
    for k in a[1]:
        assert_same(a[1][k], z[1][k], TOL[torch.float64])
    assert_same(a[2], z[2], TOL[torch.float64])
    assert_same(a[3], z[3], TOL[torch.float64])
    ga = gae(clean["rewards"], clean["values"], clean["mask"], gamma=0.9, lam=0.9, cu_seqlens=cu)
    gz = gae(dirty["rewards"], dirty["values"], dirty["mask"], gamma=0.9, lam=0.9, cu_seqlens=cu)
    for x, y in zip(ga, gz):
        assert_same(x, y, TOL[torch.float64])


def test_layout_maps():
    """Hand-checked index maps, including an empty sequence and a zero-token round trip."""
    lay = PackedLayout.from_cu_seqlens(torch.tensor([0, 3, 3, 7, 8], dtype=torch.int32))
    assert lay.seq_lens == (3, 0, 4, 1) and lay.num_tokens == 8 and lay.max_len == 4 and lay.num_seqs == 4
    assert lay.cu_seqlens.dtype == torch.int32 and lay.cu_seqlens.tolist() == [0, 3, 3, 7, 8]
    assert lay.seq_ids.tolist() == [0, 0, 0, 2, 2, 2, 2, 3]
    assert lay.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    x = torch.arange(1.0, 9.0, requires_grad=True)
    rows = lay.to_padded(x)
    assert rows.tolist() == [[1, 2, 3, 0], [0, 0, 0, 0], [4, 5, 6, 7], [8, 0, 0, 0]]
    assert torch.equal(lay.to_packed(rows.detach()), x.detach())
    (g,) = torch.autograd.grad((rows * torch.arange(16.0).view(4, 4)).sum(), [x])
    assert g.tolist() == [0, 1, 2, 8, 9, 10, 11, 12]
    assert PackedLayout.from_lengths([3, 0, 4, 1]).padded_index.tolist() == lay.padded_index.tolist()


@pytest.mark.parametrize("cu,err,match", [
    ([1, 3, 5], ValueError, "start at 0"),
    ([0, 4, 2, 6], ValueError, "non-decreasing"),
    ([0], ValueError, "S \\+ 1 >= 2"),
    ([], ValueError, "S \\+ 1 >= 2"),
    ([0, 2.0, 4], TypeError, "must be an int"),
    ([0, True], TypeError, "must be an int"),
    (torch.tensor([0.0, 2.0]), TypeError, "integer tensor"),
    (torch.tensor([[0, 2]]), ValueError, "1-D"),
    (5, TypeError, "sequence of ints"),
])
def test_bad_cu_seqlens(cu, err, match):
    with pytest.raises(err, match=match):
        PackedLayout.from_cu_seqlens(cu)
    b = packed_batch([2, 2], torch.float64)
    with pytest.raises(err, match=match):
        policy_loss(b["logp"][:, :4], b["old_logp"][:, :4], b["advantages"][:, :4], b["mask"][:, :4], cu_seqlens=cu)


def test_bad_packed_shapes():
    lens = [2, 3]
    b = packed_batch(lens, torch.float64)
    cu = cu_of(lens)
    with pytest.raises(ValueError, match="cu_seqlens\\[-1\\] = 4 tokens, got shape \\(1, 5\\)"):  # last != N
        policy_loss(b["logp"], b["old_logp"], b["advantages"], b["mask"], cu_seqlens=[0, 2, 4])
    with pytest.raises(ValueError, match="cu_seqlens\\[-1\\] = 6 tokens, got shape \\(1, 5\\)"):
        gae(b["rewards"], b["values"], b["mask"], gamma=1.0, lam=1.0, cu_seqlens=[0, 2, 6])
    with pytest.raises(ValueError, match="packed as \\[N\\] or \\[1, N\\]"):  # a [B, T] batch is not packed
        policy_loss(b["logp"].expand(2, 5), b["old_logp"].expand(2, 5), b["advantages"].expand(2, 5),
                    b["mask"].expand(2, 5), cu_seqlens=cu)
    with pytest.raises(ValueError, match="old_logp must have the packed shape"):
        policy_loss(b["logp"], b["old_logp"][0], b["advantages"], b["mask"], cu_seqlens=cu)
    with pytest.raises(ValueError, match="advantages must have the packed shape .* or \\(S,\\)"):
        policy_loss(b["logp"], b["old_logp"], b["seq_advantages"][:1], b["mask"], cu_seqlens=cu)
    with pytest.raises(ValueError, match="mask must have the packed shape"):
        value_loss(b["values"], None, b["returns"], b["mask"][:, :4], cu_seqlens=cu)
    with pytest.raises(TypeError, match="returns must be a torch.Tensor"):
        value_loss(b["values"], None, [0.0] * 5, b["mask"], cu_seqlens=cu)
    # [N] inputs with N == S and an empty sequence: per-token and per-sequence [N] cannot be told apart
    amb = packed_batch([2, 0], torch.float64)
    flat = {k: v[0] for k, v in amb.items() if k != "seq_advantages"}
    with pytest.raises(ValueError, match="ambiguous"):
        policy_loss(flat["logp"], flat["old_logp"], flat["advantages"], flat["mask"], cu_seqlens=[0, 2, 2])
    policy_loss(amb["logp"], amb["old_logp"], amb["seq_advantages"], amb["mask"], cu_seqlens=[0, 2, 2])  # [1, N]: fine
    # an all-empty packing has no token: the ops' usual empty-batch error
    with pytest.raises(ValueError):
        policy_loss(b["logp"][:, :0], b["old_logp"][:, :0], b["advantages"][:, :0], b["mask"][:, :0], cu_seqlens=[0, 0])


def test_layout_on_the_wrong_device_is_moved_and_gpu_cu_seqlens_must_be_a_layout():
    lay = PackedLayout.from_lengths([2, 1])
    assert lay.on("cpu") is lay
    if torch.cuda.is_available():
        assert lay.on("cuda").padded_index.is_cuda and lay.on("cuda") is lay.on("cuda")
        b = packed_batch([2, 1], torch.float32)
        with pytest.raises(ValueError, match="PackedLayout.from_cu_seqlens"):
            policy_loss(b["logp"], b["old_logp"], b["advantages"], b["mask"], cu_seqlens=lay.cu_seqlens.cuda())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_host_sync_with_a_prebuilt_layout(backend, monkeypatch):
    from test_no_host_sync import no_host_sync  # tests/ops is on sys.path (pytest's rootless test modules)

    lens = LENGTHS["mixed"]
    b = packed_batch(lens, torch.float32, garbage=False)
    layout = PackedLayout.from_lengths(lens, device=DEVICE)
    cfg = PolicyLossConfig(ratio_level="sequence", loss_agg="seq-mean-token-mean", kl_coef=0.1)
    logp = b["logp"].clone().requires_grad_()
    values = b["values"].clone().requires_grad_()
    seqs = torch.tensor(6.0, device=DEVICE)
    with no_host_sync(monkeypatch, DEVICE) as guard:
        loss, _ = policy_loss(logp, b["old_logp"], b["seq_advantages"], b["mask"], ref_logp=b["ref_logp"], config=cfg,
                              global_seq_count=seqs, backend=backend, cu_seqlens=layout, tiles=SMALL_TILES)
        vloss, _ = value_loss(values, b["old_values"], b["returns"], b["mask"], clip=0.2, backend=backend, cu_seqlens=layout)
        (loss + vloss).backward()
        gae(b["rewards"], b["values"], b["mask"], gamma=0.9, lam=0.9, backend=backend, cu_seqlens=layout)
        discounted_returns(b["rewards"], b["mask"], gamma=0.9, backend=backend, cu_seqlens=layout)
    assert guard.ops_seen > 0
