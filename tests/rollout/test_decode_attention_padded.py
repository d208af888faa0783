"""padded_prefix_attention (the sampler's decode/extend attention on CPU) against plain full
attention over [prompt ; the sample's visible suffix], written as loops."""

import pytest
import torch

from fastrl.ops.decode_attention import PrefixRows, padded_prefix_attention


def _case(prefix_of, prompt_lens, starts, T, *, Hq=4, Hkv=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    U, P, B = len(prompt_lens), max(prompt_lens), len(prefix_of)
    S = max(starts) + T
    pk = torch.randn(Hkv, U, P, D, generator=g)
    pv = torch.randn(Hkv, U, P, D, generator=g)
    pbias = torch.zeros(U, P)
    for u, n in enumerate(prompt_lens):
        pk[:, u, n:] = pv[:, u, n:] = 1e4  # padding: must be masked
        pbias[u, n:] = float("-inf")
    sk = torch.randn(B, Hkv, S, D, generator=g)
    sv = torch.randn(B, Hkv, S, D, generator=g)
    sbias = torch.full((B, T, S), float("-inf"))
    for b in range(B):
        for t in range(T):
            sbias[b, t, : starts[b] + t + 1] = 0.0
            sk[b, :, starts[b] + T :] = sv[b, :, starts[b] + T :] = 0.0  # unused slots (zeroed by the sampler)
    q = torch.randn(B, Hq, T, D, generator=g)
    return q, pk, pv, pbias, sk, sv, sbias


def _literal(q, pk, pv, prefix_of, prompt_lens, sk, sv, starts, scale):
    B, Hq, T, D = q.shape
    R = Hq // pk.shape[0]
    out = torch.zeros(B, T, Hq, D, dtype=torch.float64)
    for b in range(B):
        u, n = prefix_of[b], prompt_lens[prefix_of[b]]
        for t in range(T):
            s = starts[b] + t + 1
            for h in range(Hq):
                k = torch.cat([pk[h // R, u, :n], sk[b, h // R, :s]]).double()
                v = torch.cat([pv[h // R, u, :n], sv[b, h // R, :s]]).double()
                w = torch.softmax(k @ q[b, h, t].double() * scale, dim=0)
                out[b, t, h] = w @ v
    return out


@pytest.mark.parametrize("prefix_of, prompt_lens, starts, T", [
    ([0, 0, 1, 1], [5, 9], [0, 0, 0, 0], 1),  # a first decode step: one group per prompt
    ([0, 0, 1, 1], [5, 9], [3, 3, 3, 3], 1),  # decode: equal suffixes
    ([0, 1, 1, 0, 1], [7, 2], [4, 0, 6, 2, 1], 3),  # trajectories of unequal lengths and groups (dropouts), T new tokens
    ([1, 1, 1], [3, 6], [2, 5, 0], 4),  # a prompt no sample reads any more
])
def test_matches_full_attention(prefix_of, prompt_lens, starts, T):
    q, pk, pv, pbias, sk, sv, sbias = _case(prefix_of, prompt_lens, starts, T)
    rows = PrefixRows.build(prefix_of, len(prompt_lens), q.device)
    out = padded_prefix_attention(q, pk, pv, pbias, rows, sk, sv, sbias, scale=0.3)
    assert out.shape == (len(prefix_of), T, 4, 8) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _literal(q, pk, pv, prefix_of, prompt_lens, sk, sv, starts, 0.3), rtol=1e-5, atol=1e-5)


def test_identity_layout_and_no_suffix_bias():
    prefix_of, lens, starts = [0, 0, 0, 1, 1, 1], [4, 4], [2] * 6
    q, pk, pv, pbias, sk, sv, _ = _case(prefix_of, lens, starts, 1)
    rows = PrefixRows.build(prefix_of, 2, q.device)
    assert rows.identity and rows.per_prefix == 3
    out = padded_prefix_attention(q, pk, pv, pbias, rows, sk, sv, None, scale=0.5)  # all S = 3 slots visible
    torch.testing.assert_close(out.double(), _literal(q, pk, pv, prefix_of, lens, sk, sv, starts, 0.5), rtol=1e-5, atol=1e-5)
    # no prompt is padded: no prompt mask (the sampler passes None), the same result
    torch.testing.assert_close(padded_prefix_attention(q, pk, pv, None, rows, sk, sv, None, scale=0.5), out, rtol=0, atol=0)
    assert not PrefixRows.build([0, 1, 0, 1], 2, q.device).identity
