"""fastrl.ops.tree_attention: the trie layout, torch twins and the Triton kernel vs the oracle."""

import random

import pytest
import torch

from fastrl.ops.shared_prefix_attention import SharedPrefixLayout, shared_prefix_attention
from fastrl.ops.tree_attention import PackedTree, TreeLayout, tree_attention, trie_size
from fastrl.reference.tree_attention import tree_attention_reference, tree_mask_reference, tree_positions_reference

# (segment lengths, parents) in pre-order
TREES = {
    "single_node": ([5], [-1]),
    "single_token": ([1], [-1]),
    "deep_chain": ([3, 1, 4, 2, 5, 1, 2, 3], [-1, 0, 1, 2, 3, 4, 5, 6]),
    "wide_fan_out": ([4] + [1, 3, 2, 1, 5, 1, 2, 1, 4], [-1] + [0] * 9),
    "empty_segments": ([3, 0, 2, 4, 0, 1, 2], [-1, 0, 1, 1, 0, 4, -1]),
    "forest_mixed": ([2, 3, 1, 2, 1, 4, 3, 2], [-1, 0, 1, 1, 0, -1, 5, -1]),
}


def _random_tree(rng: random.Random, segments: int) -> tuple[list[int], list[int]]:
    lens, parents, path = [], [], []
    for s in range(segments):
        # attach below some node of the current root-to-last path; now and then a new root
        keep = 0 if not path or rng.random() < 0.1 else max(1, len(path) - rng.choice([0, 0, 1, 2, 3]))
        path = path[:keep]
        parents.append(path[-1] if path else -1)
        lens.append(rng.choice([0, 1, 2, 3, 5, 8]) if s else rng.randint(1, 6))
        path.append(s)
    return lens, parents


def _qkv(N, Hq, Hkv, D, dtype, device="cpu", scale=1.0):
    mk = lambda H: (torch.randn(N, H, D, device=device, dtype=torch.float64) * scale).to(dtype).requires_grad_()
    return mk(Hq), mk(Hkv), mk(Hkv)


def _check_against_oracle(lens, parents, backend, dtype, *, Hq=4, Hkv=2, D=8, atol, device="cpu"):
    layout = TreeLayout.from_parents(lens, parents, device=device)
    q, k, v = _qkv(layout.num_tokens, Hq, Hkv, D, dtype, device)
    go = torch.randn(layout.num_tokens, Hq, D, device=device, dtype=dtype)
    scale = D ** -0.5
    out = tree_attention(q, k, v, layout, scale=scale, backend=backend)
    got = torch.autograd.grad(out, (q, k, v), go)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = tree_attention_reference(q64, k64, v64, lens=lens, parents=parents, scale=scale)
    want = torch.autograd.grad(ref, (q64, k64, v64), go.double())
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), w, atol=atol, rtol=0, msg=lambda m: f"d{name}: {m}")


def test_layout_metadata_by_hand():
    # root [0, 2); child A [2, 4) with child A1 [4, 5); child B [5, 8); a second root [8, 9)
    lay = TreeLayout.from_parents([2, 2, 1, 3, 1], [-1, 0, 1, 0, -1])
    assert lay.num_tokens == 9 and lay.num_segments == 5
    assert lay.seg_cu_seqlens.tolist() == [0, 2, 4, 5, 8, 9]
    assert lay.position_ids.tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 0]
    assert lay.key_end.tolist() == [8, 8, 5, 5, 5, 8, 8, 8, 9]
    assert lay.host_subtree_end == (8, 5, 5, 8, 9) and lay.host_depth == (0, 2, 4, 2, 0)
    assert lay.ancestors(2) == [0, 1] and lay.ancestors(4) == []
    assert lay.key_end.dtype == torch.int32 and lay.seg_cu_seqlens.dtype == torch.int32


