"""Advantages over the turns of agent trajectories: GRPO broadcast, GiGPO, turn-discounted
(MT-GRPO) and PPO's GAE over policy tokens.

The formulas, the layout and the conventions are those of
``fastrl.reference.turn_advantages`` (the oracle the tests compare against); read its
docstring first. This module computes them in one segmented pass: no Python loop over
turns, groups or tokens and no host synchronisation on a GPU.

How
---
1. Episode advantages: ``group_advantages`` (``grpo`` for ``norm="std"``, ``dr_grpo`` for
   ``"none"``).
2. Turn returns ``G[b, k]``: ``discounted_returns`` over the ``[B, K]`` turn rewards with the
   present turns as mask (one reverse scan; the Triton backend runs the chunked scan kernel
   of ``csrc_triton.scans``). Float64 rewards: the float64 torch scan on both backends, and
   float64 group statistics (``segment_stats`` accumulates float64 values in float64), so
   returns 1 and 1 + 1e-9 still differ.
3. Turn groups (GiGPO's (group id, state key) step groups, or (group id, turn index)):
   a lexicographic sort of the pairs (two stable sorts), boundaries and a cumulative sum give
   dense ranks without ``torch.unique``; absent turns sort behind every present one into
   groups that are never read. Group statistics: ``csrc_triton.advantages.segment_stats``
   (Triton) or ``index_add`` sums in float64 shifted by a pivot (torch), so a group of equal
   returns gives exactly 0.
4. One elementwise pass per turn (``A_turn [B, K]``) and one per token (the gather by
   ``turn_index``), Triton kernels in ``csrc_triton.turn_advantages`` or torch ops.

GiGPO conventions (where the implementations differ)
----------------------------------------------------
Followed here: the paper's formulas (arXiv 2505.10978, Eqs. 3-8) with fastrl's group
convention, i.e. unbiased std, eps added to the std (default 1e-6), a singleton group gets 0
at both levels, the step return includes the current turn's reward, the episode statistics
are over trajectories. verl-agent (``gigpo/core_gigpo.py``) agrees on the std (``torch.std``,
unbiased), eps = 1e-6 added to the std, the step return including the current reward
(``compute_step_discounted_returns``) and singleton *step* groups (mean = the return itself,
so 0), but (a) gives a singleton *episode* group mean 0 / std 1, i.e. the raw outcome as
its advantage (here 0: no baseline), and (b) by default (``compute_mean_std_cross_steps``)
takes the episode mean/std over all step samples of the group, so long trajectories weigh
more (here: one value per trajectory, the paper's Eq. 3). Its default ``mode="mean_norm"``
is ``norm="none"`` here. ``episode_over="turns"`` switches (a) and (b) to verl-agent's
behaviour; with ``norm`` and ``eps`` set as there the op then reproduces verl-agent's numbers
(test: ``test_episode_over_turns_reproduces_verl_agent``). A verl-style adapter (stored ``gigpo`` estimator registering
``compute_gigpo_advantage`` on top of verl's GRPO advantage) also applies the std only to
groups of two or more. ROLL (``roll/pipeline/agentic/utils.py``: ``compute_discounted_returns``,
``build_state_group``, ``grouped_reward_norm``) groups steps by (trajectory group, state hash)
as here, includes the current reward in the step return, uses the unbiased std with eps =
1e-6 and gives a singleton group 0, but (a) also gives 0 to a group whose std is <= 1e-6
(here such a group gets its tiny differences divided by std + eps) and (b) normalises the
episode scores over the step samples, like verl-agent. No GiGPO estimator was found in the
stored Trinity-RFT sources (its ``advantage_fn`` has GRPO and multi-step GRPO), so it is not
compared. With ``norm="none"`` and trajectories of equal turn counts the cross-step episode
mean equals the per-trajectory one, and this op reproduces the step-sample formulation of
verl-agent / ROLL exactly (``tests/ops/test_turn_advantages.py``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from fastrl._checks import (
    Backend,
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
from fastrl.ops.advantages import group_advantages
from fastrl.ops.packing import PackedLayout, packed_to_rows
from fastrl.ops.scans import _discounted_torch, discounted_returns, gae
from fastrl.reference.turn_advantages import EPISODE_OVER, NORMS, TURN_ADVANTAGE_MODES

__all__ = ["turn_advantages", "turn_gae", "place_turn_rewards", "turn_index_from_spans", "TURN_ADVANTAGE_MODES",
           "NORMS"]

Packed = PackedLayout | torch.Tensor | Sequence[int] | None  # cu_seqlens: a layout or host offsets

_EPISODE_MODE = {"std": "grpo", "none": "dr_grpo"}  # group_advantages mode of each norm


def _check_layout(turn_index: torch.Tensor, loss_mask: torch.Tensor, num_turns: torch.Tensor, K: int) -> None:
    """Value checks of the turn layout. Read only for CPU tensors (on a GPU they would need a
    host sync; there a policy token with an index outside [0, n_b) gets advantage 0 and
    ``num_turns`` is clamped to [0, K])."""
    if num_turns.device.type != "cpu":
        return
    lo, hi = int(num_turns.min()), int(num_turns.max())
    if lo < 0 or hi > K:
        raise ValueError(f"num_turns must be in [0, {K}] (K = turn_rewards.shape[1]), got values in [{lo}, {hi}]")
    on = loss_mask != 0
    idx = turn_index.to(torch.int64)
    bad = on & ((idx < 0) | (idx >= num_turns.to(torch.int64)[:, None]))
    if bool(bad.any()):
        b, t = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"turn_index[{b}, {t}] = {int(idx[b, t])} is a policy token (loss_mask != 0) outside the row's turns "
            f"[0, num_turns[{b}] = {int(num_turns[b])}); give every policy token the index of its turn"
        )


def _check_finite(name: str, x: torch.Tensor, present: torch.Tensor | None = None) -> None:
    """NaN/inf where a value is read raises: on CPU a ``ValueError``; on CUDA a device-side
    assert (no host sync)."""
    ok = torch.isfinite(x)
    if present is not None:
        ok = ok | ~present
    if x.device.type != "cpu":
        torch._assert_async(ok.all(), f"fastrl.turn_advantages: {name} must be finite where read (found NaN/inf)")
        return
    if not bool(ok.all()):
        raise ValueError(f"{name} must be finite where it is read (present turns), found {x[~ok][0].item()}")


def _validate_layout(turn_index, loss_mask, turn_rewards, num_turns):
    check_float("turn_rewards", turn_rewards, ndim=2)
    check_nonempty("turn_rewards", turn_rewards)
    B, K = turn_rewards.shape
    if not isinstance(loss_mask, torch.Tensor):
        raise TypeError(f"loss_mask must be a torch.Tensor, got {type(loss_mask).__name__}")
    if loss_mask.dim() != 2 or loss_mask.shape[0] != B:
        raise ValueError(f"loss_mask must have shape ({B}, T) (one row per row of turn_rewards), "
                         f"got {tuple(loss_mask.shape)}")
    check_mask("loss_mask", loss_mask, tuple(loss_mask.shape))
    check_nonempty("loss_mask", loss_mask)
    check_int("turn_index", turn_index, shape=tuple(loss_mask.shape))
    check_int("num_turns", num_turns, shape=(B,))
    return B, K, loss_mask.shape[1]


def _present(num_turns: torch.Tensor, K: int) -> torch.Tensor:
    """[B, K] bool: turn k exists in row b (k < n_b)."""
    return torch.arange(K, device=num_turns.device)[None, :] < num_turns.to(torch.int64)[:, None]


def _final_turn(num_turns: torch.Tensor, K: int) -> torch.Tensor:
    """[B, K] bool: column k is row b's final turn (k = num_turns[b] - 1)."""
    return torch.arange(K, device=num_turns.device)[None, :] == (num_turns[:, None] - 1)


