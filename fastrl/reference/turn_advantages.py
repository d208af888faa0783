"""Reference advantages over the turns of agent trajectories (the specification).

Plain PyTorch with Python loops over rows, turns and groups, written to be read. The fast
paths in ``fastrl.ops.turn_advantages`` are tested against these functions. Computation is
in float64 when any float input is float64, else float32.

Layout (token level, ``[B, T]`` right-padded; row b is one trajectory)
---------------------------------------------------------------------
- ``turn_index`` [B, T] integer: the policy turn (0, 1, ...) each token belongs to. Read
  only where ``loss_mask`` is nonzero; environment/tool tokens and padding may hold
  anything. A policy token whose index is outside [0, n_b) gets advantage 0.
- ``loss_mask`` [B, T]: nonzero exactly on policy tokens (environment tokens are 0 even
  though they are attended).
- ``num_turns`` [B] integer n_b: row b has turns 0 .. n_b - 1 (0 <= n_b <= K). Values of
  the per-turn tensors at turns k >= n_b are ignored (they may be NaN).
- ``turn_rewards`` [B, K] float r[b, k]: the reward observed after turn k.
- ``outcome_rewards`` [B] float R_b: the trajectory's outcome (episode) reward.
- ``group_ids`` [B] integer: trajectories of one prompt / task share an id (any values).
- ``state_keys`` [B, K] int64 (``gigpo`` only): a hash of the environment state the agent
  acted in at turn k (GiGPO's anchor state).

Notation: for a set S of numbers, mean(S) and std(S) (unbiased, sqrt(sum (x - mean)^2 /
(|S| - 1))); ``norm`` picks F_norm: ``"std"`` -> (x - mean(S)) / (std(S) + eps),
``"none"`` -> x - mean(S) (F_norm = 1). A set of one member gets 0 in both (no baseline).

Modes (``turn_advantages_reference``)
-------------------------------------
Episode advantage (GRPO, Shao et al. 2024), over the trajectories g of a group:

    A^E_b = norm(R_b; {R_j : j in group(b)})

With ``episode_over="turns"`` (verl-agent's ``episode_norm_reward`` with
``compute_mean_std_cross_steps=True``, its default) the episode statistics are instead over
the group's *turn samples*: trajectory b counts n_b times (mean and unbiased std of the
multiset {R_j repeated n_j times}), and a group with a single sample gets mean 0, std 1, i.e.
A^E_b = R_b / (1 + eps) (``"none"``: R_b), as verl-agent does.

Discounted turn return (includes the turn's own reward):

    G[b, k] = sum_{j=k}^{n_b - 1} gamma^(j - k) r[b, j]

- ``broadcast``: A[b, t] = A^E_b on every policy token (GRPO's one advantage per
  trajectory; with ``norm="std"`` this is ``group_advantages(mode="grpo")`` broadcast, with
  ``"none"`` ``mode="dr_grpo"``).
- ``gigpo`` (Feng et al. 2025, arXiv 2505.10978, Eqs. 3-8): step groups are the pairs
  (group id, state key) over all present turns of all trajectories of the group (any turn
  index: the same state reached at different times is one group),

      A^S[b, k] = norm(G[b, k]; {G[j, l] : group(j) = group(b), key[j, l] = key[b, k]})
      A[b, k]   = A^E_b + omega * A^S[b, k]

  A singleton step group has A^S = 0.
- ``turn_discounted``: turn groups are the pairs (group id, turn index k) over the group's
  trajectories that have a turn k,

      A^T[b, k] = norm(G[b, k]; {G[j, k] : group(j) = group(b), k < n_j})
      A[b, k]   = c_k * A^T[b, k] + outcome_coef * A^E_b,
      c_k       = final_turn_coef if k = n_b - 1 (b's final turn) else turn_coef

  (``final_turn_coef=None``: ``turn_coef`` on every turn.) ``turn_coef=1, outcome_coef=0``
  is the turn-discount form (each turn's reward plus the discounted later ones, normalised
  per turn index). The statistics of turn index k are over every trajectory of the group
  that has a turn k, its final turn included: ``final_turn_coef`` only weighs the turn term
  a final turn *receives*.

  MT-GRPO (Zeng et al. 2025, arXiv:2505.11821v1, "Reinforcing Multi-Turn Reasoning in LLM
  Agents via Turn-Level Credit Assignment") has two turns, a tool call and an answer, a
  turn-level reward R^T (the tool call's: executed, found the answer) and an outcome reward
  R^O (the answer's), each normalised over the group's G rollouts (A^T, A^O), and gives

      A_{i,1} = A^O_i + lambda * A^T_i       (the first turn's tokens)
      A_{i,2} = A^O_i                        (the final turn's tokens: the outcome only)

  with lambda = ``turn_advantage_coef`` = 1 in its experiments. Read here: the paper's
  abstract and Fig. 1 caption, and its authors' code, SiliangZeng/Multi-Turn-RL-Agent
  ``mt_grpo_env_trainer._assign_advantages`` (its ``aae`` mode: tokens before the tool
  result get ``outcome_adv + turn_advantage_coef * turn_adv``, tokens after it
  ``outcome_adv``; eps = 1e-4, std unbiased), which these equations restate (a secondary
  source's rendering of the paper's equations reads the same). In fastrl's terms: ``gamma=0``,
  ``turn_coef=lambda``, ``outcome_coef=1``, ``final_turn_coef=0``; with K turns every
  non-final turn k gets A^O + lambda * A^T_k (A^T_k normalised per turn index) and the final
  turn A^O alone. The final turn's own reward is not credited twice: in fastrl's
  environments it is the outcome (the last step's reward), which A^O already carries.
  Differences from the authors' code: a trajectory of one turn (no tool result) gets A^O
  here; the code gives such a trajectory the advantage of the combined reward R^T + R^O
  normalised over the group. Their turn reward is a reward function of the whole completion;
  here it is the environment's per-turn reward.

Token expansion: A[b, t] = A[b, turn_index[b, t]] where loss_mask[b, t] != 0 and the
index is a present turn, else 0.

PPO on agents (``turn_gae_reference``)
-------------------------------------
Per-turn rewards are placed on the last policy token of their turn; a turn without policy
tokens passes its reward to the latest earlier policy token (the action the reward follows);
the outcome reward (optional) goes on the row's last loss-mask token; optional
``token_rewards`` (e.g. a KL penalty) add on policy tokens. GAE then runs over the policy
tokens only: the recursion steps from one policy token to the next *policy* token,
skipping environment tokens (their values and rewards are never read):

    for policy tokens t in reverse order, t' = the next policy token after t (none at the end):
        delta[t] = r[t] + gamma * V[t'] - V[t]           (V[t'] = 0 without t')
        A[t]     = delta[t] + gamma * lam * A[t']        (A[t'] = 0 without t')
    returns[t] = A[t] + V[t];   A = returns = 0 on environment tokens and padding.

This is verl's convention (``compute_gae_advantage_return``: "skip values and TD-error on
observation tokens") and fastrl's ``gae``. SkyRL's ``compute_gae_advantage_return``
(skyrl-train ``utils/ppo_utils.py``) instead steps through every token, environment tokens
included (their values bootstrap the policy tokens before them); that is not implemented.
"""