@pytest.mark.parametrize("key", list(TREES) + ["random"])
def test_mask_and_positions_equal_reference(key):
    trees = [TREES[key]] if key != "random" else [_random_tree(random.Random(s), 12) for s in range(20)]
    for lens, parents in trees:
        if sum(lens) == 0:
            continue
        lay = TreeLayout.from_parents(lens, parents)
        mask = tree_mask_reference(lens, parents)
        assert torch.equal(lay.dense_mask(), mask)
        assert lay.position_ids.tolist() == tree_positions_reference(lens, parents)
        # key_end is one past the last query that sees each key
        last = [int(torch.nonzero(mask[:, j])[-1]) + 1 for j in range(lay.num_tokens)]
        assert lay.key_end.tolist() == last


@pytest.mark.parametrize("block_m, block_n", [(4, 4), (16, 16), (8, 4), (3, 5)])
def test_block_lists_are_exactly_the_blocks_with_an_attended_key(block_m, block_n):
    for s in range(10):
        lens, parents = _random_tree(random.Random(100 + s), 14)
        lay = TreeLayout.from_parents(lens, parents)
        ptr, blocks = lay.block_lists(block_m, block_n)
        mask = lay.dense_mask()
        N = lay.num_tokens
        for t, m0 in enumerate(range(0, N, block_m)):
            seen = mask[m0:m0 + block_m].any(0)
            want = sorted({j // block_n for j in torch.nonzero(seen).flatten().tolist()})
            assert blocks[ptr[t]:ptr[t + 1]].tolist() == want


def test_dkdv_items_by_hand():
    # key_end [8, 8, 5, 5, 5, 8, 8, 8, 9]; key tiles of 2: the queries seeing tile t are
    # [2t, max key_end): 8, 3, 4, 2 and 1 of them, cut into chunks of 4
    lay = TreeLayout.from_parents([2, 2, 1, 3, 1], [-1, 0, 1, 0, -1])
    items = lay.dkdv_items(2, 4)
    assert items.dtype == torch.int32
    assert items.tolist() == [[0, 0], [0, 1], [1, 0], [2, 0], [3, 0], [4, 0]]
    assert lay.dkdv_items(2, 4) is items  # cached per shape
    assert lay.dkdv_items(4, 16).tolist() == [[0, 0], [1, 0], [2, 0]]


def test_dkdv_items_need_their_chunk():
    from csrc_triton.tree_attention import tiles_for, tree_attention_bwd

    lay = TreeLayout.from_parents([5], [-1])
    t = tiles_for(lay.device)
    q = torch.zeros(5, 2, 8)
    items = lay.dkdv_items(t["dkdv"]["BLOCK_N"], t["q_chunk"])
    for chunk in (None, 0, t["dkdv"]["BLOCK_M"] + 1):  # the kernel steps BLOCK_M queries at a time
        with pytest.raises(ValueError, match="q_chunk"):
            tree_attention_bwd(q, q, q, q, q, q[:, :, 0], lay.key_end, *lay.block_lists(16, 16), 1.0,
                               dkdv_items=items, q_chunk=chunk)


@pytest.mark.parametrize("block_n, q_chunk", [(4, 4), (16, 32), (8, 8), (5, 10)])
def test_dkdv_items_cover_each_key_tiles_queries_once(block_n, q_chunk):
    for s in range(10):
        lens, parents = _random_tree(random.Random(200 + s), 14)
        lay = TreeLayout.from_parents(lens, parents)
        mask = lay.dense_mask()
        N = lay.num_tokens
        chunks: dict[int, list[int]] = {}
        for t, c in lay.dkdv_items(block_n, q_chunk).tolist():
            chunks.setdefault(t, []).append(c)
        for t, k0 in enumerate(range(0, N, block_n)):
            rows = torch.nonzero(mask[:, k0:k0 + block_n].any(1)).flatten()
            q_hi = int(rows.max()) + 1  # a key sees itself: rows is never empty
            assert int(rows.min()) == k0
            assert chunks[t] == list(range(-(-(q_hi - k0) // q_chunk)))


def test_shared_prefix_layout_is_the_depth_two_tree():
    sp = SharedPrefixLayout.from_lengths([5, 0, 3], [[3, 1, 7], [6], [2, 2]])
    tree = TreeLayout.from_shared_prefix(sp)
    assert torch.equal(tree.dense_mask(), sp.dense_mask())
    assert torch.equal(tree.position_ids, sp.position_ids)
    assert torch.equal(tree.key_end, sp.k_query_end)
    q, k, v = (t.detach() for t in _qkv(sp.num_tokens, 4, 2, 8, torch.float64))
    torch.testing.assert_close(tree_attention(q, k, v, tree, scale=0.3, backend="segments"),
                               shared_prefix_attention(q, k, v, sp, scale=0.3, backend="segments"), atol=1e-13, rtol=0)


def test_layout_rejects_bad_trees():
    with pytest.raises(ValueError, match="pre-order"):
        TreeLayout.from_parents([2, 1, 1, 1], [-1, 0, -1, 1])  # segment 3's parent 1 is off the path (root 2)
    with pytest.raises(ValueError, match="pre-order"):
        TreeLayout.from_parents([2, 1], [1, -1])  # a parent after its child
    with pytest.raises(ValueError, match="one parent per segment"):
        TreeLayout.from_parents([2, 1], [-1])
    with pytest.raises(ValueError, match="at least one token"):
        TreeLayout.from_parents([0, 0], [-1, 0])
    with pytest.raises(ValueError, match=">= 0"):
        TreeLayout.from_parents([2, -1], [-1, 0])
    with pytest.raises(ValueError, match=">= -1"):
        TreeLayout.from_parents([2, 1], [-1, -2])


@pytest.mark.parametrize("backend", ["sdpa", "segments"])
@pytest.mark.parametrize("key", list(TREES))
def test_torch_backends_match_oracle_float64(backend, key):
    _check_against_oracle(*TREES[key], backend, torch.float64, atol=1e-12)


@pytest.mark.parametrize("backend", ["sdpa", "segments"])
def test_torch_backends_random_trees_fp32(backend):
    for s in range(4):
        lens, parents = _random_tree(random.Random(s), 10)
        _check_against_oracle(lens, parents, backend, torch.float32, Hq=6, Hkv=2, D=16, atol=2e-5)


def test_flex_forward_matches_oracle_cpu():
    pytest.importorskip("torch.nn.attention.flex_attention", reason="this torch build has no FlexAttention (torch < 2.5)")
    lens, parents = TREES["forest_mixed"]
    lay = TreeLayout.from_parents(lens, parents)
    q, k, v = (t.detach() for t in _qkv(lay.num_tokens, 4, 2, 16, torch.float32))
    with torch.no_grad():
        out = tree_attention(q, k, v, lay, scale=0.25, backend="flex")
    ref = tree_attention_reference(q.double(), k.double(), v.double(), lens=lens, parents=parents, scale=0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


# Triton: under the interpreter on CPU (small shapes: 16-token tiles), for real on a GPU
@pytest.mark.parametrize("key", ["single_node", "single_token", "deep_chain", "wide_fan_out", "empty_segments"])
def test_triton_matches_oracle_float64(key, device):
    _check_against_oracle(*TREES[key], "triton", torch.float64, atol=1e-12, device=device)


@pytest.mark.parametrize(
    "dtype, Hq, Hkv, D, atol",
    [(torch.float32, 4, 2, 8, 2e-6), (torch.bfloat16, 2, 2, 16, 4e-2), (torch.float16, 3, 1, 8, 5e-3)],
)
def test_triton_dtypes_and_gqa(dtype, Hq, Hkv, D, atol, device):
    _check_against_oracle(*TREES["forest_mixed"], "triton", dtype, Hq=Hq, Hkv=Hkv, D=D, atol=atol, device=device)


def test_triton_random_tree_spans_tiles(device):
    # ~50 tokens over many 16-token tiles: tiles straddle siblings, parents and roots
    lens, parents = _random_tree(random.Random(7), 16)
    _check_against_oracle(lens, parents, "triton", torch.float32, Hq=2, Hkv=1, D=16, atol=5e-6, device=device)


@pytest.mark.parametrize("Hq, Hkv", [(6, 2), (2, 2)])
def test_triton_dkdv_split_over_programs(Hq, Hkv, device):
    # a 40-token root under 4 children: the root's key tiles see ~90 queries, more than
    # the interpreter's q_chunk (32), so their dK/dV is summed over several programs (and
    # over the R query heads at Hq/Hkv = 3); Hq == Hkv with splits still adds atomically
    from csrc_triton.tree_attention import tiles_for

    lens, parents = [40, 9, 17, 1, 23], [-1, 0, 0, 0, 0]
    lay = TreeLayout.from_parents(lens, parents, device=device)
    t = tiles_for(lay.device)
    tiles = -(-lay.num_tokens // t["dkdv"]["BLOCK_N"])
    assert lay.dkdv_items(t["dkdv"]["BLOCK_N"], t["q_chunk"]).shape[0] > tiles
    _check_against_oracle(lens, parents, "triton", torch.float64, Hq=Hq, Hkv=Hkv, atol=1e-12, device=device)


def test_triton_dkdv_plain_stores_when_one_program_per_tile(device):
    # Hq == Hkv and every key tile's queries within one chunk: no atomics, exact bitwise repeats
    lens, parents = TREES["empty_segments"]
    lay = TreeLayout.from_parents(lens, parents, device=device)
    q, k, v = _qkv(lay.num_tokens, 2, 2, 8, torch.float32, device)
    go = torch.randn(lay.num_tokens, 2, 8, device=device)
    runs = [torch.autograd.grad(tree_attention(q, k, v, lay, scale=0.3, backend="triton"), (q, k, v), go) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    _check_against_oracle(lens, parents, "triton", torch.float64, Hq=2, Hkv=2, atol=1e-12, device=device)


def test_triton_never_reads_outside_the_views(device):
    # q/k/v/grad_out as views into buffers whose other rows (past N) and lanes (past D,
    # which the kernels' power-of-two head tiles cover) hold NaN: nothing may leak in
    lens, parents = TREES["forest_mixed"]
    lay = TreeLayout.from_parents(lens, parents, device=device)
    N, D = lay.num_tokens, 12
    def view(H, pad_rows=5, pad_d=4):
        buf = torch.full((N + pad_rows, H, D + pad_d), float("nan"), dtype=torch.float64, device=device)
        buf[:N, :, :D] = torch.randn(N, H, D, dtype=torch.float64, device=device)
        return buf[:N, :, :D]
    q, k, v, go = view(4), view(2), view(2), view(4)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = tree_attention(q, k, v, lay, scale=0.3, backend="triton")
    got = torch.autograd.grad(out, (q, k, v), go)
    q64, k64, v64 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = tree_attention_reference(q64, k64, v64, lens=lens, parents=parents, scale=0.3)
    want = torch.autograd.grad(ref, (q64, k64, v64), go.clone())
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=0)


def test_kernel_loops_are_for_loops_on_the_gpu():
    # Triton software-pipelines `for` loops (also over bounds loaded from memory), not `while`
    # loops (the audit found every KV loop of the previous kernels to be an unpipelined while):
    # each kernel has one `for`, under `if FOR_LOOPS:`, and a `while` only in its else branch
    # (the interpreters that cannot range() over loaded bounds)
    import ast
    import inspect

    import csrc_triton.tree_attention as mod

    tree = ast.parse(inspect.getsource(mod))
    kernels = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name.endswith("_kernel")}
    assert set(kernels) == {"_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel"}
    for name, f in kernels.items():
        fors = [n for n in ast.walk(f) if isinstance(n, ast.For)]
        whiles = [n for n in ast.walk(f) if isinstance(n, ast.While)]
        gates = [n for n in ast.walk(f) if isinstance(n, ast.If) and ast.unparse(n.test) == "FOR_LOOPS"]
        assert len(fors) == len(whiles) == len(gates) == 1, name
        assert fors[0] in gates[0].body and whiles[0] in gates[0].orelse, name
    helpers = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and not f.name.endswith("_kernel")]
    assert not any(isinstance(n, (ast.For, ast.While)) for f in helpers for n in ast.walk(f))


@pytest.mark.parametrize("Hq, Hkv", [(4, 2), (2, 2)])
def test_while_loop_form_computes_the_same(Hq, Hkv, device):
    # FOR_LOOPS=False (an older interpreter's form) runs the same steps: bitwise the same results
    from csrc_triton.tree_attention import tiles_for, tree_attention_bwd, tree_attention_fwd

    lay = TreeLayout.from_parents([20, 9, 17, 1, 3], [-1, 0, 0, 2, 0], device=device)
    t = tiles_for(lay.device)
    q, k, v = (x.detach() for x in _qkv(lay.num_tokens, Hq, Hkv, 8, torch.float64, device))
    go = torch.randn_like(q)
    ptr, blocks = lay.block_lists(t["fwd"]["BLOCK_M"], t["fwd"]["BLOCK_N"])
    dptr, dblocks = lay.block_lists(t["dq"]["BLOCK_M"], t["dq"]["BLOCK_N"])
    items = lay.dkdv_items(t["dkdv"]["BLOCK_N"], t["q_chunk"])
    runs = []
    for form in (True, False):
        out, lse = tree_attention_fwd(q, k, v, lay.key_end, ptr, blocks, 0.3, for_loops=form)
        grads = tree_attention_bwd(go, q, k, v, out, lse, lay.key_end, dptr, dblocks, 0.3, dkdv_items=items,
                                   q_chunk=t["q_chunk"], for_loops=form)
        runs.append((out, lse, *grads))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["segments", "triton"])
def test_extreme_scores_stay_finite(backend, device):
    dev = device if backend == "triton" else torch.device("cpu")
    lens, parents = TREES["deep_chain"]
    lay = TreeLayout.from_parents(lens, parents, device=dev)
    q, k, v = _qkv(lay.num_tokens, 2, 1, 16, torch.float32, dev, scale=8.0)
    out = tree_attention(q, k, v, lay, scale=0.25, backend=backend)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = tree_attention_reference(q64, k64, v64, lens=lens, parents=parents, scale=0.25)
    want = torch.autograd.grad(ref.square().sum(), (q64, k64, v64))
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(out.double(), ref, atol=1e-3, rtol=1e-4)
    for g, w in zip(grads, want):
        assert (g.double() - w).abs().max() <= 1e-3 * w.abs().max()


def test_validation():
    lay = TreeLayout.from_parents([3], [-1])
    q, k, v = (t.detach() for t in _qkv(3, 4, 2, 8, torch.float32))
    with pytest.raises(ValueError, match="layout describes"):
        tree_attention(q[:2], k[:2], v[:2], lay, scale=1.0)
    with pytest.raises(ValueError, match="multiple"):
        tree_attention(q[:, :3], k, v, lay, scale=1.0)
    with pytest.raises(TypeError, match="dtype"):
        tree_attention(q, k.double(), v.double(), lay, scale=1.0)
    with pytest.raises(ValueError, match="scale"):
        tree_attention(q, k, v, lay, scale=0.0)
    with pytest.raises(TypeError, match="TreeLayout"):
        tree_attention(q, k, v, SharedPrefixLayout.packed([3]), scale=1.0)
    with pytest.raises(ValueError, match="backend"):
        tree_attention(q, k, v, lay, scale=1.0, backend="nope")


# ---------------------------------------------------------------------------------------
# PackedTree: the trie of token sequences

STEPWISE = [
    [1, 2, 3, 10, 11],  # turn 0
    [1, 2, 3, 10, 11, 20, 21, 12, 13],  # turns 0..1 (a prefix-preserving template)
    [1, 2, 3, 10, 30, 20, 21, 12, 13, 22, 14],  # turns 0..2 with turn 0 re-rendered (not prefix-preserving)
    [1, 2, 3, 10, 11],  # a duplicate
    [5, 6],  # another prompt: a second root
]


def test_trie_by_hand():
    tree = PackedTree.from_sequences(STEPWISE, score_start=[3, 3, 3, 3, 1])
    lay = tree.layout
    # sorted: [1,2,3,10,11] x2, [1,2,3,10,11,20,...], [1,2,3,10,30,...], [5,6]
    assert tree.input_ids[0].tolist() == [1, 2, 3, 10, 11, 20, 21, 12, 13, 30, 20, 21, 12, 13, 22, 14, 5, 6]
    # a segment ends where the trie branches (after token 10), not where a sequence ends
    assert lay.lens == (4, 5, 7, 2) and lay.parents == (-1, 0, 0, -1)
    assert trie_size(STEPWISE) == lay.num_tokens == 18
    # every sequence reads back from its path, positions 0..len-1
    for b, seq in enumerate(STEPWISE):
        rows = torch.nonzero(tree.sample_index == b).flatten()
        t = tree.seq_pos[rows]
        assert t.tolist() == list(range(tree.score_start[b], len(seq)))
        u = tree.unique_of[rows]
        assert tree.target_ids[u].tolist() == seq[tree.score_start[b]:]
        assert tree.position_ids[0, tree.target_index[u]].tolist() == t.tolist()
        assert tree.position_ids[0, tree.predictor_index[u]].tolist() == (t - 1).tolist()
        assert tree.input_ids[0, tree.predictor_index[u]].tolist() == seq[tree.score_start[b] - 1:-1]
    # the duplicate and the shared turn-0 tokens are scored once
    M = tree.sample_index.shape[0]
    assert M == 2 + 6 + 8 + 2 + 1 and tree.target_index.shape[0] == M - 2 - 2 - 1
    assert tree.scored_lens == (2, 6, 8, 2, 1)


def test_trie_of_random_sequences_reproduces_each_sequence():
    rng = random.Random(3)
    base = [rng.randrange(7) for _ in range(12)]
    seqs = [base[: rng.randint(1, 12)] + [rng.randrange(3) for _ in range(rng.randint(0, 4))] for _ in range(15)]
    tree = PackedTree.from_sequences(seqs, score_start=[1] * len(seqs))
    mask = tree.layout.dense_mask()
    assert tree.layout.num_tokens == trie_size(seqs) < sum(map(len, seqs))
    for b, seq in enumerate(seqs):
        rows = torch.nonzero(tree.sample_index == b).flatten()
        path = [int(tree.predictor_index[tree.unique_of[rows[0]]])] + tree.target_index[tree.unique_of[rows]].tolist()
        assert tree.input_ids[0, path].tolist() == seq
        # the last token of the path attends exactly to the path
        assert torch.nonzero(mask[path[-1]]).flatten().tolist() == path


def test_packed_tree_batch_layout_round_trip():
    tree = PackedTree.from_sequences(STEPWISE, score_start=[3, 3, 3, 3, 1])
    vals = torch.arange(tree.sample_index.shape[0], dtype=torch.float64)
    grid = tree.to_batch_layout(vals, shift=1)
    assert grid.shape == (5, 10)
    assert grid[2, 2:10].tolist() == vals[tree.sample_index == 2].tolist()
    assert torch.equal(tree.from_batch_layout(grid, shift=1), vals)


def test_packed_tree_rejects_bad_input():
    with pytest.raises(ValueError, match="non-empty"):
        PackedTree.from_sequences([], score_start=[])
    with pytest.raises(ValueError, match="is empty"):
        PackedTree.from_sequences([[1], []], score_start=[1, 1])
    with pytest.raises(ValueError, match="one per sequence"):
        PackedTree.from_sequences([[1, 2]], score_start=[1, 1])
    with pytest.raises(ValueError, match=">= 1"):
        PackedTree.from_sequences([[1, 2]], score_start=[0])
