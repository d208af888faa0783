"""``fastrl.ops.policy_loss`` (Triton under the interpreter, and the PyTorch path) against the
float64 reference: loss, every metric, gradients wrt logp and entropy.

Tolerances: fp32 inputs 1e-5 relative. bf16/fp16 inputs are compared with the reference
evaluated (in float64) on the same rounded values, so the loss and metrics keep 1e-5;
the gradients are returned in the input dtype, hence bounded by its rounding
(bf16: rtol 1e-2, fp16: rtol 2e-3).
"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastrl import PolicyLossConfig
from fastrl.ops import policy_loss
from fastrl.reference.policy_loss import policy_loss_reference

BACKENDS = ["torch", "triton"]
D64 = torch.float64
# where the kernels run: the GPU when there is one, else the CPU under the Triton interpreter
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CONTRACT_KEYS = {"pg_loss", "clip_frac_low", "clip_frac_high", "clip_frac", "approx_kl", "ratio_mean", "ratio_min", "ratio_max"}


SMALL_TILES = {"block_t": 32, "block_b": 4, "block_c": 1}
"""32-token chunks: rows of T=37 span two programs, the second one partial; the loops over
a row's chunk partials (forward pre-pass sums, finalize) take one chunk per step."""


def make_batch(B=5, T=37, *, dtype=torch.float32, per_row_adv=False, spread=0.3, seed=0, lengths=None):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g) * 2
    old = logp + torch.randn(B, T, generator=g) * spread
    ref = logp + torch.randn(B, T, generator=g) * 0.2
    roll = old + torch.randn(B, T, generator=g) * 0.1
    ent = torch.rand(B, T, generator=g) * 3
    adv = torch.randn(B, generator=g) if per_row_adv else torch.randn(B, T, generator=g)
    if lengths is None:
        lengths = [T, 1, 0, T // 2, T - 5][:B] + [T] * max(0, B - 5)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).to(torch.float32)
    out = dict(logp=logp.to(dtype), old_logp=old.to(dtype), advantages=adv.to(dtype), mask=mask,
               ref_logp=ref.to(dtype), entropy=ent.to(dtype), rollout_logp=roll.to(dtype))
    return {k: v.to(DEVICE) for k, v in out.items()}


def run(impl, batch, cfg, *, use=("ref_logp", "entropy", "rollout_logp"), grad_out=1.0, **kw):
    """Loss, metrics and gradients (logp, entropy) of one backend, or of the reference ("ref", float64)."""
    b = {k: v for k, v in batch.items() if k in ("logp", "old_logp", "advantages", "mask") or k in use}
    if impl == "ref":
        b = {k: (v.to(D64) if v.is_floating_point() and k != "mask" else v) for k, v in b.items()}
    logp = b.pop("logp").clone().requires_grad_()
    if "entropy" in b:
        b["entropy"] = b["entropy"].clone().requires_grad_()
    if impl == "ref":
        loss, metrics = policy_loss_reference(logp, config=cfg, **b, **kw)
    else:
        loss, metrics = policy_loss(logp, config=cfg, backend=impl, **{"tiles": SMALL_TILES, **b, **kw})
    inputs = [logp] + ([b["entropy"]] if "entropy" in b else [])
    grads = torch.autograd.grad(loss * grad_out, inputs, allow_unused=True)
    return loss.detach(), {k: v.detach() for k, v in metrics.items()}, grads


def assert_matches(out, ref, *, rtol=1e-5, atol=1e-7, grad_rtol=1e-5, grad_atol=1e-8):
    loss, metrics, grads = out
    rloss, rmetrics, rgrads = ref
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss, rloss.float(), rtol=rtol, atol=atol)
    assert set(metrics) == set(rmetrics)
    for k in rmetrics:
        assert metrics[k].dtype == torch.float32 and metrics[k].dim() == 0, k
        torch.testing.assert_close(metrics[k], rmetrics[k].float(), rtol=rtol, atol=atol, msg=lambda m: f"{k}: {m}")
    for g, rg in zip(grads, rgrads):
        if rg is None:
            assert g is None or torch.count_nonzero(g) == 0
            continue
        torch.testing.assert_close(g.double(), rg, rtol=grad_rtol, atol=grad_atol)


