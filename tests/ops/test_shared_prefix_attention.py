"""fastrl.ops.shared_prefix_attention: layout, torch twins and the Triton kernel vs the oracle."""

import pytest
import torch

from fastrl.ops.shared_prefix_attention import PackedGroups, SharedPrefixLayout, shared_prefix_attention
from fastrl.reference.shared_prefix_attention import shared_prefix_attention_reference, shared_prefix_mask_reference
from fastrl.rollout.base import pack_batch

# (prefix lengths, segment lengths per document): groups of different prompt and
# completion lengths in one row, G = 1, completions of length 1, prefix 0 (plain packing),
# a prefix-only document
LAYOUTS = {
    "mixed": ([5, 0, 19], [[3, 1, 7], [6], [2, 17]]),
    "single_group_G1": ([9], [[1]]),
    "plain_packing": ([0, 0, 0], [[4], [1], [11]]),
    "prefix_only_doc": ([7, 3], [[], [2, 2]]),
}


def _qkv(N, Hq, Hkv, D, dtype, device="cpu", scale=1.0):
    mk = lambda H: (torch.randn(N, H, D, device=device, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    return mk(Hq), mk(Hkv), mk(Hkv)


def _check_against_oracle(pl, sl, backend, dtype, *, Hq=4, Hkv=2, D=8, atol, device="cpu"):
    layout = SharedPrefixLayout.from_lengths(pl, sl, device=device)
    q, k, v = _qkv(layout.num_tokens, Hq, Hkv, D, dtype, device)
    go = torch.randn(layout.num_tokens, Hq, D, device=device, dtype=dtype)
    scale = D ** -0.5
    out = shared_prefix_attention(q, k, v, layout, scale=scale, backend=backend)
    got = torch.autograd.grad(out, (q, k, v), go)
    # the oracle in float64 from the same (rounded) inputs
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = shared_prefix_attention_reference(q64, k64, v64, prefix_lens=pl, segment_lens=sl, scale=scale)
    want = torch.autograd.grad(ref, (q64, k64, v64), go.double())
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), w, atol=atol, rtol=0, msg=lambda m: f"d{name}: {m}")


def test_layout_metadata_by_hand():
    # doc 0: prefix [0, 2), segments [2, 4) [4, 5); doc 1: no prefix, segment [5, 8)
    lay = SharedPrefixLayout.from_lengths([2, 0], [[2, 1], [3]])
    assert lay.num_tokens == 8 and lay.num_docs == 2 and lay.num_segments == 3
    assert lay.doc_cu_seqlens.tolist() == [0, 5, 8]
    assert lay.seg_cu_seqlens.tolist() == [2, 4, 5, 8]
    assert lay.seg_doc.tolist() == [0, 0, 1]
    assert lay.position_ids.tolist() == [0, 1, 2, 3, 2, 0, 1, 2]
    assert lay.q_doc_start.tolist() == [0, 0, 0, 0, 0, 5, 5, 5]
    assert lay.q_prefix_end.tolist() == [2, 2, 2, 2, 2, 5, 5, 5]
    assert lay.q_seg_start.tolist() == [0, 0, 2, 2, 4, 5, 5, 5]
    assert lay.k_query_end.tolist() == [5, 5, 4, 4, 5, 8, 8, 8]
    for t in (lay.doc_cu_seqlens, lay.seg_cu_seqlens, lay.q_doc_start, lay.q_prefix_end, lay.q_seg_start, lay.k_query_end):
        assert t.dtype == torch.int32


@pytest.mark.parametrize("key", list(LAYOUTS))
def test_dense_mask_equals_reference_mask(key):
    pl, sl = LAYOUTS[key]
    lay = SharedPrefixLayout.from_lengths(pl, sl)
    assert torch.equal(lay.dense_mask(), shared_prefix_mask_reference(pl, sl))
    # k_query_end is one past the last query that sees each key
    mask = lay.dense_mask()
    last = torch.tensor([int(torch.nonzero(mask[:, j])[-1]) + 1 for j in range(lay.num_tokens)], dtype=torch.int32)
    assert torch.equal(lay.k_query_end, last)


def test_packed_layout_is_block_causal():
    lay = SharedPrefixLayout.packed([3, 1, 2])
    blocks = torch.block_diag(*(torch.ones(n, n) for n in (3, 1, 2))).bool()
    assert torch.equal(lay.dense_mask(), blocks & torch.ones(6, 6).tril().bool())
    assert lay.position_ids.tolist() == [0, 1, 2, 0, 0, 1]


