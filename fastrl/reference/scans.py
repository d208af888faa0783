"""Reference GAE and discounted returns: the literal reverse loop over time.

This is the specification the fast paths (``fastrl.ops.scans``) are tested against. It
is deliberately the plain loop, one time step at a time, vectorised over the batch only.

Masking rule (shared by both functions). ``mask[b, t] != 0`` marks a token the policy
generated ("masked in"). A masked-out token is padding, or -- inside an agent trajectory
-- a tool-output/observation token the policy did not generate. The recursion *skips*
masked-out tokens: they get output 0 and the running state (``V_next``, ``A_next``,
``G_next``) passes through them unchanged, so the masked-in tokens on either side of an
observation block are linked as if they were adjacent. Equivalently: drop the masked-out
tokens, run the ordinary recursion on what is left, scatter the result back, and put 0
everywhere else.

GAE (Schulman et al. 2016, https://arxiv.org/abs/1506.02438), for ``t = T-1 .. 0``,
starting from ``V_next = A_next = 0`` (the episode ends after the last masked-in token)::

    if mask[t]:
        delta[t] = r[t] + gamma * V_next - V[t]
        A[t]     = delta[t] + gamma * lam * A_next
        V_next, A_next = V[t], A[t]
    else:
        A[t] = 0                      # V_next, A_next carry over unchanged

    returns[t] = A[t] + V[t] if mask[t] else 0

``returns`` uses the advantages *before* whitening (what PPO's value loss regresses on).
With ``whiten=True`` the advantages are then whitened over all masked-in tokens of the
batch::

    n     = sum(mask)
    mean  = sum(mask * A) / max(n, 1)
    var   = sum(mask * (A - mean)**2) / max(n - 1, 1)      # unbiased (Bessel), as TRL/verl
    A_out = mask * (A - mean) / sqrt(var + 1e-8)

The unbiased variance matches ``masked_whiten`` in TRL and verl; where they raise on a
batch with fewer than two masked-in tokens, this returns zeros (``n = 1``: ``A - mean`` is
0; ``n = 0``: nothing is masked in) -- raising would need a host sync.

Discounted returns (REINFORCE, REINFORCE++), for ``t = T-1 .. 0`` from ``G_next = 0``::

    if mask[t]:
        G[t] = r[t] + gamma * G_next;  G_next = G[t]
    else:
        G[t] = 0                      # G_next carries over unchanged

Both are computed in float64 when given float64 inputs and float32 otherwise, and return
that dtype. No gradients flow (advantages and returns are regression/policy targets).
"""

from __future__ import annotations

import torch

WHITEN_EPS = 1e-8


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@torch.no_grad()
def masked_whiten_unbiased(x: torch.Tensor, mask: torch.Tensor, eps: float = WHITEN_EPS) -> torch.Tensor:
    """``mask * (x - mean) / sqrt(var + eps)`` over masked-in entries, unbiased variance.

    ``n = sum(mask)``; ``mean = sum(mask * x) / max(n, 1)``;
    ``var = sum(mask * (x - mean)^2) / max(n - 1, 1)``. Masked-out entries are 0.
    """
    m = (mask != 0).to(x.dtype)
    x = torch.where(mask != 0, x, 0.0)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1)
    var = (((x - mean) ** 2) * m).sum() / (n - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * m


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    whiten: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation by the literal reverse loop (see module docstring).

    Args:
        rewards, values: ``[B, T]`` float; ``values[b, t]`` is the critic's estimate at token t.
        mask: ``[B, T]``, nonzero = masked in (policy token), zero = padding or observation.
        gamma: discount in [0, 1]. lam: GAE lambda in [0, 1].
        whiten: whiten the advantages over masked-in tokens (unbiased variance, eps 1e-8).

    Returns:
        ``(advantages, returns)``, ``[B, T]``, 0 on masked-out tokens.
    """
    dt = _compute_dtype(rewards)
    r = rewards.to(dt)
    v = values.to(dt)
    m = mask != 0
    B, T = r.shape
    adv = torch.zeros(B, T, dtype=dt, device=r.device)
    v_next = torch.zeros(B, dtype=dt, device=r.device)
    a_next = torch.zeros(B, dtype=dt, device=r.device)
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * v_next - v[:, t]
        a_t = delta + gamma * lam * a_next
        adv[:, t] = torch.where(m[:, t], a_t, torch.zeros_like(a_t))
        v_next = torch.where(m[:, t], v[:, t], v_next)
        a_next = torch.where(m[:, t], a_t, a_next)
    returns = torch.where(m, adv + v, torch.zeros_like(adv))
    if whiten:
        adv = masked_whiten_unbiased(adv, m)
    return adv, returns


@torch.no_grad()
def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, *, gamma: float) -> torch.Tensor:
    """Discounted reward-to-go by the literal reverse loop (see module docstring).

    Args:
        rewards: ``[B, T]`` float. mask: ``[B, T]``, nonzero = masked in. gamma: in [0, 1].

    Returns:
        ``[B, T]``: ``G[t] = r[t] + gamma * G_next`` on masked-in tokens, 0 elsewhere.
    """
    dt = _compute_dtype(rewards)
    r = rewards.to(dt)
    m = mask != 0
    B, T = r.shape
    out = torch.zeros(B, T, dtype=dt, device=r.device)
    g_next = torch.zeros(B, dtype=dt, device=r.device)
    for t in reversed(range(T)):
        g_t = r[:, t] + gamma * g_next
        out[:, t] = torch.where(m[:, t], g_t, torch.zeros_like(g_t))
        g_next = torch.where(m[:, t], g_t, g_next)
    return out
