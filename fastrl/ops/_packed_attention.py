"""What the packed-attention ops share: their input rules, backend choice and mask-agnostic runners.

``shared_prefix_attention`` and ``tree_attention`` attend over one packed row of ``[N, heads, D]``
tokens under a layout (``SharedPrefixLayout``, ``TreeLayout``: each has ``num_tokens``,
``device`` and a cached ``dense_mask()``). Their backends differ only in the mask they build;
the rest lives here, so each op imports this module and neither imports the other's helpers.
(The shared-prefix op does import the tree op, whose Triton kernels it runs: its layout is the
depth-2 tree.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastrl._checks import check_choice, check_float, resolve_backend

# Up to this many tokens the CPU default is the dense-mask SDPA (one call: wins with many
# short segments, e.g. N=288 in 64 segments: 49 vs 94 ms fwd+bwd); above it the
# per-segment SDPA (no N^2 mask: N=576 in 4 groups of 16: 99 vs 217 ms; N=3072, one
# group of 8: 2.1 vs 5.4 s). Single thread, best of 3, Hq=8, Hkv=2, D=64, fp32, on a
# shared (loaded) 2-core machine (measured on the shared-prefix layout).
DENSE_MAX_TOKENS = 512

# ``auto`` on CUDA. The backend a measurement picked per shape belongs here; none has measured
# the FlashAttention-2-shaped Triton kernels yet (benchmarks/gpu/bench_train_attention.py
# times them beside FlexAttention and SDPA over the repeated prompt). Until it has, ``auto``
# runs FlexAttention, the fastest measured: the 1.5B GRPO step at 32K tokens per group took
# 1.25 s with it against 1.46 s with the previous (unpipelined) Triton kernels on an H200
# (benchmarks/results/gpu_h200_20261204/). fp64 has no FlexAttention path worth the name: Triton.
CUDA_AUTO_BACKEND = "flex"


def cuda_auto_backend(q: torch.Tensor) -> str:
    """What ``backend="auto"`` runs for CUDA inputs like ``q`` (see ``CUDA_AUTO_BACKEND``)."""
    if q.dtype == torch.float64:
        return "triton"
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:  # torch < 2.5
        return "triton"
    return CUDA_AUTO_BACKEND


def resolve_packed_backend(backend: str, choices: tuple[str, ...], q: torch.Tensor, num_tokens: int) -> str:
    """The implementation ``backend`` (one of ``choices``) names for ``q`` over ``num_tokens``
    packed tokens: ``auto`` is ``cuda_auto_backend`` on CUDA and ``torch`` elsewhere; ``torch``
    is ``sdpa`` up to ``DENSE_MAX_TOKENS`` tokens and ``segments`` above."""
    check_choice("backend", backend, choices)
    if backend == "auto" and q.device.type == "cuda":
        return cuda_auto_backend(q)
    if backend in ("auto", "triton"):
        backend = resolve_backend(backend, q.device)
    if backend == "torch":
        return "sdpa" if num_tokens <= DENSE_MAX_TOKENS else "segments"
    return backend


def check_packed_attention_inputs(q, k, v, layout, scale, *, layout_type: type) -> None:
    """The input rules of a packed attention op (``[N, H, D]`` q/k/v over a layout of
    ``layout_type`` with ``num_tokens`` and ``device``): shared by the shared-prefix and the
    prefix-tree ops."""
    check_float("q", q, ndim=3)
    N, Hq, D = q.shape
    check_float("k", k, ndim=3)
    if k.shape[0] != N or k.shape[2] != D:
        raise ValueError(f"k must have shape ({N}, Hkv, {D}) like q, got {tuple(k.shape)}")
    check_float("v", v, shape=tuple(k.shape))
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"q has {Hq} heads, which is not a multiple of k's {Hkv} kv heads")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not isinstance(layout, layout_type):
        raise TypeError(f"layout must be a {layout_type.__name__}, got {type(layout).__name__}")
    if layout.num_tokens != N:
        raise ValueError(f"layout describes {layout.num_tokens} tokens, q has {N}")
    if layout.device != q.device or k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v and the layout must share one device, got {q.device}, {k.device}, {v.device}, {layout.device}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive number, got {scale!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head) dimension")


def sdpa_dense(q, k, v, layout, scale: float) -> torch.Tensor:
    """One ``scaled_dot_product_attention`` call over packed ``[N, heads, D]`` tensors with the
    layout's dense ``[N, N]`` boolean mask."""
    gqa = q.shape[1] != k.shape[1]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=layout.dense_mask(), scale=scale, enable_gqa=gqa,
    )
    return out[0].transpose(0, 1)


def sdpa_after_context(q, k, v, context: int, scale: float, masks: dict) -> torch.Tensor:
    """SDPA of one piece: ``n`` queries ``[Hq, n, D]`` over ``context + n`` keys
    ``[Hkv, context + n, D]`` (the piece's own keys last): every query sees all ``context``
    leading keys and its own piece causally. ``masks`` caches the ``[n, context + n]`` masks
    by shape over one call's pieces."""
    gqa = q.shape[0] != k.shape[0]
    if context == 0:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=gqa)[0]
    n = q.shape[1]
    mask = masks.get((n, context))
    if mask is None:
        t = torch.arange(n, device=q.device)
        mask = torch.cat([torch.ones(n, context, dtype=torch.bool, device=q.device), t[None, :] <= t[:, None]], dim=1)
        masks[(n, context)] = mask
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=gqa)[0]


_FLEX_COMPILED = None


def run_flex(q, k, v, block_mask, scale: float) -> torch.Tensor:
    """FlexAttention of packed ``[N, heads, D]`` tensors under ``block_mask`` (any packed
    layout's: the shared-prefix and the prefix-tree ops build their own)."""
    from torch.nn.attention.flex_attention import flex_attention

    global _FLEX_COMPILED
    if q.device.type == "cuda":
        if _FLEX_COMPILED is None:  # one compiled function for all layouts (dynamic shapes: no recompile per N)
            _FLEX_COMPILED = torch.compile(flex_attention)
        fn = _FLEX_COMPILED
    else:  # eager on CPU (forward only in torch 2.13; compiling costs ~30 s)
        fn = flex_attention
    gqa = q.shape[1] != k.shape[1]
    out = fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=block_mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)