def test_layout_rejects_bad_lengths():
    with pytest.raises(ValueError, match="prefix_lens"):
        SharedPrefixLayout.from_lengths([-1], [[2]])
    with pytest.raises(ValueError, match="segment_lens\\[0\\]"):
        SharedPrefixLayout.from_lengths([2], [[0]])
    with pytest.raises(ValueError, match="one per prefix"):
        SharedPrefixLayout.from_lengths([2, 3], [[1]])
    with pytest.raises(ValueError, match="empty"):
        SharedPrefixLayout.from_lengths([0], [[]])
    with pytest.raises(ValueError, match="at least one document"):
        SharedPrefixLayout.from_lengths([], [])


def test_packed_groups_maps_match_rollout_batch_layout():
    prompts = [[11, 12, 13], [21], [31, 32, 33, 34, 35]]
    comps = [[[1, 2], [3], [4, 5, 6]], [[7, 8, 9, 10]], [[], [41, 42]]]
    pg = PackedGroups.from_groups(list(zip(prompts, comps)))
    assert pg.input_ids.tolist() == [[11, 12, 13, 1, 2, 3, 4, 5, 6, 21, 7, 8, 9, 10, 31, 32, 33, 34, 35, 41, 42]]
    assert pg.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 3, 4, 5, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]]
    assert pg.layout.segment_lens == ((2, 1, 3), (4,), (2,))  # the empty completion has no segment
    assert pg.num_samples == 6 and pg.completion_lens == (2, 1, 3, 4, 0, 2)
    # the first token of every completion is predicted by its prompt's last token
    assert pg.predictor_index.tolist() == [2, 3, 2, 2, 6, 7, 9, 10, 11, 12, 18, 19]
    assert torch.equal(pg.input_ids[0, pg.target_index], pg.target_ids)

    # scattered to the [B, T] layout the trainer gets from RolloutBatch, the targets land on
    # the completion tokens of input_ids, i.e. exactly where response_mask is 1
    flat_prompts = [p for p, c in zip(prompts, comps) for _ in c]
    flat_comps = [x for c in comps for x in c]
    B = len(flat_comps)
    ids, attn, resp, _, _ = pack_batch(flat_prompts, flat_comps, [torch.zeros(len(c)) for c in flat_comps], 1, -1)
    got = pg.to_batch_layout(pg.target_ids, fill=-1)
    assert got.shape == ids.shape
    assert torch.equal(got, torch.where(resp.bool(), ids, torch.full_like(ids, -1)))
    assert torch.equal(pg.from_batch_layout(ids), pg.target_ids)
    # completion layout [B, L_max]: TRL's logits_to_keep columns
    cl = pg.to_completion_layout(pg.target_ids, fill=-1)
    assert cl.shape == (B, 4)
    assert cl[2].tolist() == [4, 5, 6, -1] and cl[4].tolist() == [-1] * 4
    assert torch.equal(pg.from_completion_layout(cl), pg.target_ids)


def test_packed_groups_from_samples_is_from_groups():
    prompts = [[1, 2], [3, 4, 5]]
    comps = [[6], [7, 8], [9, 10, 11], []]
    a = PackedGroups.from_samples(prompts, comps, group_size=2)
    b = PackedGroups.from_groups([(prompts[0], comps[:2]), (prompts[1], comps[2:])])
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.predictor_index, b.predictor_index)
    assert a.completion_lens == (1, 2, 3, 0)
    with pytest.raises(ValueError, match="samples"):
        PackedGroups.from_samples(prompts, comps[:3], group_size=2)


def test_packed_groups_rejects_empty_prompt():
    with pytest.raises(ValueError, match="empty prompt"):
        PackedGroups.from_groups([([], [[1, 2]])])
    with pytest.raises(ValueError, match="no completion"):
        PackedGroups.from_groups([([1], [])])


@pytest.mark.parametrize("backend", ["sdpa", "segments"])
@pytest.mark.parametrize("key", list(LAYOUTS))
def test_torch_backends_match_oracle_float64(backend, key):
    _check_against_oracle(*LAYOUTS[key], backend, torch.float64, atol=1e-12)


@pytest.mark.parametrize("backend", ["sdpa", "segments"])
def test_torch_backends_moderate_shape_fp32(backend):
    pl, sl = [40, 3, 0], [[25, 1, 30, 8], [50], [60, 2]]
    _check_against_oracle(pl, sl, backend, torch.float32, Hq=6, Hkv=2, D=32, atol=2e-5)


def test_torch_auto_picks_by_size():
    # (fastrl.ops.shared_prefix_attention is also the op's name in fastrl.ops: import from the module path)
    from fastrl.ops.shared_prefix_attention import DENSE_MAX_TOKENS, _resolve

    small = SharedPrefixLayout.packed([4])
    big = SharedPrefixLayout.packed([DENSE_MAX_TOKENS + 1])
    q = torch.zeros(4, 1, 8)
    assert _resolve("auto", q, small) == "sdpa"
    assert _resolve("torch", q, big) == "segments"