from __future__ import annotations

import torch

from fastrl.reference.advantages import group_advantages_reference

TURN_ADVANTAGE_MODES = ("broadcast", "gigpo", "turn_discounted")
NORMS = ("std", "none")
EPISODE_OVER = ("trajectories", "turns")


def _dtype(*xs: torch.Tensor | None) -> torch.dtype:
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def _normalise(vals: list[torch.Tensor], norm: str, eps: float) -> list[torch.Tensor]:
    """norm(x; S) for every x of the set S (0 for a set of one)."""
    if len(vals) < 2:
        return [torch.zeros_like(v) for v in vals]
    s = torch.stack(vals)
    d = s - s.mean()
    if norm == "std":
        d = d / (s.std(unbiased=True) + eps)
    return list(d)


def episode_advantages_reference(
    outcome_rewards, group_ids, *, norm: str = "std", eps: float = 1e-6, num_turns=None, over: str = "trajectories"
) -> torch.Tensor:
    """A^E_b = norm(R_b; outcomes of b's group), [B] in the working dtype (``over="turns"``:
    the statistics of the group's turn samples, see the module docstring)."""
    dt = _dtype(outcome_rewards)
    R = outcome_rewards.to(dt)
    ids = [int(i) for i in group_ids]
    out = torch.zeros_like(R)
    for g in set(ids):
        members = [b for b in range(len(ids)) if ids[b] == g]
        if over == "trajectories":
            for b, a in zip(members, _normalise([R[b] for b in members], norm, eps)):
                out[b] = a
            continue
        samples = [R[b] for b in members for _ in range(int(num_turns[b]))]
        if not samples:
            continue
        if len(samples) == 1:
            mean, std = torch.zeros((), dtype=dt), torch.ones((), dtype=dt)
        else:
            s = torch.stack(samples)
            mean, std = s.mean(), s.std(unbiased=True)
        for b in members:
            out[b] = (R[b] - mean) / (std + eps) if norm == "std" else R[b] - mean
    return out