CONFIGS = [
    dict(),
    dict(clip_low=0.2, clip_high=0.28),
    dict(dual_clip=3.0, log_ratio_clamp=0.3),
    dict(kl_coef=0.05, kl_estimator="k1", entropy_coef=0.01),
    dict(kl_coef=0.05, kl_estimator="k2", kl_clamp=0.02),
    dict(kl_coef=0.05, kl_estimator="k3", kl_clamp=0.05, is_cap=1.5),
    dict(is_level="sequence", is_cap=1.1, loss_agg="seq-mean-token-sum"),
    dict(ratio_level="sequence", clip_low=0.05, clip_high=0.05, kl_coef=0.1, entropy_coef=0.01),
    dict(ratio_level="sequence", log_ratio_clamp=0.2, dual_clip=1.5, is_level="sequence"),
    dict(loss_agg="seq-mean-token-mean", dual_clip=2.0, kl_coef=0.1, entropy_coef=0.02),
    dict(loss_agg="seq-mean-token-sum-norm", norm_length=64, kl_coef=0.02),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_matches_reference(backend, cfg):
    cfg = PolicyLossConfig(**cfg)
    batch = make_batch()
    assert_matches(run(backend, batch, cfg, grad_out=1.7), run("ref", batch, cfg, grad_out=1.7))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", ["ppo", "grpo", "dapo", "dr_grpo", "gspo"])
def test_presets_with_per_sequence_advantages(backend, preset):
    cfg = PolicyLossConfig.preset(preset, **({"norm_length": 48.0} if preset == "dr_grpo" else {}))
    batch = make_batch(per_row_adv=True, spread=0.01 if preset == "gspo" else 0.3)
    use = ("ref_logp",) if cfg.kl_coef else ()
    out = run(backend, batch, cfg, use=use)
    assert_matches(out, run("ref", batch, cfg, use=use))
    assert CONTRACT_KEYS <= set(out[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,grad_rtol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
def test_low_precision_inputs(backend, dtype, grad_rtol):
    cfg = PolicyLossConfig(kl_coef=0.05, entropy_coef=0.01, dual_clip=3.0, is_cap=2.0)
    batch = make_batch(dtype=dtype)
    out = run(backend, batch, cfg)
    assert out[2][0].dtype == dtype and out[2][1].dtype == dtype
    assert_matches(out, run("ref", batch, cfg), grad_rtol=grad_rtol, grad_atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_dtypes_and_mask_dtypes(backend):
    cfg = PolicyLossConfig(kl_coef=0.05)
    batch = make_batch()
    expected = run("ref", batch, cfg, use=("ref_logp",))
    for mask in (batch["mask"].bool(), batch["mask"].to(torch.int64), batch["mask"].to(torch.bfloat16) * 3):
        b = dict(batch, mask=mask, old_logp=batch["old_logp"].double(), advantages=batch["advantages"].half().float())
        exp = run("ref", b, cfg, use=("ref_logp",))
        assert_matches(run(backend, b, cfg, use=("ref_logp",)), exp)
    assert expected[0].isfinite()


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend):
    cfg = PolicyLossConfig(kl_coef=0.05, entropy_coef=0.01, ratio_level="sequence")
    batch = make_batch(B=4, T=40)
    sliced = {k: (v[:, 3:] if v.dim() == 2 else v) for k, v in batch.items()}  # row stride 40, 37 columns
    sliced["advantages"] = torch.randn(4, 2, device=DEVICE)[:, 0]  # [B] with stride 2
    sliced["old_logp"] = batch["old_logp"].t().contiguous().t()[:, 3:]  # column stride != 1
    assert not sliced["logp"].is_contiguous()
    assert_matches(run(backend, sliced, cfg), run("ref", sliced, cfg))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", [dict(), dict(ratio_level="sequence", is_level="sequence", loss_agg="seq-mean-token-mean")])
def test_length_one_rows_and_single_row(backend, cfg):
    cfg = PolicyLossConfig(**cfg, kl_coef=0.1, entropy_coef=0.01)
    for B, T, lengths in ((3, 1, [1, 0, 1]), (1, 5, [5]), (1, 1, [1])):
        batch = make_batch(B=B, T=T, lengths=lengths)
        assert_matches(run(backend, batch, cfg), run("ref", batch, cfg))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_no_token_at_all(backend, agg):
    cfg = PolicyLossConfig(loss_agg=agg, kl_coef=0.1, entropy_coef=0.01, dual_clip=3.0,
                           ratio_level="sequence" if agg == "seq-mean-token-mean" else "token",
                           norm_length=32.0 if agg == "seq-mean-token-sum-norm" else None)
    batch = make_batch(B=3, T=20, lengths=[0, 0, 0])
    loss, metrics, grads = run(backend, batch, cfg)
    assert loss.item() == 0.0
    assert all(v.item() == 0.0 for v in metrics.values()), metrics
    assert all(torch.count_nonzero(g) == 0 for g in grads)


@pytest.mark.parametrize("backend", BACKENDS)
def test_garbage_at_masked_positions_is_ignored(backend):
    cfg = PolicyLossConfig(kl_coef=0.1, entropy_coef=0.01, is_cap=2.0, ratio_level="sequence")
    batch = make_batch()
    clean = {k: (torch.where(batch["mask"] != 0, v, 0.0) if k != "mask" and v.dim() == 2 else v) for k, v in batch.items()}
    dirty = dict(clean)
    pad = batch["mask"] == 0
    dirty["logp"] = clean["logp"].masked_fill(pad, -math.inf)
    for k in ("old_logp", "advantages", "ref_logp", "entropy", "rollout_logp"):
        dirty[k] = clean[k].masked_fill(pad, math.nan)
    out = run(backend, dirty, cfg)
    assert out[0].isfinite() and all(g.isfinite().all() for g in out[2])
    assert_matches(out, run("ref", clean, cfg))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", [dict(), dict(dual_clip=3.0), dict(log_ratio_clamp=20.0),
                                 dict(ratio_level="sequence"), dict(ratio_level="sequence", log_ratio_clamp=20.0)])
def test_extreme_log_ratios(backend, cfg):
    """Log-ratios of +-50 (ratios 1e-22 .. 5e21, far outside the clip range) stay finite and exact."""
    cfg = PolicyLossConfig(**cfg)
    batch = make_batch(B=4, T=20)
    sign = torch.where(torch.rand(4, 20, generator=torch.Generator().manual_seed(3)) < 0.5, -1.0, 1.0).to(DEVICE)
    batch["old_logp"] = batch["logp"] - 50.0 * sign
    if cfg.ratio_level == "sequence":  # one extreme row, one normal row: the mean stays at +-50 / 0
        batch["old_logp"][0] = batch["logp"][0] - 50.0
        batch["old_logp"][1] = batch["logp"][1] + 50.0
        batch["old_logp"][3] = batch["logp"][3] - 0.1
    out = run(backend, batch, cfg, use=())
    assert out[0].isfinite() and all(v.isfinite() for v in out[1].values())
    assert all(g.isfinite().all() for g in out[2])
    assert_matches(out, run("ref", batch, cfg, use=()))
    if cfg.log_ratio_clamp is not None:
        assert out[1]["ratio_max"].item() <= math.exp(20.0) * (1 + 1e-6)


@pytest.mark.parametrize("backend", BACKENDS + ["ref"])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_overflowed_ratio_on_clipped_token_has_zero_gradient(backend, ratio_level):
    """A log-ratio of 1000 overflows exp (fp32 and the float64 reference). On a clipped (A > 0) or dual-clipped (A < 0)
    token the loss is finite and the exact gradient is 0 -- not 0 * inf = NaN. Everything
    else equals the same batch with a moderate (still clipped) log-ratio of 5 there."""
    cfg = PolicyLossConfig(ratio_level=ratio_level, dual_clip=3.0, kl_coef=0.1, entropy_coef=0.01)
    batch = make_batch(B=4, T=20, per_row_adv=ratio_level == "sequence")

    def with_log_ratio(lr_big):
        b = {k: v.clone() for k, v in batch.items()}
        if ratio_level == "token":  # one clipped-high token (A > 0) and one dual-clipped token (A < 0)
            b["advantages"][0, 3], b["advantages"][3, 7] = 1.5, -0.7
            for r, t in ((0, 3), (3, 7)):
                b["old_logp"][r, t] = b["logp"][r, t] - lr_big
        else:  # whole rows: row 0 (A > 0) is clipped, row 3 (A < 0) dual-clipped
            b["advantages"][0], b["advantages"][3] = 1.5, -0.7
            for r in (0, 3):
                b["old_logp"][r] = torch.where(b["mask"][r] != 0, b["logp"][r] - lr_big, b["old_logp"][r])
        return b

    use = ("ref_logp", "entropy")  # (importance weights read old_logp: they would differ)
    extreme = run(backend, with_log_ratio(1000.0), cfg, use=use)
    moderate = run(backend, with_log_ratio(5.0), cfg, use=use)
    assert extreme[0].isfinite() and extreme[1]["pg_loss"].isfinite()
    assert all(g.isfinite().all() for g in extreme[2]), "overflowed clipped tokens must not poison the gradient"
    torch.testing.assert_close(extreme[0], moderate[0], rtol=1e-6, atol=1e-7)
    for g, g_mod in zip(extreme[2], moderate[2]):
        torch.testing.assert_close(g, g_mod, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_k3_terms_near_zero_keep_relative_precision(backend, ratio_level):
    """The k3 KL (kl_loss, kl_ref_mean, its gradient) and approx_kl (k3 of the log-ratio)
    for differences ~1e-4: non-negative, and equal to the float64 reference at 1e-5 relative."""
    cfg = PolicyLossConfig(ratio_level=ratio_level, kl_coef=0.5, kl_estimator="k3")
    batch = make_batch(B=4, T=20, spread=1e-4)
    g = torch.Generator().manual_seed(7)
    batch["ref_logp"] = batch["logp"] + 1e-4 * torch.randn(4, 20, generator=g).to(DEVICE)
    use = ("ref_logp",)
    loss, metrics, (glogp,) = run(backend, batch, cfg, use=use)
    rloss, rmetrics, (rglogp,) = run("ref", batch, cfg, use=use)
    for k in ("kl_loss", "kl_ref_mean", "approx_kl"):
        assert metrics[k] > 0, k
        torch.testing.assert_close(metrics[k].double(), rmetrics[k], rtol=1e-5, atol=0, msg=lambda m, k=k: f"{k}: {m}")
    torch.testing.assert_close(glogp.double(), rglogp, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dr_grpo_micro_batches_padded_to_their_own_length_add_up(backend):
    """Dr. GRPO with gradient accumulation: two micro-batches, each right-padded only to its
    own longest row, give the loss and gradients of the full batch (the constant is the
    config's norm_length, never the micro-batch's padded length)."""
    cfg = PolicyLossConfig.preset("dr_grpo", norm_length=64, kl_coef=0.05)
    lengths = [21, 4, 0, 10, 16, 3]
    batch = make_batch(B=6, T=21, lengths=lengths)
    big = run(backend, batch, cfg)
    n_seq = sum(n > 0 for n in lengths)
    total, grads = 0.0, []
    for rows in (slice(0, 2), slice(2, 6)):
        width = max(lengths[rows])
        part = {k: (v[rows] if v.dim() == 1 else v[rows, :width]) for k, v in batch.items()}
        loss, _, (g_logp, _) = run(backend, part, cfg, global_seq_count=n_seq)
        total += loss
        grads.append(torch.nn.functional.pad(g_logp, (0, 21 - width)))
    torch.testing.assert_close(total, big[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.cat(grads), big[2][0], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("agg,count_kw", [("token-mean", "global_token_count"), ("seq-mean-token-mean", "global_seq_count"),
                                          ("seq-mean-token-sum-norm", "global_seq_count")])
def test_global_counts_make_micro_batches_add_up(backend, agg, count_kw):
    cfg = PolicyLossConfig(loss_agg=agg, kl_coef=0.1, entropy_coef=0.01, norm_length=40)
    batch = make_batch(B=6, T=21, lengths=[21, 1, 0, 10, 16, 3])
    big = run(backend, batch, cfg)
    m = batch["mask"]
    count = m.sum() if agg == "token-mean" else (m.sum(1) > 0).sum()
    total_loss = 0.0
    grads = [[], []]
    for i, rows in enumerate((slice(0, 2), slice(2, 6))):
        part = {k: v[rows] for k, v in batch.items()}
        c = count if i == 0 else int(count.item())  # a device tensor for one, a number for the other
        loss, _, g = run(backend, part, cfg, **{count_kw: c})
        total_loss += loss
        grads[0].append(g[0])
        grads[1].append(g[1])
    torch.testing.assert_close(total_loss, big[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(torch.cat(grads[0]), big[2][0], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(torch.cat(grads[1]), big[2][1], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_grad_and_unused_entropy_grad(backend):
    cfg = PolicyLossConfig(kl_coef=0.1)  # entropy given (metrics) but entropy_coef = 0
    batch = make_batch()
    loss, metrics = policy_loss(**batch, config=cfg, backend=backend, tiles=SMALL_TILES)  # nothing requires grad
    assert not loss.requires_grad
    rloss, rmetrics, _ = run("ref", batch, cfg)
    torch.testing.assert_close(loss, rloss.float(), rtol=1e-5, atol=1e-7)
    assert {"entropy_mean", "entropy_loss", "kl_loss", "kl_ref_mean", "is_weight_mean"} <= set(metrics)
    _, _, grads = run(backend, batch, cfg)
    assert grads[1] is None or torch.count_nonzero(grads[1]) == 0


def test_auto_backend_is_triton_on_cuda_and_torch_on_cpu():
    batch = make_batch()
    a, _ = policy_loss(**batch, backend="auto", config=PolicyLossConfig(kl_coef=0.1))
    b, _ = policy_loss(**batch, backend="triton" if DEVICE.type == "cuda" else "torch", config=PolicyLossConfig(kl_coef=0.1))
    assert torch.equal(a, b)


@pytest.mark.parametrize("cfg", [
    dict(ratio_level="sequence", is_level="sequence", log_ratio_clamp=0.2, kl_coef=0.1, entropy_coef=0.01),
    dict(loss_agg="seq-mean-token-mean", dual_clip=2.0, is_cap=1.5, kl_coef=0.1),
], ids=["sequence", "token"])
def test_chunk_partials_summed_over_several_partial_steps(cfg):
    """Rows of 37 tokens in 8-token programs (5 chunks), chunk partials read 2 at a time: the
    loops over a row's partials (forward's sequence sums, finalize) take 3 steps, the last one
    half masked, and 9 rows take 3 steps of 4 rows."""
    cfg = PolicyLossConfig(**cfg)
    batch = make_batch(B=9, spread=0.05, lengths=[37, 1, 0, 18, 32, 9, 37, 36, 17])
    tiles = {"block_t": 8, "block_b": 4, "block_c": 2}
    assert_matches(run("triton", batch, cfg, grad_out=1.3, tiles=tiles), run("ref", batch, cfg, grad_out=1.3))


def test_default_block_single_chunk():
    """The default tiles (tiles=None): T=37 fits in one program."""
    cfg = PolicyLossConfig.preset("gspo", kl_coef=0.05)
    batch = make_batch(per_row_adv=True, spread=0.01)
    assert_matches(run("triton", batch, cfg, use=("ref_logp",), tiles=None), run("ref", batch, cfg, use=("ref_logp",)))


@pytest.mark.parametrize(("tiles", "match"), [({"block_x": 8}, "unknown names"), ({"block_t": 12}, "power of two"),
                                              ({"block_c": 0}, "power of two")])
def test_bad_tiles_are_errors(tiles, match):
    with pytest.raises(ValueError, match=match):
        run("triton", make_batch(), PolicyLossConfig(), tiles=tiles)


# ----------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------


def _args(**over):
    b = {k: v.cpu() for k, v in make_batch(B=2, T=3, lengths=[3, 2]).items()}
    b = {k: b[k] for k in ("logp", "old_logp", "advantages", "mask")}
    b.update(over)
    return b


@pytest.mark.parametrize("over,kw,exc,name", [
    (dict(logp=torch.zeros(2, 3, dtype=torch.long)), {}, TypeError, "logp"),
    (dict(logp=torch.zeros(6)), {}, ValueError, "logp"),
    (dict(logp=torch.zeros(0, 3), old_logp=torch.zeros(0, 3), advantages=torch.zeros(0), mask=torch.zeros(0, 3)), {}, ValueError, "logp"),
    (dict(old_logp=torch.zeros(2, 4)), {}, ValueError, "old_logp"),
    (dict(advantages=torch.zeros(3)), {}, ValueError, "advantages"),
    (dict(advantages=torch.zeros(2, 3, dtype=torch.int32)), {}, TypeError, "advantages"),
    (dict(mask=torch.ones(2, 4)), {}, ValueError, "mask"),
    ({}, dict(ref_logp=torch.zeros(3, 3)), ValueError, "ref_logp"),
    ({}, dict(entropy=torch.zeros(2, 3, dtype=torch.int64)), TypeError, "entropy"),
    ({}, dict(rollout_logp=torch.zeros(2)), ValueError, "rollout_logp"),
    ({}, dict(config=PolicyLossConfig(kl_coef=0.1)), ValueError, "ref_logp"),
    ({}, dict(config=PolicyLossConfig(entropy_coef=0.1)), ValueError, "entropy"),
    ({}, dict(global_seq_count=4), ValueError, "global_seq_count"),
    ({}, dict(config=PolicyLossConfig(loss_agg="seq-mean-token-sum"), global_token_count=4), ValueError, "global_token_count"),
    ({}, dict(global_token_count=-1), ValueError, "global_token_count"),
    ({}, dict(global_token_count=math.nan), ValueError, "global_token_count"),
    ({}, dict(global_token_count=torch.ones(2)), ValueError, "global_token_count"),
    ({}, dict(global_token_count=torch.tensor(True)), TypeError, "global_token_count"),
    ({}, dict(config={"clip_low": 0.2}), TypeError, "config"),
    ({}, dict(backend="cuda"), ValueError, "backend"),
    ({}, dict(ref_logp=torch.zeros(2, 3, device="meta")), ValueError, "ref_logp"),
    ({}, dict(global_token_count=torch.tensor(3.0, device="meta")), ValueError, "global_token_count"),
])
def test_bad_input_names_the_argument(over, kw, exc, name):
    with pytest.raises(exc, match=name):
        policy_loss(**_args(**over), **kw)


# ----------------------------------------------------------------------------------------
# property test over shapes, masks and options
# ----------------------------------------------------------------------------------------


@st.composite
def cases(draw):
    B = draw(st.integers(1, 5))
    T = draw(st.integers(1, 40))
    lengths = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
    holes = draw(st.booleans())
    cfg = dict(
        ratio_level=draw(st.sampled_from(["token", "sequence"])),
        clip_low=draw(st.sampled_from([0.1, 0.2])),
        clip_high=draw(st.sampled_from([0.2, 0.28])),
        dual_clip=draw(st.sampled_from([None, 3.0])),
        log_ratio_clamp=draw(st.sampled_from([None, 0.5])),
        kl_coef=draw(st.sampled_from([0.0, 0.05])),
        kl_estimator=draw(st.sampled_from(["k1", "k2", "k3"])),
        kl_clamp=draw(st.sampled_from([None, 0.1])),
        entropy_coef=draw(st.sampled_from([0.0, 0.01])),
        is_cap=draw(st.sampled_from([None, 1.2])),
        is_level=draw(st.sampled_from(["token", "sequence"])),
        loss_agg=draw(st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])),
    )
    if cfg["loss_agg"] == "seq-mean-token-sum-norm":
        cfg["norm_length"] = draw(st.sampled_from([1.0, 50.0]))
    use = tuple(k for k in ("ref_logp", "entropy", "rollout_logp") if draw(st.booleans()))
    if cfg["kl_coef"] and "ref_logp" not in use:
        use += ("ref_logp",)
    if cfg["entropy_coef"] and "entropy" not in use:
        use += ("entropy",)
    return B, T, lengths, holes, cfg, use, draw(st.booleans()), draw(st.integers(0, 2**16))


def _property_check(backend, case):
    B, T, lengths, holes, cfg, use, per_row, seed = case
    batch = make_batch(B=B, T=T, lengths=lengths, per_row_adv=per_row, seed=seed)
    if holes:  # masks that are not a prefix
        batch["mask"] = batch["mask"] * (torch.rand(B, T, generator=torch.Generator().manual_seed(seed)) < 0.7).to(DEVICE)
    cfg = PolicyLossConfig(**cfg)
    assert_matches(run(backend, batch, cfg, use=use), run("ref", batch, cfg, use=use), atol=2e-7)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_property_torch(case):
    _property_check("torch", case)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_property_triton(case):
    _property_check("triton", case)


# ----------------------------------------------------------------------------------------
# presets reproduce the trainers' numbers (eager re-implementations of TRL / verl losses)
# ----------------------------------------------------------------------------------------


def _eager_gspo_sg_token(logp, old_logp, advantages, mask, *, eps_low, eps_high):
    """verl/TRL-style GSPO: s_it = sg[s_i] * pi_t / sg[pi_t], per-row token mean then row mean."""
    n = mask.sum(-1).clamp(min=1)
    seq_lr = ((logp - old_logp) * mask).sum(-1) / n
    log_s = logp - logp.detach() + seq_lr.detach()[:, None]
    s = torch.exp(log_s)
    A = advantages[:, None]
    pg = torch.maximum(-A * s, -A * torch.clamp(s, 1 - eps_low, 1 + eps_high))
    rows = (pg * mask).sum(-1) / n
    return (rows * (mask.sum(-1) > 0)).sum() / (mask.sum(-1) > 0).sum().clamp(min=1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["trl-grpo", "trl-dapo", "verl-grpo", "verl-dapo", "gspo"])
def test_presets_match_trainer_losses(backend, name):
    from fastrl.bench.cases_policy_loss import BASELINES, FASTRL_CONFIGS

    batch = make_batch(B=6, T=40, per_row_adv=True, spread=0.3, lengths=[40, 1, 7, 20, 33, 40])
    x = {k: batch[k] for k in ("logp", "old_logp", "ref_logp", "entropy", "advantages", "mask")}
    lp = x["logp"].clone().requires_grad_()
    x["logp"] = lp
    if name == "gspo":  # the sg-token form has the same value and, for [B] advantages, the same gradient
        cfg = PolicyLossConfig.preset("gspo", clip_low=0.05, clip_high=0.05)
        x["old_logp"] = x["logp"].detach() + 0.02 * torch.randn_like(lp)
        expected = _eager_gspo_sg_token(lp, x["old_logp"], x["advantages"], x["mask"], eps_low=0.05, eps_high=0.05)
    else:
        cfg = FASTRL_CONFIGS[name]
        expected, _ = BASELINES[name](x)
    (g_exp,) = torch.autograd.grad(expected, [lp])
    loss, _ = policy_loss(lp, x["old_logp"], x["advantages"], x["mask"],
                          ref_logp=x["ref_logp"] if cfg.kl_coef else None, config=cfg, backend=backend, tiles=SMALL_TILES)
    (g,) = torch.autograd.grad(loss, [lp])
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g, g_exp, rtol=1e-4, atol=1e-8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", [dict(), dict(is_cap=1.5, dual_clip=3.0),
                                 dict(ratio_level="sequence", is_level="sequence", loss_agg="seq-mean-token-mean")])
def test_decoupled_ppo_matches_reference(backend, cfg):
    # proximal_logp: the ratio against the proximal policy, old_logp the behaviour policy
    batch = make_batch(seed=3)
    batch["proximal_logp"] = batch.pop("rollout_logp")
    config = PolicyLossConfig(**cfg)
    got = run(backend, batch, config, use=("ref_logp", "entropy", "proximal_logp"))
    want = run("ref", batch, config, use=("ref_logp", "entropy", "proximal_logp"))
    assert_matches(got, want)
    assert "is_weight_mean" in got[1]


def decoupled_hand_case():
    """Decoupled PPO on three tokens (clip 0.2, token-mean), by hand (the same case as
    tests/reference/test_policy_loss_reference.py::test_hand_decoupled_ppo): the ratio
    against the proximal policy, times the behaviour weight exp(proximal - behaviour).
    Returns (logp, behaviour, proximal, advantages, loss, grad, weight mean)."""
    e = math.exp
    loss = (-e(0.1) * e(0.5) - 1.2 + 1.6 * e(0.2)) / 3
    return ([[0.1, 0.5, 0.0]], [[-0.5, 0.0, 0.1]], [[0.0, 0.0, 0.3]], [[1.0, 1.0, -2.0]], loss,
            [[-e(0.1) * e(0.5) / 3, 0.0, 0.0]], (e(0.5) + 1.0 + e(0.2)) / 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decoupled_ppo_hand_case(backend):
    lp, behaviour, proximal, adv, want_loss, want_grad, want_w = decoupled_hand_case()
    f32 = lambda x: torch.tensor(x, dtype=torch.float32, device=DEVICE)  # noqa: E731
    logp = f32(lp).requires_grad_()
    loss, m = policy_loss(logp, f32(behaviour), f32(adv), torch.ones(1, 3, device=DEVICE), proximal_logp=f32(proximal),
                          backend=backend)
    assert loss.item() == pytest.approx(want_loss, rel=1e-6)
    assert m["is_weight_mean"].item() == pytest.approx(want_w, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad.double().cpu(), torch.tensor(want_grad, dtype=D64), rtol=1e-6, atol=1e-7)


def test_decoupled_ppo_refuses_rollout_logp_and_bad_shapes():
    b = make_batch(B=2, T=4)
    with pytest.raises(ValueError, match="rollout_logp must be None"):
        policy_loss(b["logp"], b["old_logp"], b["advantages"], b["mask"], proximal_logp=b["old_logp"],
                    rollout_logp=b["rollout_logp"])
    with pytest.raises(ValueError, match="proximal_logp"):
        policy_loss(b["logp"], b["old_logp"], b["advantages"], b["mask"], proximal_logp=b["old_logp"][:, :2])
