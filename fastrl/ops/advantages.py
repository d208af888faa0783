"""Group-relative advantages: outcome rewards (``group_advantages``) and process rewards
(``step_advantages``).

On CUDA both are computed without a host synchronisation: groups are found by sorting
the ids (``fastrl.ops._segments.dense_groups``), never with ``torch.unique``. On CPU,
where there is no device to wait for, ``group_advantages`` reads the id range on the host
and indexes groups by ``id - min`` directly (faster than any sort). The formulas are
those of ``fastrl.reference.advantages`` (the oracle the tests compare against). The
results carry no gradient (rewards are data).
"""

from __future__ import annotations

import torch

from fastrl._checks import (
    check_choice,
    check_float,
    check_int,
    check_mask,
    check_nonempty,
    check_same_device,
    check_scalar,
    resolve_backend,
)
from fastrl.ops._segments import DenseGroups, dense_groups, kernel_mask
from fastrl.reference.advantages import BATCH_STD_FLOOR, GROUP_MODES

__all__ = ["group_advantages", "step_advantages", "GROUP_MODES"]


def _batch_mean_std(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased std (0 for one element) of a flat tensor, in its dtype."""
    mean = r.mean()
    d = r - mean
    return mean, torch.sqrt((d * d).sum() / max(r.numel() - 1, 1))


def _centred_advantages(
    d: torch.Tensor, std: torch.Tensor, n: torch.Tensor, batch_std: torch.Tensor, mode: str, eps: float
) -> torch.Tensor:
    """Per-sample advantage from d = r - mean_g and the sample's group std and size."""
    if mode == "grpo":
        a = d / (std + eps)
    elif mode in ("dr_grpo", "reinforce_pp"):
        a = d
    elif mode == "batch_std":
        a = d / (batch_std + eps)
    elif mode == "group_mean_batch_std_floor":
        a = d / (torch.maximum(std, BATCH_STD_FLOOR * batch_std) + eps)
    else:  # rloo: r - (sum_g - r) / (n - 1) = n / (n - 1) * (r - mean_g)
        a = d * n / (n - 1.0).clamp(min=1.0)
    return torch.where(n > 1.0, a, 0.0)


def _group_scale(std: torch.Tensor, n: torch.Tensor, batch_std: torch.Tensor, mode: str, eps: float) -> torch.Tensor:
    """Per-group factor s_g with advantage = (r - mean_g) * s_g (0 for a single-member group)."""
    if mode == "grpo":
        s = 1.0 / (std + eps)
    elif mode in ("dr_grpo", "reinforce_pp"):
        s = torch.ones_like(std)
    elif mode == "batch_std":
        s = (1.0 / (batch_std + eps)).expand_as(std)
    elif mode == "group_mean_batch_std_floor":
        s = 1.0 / (torch.maximum(std, BATCH_STD_FLOOR * batch_std) + eps)
    else:
        s = n / (n - 1.0).clamp(min=1.0)
    return torch.where(n > 1.0, s, 0.0)


def _group_index_host(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(group slot of each sample [N], members per slot [G]) of CPU int64 ids; some slots
    may be empty (count 0). Reads the id range (free on CPU): ids spanning at most about
    2N values use ``id - min`` as the slot directly (no sort); others ``torch.unique``."""
    n = ids.numel()
    lo, hi = (int(v) for v in torch.aminmax(ids))
    if hi - lo < 2 * n + 1024:
        slot = ids - lo
        return slot, torch.bincount(slot, minlength=hi - lo + 1)
    _, inv, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    return inv, counts


def _group_adv_host(
    r: torch.Tensor, ids: torch.Tensor, batch_std: torch.Tensor, mode: str, eps: float, *, exact_sums: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CPU path: dense ids from the id range (no device to sync with), float64 statistics
    (``r`` is float64; ``exact_sums`` when it was widened from fp32 or narrower).
    ``index_select``, not ``x[idx]``: several times faster on CPU.

    Returns (advantages [N] in r's dtype, number of groups with >= 2 distinct rewards and
    number of groups, both 0-dim float32)."""
    inv, counts = _group_index_host(ids.to(torch.int64))
    G = counts.numel()
    n = counts.to(r.dtype).clamp_(min=1.0)  # (empty slots are never read back)
    if exact_sums:
        # rewards that came from fp32 or narrower: float64 sums of up to 2^29 of them are
        # exact, so a group whose rewards are all equal has mean == r and d = 0 exactly
        d = r - torch.zeros(G, dtype=r.dtype).index_add_(0, inv, r).div_(n).index_select(0, inv)
    else:
        # float64 rewards: sums shifted by a pivot (any one member's value) give the same
        # guarantee (all equal -> d = 0 exactly)
        pivot = torch.empty(G, dtype=r.dtype).index_copy_(0, inv, r)
        d = r - pivot.index_select(0, inv)
        d -= torch.zeros(G, dtype=r.dtype).index_add_(0, inv, d).div_(n).index_select(0, inv)
    m2 = torch.zeros(G, dtype=r.dtype).index_add_(0, inv, d * d)
    std = (m2 / (n - 1.0).clamp(min=1.0)).sqrt_()
    a = d.mul_(_group_scale(std, n, batch_std, mode, eps).index_select(0, inv))
    # some d != 0 <=> the group has two distinct rewards (d * d cannot underflow to 0 for
    # differences of fp32 values; for float64 ones below 1e-154 it would)
    return a, (m2 > 0).sum().to(torch.float32), (counts > 0).sum().to(torch.float32)


def _group_adv_sync_free(r: torch.Tensor, g: DenseGroups, batch_std: torch.Tensor, mode: str, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sync-free vectorised PyTorch path (any device; used on CUDA without Triton), computed
    in the sorted order and scattered back.

    Returns (advantages [N] in the original order and r's dtype, number of groups with >= 2
    distinct rewards as a 0-dim float32 tensor)."""
    N = r.numel()
    rk = g.rank_sorted
    rs = r[g.perm]
    zeros = torch.zeros(N, dtype=r.dtype, device=r.device)
    count = zeros.index_add(0, rk, torch.ones_like(rs))
    mean = zeros.index_add(0, rk, rs) / count.clamp(min=1.0)
    d = rs - mean[rk]
    std = torch.sqrt(zeros.index_add(0, rk, d * d) / (count - 1.0).clamp(min=1.0))
    a = _centred_advantages(d, std[rk], count[rk], batch_std, mode, eps)
    # a group has signal when some member differs from its sorted neighbour
    neq = (rs[1:] != rs[:-1]) & ~g.is_first[1:]
    n_distinct = (zeros.index_add(0, rk[1:], neq.to(r.dtype)) > 0).sum(dtype=torch.float32)
    return torch.empty_like(a).scatter_(0, g.perm, a), n_distinct


def _check_finite_rewards(rewards: torch.Tensor, mean: torch.Tensor | None = None) -> None:
    """NaN/inf rewards raise: on CPU a ValueError; on CUDA a device-side assert (no host
    sync). On CPU a finite batch ``mean`` (when given) proves every reward finite at the
    cost of one scalar read."""
    if rewards.device.type != "cpu":
        torch._assert_async(torch.isfinite(rewards).all(), "fastrl.group_advantages: rewards must be finite (found NaN/inf)")
        return
    if mean is not None and bool(torch.isfinite(mean)):
        return
    finite = torch.isfinite(rewards)
    if not bool(finite.all()):
        bad = rewards[~finite][0].item()
        raise ValueError(
            f"rewards must be finite, found {bad}: give failed or missing rewards a value (e.g. 0) "
            "before computing advantages"
        )


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    mode: str = "grpo",
    eps: float = 1e-6,
    backend: str = "auto",
    cpu_host_path: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Advantages of N outcome rewards relative to their group (e.g. the G samples of a prompt).

    Args:
        rewards: [N] float, one scalar reward per sample (any float dtype), all finite.
            A NaN or inf reward (a failed reward function) is an error -- a ``ValueError``
            on CPU, a device-side assert on CUDA (checking there would need a host sync):
            it would turn every advantage of ``batch_std``/``reinforce_pp`` into NaN.
            Replace failed rewards by a value (e.g. 0) before calling.
        group_ids: [N] integer. Samples with equal ids form a group; ids are arbitrary
            (negative, huge, unsorted) and groups may differ in size.
        mode: ``grpo`` (r - mean_g) / (std_g + eps); ``dr_grpo`` r - mean_g;
            ``batch_std`` (r - mean_g) / (std_batch + eps);
            ``group_mean_batch_std_floor`` (r - mean_g) / (max(std_g, 0.1 std_batch) + eps);
            ``rloo`` r - mean of the other members; ``reinforce_pp`` r - mean_g, then
            whitened over the batch, (a - mean(a)) / (std(a) + eps). All std unbiased.
            A group of one member gets 0 (it has no baseline).
        eps: added to the standard deviation (> 0).
        backend: ``auto`` | ``triton`` | ``torch``.
        cpu_host_path: the PyTorch path on CPU tensors ranks the ids with host reads (free
            on CPU, and faster there than the sync-free sort). False runs the sync-free path
            that CUDA tensors take, on CPU (how the tests check that path without a GPU).
            The advantages are the same either way; ignored on CUDA and by Triton.

    Precision: group and batch statistics are computed in float64 (PyTorch paths) or in
    fp32 with a shifted sum / fp64 for fp64 rewards (Triton), never below the input
    precision, so a group of millions of rewards with a large common offset keeps a mean
    advantage of 0, and float64 rewards 1 and 1 + 1e-9 form a group with signal. The
    advantages are returned in float32 (the contract of every op).

    On CPU the torch path reads the id range on the host (free there); on CUDA no op here
    synchronises with the host (groups come from a sort, never ``torch.unique``).

    Returns:
        ``(advantages [N] float32, stats)`` where stats are 0-dim float32 tensors:
        ``frac_all_equal_groups`` (groups whose rewards are all equal: no signal; a
        single-member group counts as all-equal), ``effective_group_ratio``
        (1 - frac_all_equal_groups), ``reward_mean``, ``reward_std`` (batch, unbiased).
    """
    check_float("rewards", rewards, ndim=1)
    check_nonempty("rewards", rewards)
    check_int("group_ids", group_ids, ndim=1)
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids must have shape {tuple(rewards.shape)} (one id per reward), got {tuple(group_ids.shape)}")
    device = check_same_device(rewards=rewards, group_ids=group_ids)
    check_choice("mode", mode, GROUP_MODES)
    eps = check_scalar("eps", eps, low=0.0, low_inclusive=False)
    impl = resolve_backend(backend, device)

    with torch.no_grad():
        if impl == "triton":
            _check_finite_rewards(rewards)
            from csrc_triton.advantages import MODE_CODES, group_advantages_elementwise, segment_stats

            # the kernels accumulate in fp32 (shifted sums), or fp64 for fp64 rewards
            r = rewards.detach().contiguous()
            if r.dtype != torch.float64:
                r = r.to(torch.float32)
            reward_mean, batch_std = _batch_mean_std(r.to(torch.float64))
            g = dense_groups(group_ids)
            counts, starts = g.counts_starts()
            mean, std, count, distinct, mean_lo = segment_stats(r, g.perm, starts, counts)
            adv = group_advantages_elementwise(
                r, g.rank(), mean, mean_lo, std, count, batch_std.to(mean.dtype), mode=MODE_CODES[mode], eps=eps,
                floor=BATCH_STD_FLOOR,
            )
            n_distinct = distinct.sum()
            num_groups = g.num_groups.to(torch.float32)
        else:
            # float64 statistics: exact enough for millions of rewards with a large common
            # offset, and never below the input precision
            r = rewards.detach().to(torch.float64).contiguous()
            reward_mean, batch_std = _batch_mean_std(r)
            _check_finite_rewards(rewards, reward_mean)
            if device.type == "cpu" and cpu_host_path:
                adv, n_distinct, num_groups = _group_adv_host(
                    r, group_ids, batch_std, mode, eps, exact_sums=rewards.dtype != torch.float64
                )
            else:
                g = dense_groups(group_ids)
                adv, n_distinct = _group_adv_sync_free(r, g, batch_std, mode, eps)
                num_groups = g.num_groups.to(torch.float32)
        if mode == "reinforce_pp":
            a_mean, a_std = _batch_mean_std(adv)
            adv = (adv - a_mean) / (a_std + eps)
        frac_equal = (num_groups - n_distinct) / num_groups
        stats = {
            "frac_all_equal_groups": frac_equal,
            "effective_group_ratio": 1.0 - frac_equal,
            "reward_mean": reward_mean.to(torch.float32),
            "reward_std": batch_std.to(torch.float32),
        }
    return adv.to(torch.float32), stats


def _check_step_layout(step_end_index: torch.Tensor, T: int) -> None:
    """Value checks of the step layout. Only run for CPU tensors: on a GPU they would
    need a host sync, so there out-of-range indices follow the documented fallback."""
    if step_end_index.device.type != "cpu" or step_end_index.numel() == 0:
        return
    lo, hi = int(step_end_index.min()), int(step_end_index.max())
    if lo < -1 or hi >= T:
        raise ValueError(
            f"step_end_index must hold token indices in [0, {T}) for present steps and -1 for absent ones, "
            f"got values in [{lo}, {hi}]"
        )


def step_advantages(
    step_rewards: torch.Tensor,
    step_end_index: torch.Tensor,
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps: float = 1e-6,
    backend: str = "auto",
) -> torch.Tensor:
    """Process-supervision GRPO advantages (DeepSeekMath, Shao et al. 2024, sec. 4.1.3).

    Padded layout: row b of the batch has up to S reasoning steps.

    - ``step_rewards`` [B, S] float: reward of step s of row b (ignored where absent).
    - ``step_end_index`` [B, S] integer: token index in [0, T) of the last token of the
      step, or -1 for an absent step (padding). Steps need not be sorted or distinct.
    - ``group_ids`` [B] integer: rows with equal ids are samples of one prompt.
    - ``mask`` [B, T]: response mask (0/1, any dtype).

    The present step rewards of all rows of a group are normalised together,
    r~ = (r - mean_g) / (std_g + eps) (std unbiased, 0 for a group with one step), and

        A[b, t] = mask[b, t] * sum over steps s of row b with end[b, s] >= t of r~[b, s]

    i.e. each token gets the sum of the normalised rewards of the steps ending at or
    after it. Rows without steps and masked-out tokens get 0. On CPU, indices outside
    [-1, T) raise ``ValueError``; on GPU (where that check would need a host sync) an
    index < -1 counts as absent and an index >= T as ending at the last token.

    Returns the advantages [B, T] float32 (no gradient).
    """
    check_float("step_rewards", step_rewards, ndim=2)
    check_int("step_end_index", step_end_index, shape=tuple(step_rewards.shape))
    check_int("group_ids", group_ids, ndim=1)
    check_nonempty("step_rewards", step_rewards)
    B, S = step_rewards.shape
    if group_ids.shape[0] != B:
        raise ValueError(f"group_ids must have shape ({B},) (one id per row of step_rewards), got {tuple(group_ids.shape)}")
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dim() != 2 or mask.shape[0] != B:
        raise ValueError(f"mask must have shape ({B}, T), got {tuple(mask.shape)}")
    check_mask("mask", mask, tuple(mask.shape))
    check_nonempty("mask", mask)
    T = mask.shape[1]
    device = check_same_device(step_rewards=step_rewards, step_end_index=step_end_index, group_ids=group_ids, mask=mask)
    eps = check_scalar("eps", eps, low=0.0, low_inclusive=False)
    impl = resolve_backend(backend, device)
    _check_step_layout(step_end_index, T)

    with torch.no_grad():
        g = dense_groups(group_ids)
        end = step_end_index.to(torch.int64)
        r = step_rewards.detach()
        if impl == "triton":
            from csrc_triton.advantages import segment_stats, step_advantages_tokens

            r = r.contiguous()
            end = end.contiguous()
            present = (end >= 0).view(torch.uint8).reshape(-1)
            order = (g.perm[:, None] * S + torch.arange(S, device=device)).reshape(-1)
            counts, starts = g.counts_starts()
            mean, std, _, _, mean_lo = segment_stats(r.reshape(-1), order, starts * S, counts * S, valid=present)
            return step_advantages_tokens(r, end, g.rank(), mean, mean_lo, std, kernel_mask(mask), eps=eps)
        rank = g.rank()
        present = end >= 0
        rf = torch.where(present, r.to(torch.float32), 0.0)
        pf = present.to(torch.float32)
        cnt = torch.zeros(B, dtype=torch.float32, device=device).index_add_(0, rank, pf.sum(1))
        mean = torch.zeros_like(cnt).index_add_(0, rank, rf.sum(1)) / cnt.clamp(min=1.0)
        dev = (rf - mean[rank][:, None]) * pf
        m2 = torch.zeros_like(cnt).index_add_(0, rank, (dev * dev).sum(1))
        std = torch.sqrt(m2 / (cnt - 1.0).clamp(min=1.0))
        norm = dev / (std[rank][:, None] + eps)
        col = torch.where(present, end.clamp(max=T - 1), T)
        contrib = torch.zeros(B, T + 1, dtype=torch.float32, device=device).scatter_add_(1, col, norm)[:, :T]
        adv = contrib.flip(1).cumsum(1).flip(1)
        return torch.where(mask != 0, adv, 0.0)