def turn_index_from_spans_reference(turn_start, turn_end, num_turns, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token turn index from a segment table: token t of row b belongs to turn k when
    turn_start[b, k] <= t < turn_end[b, k] (k < n_b; spans sorted, not overlapping, inside
    [0, T]). Returns (turn_index [B, T] int64, -1 outside every span; in_turn [B, T] bool)."""
    B = turn_start.shape[0]
    ti = torch.full((B, T), -1, dtype=torch.int64)
    for b in range(B):
        for k in range(int(num_turns[b])):
            ti[b, int(turn_start[b, k]) : int(turn_end[b, k])] = k
    return ti, ti >= 0


def turn_returns_reference(turn_rewards, num_turns, *, gamma: float) -> torch.Tensor:
    """G[b, k] = sum_{j=k}^{n_b-1} gamma^(j-k) r[b, j]; 0 at absent turns."""
    dt = _dtype(turn_rewards)
    B, K = turn_rewards.shape
    G = torch.zeros(B, K, dtype=dt)
    for b in range(B):
        run = torch.zeros((), dtype=dt)
        for k in reversed(range(int(num_turns[b]))):
            run = turn_rewards[b, k].to(dt) + gamma * run
            G[b, k] = run
    return G


def _expand(A_turn, turn_index, loss_mask, num_turns) -> torch.Tensor:
    B, T = loss_mask.shape
    out = torch.zeros(B, T, dtype=A_turn.dtype)
    for b in range(B):
        for t in range(T):
            k = int(turn_index[b, t])
            if loss_mask[b, t] != 0 and 0 <= k < int(num_turns[b]):
                out[b, t] = A_turn[b, k]
    return out


TURN_STAT_KEYS = ("turn_groups", "frac_singleton_turn_groups", "frac_all_equal_turn_groups")
EPISODE_STAT_KEYS = ("frac_all_equal_groups", "reward_mean", "reward_std")


def turn_advantages_reference(
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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token advantages [B, T] of the module's modes (see the module docstring) and
    0-dim float32 statistics:

    - ``frac_all_equal_groups``, ``reward_mean``, ``reward_std``: of the outcome rewards,
      as ``group_advantages_reference`` (grpo) reports them.
    - ``gigpo`` / ``turn_discounted`` only: ``turn_groups`` (number of step groups, resp.
      (group, turn index) groups, with at least one present turn),
      ``frac_singleton_turn_groups`` (of those, the fraction with one member: no step
      signal) and ``frac_all_equal_turn_groups`` (the fraction whose returns are all equal,
      singletons included).
    """
    if mode not in TURN_ADVANTAGE_MODES:
        raise ValueError(f"mode must be one of {TURN_ADVANTAGE_MODES}, got {mode!r}")
    dt = _dtype(turn_rewards, outcome_rewards)
    B, K = turn_rewards.shape
    AE = episode_advantages_reference(outcome_rewards.to(dt), group_ids, norm=norm, eps=eps, num_turns=num_turns,
                                      over=episode_over)
    _, ep = group_advantages_reference(outcome_rewards.to(dt), group_ids, mode="grpo")
    stats = {k: ep[k] for k in EPISODE_STAT_KEYS}
    if mode == "broadcast":
        m = (loss_mask != 0).to(dt)
        return AE[:, None] * m, stats
    G = turn_returns_reference(turn_rewards.to(dt), num_turns, gamma=gamma)
    ids = [int(i) for i in group_ids]
    present = [(b, k) for b in range(B) for k in range(int(num_turns[b]))]
    if mode == "gigpo":
        key = lambda b, k: (ids[b], int(state_keys[b, k]))  # noqa: E731
    else:
        key = lambda b, k: (ids[b], k)  # noqa: E731
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for b, k in present:
        groups.setdefault(key(b, k), []).append((b, k))
    A_rel = torch.zeros(B, K, dtype=dt)
    for members in groups.values():
        for (b, k), a in zip(members, _normalise([G[b, k] for b, k in members], norm, eps)):
            A_rel[b, k] = a
    n_groups = len(groups)
    stats["turn_groups"] = torch.tensor(float(n_groups))
    stats["frac_singleton_turn_groups"] = torch.tensor(
        sum(len(m) == 1 for m in groups.values()) / max(n_groups, 1), dtype=torch.float32)
    stats["frac_all_equal_turn_groups"] = torch.tensor(
        sum(all(bool(G[b, k] == G[m[0]]) for b, k in m) for m in groups.values()) / max(n_groups, 1),
        dtype=torch.float32)
    if mode == "gigpo":
        A_turn = AE[:, None] + step_coef * A_rel
    else:
        A_turn = torch.zeros(B, K, dtype=dt)
        for b, k in present:
            final = k == int(num_turns[b]) - 1
            c = final_turn_coef if final and final_turn_coef is not None else turn_coef
            A_turn[b, k] = c * A_rel[b, k] + outcome_coef * AE[b]
    return _expand(A_turn, turn_index, loss_mask, num_turns), stats


def place_turn_rewards_reference(
    turn_index, loss_mask, turn_rewards, num_turns, *, outcome_rewards=None, token_rewards=None
) -> torch.Tensor:
    """[B, T] token rewards of PPO on agents (see the module docstring)."""
    dt = _dtype(turn_rewards, outcome_rewards, token_rewards)
    B, T = loss_mask.shape
    r = torch.zeros(B, T, dtype=dt)
    for b in range(B):
        n = int(num_turns[b])
        policy = [t for t in range(T) if loss_mask[b, t] != 0 and 0 <= int(turn_index[b, t]) < n]
        for k in range(n):
            # the latest policy token of a turn <= k
            cands = [t for t in policy if int(turn_index[b, t]) <= k]
            if cands:
                r[b, max(cands)] += turn_rewards[b, k].to(dt)
        trained = [t for t in range(T) if loss_mask[b, t] != 0]
        if outcome_rewards is not None and trained:
            r[b, max(trained)] += outcome_rewards[b].to(dt)
        if token_rewards is not None:
            for t in range(T):
                if loss_mask[b, t] != 0:
                    r[b, t] += token_rewards[b, t].to(dt)
    return r


def turn_gae_reference(
    turn_index, loss_mask, turn_rewards, num_turns, values, *, gamma: float, lam: float,
    outcome_rewards=None, token_rewards=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [B, T] of PPO on agents: a loop over the policy tokens."""
    r = place_turn_rewards_reference(turn_index, loss_mask, turn_rewards, num_turns,
                                     outcome_rewards=outcome_rewards, token_rewards=token_rewards)
    dt = _dtype(r, values)
    r, v = r.to(dt), values.to(dt)
    B, T = loss_mask.shape
    adv = torch.zeros(B, T, dtype=dt)
    ret = torch.zeros(B, T, dtype=dt)
    for b in range(B):
        next_v = torch.zeros((), dtype=dt)
        next_a = torch.zeros((), dtype=dt)
        for t in reversed(range(T)):
            if loss_mask[b, t] == 0:
                continue
            delta = r[b, t] + gamma * next_v - v[b, t]
            a = delta + gamma * lam * next_a
            adv[b, t], ret[b, t] = a, a + v[b, t]
            next_v, next_a = v[b, t], a
    return adv, ret