def _dense_pairs(a: torch.Tensor, b: torch.Tensor) -> DenseGroups:
    """Dense ranks of the pairs (a[i], b[i]) (int64, [N]) without a host sync: a stable sort by
    b, then a stable sort by a, boundaries where either changes, a cumulative sum."""
    N = a.numel()
    _, p1 = torch.sort(b, stable=True)
    _, p2 = torch.sort(a[p1], stable=True)
    perm = p1[p2]
    sa, sb = a[perm], b[perm]
    is_first = torch.empty(N, dtype=torch.bool, device=a.device)
    is_first[:1] = True
    torch.logical_or(sa[1:] != sa[:-1], sb[1:] != sb[:-1], out=is_first[1:])
    rank_sorted = torch.cumsum(is_first, 0) - 1
    return DenseGroups(perm, rank_sorted, is_first, is_first.sum())


def _check_spans(turn_start: torch.Tensor, turn_end: torch.Tensor, num_turns: torch.Tensor, T: int) -> None:
    """Value checks of a segment table. Read only for CPU tensors (a host sync on a GPU;
    there overlapping or unsorted spans give the later turn's index where they meet)."""
    if turn_start.device.type != "cpu":
        return
    K = turn_start.shape[1]
    lo, hi = int(num_turns.min()), int(num_turns.max())
    if lo < 0 or hi > K:
        raise ValueError(f"num_turns must be in [0, {K}] (K = turn_start.shape[1]), got values in [{lo}, {hi}]")
    present = _present(num_turns, K)
    s, e = turn_start.to(torch.int64), turn_end.to(torch.int64)
    prev_end = torch.nn.functional.pad(e[:, :-1], (1, 0))
    bad = present & ((s < prev_end) | (e < s) | (e > T) | (s < 0))
    if bool(bad.any()):
        b, k = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"turn span {k} of row {b} is [{int(s[b, k])}, {int(e[b, k])}): spans must satisfy "
            f"0 <= start <= end <= T = {T}, sorted and not overlapping (start >= the previous turn's end)")


