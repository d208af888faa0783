"""Triton kernels for group-relative advantages (outcome and process rewards).

Groups arrive as contiguous segments of an ``order`` array (element indices sorted by
group; ``fastrl.ops.advantages`` builds it with a sort, a boundary mark and a cumsum,
without a host sync). Kernels:

- ``_segment_stats_kernel``: one program per segment (group): mean, unbiased std,
  count and "has two distinct values", two passes over the segment (mean first, then
  squared deviations) for a stable variance; fp32 sums are shifted by a pivot (the mean of
  the first block), fp64 rewards are accumulated in fp64. Programs past the last group see an empty
  segment and only write zeros.
- ``_group_adv_kernel``: the elementwise pass producing each sample's advantage.
- ``_step_adv_kernel``: process-reward advantages: per token tile of a row, the sum of
  the normalised rewards of the steps ending at or after each token (a reverse
  cumulative sum done as a [BLOCK_T, BLOCK_S] comparison, no sequential scan).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Mode codes shared with fastrl.ops.advantages.
MODE_CODES = {
    "grpo": 0,
    "dr_grpo": 1,
    "batch_std": 2,
    "group_mean_batch_std_floor": 3,
    "rloo": 4,
    "reinforce_pp": 1,  # centred like dr_grpo; the batch whitening follows in the op
}


@triton.jit
def _load_members(vals_ptr, order_ptr, valid_ptr, start, j, length, HAS_VALID: tl.constexpr, F64: tl.constexpr):
    """Values (fp32, or fp64 when F64) of the group members at positions ``j`` of its sorted
    run, and which are real."""
    inb = j < length
    idx = tl.load(order_ptr + start + j, mask=inb, other=0)
    ok = inb
    if HAS_VALID:
        ok = ok & (tl.load(valid_ptr + idx, mask=inb, other=0) != 0)
    x = tl.load(vals_ptr + idx, mask=ok, other=0.0)
    if F64:
        x = x.to(tl.float64)
    else:
        x = x.to(tl.float32)
    return x, ok


@triton.jit
def _segment_stats_kernel(
    vals_ptr,
    order_ptr,
    valid_ptr,
    seg_start_ptr,
    seg_len_ptr,
    mean_ptr,
    mean_lo_ptr,
    std_ptr,
    count_ptr,
    distinct_ptr,
    HAS_VALID: tl.constexpr,
    F64: tl.constexpr,
    BLOCK: tl.constexpr,
):
    g = tl.program_id(0)
    start = tl.load(seg_start_ptr + g)
    length = tl.load(seg_len_ptr + g)
    offs = tl.arange(0, BLOCK)
    ACC = tl.float64 if F64 else tl.float32
    # Sums are shifted by a pivot (one member's value): with a large common offset (a
    # million rewards near 100) an unshifted fp32 sum loses the mean. The mean is kept as
    # mean + mean_lo (a rounded head and its residual), so r - mean_g stays exact to fp32
    # rounding of the small difference, not of the offset.
    x0, ok0 = _load_members(vals_ptr, order_ptr, valid_ptr, start, offs, length, HAS_VALID, F64)
    pivot = tl.max(tl.where(ok0, x0, float("-inf")), axis=0)
    pivot = tl.where(tl.sum(ok0.to(tl.float32), axis=0) > 0, pivot, 0.0)
    acc_sum = tl.zeros([BLOCK], dtype=ACC)
    acc_cnt = tl.zeros([BLOCK], dtype=tl.float32)
    acc_max = tl.full([BLOCK], float("-inf"), dtype=ACC)
    acc_min = tl.full([BLOCK], float("inf"), dtype=ACC)
    # while loops (not range) over the data-dependent length: the interpreter cannot
    # take a loaded scalar as a range bound.
    off = start * 0  # a tensor (not a constexpr) so it can be loop-carried
    while off < length:
        x, ok = _load_members(vals_ptr, order_ptr, valid_ptr, start, off + offs, length, HAS_VALID, F64)
        off += BLOCK
        acc_sum += tl.where(ok, x - pivot, 0.0)
        acc_cnt += tl.where(ok, 1.0, 0.0)
        acc_max = tl.maximum(acc_max, tl.where(ok, x, float("-inf")))
        acc_min = tl.minimum(acc_min, tl.where(ok, x, float("inf")))
    cnt = tl.sum(acc_cnt, axis=0)
    shift = tl.sum(acc_sum, axis=0) / tl.maximum(cnt, 1.0)
    mean = pivot + shift
    mean_lo = shift - (mean - pivot)  # exact residual (Fast2Sum), |shift| <= spread of the group
    acc_m2 = tl.zeros([BLOCK], dtype=ACC)
    off = start * 0  # a tensor (not a constexpr) so it can be loop-carried
    while off < length:
        x, ok = _load_members(vals_ptr, order_ptr, valid_ptr, start, off + offs, length, HAS_VALID, F64)
        off += BLOCK
        d = tl.where(ok, (x - mean) - mean_lo, 0.0)
        acc_m2 += d * d
    m2 = tl.sum(acc_m2, axis=0)
    std = tl.where(cnt > 1.0, tl.sqrt(m2 / tl.maximum(cnt - 1.0, 1.0)), 0.0)
    distinct = tl.max(acc_max, axis=0) > tl.min(acc_min, axis=0)
    tl.store(mean_ptr + g, mean)
    tl.store(mean_lo_ptr + g, mean_lo)
    tl.store(std_ptr + g, std)
    tl.store(count_ptr + g, cnt)
    tl.store(distinct_ptr + g, distinct.to(tl.float32))


@triton.jit
def _group_adv_kernel(
    r_ptr,
    rank_ptr,
    mean_ptr,
    mean_lo_ptr,
    std_ptr,
    count_ptr,
    batch_std_ptr,
    out_ptr,
    N,
    eps,
    floor,
    MODE: tl.constexpr,
    F64: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    ok = i < N
    r = tl.load(r_ptr + i, mask=ok, other=0.0)
    if F64:
        r = r.to(tl.float64)
    else:
        r = r.to(tl.float32)
    g = tl.load(rank_ptr + i, mask=ok, other=0)
    mean = tl.load(mean_ptr + g, mask=ok, other=0.0)
    mean_lo = tl.load(mean_lo_ptr + g, mask=ok, other=0.0)
    std = tl.load(std_ptr + g, mask=ok, other=0.0)
    n = tl.load(count_ptr + g, mask=ok, other=1.0)
    d = (r - mean) - mean_lo
    if MODE == 0:
        a = d / (std + eps)
    elif MODE == 1:
        a = d
    elif MODE == 2:
        a = d / (tl.load(batch_std_ptr) + eps)
    elif MODE == 3:
        a = d / (tl.maximum(std, floor * tl.load(batch_std_ptr)) + eps)
    else:
        a = d * n / tl.maximum(n - 1.0, 1.0)
    a = tl.where(n > 1.0, a, 0.0)
    tl.store(out_ptr + i, a.to(tl.float32), mask=ok)


# S (steps per row) only bounds the loop and addresses the step arrays: exempt from the JIT's
# integer specialisation (== 1, % 16), which would otherwise compile per batch.
@triton.jit(do_not_specialize=["S"])
def _step_adv_kernel(
    r_ptr,
    end_ptr,
    rank_ptr,
    mean_ptr,
    mean_lo_ptr,
    std_ptr,
    mask_ptr,
    out_ptr,
    S,
    T,
    eps,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    tb = tl.program_id(1)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    g = tl.load(rank_ptr + b)
    mean = tl.load(mean_ptr + g).to(tl.float32)
    mean_lo = tl.load(mean_lo_ptr + g).to(tl.float32)
    std = tl.load(std_ptr + g).to(tl.float32)
    acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    offs_s = tl.arange(0, BLOCK_S)
    s0 = b * 0  # a tensor (not a constexpr) so it can be loop-carried
    while s0 < S:
        s = s0 + offs_s
        s0 += BLOCK_S
        s_ok = s < S
        end = tl.load(end_ptr + b * S + s, mask=s_ok, other=-1)
        r = tl.load(r_ptr + b * S + s, mask=s_ok, other=0.0).to(tl.float32)
        norm = tl.where(end >= 0, ((r - mean) - mean_lo) / (std + eps), 0.0)
        hit = end[None, :] >= t[:, None]
        acc += tl.sum(tl.where(hit, norm[None, :], 0.0), axis=1)
    m = tl.load(mask_ptr + b * T + t, mask=t_ok, other=0)
    acc = tl.where(m != 0, acc, 0.0)
    tl.store(out_ptr + b * T + t, acc, mask=t_ok)


def segment_stats(
    vals: torch.Tensor,
    order: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    valid: torch.Tensor | None = None,
    *,
    block: int = 256,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-segment (mean, unbiased std, count, distinct, mean_lo) of ``vals[order[start:start+len]]``.

    ``vals`` flat (any float dtype), ``order``/``seg_start``/``seg_len`` int64 (one
    program per entry of ``seg_start``), ``valid`` optional flat uint8/bool-like mask
    indexed like ``vals``. Outputs have len(seg_start) entries: mean and std in float64
    for float64 ``vals`` (accumulated in fp64), else float32 (fp32 sums shifted by a pivot);
    count and distinct float32. ``mean_lo`` is the rounding residual of ``mean`` (the exact
    mean is mean + mean_lo): pass both to the elementwise kernels.
    """
    G = seg_start.numel()
    dev = vals.device
    f64 = vals.dtype == torch.float64
    mean = torch.empty(G, dtype=torch.float64 if f64 else torch.float32, device=dev)
    mean_lo = torch.empty_like(mean)
    std = torch.empty_like(mean)
    count = torch.empty(G, dtype=torch.float32, device=dev)
    distinct = torch.empty_like(count)
    _segment_stats_kernel[(G,)](
        vals,
        order,
        valid if valid is not None else vals,
        seg_start,
        seg_len,
        mean,
        mean_lo,
        std,
        count,
        distinct,
        HAS_VALID=valid is not None,
        F64=f64,
        BLOCK=block,
    )
    return mean, std, count, distinct, mean_lo


