"""Triton kernels for advantages over the turns of agent trajectories.

The group statistics come from ``csrc_triton.advantages.segment_stats`` (turns sorted by
group, one program per group) and the turn returns from ``csrc_triton.scans`` (the reverse
discounted scan over the ``[B, K]`` turn rewards); the two kernels here are the elementwise
passes around them:

- ``_turn_combine_kernel``: per turn (b, k), ``c_ep * A^E[b] + c_rel * rel`` where
  ``rel = ((G - mean_g) - mean_lo_g) / (std_g + eps)`` (or without the std), 0 for a group
  of one member and for absent turns.
- ``_expand_kernel``: per token tile of a row, the turn advantage of each policy token's
  turn (a gather by ``turn_index``), 0 off the loss mask and for indices outside the row's
  turns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# K only addresses the episode advantages: exempt from the JIT's integer specialisation.
@triton.jit(do_not_specialize=["K"])
def _turn_combine_kernel(
    g_ptr, valid_ptr, rank_ptr, mean_ptr, mean_lo_ptr, std_ptr, count_ptr, ae_ptr, out_ptr,
    N, K, c_ep, c_rel, eps,
    USE_STD: tl.constexpr, F64: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    inb = i < N
    ok = inb & (tl.load(valid_ptr + i, mask=inb, other=0) != 0)
    x = tl.load(g_ptr + i, mask=ok, other=0.0)
    if F64:
        x = x.to(tl.float64)
    else:
        x = x.to(tl.float32)
    g = tl.load(rank_ptr + i, mask=ok, other=0)
    mean = tl.load(mean_ptr + g, mask=ok, other=0.0)
    mean_lo = tl.load(mean_lo_ptr + g, mask=ok, other=0.0)
    n = tl.load(count_ptr + g, mask=ok, other=0.0)
    d = (x - mean) - mean_lo
    if USE_STD:
        d = d / (tl.load(std_ptr + g, mask=ok, other=0.0) + eps)
    rel = tl.where(n > 1.0, d, 0.0).to(tl.float32)
    ae = tl.load(ae_ptr + i // K, mask=ok, other=0.0).to(tl.float32)
    a = tl.where(ok, c_ep * ae + c_rel * rel, 0.0)
    tl.store(out_ptr + i, a, mask=inb)


# K only addresses the turn table: exempt from the JIT's integer specialisation (== 1, % 16).
@triton.jit(do_not_specialize=["K"])
def _expand_kernel(
    a_ptr, idx_ptr, mask_ptr, n_ptr, out_ptr,
    T, K,
    USE_TURN: tl.constexpr, BLOCK_T: tl.constexpr,
):
    b = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    inb = t < T
    on = inb & (tl.load(mask_ptr + b * T + t, mask=inb, other=0) != 0)
    if USE_TURN:
        k = tl.load(idx_ptr + b * T + t, mask=on, other=0).to(tl.int64)
        n = tl.load(n_ptr + b)
        on = on & (k >= 0) & (k < n)
        a = tl.load(a_ptr + b * K + k, mask=on, other=0.0)
    else:
        a = tl.load(a_ptr + b * K + t * 0, mask=on, other=0.0)
    tl.store(out_ptr + b * T + t, tl.where(on, a, 0.0), mask=inb)


def turn_combine(
    G: torch.Tensor,
    valid: torch.Tensor,
    rank: torch.Tensor,
    mean: torch.Tensor,
    mean_lo: torch.Tensor,
    std: torch.Tensor,
    count: torch.Tensor,
    episode_adv: torch.Tensor,
    *,
    c_ep: float,
    c_rel: float,
    use_std: bool,
    eps: float,
    block: int = 1024,
) -> torch.Tensor:
    """[B, K] float32 turn advantages from the turn returns ``G`` [B, K], the present-turn flags
    ``valid`` (flat uint8), each turn's group ``rank`` (flat int64, original order), the
    per-group statistics of ``segment_stats`` and the episode advantages [B]."""
    B, K = G.shape
    N = B * K
    out = torch.empty(B, K, dtype=torch.float32, device=G.device)
    _turn_combine_kernel[(triton.cdiv(N, block),)](
        G.contiguous(), valid, rank, mean, mean_lo, std, count, episode_adv.contiguous(), out,
        N, K, c_ep, c_rel, eps, USE_STD=use_std, F64=mean.dtype == torch.float64, BLOCK=block,
    )
    return out


def expand_turn_advantages(
    turn_adv: torch.Tensor,
    turn_index: torch.Tensor,
    mask: torch.Tensor,
    num_turns: torch.Tensor,
    *,
    use_turn: bool,
    block_t: int = 256,
) -> torch.Tensor:
    """[B, T] float32: ``turn_adv[b, turn_index[b, t]]`` on policy tokens of present turns
    (``use_turn``), or ``turn_adv[b, 0]`` on every policy token (broadcast); 0 elsewhere.
    Contiguous inputs; ``mask`` as ``fastrl.ops._segments.kernel_mask`` gives it."""
    B, K = turn_adv.shape
    T = mask.shape[1]
    out = torch.empty(B, T, dtype=torch.float32, device=turn_adv.device)
    _expand_kernel[(B, triton.cdiv(T, block_t))](
        turn_adv, turn_index, mask, num_turns.contiguous(), out, T, K, USE_TURN=use_turn, BLOCK_T=block_t,
    )
    return out
