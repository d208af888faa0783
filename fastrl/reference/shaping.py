"""Reference reward shaping: outcome rewards on the token grid, with KL to a reference policy.

The specification of ``fastrl.ops.shaping`` (``token_rewards``, ``sequence_rewards``),
written as loops over sequences and tokens.
"""

from __future__ import annotations

import torch


def token_rewards_reference(
    outcome: torch.Tensor, mask: torch.Tensor, *, token_kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """Per-token rewards ``[B, T]`` of a PPO step.

    r[b, t] = outcome[b] at the last masked-in token of row b (nothing on a row without one),
    minus ``kl_coef * token_kl[b, t]`` at every token when ``token_kl`` is given
    (the KL-in-reward penalty: the reward of each token pays for its distance to the
    reference policy).
    """
    B, T = mask.shape
    out = torch.zeros(B, T, dtype=torch.float32, device=mask.device)
    for b in range(B):
        cols = [t for t in range(T) if mask[b, t] > 0]
        if cols:
            out[b, cols[-1]] = float(outcome[b])
    if token_kl is not None:
        for b in range(B):
            for t in range(T):
                out[b, t] = out[b, t] - kl_coef * float(token_kl[b, t])
    return out


def sequence_rewards_reference(outcome: torch.Tensor, *, token_kl: torch.Tensor | None = None, kl_coef: float = 0.0) -> torch.Tensor:
    """Per-sequence rewards ``[B]`` for a group estimator: ``outcome[b] - kl_coef * sum_t token_kl[b, t]``
    (``outcome`` unchanged without ``token_kl``)."""
    if token_kl is None:
        return outcome.clone()
    return torch.stack([outcome[b] - kl_coef * token_kl[b].sum() for b in range(outcome.shape[0])])