def group_advantages_elementwise(
    rewards: torch.Tensor,
    rank: torch.Tensor,
    mean: torch.Tensor,
    mean_lo: torch.Tensor,
    std: torch.Tensor,
    count: torch.Tensor,
    batch_std: torch.Tensor,
    *,
    mode: int,
    eps: float,
    floor: float,
    block: int = 1024,
) -> torch.Tensor:
    """Advantage of each sample from its group's statistics (``rank`` = dense group index),
    computed in the dtype of ``mean`` (float64 or float32), written as float32."""
    N = rewards.numel()
    out = torch.empty(N, dtype=torch.float32, device=rewards.device)
    _group_adv_kernel[(triton.cdiv(N, block),)](
        rewards, rank, mean, mean_lo, std, count, batch_std, out, N, eps, floor, MODE=mode,
        F64=mean.dtype == torch.float64, BLOCK=block,
    )
    return out


def step_advantages_tokens(
    step_rewards: torch.Tensor,
    step_end_index: torch.Tensor,
    rank: torch.Tensor,
    mean: torch.Tensor,
    mean_lo: torch.Tensor,
    std: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps: float,
    block_t: int = 128,
    block_s: int = 32,
) -> torch.Tensor:
    """[B, T] float32 process-reward advantages (contiguous inputs, ``rank`` per row).

    ``block_t``/``block_s`` are fixed tile sizes (tokens x steps per loop step), not derived
    from T or S, so the compile key does not follow the batch shape; the kernel loops over
    the steps with a runtime bound.
    """
    B, S = step_rewards.shape
    T = mask.shape[1]
    out = torch.empty(B, T, dtype=torch.float32, device=step_rewards.device)
    _step_adv_kernel[(B, triton.cdiv(T, block_t))](
        step_rewards, step_end_index, rank, mean, mean_lo, std, mask, out, S, T, eps, BLOCK_T=block_t, BLOCK_S=block_s
    )
    return out