def turn_index_from_spans(
    turn_start: torch.Tensor, turn_end: torch.Tensor, num_turns: torch.Tensor, *, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token turn index from a segment table (each policy turn's [start, end) token span).

    ``turn_start``/``turn_end`` [B, K] integer (end exclusive; read for k < num_turns[b]),
    ``num_turns`` [B] integer, ``seq_len`` T. Returns ``(turn_index [B, T] int64, -1 outside
    every span; in_turn [B, T] bool)``, the ``turn_index`` of :func:`turn_advantages` (AND
    ``in_turn`` with a loss mask if some span tokens are not trained). A scatter of the span
    starts and a cumulative sum: no loop, no host sync. On CPU an unsorted, overlapping or
    out-of-range span raises ``ValueError``.
    """
    check_int("turn_start", turn_start, ndim=2)
    check_nonempty("turn_start", turn_start)
    B, K = turn_start.shape
    check_int("turn_end", turn_end, shape=(B, K))
    check_int("num_turns", num_turns, shape=(B,))
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int (the padded length T), got {seq_len!r}")
    T = seq_len
    device = check_same_device(turn_start=turn_start, turn_end=turn_end, num_turns=num_turns)
    _check_spans(turn_start, turn_end, num_turns, T)
    with torch.no_grad():
        n = num_turns.to(torch.int64).clamp(0, K)
        present = _present(n, K)
        s = turn_start.to(torch.int64).clamp(0, T)
        marks = torch.zeros(B, T + 1, dtype=torch.int64, device=device)
        marks.scatter_add_(1, torch.where(present, s, T), present.to(torch.int64))
        k = torch.cumsum(marks[:, :T], 1) - 1  # the latest turn starting at or before t
        end = torch.gather(torch.where(present, turn_end.to(torch.int64), 0), 1, k.clamp(0, K - 1))
        in_turn = (k >= 0) & (torch.arange(T, device=device)[None] < end)
        return torch.where(in_turn, k, -1), in_turn


def _turn_groups(group_ids: torch.Tensor, keys: torch.Tensor, present: torch.Tensor) -> DenseGroups:
    """Groups of the B*K turns by (group id, key); absent turns form groups of their own
    behind every present one (primary rank B, never read)."""
    B, K = present.shape
    grank = dense_groups(group_ids).rank()
    primary = torch.where(present, grank[:, None], B).reshape(-1)
    secondary = torch.where(present, keys.to(torch.int64), 0).reshape(-1)
    return _dense_pairs(primary, secondary)


def _episode_over_turns(R: torch.Tensor, group_ids: torch.Tensor, n: torch.Tensor, norm: str, eps: float):
    """A^E [B] float32 with verl-agent's cross-step statistics: trajectory b weighs n_b, a group
    of one sample gets mean 0 / std 1. [B]-sized index_add sums in float64: no loop, no sync."""
    B = R.numel()
    r = R.to(torch.float64)
    w = n.to(torch.float64)
    rank = dense_groups(group_ids).rank()
    zeros = torch.zeros(B, dtype=torch.float64, device=R.device)
    cnt = zeros.index_add(0, rank, w)
    pivot = torch.zeros_like(zeros).scatter_(0, rank, r)  # one member's value per group
    d0 = r - pivot[rank]
    mean = pivot + zeros.index_add(0, rank, w * d0) / cnt.clamp(min=1.0)
    d = r - mean[rank]
    std = torch.sqrt(zeros.index_add(0, rank, w * d * d) / (cnt - 1.0).clamp(min=1.0))
    single = (cnt == 1.0)[rank]
    d = torch.where(single, r, d)
    s = torch.where(single, 1.0, std[rank])
    a = d / (s + eps) if norm == "std" else d
    return torch.where(cnt[rank] > 0, a, 0.0).float()


def _turn_stats_torch(G: torch.Tensor, present: torch.Tensor, g: DenseGroups, norm: str, eps: float):
    """Relative turn advantages [B, K] (float64) and (groups, singleton groups, all-equal
    groups) counts, the torch way: float64 sums shifted by each group's first member."""
    N = G.numel()
    dt = torch.float64
    rk, perm = g.rank_sorted, g.perm
    vs = G.reshape(-1).to(dt)[perm]
    ps = present.reshape(-1)[perm]
    vs = torch.where(ps, vs, 0.0)
    pf = ps.to(dt)
    zeros = torch.zeros(N, dtype=dt, device=G.device)
    count = zeros.index_add(0, rk, pf)
    counts, starts = g.counts_starts()
    pivot = vs[starts.clamp(max=N - 1)]
    d = (vs - pivot[rk]) * pf
    d = (d - (zeros.index_add(0, rk, d) / count.clamp(min=1.0))[rk]) * pf
    std = torch.sqrt(zeros.index_add(0, rk, d * d) / (count - 1.0).clamp(min=1.0))
    rel = d / (std[rk] + eps) if norm == "std" else d
    rel = torch.where(count[rk] > 1.0, rel, 0.0)
    out = torch.empty_like(rel).scatter_(0, perm, rel).view_as(G)
    neq = ((vs[1:] != vs[:-1]) & ~g.is_first[1:] & ps[1:]).to(dt)
    distinct = zeros.index_add(0, rk[1:], neq) > 0
    real = count > 0
    return out, real.sum(), (count == 1.0).sum(), (real & ~distinct).sum()


def turn_advantages(
    turn_index: torch.Tensor,
    loss_mask: torch.Tensor,
    turn_rewards: torch.Tensor,
    num_turns: torch.Tensor,
    outcome_rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    mode: str = "broadcast",
    state_keys: torch.Tensor | None = None,
    gamma: float = 1.0,
    step_coef: float = 1.0,
    turn_coef: float = 1.0,
    outcome_coef: float = 0.0,
    norm: str = "std",
    eps: float = 1e-6,
    episode_over: str = "trajectories",
    final_turn_coef: float | None = None,
    backend: Backend = "auto",
    cu_seqlens: Packed = None,
    cpu_host_path: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token advantages of agent trajectories from per-turn and outcome rewards.

    Args (layout and formulas: ``fastrl.reference.turn_advantages``):
        turn_index: [B, T] integer, the turn of each policy token (read where ``loss_mask``).
        loss_mask: [B, T] 0/1 (bool/int/float), nonzero exactly on policy tokens.
        turn_rewards: [B, K] float, reward after turn k (ignored at k >= num_turns[b]; NaN
            allowed there). Finite where present.
        num_turns: [B] integer in [0, K]: row b has turns 0 .. num_turns[b] - 1.
        outcome_rewards: [B] float, finite: the episode reward of each trajectory.
        group_ids: [B] integer: trajectories of one prompt/task share an id (any values).
        mode: ``broadcast`` (GRPO: A^E on every policy token), ``gigpo`` (A^E + step_coef *
            step advantage over (group, state key) groups) or ``turn_discounted``
            (turn_coef * per-turn-index advantage of the discounted turn returns +
            outcome_coef * A^E; MT-GRPO: gamma=0, turn_coef=lambda, outcome_coef=1,
            final_turn_coef=0).
        state_keys: [B, K] integer (int64 hashes of the environment state at each turn);
            required for ``gigpo``, rejected otherwise.
        gamma: discount of the turn returns, in [0, 1] (not used by ``broadcast``).
        step_coef: GiGPO's omega (finite).
        turn_coef, outcome_coef: the ``turn_discounted`` mix (finite).
        final_turn_coef: ``turn_discounted``: the turn term's weight on each trajectory's
            final turn (k = num_turns[b] - 1) instead of ``turn_coef`` (finite; None:
            ``turn_coef``). MT-GRPO's 0: the final turn gets the outcome term alone.
        norm: ``std`` (F_norm = std + eps) or ``none`` (F_norm = 1), at both levels.
        eps: added to every std (> 0).
        episode_over: ``trajectories`` (the paper's Eq. 3: one value per trajectory) or
            ``turns`` (verl-agent's default cross-step episode statistics: trajectory b
            weighs num_turns[b], a one-sample group gets mean 0 / std 1; with ``norm`` and
            ``eps`` as there this reproduces verl-agent's GiGPO numbers).
        backend: ``auto`` | ``triton`` | ``torch``.
        cpu_host_path: passed to ``group_advantages`` for the episode advantage (its CPU
            tensors' fast path reads the group ids on the host; ``False`` keeps every path
            sync-free, as on a GPU).
        cu_seqlens: packed trajectories: ``turn_index`` and ``loss_mask`` are ``[N]`` or
            ``[1, N]`` (S trajectories back to back) and this is their
            ``fastrl.ops.PackedLayout`` or host ``cu_seqlens`` ``[S + 1]``; the per-turn and
            per-trajectory tensors keep their ``[S, K]`` / ``[S]`` shapes. The advantages come
            back packed like ``loss_mask`` and equal those of the padded ``[S, T]`` rows.

    On CPU the layout is checked (``ValueError`` for a policy token outside its row's turns,
    or ``num_turns`` outside [0, K]); on a GPU that would need a host sync, so such a token
    gets 0 there. Non-finite present rewards raise (CPU) or trip a device assert (CUDA).

    Returns:
        ``(advantages [B, T] float32, stats)``: 0 off the loss mask, no autograd graph; stats
        are 0-dim float32 tensors (keys in the reference's docstring).
    """
    if cu_seqlens is not None:  # packed trajectories: this op on their padded [S, T] view
        layout, (lm, ti) = packed_to_rows(cu_seqlens, loss_mask=loss_mask, turn_index=turn_index)
        adv, stats = turn_advantages(ti, lm, turn_rewards, num_turns, outcome_rewards, group_ids, mode=mode,
                                     state_keys=state_keys, gamma=gamma, step_coef=step_coef, turn_coef=turn_coef,
                                     outcome_coef=outcome_coef, norm=norm, eps=eps, episode_over=episode_over,
                                     final_turn_coef=final_turn_coef, backend=backend)
        return layout.to_packed(adv, shape=loss_mask.shape), stats
    B, K, T = _validate_layout(turn_index, loss_mask, turn_rewards, num_turns)
    check_float("outcome_rewards", outcome_rewards, shape=(B,))
    check_int("group_ids", group_ids, shape=(B,))
    check_choice("mode", mode, TURN_ADVANTAGE_MODES)
    check_choice("norm", norm, NORMS)
    check_choice("episode_over", episode_over, EPISODE_OVER)
    if mode == "gigpo":
        if state_keys is None:
            raise ValueError("mode='gigpo' needs state_keys ([B, K] int64 hashes of the environment state at "
                             "each turn)")
        check_int("state_keys", state_keys, shape=(B, K))
    elif state_keys is not None:
        raise ValueError(f"state_keys is only read by mode='gigpo', got mode={mode!r}")
    device = check_same_device(turn_index=turn_index, loss_mask=loss_mask, turn_rewards=turn_rewards,
                               num_turns=num_turns, outcome_rewards=outcome_rewards, group_ids=group_ids,
                               state_keys=state_keys)
    gamma = check_scalar("gamma", gamma, low=0.0, high=1.0)
    step_coef = check_scalar("step_coef", step_coef)
    turn_coef = check_scalar("turn_coef", turn_coef)
    outcome_coef = check_scalar("outcome_coef", outcome_coef)
    if final_turn_coef is not None:
        if mode != "turn_discounted":
            raise ValueError(f"final_turn_coef is only read by mode='turn_discounted', got mode={mode!r}")
        final_turn_coef = check_scalar("final_turn_coef", final_turn_coef)
        if final_turn_coef == turn_coef:
            final_turn_coef = None  # the same weight on every turn
    eps = check_scalar("eps", eps, low=0.0, low_inclusive=False)
    impl = resolve_backend(backend, device)
    _check_layout(turn_index, loss_mask, num_turns, K)

    with torch.no_grad():
        n = num_turns.to(torch.int64).clamp(0, K)
        AE, ep_stats = group_advantages(outcome_rewards.detach(), group_ids, mode=_EPISODE_MODE[norm], eps=eps,
                                        backend=impl, cpu_host_path=cpu_host_path)
        stats = {k: ep_stats[k] for k in ("frac_all_equal_groups", "reward_mean", "reward_std")}
        if episode_over == "turns":
            AE = _episode_over_turns(outcome_rewards.detach(), group_ids, n, norm, eps)
        if mode == "broadcast":
            A_turn = AE[:, None]
        else:
            present = _present(n, K)
            _check_finite("turn_rewards", turn_rewards, present)
            r = torch.where(present, turn_rewards.detach(), 0.0)
            if r.dtype == torch.float64:
                # float64 returns keep float64 precision (the scan kernel is fp32); [B, K] is small
                G = _discounted_torch(r, present, gamma)
            else:
                G = discounted_returns(r, present, gamma=gamma, backend=impl)  # [B, K] float32
            keys = state_keys if mode == "gigpo" else torch.arange(K, device=device).expand(B, K)
            g = _turn_groups(group_ids, keys, present)
            c_ep, c_rel = (1.0, step_coef) if mode == "gigpo" else (outcome_coef, turn_coef)
            if impl == "triton":
                from csrc_triton.advantages import segment_stats
                from csrc_triton.turn_advantages import turn_combine

                counts, starts = g.counts_starts()
                pv = present.reshape(-1).view(torch.uint8)
                mean, std, count, distinct, mean_lo = segment_stats(G.reshape(-1), g.perm, starts, counts, valid=pv)
                A_turn = turn_combine(G, pv, g.rank(), mean, mean_lo, std, count, AE, c_ep=c_ep, c_rel=c_rel,
                                      use_std=norm == "std", eps=eps)
                if final_turn_coef is not None:  # the final turns' values: the same kernel, their weight
                    A_final = turn_combine(G, pv, g.rank(), mean, mean_lo, std, count, AE, c_ep=c_ep,
                                           c_rel=final_turn_coef, use_std=norm == "std", eps=eps)
                    A_turn = torch.where(_final_turn(n, K), A_final, A_turn)
                real = count > 0
                n_groups, n_single, n_equal = real.sum(), (count == 1.0).sum(), (real & (distinct == 0)).sum()
            else:
                rel, n_groups, n_single, n_equal = _turn_stats_torch(G, present, g, norm, eps)
                if final_turn_coef is not None:
                    c_rel = torch.where(_final_turn(n, K), final_turn_coef, c_rel).to(torch.float64)
                A_turn = torch.where(present, c_ep * AE.to(torch.float64)[:, None] + c_rel * rel, 0.0).float()
            ng = n_groups.to(torch.float32)
            stats["turn_groups"] = ng
            stats["frac_singleton_turn_groups"] = n_single.to(torch.float32) / ng.clamp(min=1.0)
            stats["frac_all_equal_turn_groups"] = n_equal.to(torch.float32) / ng.clamp(min=1.0)
        use_turn = mode != "broadcast"
        if impl == "triton":
            from csrc_triton.turn_advantages import expand_turn_advantages

            adv = expand_turn_advantages(A_turn.contiguous(), turn_index.contiguous(), kernel_mask(loss_mask), n,
                                         use_turn=use_turn)
        else:
            on = loss_mask != 0
            if use_turn:
                idx = turn_index.to(torch.int64)
                on = on & (idx >= 0) & (idx < n[:, None])
                vals = torch.gather(A_turn, 1, idx.clamp(0, K - 1))
            else:
                vals = A_turn.expand(B, T)
            adv = torch.where(on, vals, 0.0)
    return adv.float(), stats


def place_turn_rewards(
    turn_index: torch.Tensor,
    loss_mask: torch.Tensor,
    turn_rewards: torch.Tensor,
    num_turns: torch.Tensor,
    *,
    outcome_rewards: torch.Tensor | None = None,
    token_rewards: torch.Tensor | None = None,
    cu_seqlens: Packed = None,
) -> torch.Tensor:
    """[B, T] float32 token rewards of PPO on agents (placement rule in the reference):
    turn k's reward on the last policy token of the latest turn <= k that has one, the
    outcome on the row's last loss-mask token, ``token_rewards`` added on policy tokens.
    Torch ops on [B, K] and [B, T] (scatter-max, cummax, scatter-add): no loop, no sync.
    ``cu_seqlens``: packed token tensors, as in ``turn_advantages``."""
    if cu_seqlens is not None:
        layout, (lm, ti, tok) = packed_to_rows(cu_seqlens, loss_mask=loss_mask, turn_index=turn_index,
                                               token_rewards=token_rewards)
        rows = place_turn_rewards(ti, lm, turn_rewards, num_turns, outcome_rewards=outcome_rewards, token_rewards=tok)
        return layout.to_packed(rows, shape=loss_mask.shape)
    B, K, T = _validate_layout(turn_index, loss_mask, turn_rewards, num_turns)
    if outcome_rewards is not None:
        check_float("outcome_rewards", outcome_rewards, shape=(B,))
    if token_rewards is not None:
        check_float("token_rewards", token_rewards, shape=(B, T))
    device = check_same_device(turn_index=turn_index, loss_mask=loss_mask, turn_rewards=turn_rewards,
                               num_turns=num_turns, outcome_rewards=outcome_rewards, token_rewards=token_rewards)
    _check_layout(turn_index, loss_mask, num_turns, K)
    with torch.no_grad():
        n = num_turns.to(torch.int64).clamp(0, K)
        present = _present(n, K)
        _check_finite("turn_rewards", turn_rewards, present)
        on = loss_mask != 0
        idx = turn_index.to(torch.int64)
        valid = on & (idx >= 0) & (idx < n[:, None])
        pos = torch.arange(T, device=device).expand(B, T)
        # last policy token of each turn (-1: none); column K collects the other tokens
        last = torch.full((B, K + 1), -1, dtype=torch.int64, device=device)
        last.scatter_reduce_(1, torch.where(valid, idx, K), torch.where(valid, pos, -1), reduce="amax")
        dest = torch.cummax(last[:, :K], dim=1).values  # latest policy token of a turn <= k
        dest = torch.where(present & (dest >= 0), dest, T)  # column T: dropped
        r = torch.where(present, turn_rewards.detach().to(torch.float32), 0.0)
        placed = torch.zeros(B, T + 1, dtype=torch.float32, device=device).scatter_add_(1, dest, r)
        if outcome_rewards is not None:
            _check_finite("outcome_rewards", outcome_rewards)
            last_on = torch.where(on, pos, -1).amax(dim=1)
            col = torch.where(last_on >= 0, last_on, T)[:, None]
            placed.scatter_add_(1, col, outcome_rewards.detach().to(torch.float32)[:, None])
        placed = placed[:, :T]
        if token_rewards is not None:
            placed = placed + torch.where(on, token_rewards.detach().to(torch.float32), 0.0)
        return placed


def turn_gae(
    turn_index: torch.Tensor,
    loss_mask: torch.Tensor,
    turn_rewards: torch.Tensor,
    num_turns: torch.Tensor,
    values: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    outcome_rewards: torch.Tensor | None = None,
    token_rewards: torch.Tensor | None = None,
    whiten: bool = False,
    backend: Backend = "auto",
    cu_seqlens: Packed = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO on agents: per-turn rewards placed by ``place_turn_rewards``, then GAE over the
    policy tokens only (verl's convention: the recursion steps from one policy token to the
    next policy token, environment tokens skipped; ``fastrl.ops.gae`` with ``loss_mask``).
    ``values`` [B, T] float are the critic's values, read at policy tokens only.

    ``cu_seqlens``: packed token tensors (``values`` too), as in ``turn_advantages``; the
    recursion stops at each trajectory's end.

    Returns ``(advantages, returns)`` [B, T] float32, 0 off the loss mask, no grad.
    """
    if cu_seqlens is not None:
        layout, (lm, ti, v, tok) = packed_to_rows(cu_seqlens, loss_mask=loss_mask, turn_index=turn_index, values=values,
                                                  token_rewards=token_rewards)
        adv, ret = turn_gae(ti, lm, turn_rewards, num_turns, v, gamma=gamma, lam=lam, outcome_rewards=outcome_rewards,
                            token_rewards=tok, whiten=whiten, backend=backend)
        return layout.to_packed(adv, shape=loss_mask.shape), layout.to_packed(ret, shape=loss_mask.shape)
    rewards = place_turn_rewards(turn_index, loss_mask, turn_rewards, num_turns,
                                 outcome_rewards=outcome_rewards, token_rewards=token_rewards)
    check_float("values", values, shape=tuple(loss_mask.shape))
    check_same_device(loss_mask=loss_mask, values=values)
    return gae(rewards, values, loss_mask, gamma=gamma, lam=lam, whiten=whiten, backend=backend)
