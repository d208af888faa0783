"""Decode attention's precision paths (csrc_triton.decode_attention): 16-bit inputs take the
tensor-core dots, anything else (fp32, fp64, a 16-bit query over an fp32 cache) exact fp32."""

import pytest
import torch

from fastrl.ops.decode_attention import shared_prefix_decode_attention
from fastrl.reference.decode_attention import shared_prefix_decode_attention_reference as reference


def _inputs(device, q_dtype, kv_dtype, *, G=2, Hq=4, Hkv=2, D=16, P=(11, 30), S=3):
    g = torch.Generator().manual_seed(0)
    n = len(P)
    B = n * G
    mk = lambda *s, dt: torch.randn(*s, generator=g).to(device, dt)  # noqa: E731
    i32 = dict(dtype=torch.int32, device=device)
    starts = torch.tensor([0, P[0]], **i32)
    return dict(q=mk(B, Hq, D, dt=q_dtype), prefix_k=mk(Hkv, sum(P), D, dt=kv_dtype),
                prefix_v=mk(Hkv, sum(P), D, dt=kv_dtype), prefix_start=starts, prefix_len=torch.tensor(P, **i32),
                suffix_k=mk(B, Hkv, S, D, dt=kv_dtype), suffix_v=mk(B, Hkv, S, D, dt=kv_dtype),
                suffix_len=torch.tensor([3, 1, 2, 3], **i32))


@pytest.mark.parametrize("q_dtype, kv_dtype, tol", [
    (torch.float64, torch.float64, 1e-5),  # computed in fp32, returned in fp64
    (torch.bfloat16, torch.float32, 1e-2),  # mixed: exact fp32 dots, output rounded to bf16
    (torch.float16, torch.float16, 1e-2),  # tensor-core path (the interpreter runs fp16 dots as such)
])
def test_precision_paths_match_the_reference(q_dtype, kv_dtype, tol, device):
    inp = _inputs(device, q_dtype, kv_dtype)
    out = shared_prefix_decode_attention(**inp, group_size=2, scale=0.25, backend="triton")
    assert out.dtype == q_dtype
    ref = reference(**{k: (v.double() if v.is_floating_point() else v) for k, v in inp.items()}, group_size=2, scale=0.25)
    torch.testing.assert_close(out.double().cpu(), ref.cpu(), rtol=tol, atol=tol)
