"""Shared-prefix decode attention: Triton kernel (interpreter on CPU) and the PyTorch
twin against plain full attention over [prefix ; suffix]."""

import math

import pytest
import torch

from fastrl.ops.decode_attention import shared_prefix_decode_attention
from fastrl.reference.decode_attention import shared_prefix_decode_attention_reference as reference


pytestmark = pytest.mark.usefixtures("one_thread")


def make_inputs(*, prefix_lens, group_size, Hq, Hkv, D, S, suffix_lens=None, dtype=torch.float32, device="cpu", alias=None):
    """Packed prefixes (optionally non-contiguous, like a transposed projection) and suffixes."""
    n_groups = len(prefix_lens)
    B = n_groups * group_size
    starts, total = [], 0
    for n in prefix_lens:
        starts.append(total)
        total += n
    if alias is not None:  # group alias[0] reuses group alias[1]'s stored prompt
        starts[alias[0]] = starts[alias[1]]
    # [N, Hkv, D] storage viewed as [Hkv, N, D]: strided like the model's key projection
    prefix_k = torch.randn(total, Hkv, D, device=device).to(dtype).transpose(0, 1)
    prefix_v = torch.randn(total, Hkv, D, device=device).to(dtype).transpose(0, 1)
    suffix_k = torch.randn(B, Hkv, S, D, device=device).to(dtype)
    suffix_v = torch.randn(B, Hkv, S, D, device=device).to(dtype)
    if suffix_lens is None:
        suffix_lens = [S] * B
    for b, n in enumerate(suffix_lens):  # slots past a sample's length hold garbage; they must never be read
        suffix_k[b, :, n:] = float("nan")
        suffix_v[b, :, n:] = float("nan")
    q = torch.randn(B, Hq, D, device=device).to(dtype)
    as_t = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return dict(
        q=q, prefix_k=prefix_k, prefix_v=prefix_v,
        prefix_start=as_t(starts), prefix_len=as_t(list(prefix_lens)),
        suffix_k=suffix_k, suffix_v=suffix_v, suffix_len=as_t(suffix_lens),
    )


def literal(inp, group_size, scale):
    """The formula with Python loops over samples, heads and keys."""
    q = inp["q"].double()
    B, Hq, D = q.shape
    Hkv = inp["prefix_k"].shape[0]
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        g = b // group_size
        a, n, s = int(inp["prefix_start"][g]), int(inp["prefix_len"][g]), int(inp["suffix_len"][b])
        for h in range(Hq):
            kvh = h // (Hq // Hkv)
            keys = [inp["prefix_k"][kvh, a + i].double() for i in range(n)] + [inp["suffix_k"][b, kvh, j].double() for j in range(s)]
            vals = [inp["prefix_v"][kvh, a + i].double() for i in range(n)] + [inp["suffix_v"][b, kvh, j].double() for j in range(s)]
            logits = [float(q[b, h] @ k) * scale for k in keys]
            m = max(logits)
            w = [math.exp(x - m) for x in logits]
            z = sum(w)
            out[b, h] = sum(wi / z * v for wi, v in zip(w, vals))
    return out


def test_reference_matches_literal_loop():
    inp = make_inputs(prefix_lens=[3, 5], group_size=2, Hq=4, Hkv=2, D=4, S=3, suffix_lens=[1, 3, 2, 3])
    ref = reference(**inp, group_size=2, scale=0.5)
    torch.testing.assert_close(ref.double(), literal(inp, 2, 0.5), rtol=1e-5, atol=1e-6)


def test_reference_hand_computed():
    # one sample, one head, D=1: keys 0 (prefix) and 1 (suffix), q=1, scale=1
    q = torch.tensor([[[1.0]]])
    pk = torch.tensor([[[0.0]]])
    pv = torch.tensor([[[2.0]]])
    sk = torch.tensor([[[[1.0]]]])
    sv = torch.tensor([[[[4.0]]]])
    one = torch.tensor([1])
    out = reference(q, pk, pv, torch.tensor([0]), one, sk, sv, one, group_size=1, scale=1.0)
    w0, w1 = 1 / (1 + math.e), math.e / (1 + math.e)
    assert out.item() == pytest.approx(2 * w0 + 4 * w1, rel=1e-6)