def test_flex_forward_matches_oracle_cpu():
    pytest.importorskip("torch.nn.attention.flex_attention", reason="this torch build has no FlexAttention (torch < 2.5)")
    pl, sl = LAYOUTS["mixed"]
    lay = SharedPrefixLayout.from_lengths(pl, sl)
    q, k, v = (t.detach() for t in _qkv(lay.num_tokens, 4, 2, 16, torch.float32))
    with torch.no_grad():
        out = shared_prefix_attention(q, k, v, lay, scale=0.25, backend="flex")
    ref = shared_prefix_attention_reference(q.double(), k.double(), v.double(), prefix_lens=pl, segment_lens=sl, scale=0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


# Triton: under the interpreter on CPU (slow: small shapes), for real on a GPU
@pytest.mark.parametrize("key", ["mixed", "prefix_only_doc"])
def test_triton_matches_oracle_float64(key, device):
    _check_against_oracle(*LAYOUTS[key], "triton", torch.float64, atol=1e-12, device=device)


@pytest.mark.parametrize(
    "dtype, Hq, Hkv, D, atol",
    [(torch.float32, 4, 2, 8, 2e-6), (torch.bfloat16, 2, 2, 16, 4e-2), (torch.float16, 3, 1, 8, 5e-3)],
)
def test_triton_dtypes_and_gqa(dtype, Hq, Hkv, D, atol, device):
    _check_against_oracle(*LAYOUTS["single_group_G1" if dtype == torch.float16 else "plain_packing"], "triton", dtype, Hq=Hq, Hkv=Hkv, D=D, atol=atol, device=device)


def test_triton_head_dim_64_spans_tiles(device):
    # 40 tokens: several 16-token tiles in the interpreter; tiles straddle documents and segments
    _check_against_oracle([13, 0], [[1, 9, 6], [11]], "triton", torch.float32, Hq=2, Hkv=1, D=64, atol=5e-6, device=device)


def _random_layout(rng):
    pl = [rng.choice([0, 1, 3, 16, 17, 40]) for _ in range(rng.randint(1, 4))]
    return pl, [[rng.choice([1, 2, 5, 15, 16, 33]) for _ in range(rng.randint(0 if p else 1, 4))] for p in pl]


@pytest.mark.parametrize("block_m, block_n", [(16, 16), (16, 32), (32, 16), (128, 64)])
def test_device_built_depth2_lists_equal_the_tree_lists(block_m, block_n):
    # the launchers' sync-free key_end and block lists (from the per-token bounds; also what a
    # shared-prefix layout's tree uses) are the host-built ones of the same tree (exactly the
    # blocks holding an attended key)
    import random

    from csrc_triton.shared_prefix_attention import depth2_block_lists, depth2_key_end
    from fastrl.ops.tree_attention import TreeLayout

    rng = random.Random(5)
    for _ in range(40):
        lay = SharedPrefixLayout.from_lengths(*_random_layout(rng))
        bounds = (lay.q_doc_start, lay.q_prefix_end, lay.q_seg_start)
        assert torch.equal(depth2_key_end(*bounds), lay.k_query_end)
        ptr, blocks = depth2_block_lists(*bounds, block_m, block_n)
        depth2 = TreeLayout.from_shared_prefix(lay)  # its block_lists come from depth2_block_lists
        host = TreeLayout.from_parents(depth2.lens, depth2.parents)  # the host-built lists of the same tree
        tptr, tblocks = host.block_lists(block_m, block_n)
        assert torch.equal(ptr, tptr) and torch.equal(blocks[: int(ptr[-1])], tblocks)
        dptr, dblocks = depth2.block_lists(block_m, block_n)
        assert torch.equal(dptr, tptr) and torch.equal(dblocks[: int(dptr[-1])], tblocks)


def test_csrc_launchers_match_oracle_float64(device):
    # the kernel-level entry points (per-token bounds, no host layout: one dK/dV program per key tile)
    from csrc_triton.shared_prefix_attention import shared_prefix_attention_bwd, shared_prefix_attention_fwd

    pl, sl = LAYOUTS["mixed"]
    lay = SharedPrefixLayout.from_lengths(pl, sl, device=device)
    q, k, v = (t.detach() for t in _qkv(lay.num_tokens, 4, 2, 8, torch.float64, device))
    go = torch.randn_like(q)
    bounds = (lay.q_doc_start, lay.q_prefix_end, lay.q_seg_start)
    out, lse = shared_prefix_attention_fwd(q, k, v, *bounds, 0.3)
    grads = shared_prefix_attention_bwd(go, q, k, v, out, lse, *bounds, lay.k_query_end, 0.3)
    q64, k64, v64 = (t.clone().requires_grad_() for t in (q, k, v))
    ref = shared_prefix_attention_reference(q64, k64, v64, prefix_lens=pl, segment_lens=sl, scale=0.3)
    want = torch.autograd.grad(ref, (q64, k64, v64), go)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=0)


