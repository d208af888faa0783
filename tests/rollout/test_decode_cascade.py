"""The cascade decode kernels (csrc_triton.decode_attention: prefix split into chunks, each
suffix read once per kv head, one merge) against the reference, at their edge cases, and the
prepared plan's per-call path (no checks, no torch op, two launches)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fastrl.ops.decode_attention as ops
from csrc_triton import decode_attention as kernels
from fastrl.reference.decode_attention import shared_prefix_decode_attention_reference as reference

pytestmark = pytest.mark.usefixtures("one_thread")


def inputs(prefix_lens, suffix_lens, *, G, Hq, Hkv, D, S, dtype=torch.float32, device="cpu", seed=0):
    """Prompts packed with a NaN token between them (a kernel reading past a prompt's end, or
    before its start, returns NaN), NaN in every suffix slot past its row's length."""
    g = torch.Generator().manual_seed(seed)
    n = len(prefix_lens)
    B = n * G
    starts, pos = [], 1
    for p in prefix_lens:
        starts.append(pos)
        pos += p + 1
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    pk, pv = rnd(Hkv, pos, D), rnd(Hkv, pos, D)
    keep = torch.zeros(pos, dtype=torch.bool)
    for a, p in zip(starts, prefix_lens):
        keep[a:a + p] = True
    pk[:, ~keep], pv[:, ~keep] = float("nan"), float("nan")
    sk, sv = rnd(B, Hkv, S, D), rnd(B, Hkv, S, D)
    for b, s in enumerate(suffix_lens):
        sk[b, :, s:], sv[b, :, s:] = float("nan"), float("nan")
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    to = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return dict(q=to(rnd(B, Hq, D)), prefix_k=to(pk), prefix_v=to(pv), prefix_start=i32(starts), prefix_len=i32(prefix_lens),
                suffix_k=to(sk), suffix_v=to(sv), suffix_len=i32(suffix_lens))


def check(inp, G, out, tol):
    ref = reference(**{k: v.double() if v.is_floating_point() else v for k, v in inp.items()}, group_size=G, scale=0.3)
    assert out.dtype == inp["q"].dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out.double().cpu(), ref.cpu(), rtol=tol, atol=tol)


# prefix lengths, suffix lengths (G per group), G, Hq, Hkv, D, S; splits forced to 3
EDGE_CASES = {
    "empty prefix, suffixes 0/1/odd": ([0, 45], [1, 0, 5, 3, 17, 1], 3, 4, 4, 16, 17),  # GQA 1
    "GQA 2, D not a power of two": ([67, 13], [2, 65, 1, 0], 2, 4, 2, 24, 66),
    "GQA 7": ([33], [3, 1], 2, 7, 1, 16, 4),
}


@pytest.mark.parametrize("loop_for", [True, False], ids=["for", "while"])
@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_edge_cases_match_the_reference(case, loop_for, device):
    if loop_for and device.type == "cpu" and not kernels.INTERPRETER_RANGE_OK:
        pytest.skip("this Triton's interpreter runs only the while form")
    P, slen, G, Hq, Hkv, D, S = EDGE_CASES[case]
    inp = inputs(P, slen, G=G, Hq=Hq, Hkv=Hkv, D=D, S=S, device=device)
    plan = kernels.CascadePlan(batch=len(slen), q_heads=Hq, kv_heads=Hkv, head_dim=D, group_size=G, dtype=torch.float32,
                               device=device, splits=3, loop_for=loop_for)
    check(inp, G, plan.run(**inp, scale=0.3), 1e-5)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
def test_dtypes_and_the_default_split(dtype, tol, device):
    # 4 groups of 2, GQA 7 (56 rows of a group fill one tile), lengths across several key blocks
    inp = inputs([70, 1, 0, 129], [5, 0, 1, 33, 2, 7, 64, 65], G=2, Hq=14, Hkv=2, D=32, S=65, dtype=dtype, device=device)
    out = ops.shared_prefix_decode_attention(**inp, group_size=2, scale=0.3, backend="triton")
    check(inp, 2, out, tol)


def test_a_plan_is_reused_across_lengths_and_layers(device):
    # one plan, calls with other tensors of the same layout and other lengths: each matches
    G, Hq, Hkv, D, S = 2, 4, 2, 16, 9
    first = inputs([12, 30], [1, 2, 3, 4], G=G, Hq=Hq, Hkv=Hkv, D=D, S=S, device=device)
    plan = ops.prepare_decode_attention(**first, group_size=G, scale=0.3, backend="triton", max_prefix_len=40)
    for i, (P, slen) in enumerate([([12, 30], [1, 2, 3, 4]), ([40, 1], [9, 0, 5, 8]), ([0, 7], [2, 2, 2, 2])]):
        inp = inputs(P, slen, G=G, Hq=Hq, Hkv=Hkv, D=D, S=S, device=device, seed=i + 1)
        check(inp, G, plan(**inp).clone(), 1e-5)


def test_the_split_fills_the_device_and_never_outnumbers_the_key_blocks():
    # the shape: 16 groups x 4 kv heads = 64 programs a chunk -> 4 chunks = 256 programs on 132 SMs
    assert kernels.prefix_splits(16, 4, 1, 132, 1024, 64) == 4
    assert kernels.prefix_splits(16, 2, 1, 132, 2048, 64) == 8
    assert kernels.prefix_splits(16, 4, 1, 132, 100, 64) == 2  # a 100-token prompt has 2 key blocks
    assert kernels.prefix_splits(1, 1, 1, 132, None, 64) == kernels.MAX_PREFIX_SPLITS
    assert kernels.prefix_splits(512, 8, 1, 132, 4096, 64) == 1


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_prepared_call_runs_no_check_and_no_torch_op(monkeypatch):
    # meta tensors at the shape; the launches are recorded, not run
    meta = lambda *s, dtype=torch.bfloat16: torch.empty(*s, dtype=dtype, device="meta")  # noqa: E731
    B, G, Hq, Hkv, D, P, S = 128, 8, 28, 4, 128, 1024, 256
    args = (meta(B, Hq, D), meta(Hkv, 16 * P, D), meta(Hkv, 16 * P, D), meta(16, dtype=torch.int32), meta(16, dtype=torch.int32),
            meta(B, Hkv, S, D), meta(B, Hkv, S, D), meta(B, dtype=torch.int32))
    launches = []
    kernel_type = type(kernels._prefix_attn_kernel)
    monkeypatch.setattr(kernel_type, "run", lambda self, *a, grid, **kw: launches.append((self, tuple(grid))))
    plan = ops.prepare_decode_attention(*args, group_size=G, scale=D**-0.5, backend="triton", max_prefix_len=P)
    monkeypatch.setattr(ops, "_check", lambda *a, **k: pytest.fail("checked per call"))
    with _Ops() as seen:
        out = plan(*args)
        out = plan(*args)
    assert seen.ops == []  # no allocation, no copy, no host sync: only the launches
    assert [k for k, _ in launches] == [kernels._prefix_attn_kernel, kernels._suffix_merge_kernel] * 2
    assert launches[0][1] == (16, Hkv, 4) and launches[1][1] == (B, Hkv)
    assert out.shape == (B, Hq, D) and out.dtype == torch.bfloat16
