"""Reference group-relative advantages (outcome and process rewards).

Plain PyTorch, written for clarity: a loop over the distinct groups. The fast paths in
``fastrl.ops.advantages`` are tested against these functions.

Notation for one group g (the samples sharing a group id), with n_g members:

    mean_g = sum_{i in g} r_i / n_g
    std_g  = sqrt(sum_{i in g} (r_i - mean_g)^2 / (n_g - 1))    (unbiased; 0 when n_g == 1)

and over the whole batch of N samples: mean_B, std_B (unbiased; 0 when N == 1).

Computation is in float32, or float64 when ``rewards`` is float64 (tests use that for
tight comparisons).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

GroupMode = Literal["grpo", "dr_grpo", "batch_std", "group_mean_batch_std_floor", "rloo", "reinforce_pp"]
"""The ``group_advantages`` modes (one list; ``GROUP_MODES`` is derived from it)."""
GROUP_MODES: tuple[str, ...] = get_args(GroupMode)

BATCH_STD_FLOOR = 0.1
"""``group_mean_batch_std_floor`` divides by max(std_g, BATCH_STD_FLOOR * std_B)."""


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _unbiased_std(x: torch.Tensor) -> torch.Tensor:
    """sqrt(sum (x - mean)^2 / (n - 1)); 0 for a single element."""
    n = x.numel()
    if n < 2:
        return torch.zeros((), dtype=x.dtype)
    return ((x - x.mean()) ** 2).sum().div(n - 1).sqrt()


def group_advantages_reference(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, mode: str = "grpo", eps: float = 1e-6
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Advantages of N scalar rewards relative to their group.

    ``rewards`` [N] float, ``group_ids`` [N] integer (arbitrary values, any order; all
    samples with equal id form one group, groups may differ in size). Per sample i in
    group g:

    - ``grpo``:        (r_i - mean_g) / (std_g + eps)                 (Shao et al. 2024)
    - ``dr_grpo``:     r_i - mean_g                                   (Liu et al. 2025)
    - ``batch_std``:   (r_i - mean_g) / (std_B + eps)
    - ``group_mean_batch_std_floor``: (r_i - mean_g) / (max(std_g, 0.1 * std_B) + eps)
    - ``rloo``:        r_i - (sum_{j in g, j != i} r_j) / (n_g - 1)   (leave-one-out;
                       equals n_g / (n_g - 1) * (r_i - mean_g)); 0 when n_g == 1
    - ``reinforce_pp``: a_i = r_i - mean_g, then whitened over the batch:
                       (a_i - mean_B(a)) / (std_B(a) + eps)           (REINFORCE++ baseline)

    A group of one member gets advantage 0 in every mode but ``reinforce_pp`` (where its
    0 is then shifted by the tiny batch mean of ``a``): it has no baseline to compare to.

    Statistics (0-dim float32):

    - ``frac_all_equal_groups``: fraction of groups whose rewards are all exactly equal
      (compared in the working dtype). They carry no learning signal. A single-member
      group counts as all-equal.
    - ``effective_group_ratio``: fraction of groups with at least two distinct rewards,
      i.e. 1 - frac_all_equal_groups.
    - ``reward_mean``, ``reward_std``: mean_B and std_B (unbiased) of the rewards.
    """
    dt = _work_dtype(rewards)
    r = rewards.to(dt)
    ids = group_ids.to(torch.int64)
    adv = torch.zeros_like(r)
    std_b = _unbiased_std(r)
    groups = torch.unique(ids)
    n_equal = 0
    for gid in groups.tolist():
        sel = ids == gid
        rg = r[sel]
        n = rg.numel()
        mean_g = rg.mean()
        std_g = _unbiased_std(rg)
        if bool((rg == rg[0]).all()):
            n_equal += 1
        if mode == "grpo":
            a = (rg - mean_g) / (std_g + eps)
        elif mode in ("dr_grpo", "reinforce_pp"):
            a = rg - mean_g
        elif mode == "batch_std":
            a = (rg - mean_g) / (std_b + eps)
        elif mode == "group_mean_batch_std_floor":
            a = (rg - mean_g) / (torch.maximum(std_g, BATCH_STD_FLOOR * std_b) + eps)
        elif mode == "rloo":
            a = (rg - (rg.sum() - rg) / (n - 1)) if n > 1 else torch.zeros_like(rg)
        else:
            raise ValueError(f"mode must be one of {GROUP_MODES}, got {mode!r}")
        if n == 1:
            a = torch.zeros_like(rg)
        adv[sel] = a
    if mode == "reinforce_pp":
        adv = (adv - adv.mean()) / (_unbiased_std(adv) + eps)
    frac = torch.tensor(n_equal / len(groups), dtype=torch.float32)
    stats = {
        "frac_all_equal_groups": frac,
        "effective_group_ratio": 1.0 - frac,
        "reward_mean": r.mean().float(),
        "reward_std": std_b.float(),
    }
    return adv, stats


def step_advantages_reference(
    step_rewards: torch.Tensor,
    step_end_index: torch.Tensor,
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Process-supervision GRPO advantages (DeepSeekMath, Shao et al. 2024, sec. 4.1.3).

    Layout (padded): ``step_rewards`` [B, S] float, ``step_end_index`` [B, S] integer,
    ``group_ids`` [B] integer, ``mask`` [B, T]. Row b has a step s when
    ``step_end_index[b, s] >= 0``; the value is the token index (0 <= index < T) of the
    last token of that step and ``step_rewards[b, s]`` its reward. ``-1`` marks an absent
    step (padding) and its reward is ignored. Steps need not be sorted and may share an
    end index.

    Normalisation runs over all present steps of all rows of a group g (K_g steps):

        r~ = (r - mean_g) / (std_g + eps)     std unbiased; 0 when K_g == 1

    and the advantage of token t of row b is the sum of the normalised rewards of the
    steps of row b that end at or after t (a reverse cumulative sum over the sequence):

        A[b, t] = mask[b, t] * sum_{s : end[b, s] >= t} r~[b, s]

    Rows without steps get 0 everywhere; masked-out tokens get 0.
    """
    dt = _work_dtype(step_rewards)
    r = step_rewards.to(dt)
    end = step_end_index.to(torch.int64)
    ids = group_ids.to(torch.int64)
    B, S = r.shape
    T = mask.shape[1]
    present = end >= 0
    norm = torch.zeros_like(r)
    for gid in torch.unique(ids).tolist():
        rows = ids == gid
        sel = present & rows[:, None]
        vals = r[sel]
        if vals.numel() == 0:
            continue
        norm[sel] = (vals - vals.mean()) / (_unbiased_std(vals) + eps)
    adv = torch.zeros(B, T, dtype=dt)
    for b in range(B):
        for s in range(S):
            e = int(end[b, s])
            if e >= 0:
                adv[b, : e + 1] += norm[b, s]
    return adv * (mask != 0).to(dt)