CASES = [
    # prefix lengths (different per group), group size, Hq, Hkv, D, S, suffix lengths
    dict(prefix_lens=[7, 1, 70], group_size=3, Hq=4, Hkv=2, D=16, S=5, suffix_lens=[1, 2, 3, 4, 5, 5, 1, 1, 3]),  # GQA 2:1
    dict(prefix_lens=[33, 9], group_size=2, Hq=4, Hkv=4, D=16, S=3),  # MHA
    dict(prefix_lens=[5, 130], group_size=4, Hq=8, Hkv=1, D=8, S=2, suffix_lens=[2, 1, 2, 1, 0, 2, 2, 1]),  # MQA, D < 16, empty suffix
    dict(prefix_lens=[20], group_size=8, Hq=2, Hkv=1, D=32, S=70),  # long suffix (several blocks), 1 group
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_full_attention(backend, case, device):
    c = CASES[case]
    inp = make_inputs(**c, device=device)
    scale = c["D"] ** -0.5
    out = shared_prefix_decode_attention(**inp, group_size=c["group_size"], scale=scale, backend=backend)
    ref = reference(**inp, group_size=c["group_size"], scale=scale)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_groups_sharing_one_stored_prompt(backend, device):
    inp = make_inputs(prefix_lens=[6, 6, 11], group_size=2, Hq=4, Hkv=2, D=16, S=2, alias=(1, 0), device=device)
    out = shared_prefix_decode_attention(**inp, group_size=2, scale=0.25, backend=backend)
    torch.testing.assert_close(out, reference(**inp, group_size=2, scale=0.25), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(backend, dtype, device):
    # fp32 accumulation, output rounded to the input dtype: within one rounding of it
    inp = make_inputs(prefix_lens=[9, 40], group_size=2, Hq=4, Hkv=2, D=16, S=4, dtype=dtype, device=device)
    out = shared_prefix_decode_attention(**inp, group_size=2, scale=0.25, backend=backend)
    assert out.dtype == dtype
    ref = reference(**{k: (v.float() if v.is_floating_point() else v) for k, v in inp.items()}, group_size=2, scale=0.25)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)


def test_triton_and_torch_agree_on_rows_beyond_one_tile(device):
    # G * R = 96 query rows per kv head: two tiles of the prefix kernel
    inp = make_inputs(prefix_lens=[17, 3], group_size=24, Hq=4, Hkv=1, D=16, S=2, device=device)
    a = shared_prefix_decode_attention(**inp, group_size=24, scale=0.25, backend="triton")
    b = shared_prefix_decode_attention(**inp, group_size=24, scale=0.25, backend="torch")
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a, reference(**inp, group_size=24, scale=0.25), rtol=1e-5, atol=1e-5)


def test_bad_inputs():
    inp = make_inputs(prefix_lens=[3, 4], group_size=2, Hq=4, Hkv=2, D=8, S=2)
    with pytest.raises(ValueError, match="group_size"):
        shared_prefix_decode_attention(**inp, group_size=3, scale=1.0)
    with pytest.raises(ValueError, match="kv heads"):
        shared_prefix_decode_attention(**{**inp, "q": torch.randn(4, 3, 8)}, group_size=2, scale=1.0)
    with pytest.raises(ValueError, match="prefix_start"):
        shared_prefix_decode_attention(**{**inp, "prefix_start": torch.zeros(3, dtype=torch.int32)}, group_size=2, scale=1.0)
    with pytest.raises(ValueError, match="suffix_k"):
        shared_prefix_decode_attention(**{**inp, "suffix_k": torch.randn(4, 1, 2, 8)}, group_size=2, scale=1.0)
    with pytest.raises(TypeError, match="suffix_len"):
        shared_prefix_decode_attention(**{**inp, "suffix_len": torch.ones(4)}, group_size=2, scale=1.0)
    with pytest.raises(ValueError, match="scale"):
        shared_prefix_decode_attention(**inp, group_size=2, scale=0.0)
    with pytest.raises(ValueError, match="backend"):
        shared_prefix_decode_attention(**inp, group_size=2, scale=1.0, backend="cuda")