def test_triton_long_prompt_gqa_six(device):
    # a 48-token prompt under 3 completions: the prompt's key tiles split their dK/dV over
    # programs; Hq/Hkv = 6 as in Qwen2.5-1.5B; bf16 in, fp32 accumulation
    _check_against_oracle([48], [[7, 20, 1]], "triton", torch.bfloat16, Hq=6, Hkv=1, D=16, atol=4e-2, device=device)


def test_auto_on_cuda_runs_flex_until_the_kernels_are_measured():
    from fastrl.ops.shared_prefix_attention import CUDA_AUTO_BACKEND, cuda_auto_backend

    assert CUDA_AUTO_BACKEND == "flex"
    assert cuda_auto_backend(torch.zeros(1, dtype=torch.bfloat16)) == "flex"
    assert cuda_auto_backend(torch.zeros(1, dtype=torch.float64)) == "triton"


def test_validation():
    lay = SharedPrefixLayout.packed([3])
    q, k, v = (t.detach() for t in _qkv(3, 4, 2, 8, torch.float32))
    with pytest.raises(ValueError, match="layout describes"):
        shared_prefix_attention(q[:2], k[:2], v[:2], lay, scale=1.0)
    with pytest.raises(ValueError, match="multiple"):
        shared_prefix_attention(q[:, :3], k, v, lay, scale=1.0)
    with pytest.raises(TypeError, match="dtype"):
        shared_prefix_attention(q, k.double(), v.double(), lay, scale=1.0)
    with pytest.raises(ValueError, match="scale"):
        shared_prefix_attention(q, k, v, lay, scale=0.0)
    with pytest.raises(ValueError, match="backend"):
        shared_prefix_attention(q, k, v, lay, scale=1.0, backend="nope")
    with pytest.raises(TypeError, match="layout"):
        shared_prefix_attention(q, k, v, [3], scale=1.0)


def _flash_varlen_emulation(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False):
    """flash-attn's documented varlen semantics in torch (flash-attn cannot be installed
    here): per sequence, GQA, and with causal=True a mask aligned to the bottom right
    (query t of a sequence with nq queries and nk keys sees keys <= t + nk - nq)."""
    outs = []
    rep = q.shape[1] // k.shape[1]
    for (qa, qb), (ka, kb) in zip(zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist()), zip(cu_seqlens_k[:-1].tolist(), cu_seqlens_k[1:].tolist())):
        qs = q[qa:qb].float().transpose(0, 1)
        ks = k[ka:kb].float().transpose(0, 1).repeat_interleave(rep, 0)
        vs = v[ka:kb].float().transpose(0, 1).repeat_interleave(rep, 0)
        s = qs @ ks.transpose(1, 2) * softmax_scale
        nq, nk = qb - qa, kb - ka
        assert nq <= max_seqlen_q and nk <= max_seqlen_k
        if causal:
            t = torch.arange(nq)[:, None]
            s = s.masked_fill(torch.arange(nk)[None, :] > t + nk - nq, float("-inf"))
        outs.append((torch.softmax(s, -1) @ vs).transpose(0, 1))
    return torch.cat(outs).to(q.dtype)


@pytest.mark.parametrize("key", ["mixed", "plain_packing", "prefix_only_doc"])
def test_flash_attn_metadata_against_an_emulation(key, monkeypatch):
    import sys
    import types

    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = _flash_varlen_emulation
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    _check_against_oracle(*LAYOUTS[key], "flash_attn", torch.bfloat16, atol=4e-2)


@pytest.mark.parametrize("backend", ["segments", "triton"])
def test_extreme_scores_stay_finite_and_exact(backend, device):
    # scores of several hundred: a softmax that is not max-shifted would overflow in fp32
    dev = device if backend == "triton" else torch.device("cpu")
    pl, sl = LAYOUTS["mixed"]
    lay = SharedPrefixLayout.from_lengths(pl, sl, device=dev)
    q, k, v = _qkv(lay.num_tokens, 2, 1, 16, torch.float32, dev, scale=8.0)
    out = shared_prefix_attention(q, k, v, lay, scale=0.25, backend=backend)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = shared_prefix_attention_reference(q64, k64, v64, prefix_lens=pl, segment_lens=sl, scale=0.25)
    want = torch.autograd.grad(ref.square().sum(), (q64, k64, v64))
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(out.double(), ref, atol=1e-3, rtol=1e-4)
    for g, w in zip(grads, want):
        assert (g.double() - w).abs().max() <= 1e-3 * w.abs().max()
