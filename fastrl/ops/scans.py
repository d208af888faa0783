"""GAE and discounted returns as reverse scans along the sequence.

Semantics are those of :mod:`fastrl.reference.scans` (the literal reverse loop): masked-out
tokens (padding, or tool-output/observation tokens inside an agent trajectory) get 0 and
the recursion passes through them, so the policy tokens on either side of an observation
block are linked as if adjacent. Outputs are float32 for any float input dtype and carry
no gradient (advantages and returns are targets; the inputs' autograd graphs are not
touched). No host synchronisation.

Backends
--------
* ``triton``: one launch of a chunked associative scan with decoupled look-back across
  chunks (:mod:`csrc_triton.scans`); parallel over rows and over chunks of time.
* ``torch``: vectorised over time, no Python loop over ``T``. The masked-in tokens of each
  row are packed to the left (a cumulative-count index, one scatter per input), which turns the
  masked recursion into the constant-coefficient one ``x[i] = b[i] + beta * x[i+1]``. That
  is solved blockwise with matrix products against the fixed ``C x C`` Toeplitz matrix
  ``beta^(j-i)`` (``j >= i``); the block heads form the same recursion with ``beta^C``, solved
  recursively (``log_C T`` levels, no loop over blocks). Only nonnegative integer powers of
  ``beta`` appear -- no division, no logarithm -- so ``gamma*lam`` near 0 just underflows to
  0, and ``T`` is unbounded. Work is ``O(B * T * C)`` with ``C = 64`` in dense matmuls.
"""

from __future__ import annotations

from typing import Sequence

import torch

from fastrl._checks import (
    Backend,
    check_float,
    check_mask,
    check_nonempty,
    check_same_device,
    check_scalar,
    resolve_backend,
)
from fastrl.ops.packing import PackedLayout, packed_to_rows
from fastrl.ops.whiten import masked_whiten
from fastrl.reference.scans import WHITEN_EPS

__all__ = ["gae", "discounted_returns"]

_BLOCK = 64  # torch path: Toeplitz block length


def _validate(rewards, values, mask, gamma, lam):
    check_float("rewards", rewards, ndim=2)
    check_nonempty("rewards", rewards)
    if values is not None:
        check_float("values", values, shape=tuple(rewards.shape))
    check_mask("mask", mask, tuple(rewards.shape))
    check_same_device(rewards=rewards, values=values, mask=mask)
    gamma = check_scalar("gamma", gamma, low=0.0, high=1.0)
    if lam is not None:
        lam = check_scalar("lam", lam, low=0.0, high=1.0)
    return gamma, lam


def _toeplitz_t(n: int, beta: float, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``U[j, i] = beta**(j - i)`` for ``j >= i`` else 0 (``0**0 = 1``), contiguous.

    ``x = b @ U`` computes ``x[i] = sum_{j >= i} beta**(j - i) b[j]`` (a plain contiguous
    right operand: CPU GEMM is far slower with a transposed view here).
    """
    idx = torch.arange(n, device=device, dtype=torch.float64)
    diff = idx[:, None] - idx[None, :]
    w = torch.pow(beta, diff.clamp(min=0))  # a Python base: no host-to-device copy
    return torch.where(diff >= 0, w, torch.zeros_like(w)).to(dtype)


def _scan_const(b: torch.Tensor, beta: float, block: int = _BLOCK) -> torch.Tensor:
    """Solve ``x[..., i] = b[..., i] + beta * x[..., i+1]`` (``x`` is 0 past the end) along the last dim."""
    n, length = b.shape
    if length <= block:
        return b @ _toeplitz_t(length, beta, b.device, b.dtype)
    n_blocks = -(-length // block)
    pad = n_blocks * block - length
    if pad:
        b = torch.nn.functional.pad(b, (0, pad))
    local = (b.reshape(n * n_blocks, block) @ _toeplitz_t(block, beta, b.device, b.dtype)).view(n, n_blocks, block)
    # x at each block's first token, including everything to its right.
    heads = _scan_const(local[:, :, 0].contiguous(), beta**block, block)
    # State entering block k from the right = head of block k+1 (0 after the last block).
    incoming = torch.nn.functional.pad(heads[:, 1:], (0, 1))
    # From token i of a block, the next block's head is (block - i) steps away.
    decay = torch.pow(beta, torch.arange(block, 0, -1, device=b.device, dtype=torch.float64)).to(b.dtype)
    local.addcmul_(incoming[:, :, None], decay)
    return local.view(n, n_blocks * block)[:, :length]


class _Packed:
    """The masked-in tokens of each row packed to the left, behind one scratch column.

    ``slot[b, t]`` is ``k`` for the k-th masked-in token of row ``b`` (1-based) and 0 for
    masked-out tokens. In a packed buffer (``width`` columns, a multiple of the block and
    ``>= T + 1``) column 0 is scratch, columns ``1..n`` hold the row's masked-in tokens in
    order and zeros follow -- so ``buf[:, i + 1]`` is "the next masked-in token" of
    ``buf[:, i]``. Outputs get column 0 set to 0 before gathering at ``slot``, which puts 0
    on the masked-out tokens for free.
    """

    def __init__(self, mask: torch.Tensor, block: int = _BLOCK):
        T = mask.shape[1]
        m = mask if mask.dtype == torch.bool else mask != 0
        self.width = -(-(T + 1) // block) * block
        # Counting in floating point is exact (float32 up to 2**24 tokens a row) and, on CPU,
        # several times faster than an int64 cumsum.
        count = m.to(torch.float32 if T < 2**24 else torch.float64).cumsum_(1)
        self.slot = count.masked_fill_(~m, 0).long()
        self.keep = m

    def pack(self, x: torch.Tensor, dtype: torch.dtype, extra: int = 0) -> torch.Tensor:
        out = torch.zeros(x.shape[0], self.width + extra, dtype=dtype, device=x.device)
        # masked-out values land in the scratch column, which the scan reads (0 * NaN is NaN
        # in the block products): select 0 there so padding garbage cannot leak
        return out.scatter_(1, self.slot, torch.where(self.keep, x.to(dtype), 0.0))

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        packed[:, 0] = 0
        return torch.gather(packed, 1, self.slot)


def _compute_dtype(*xs: torch.Tensor | None) -> torch.dtype:
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def _gae_torch(rewards, values, mask, gamma, lam):
    dt = _compute_dtype(rewards, values)
    pk = _Packed(mask)
    w = pk.width
    v = pk.pack(values, dt, extra=1)  # one more zero column: the "next" of the last one
    # Packed, the next masked-in value is simply the next entry (0 past the last one).
    delta = pk.pack(rewards, dt).add_(v[:, 1:], alpha=gamma).sub_(v[:, :w])
    adv = _scan_const(delta, gamma * lam)
    returns = v[:, :w].add_(adv)
    return pk.unpack(adv), pk.unpack(returns)


def _discounted_torch(rewards, mask, gamma):
    dt = _compute_dtype(rewards)
    pk = _Packed(mask)
    return pk.unpack(_scan_const(pk.pack(rewards, dt), gamma))


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    whiten: bool = False,
    backend: Backend = "auto",
    cu_seqlens: PackedLayout | torch.Tensor | Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (https://arxiv.org/abs/1506.02438) over ``[B, T]`` tokens.

    For ``t = T-1 .. 0`` on masked-in tokens (state starts at 0)::

        delta[t] = r[t] + gamma * V_next - V[t]
        A[t]     = delta[t] + gamma * lam * A_next;   V_next, A_next = V[t], A[t]

    masked-out tokens get ``A = 0`` and leave ``V_next, A_next`` unchanged (observation
    tokens are skipped, not treated as episode ends). ``returns = A + V`` on masked-in
    tokens, 0 elsewhere, computed from the advantages before whitening.

    Args:
        rewards: ``[B, T]`` float, per-token rewards (e.g. score on the last token minus a
            KL penalty). Any float dtype.
        values: ``[B, T]`` float, critic values ``V(s_t)``.
        mask: ``[B, T]`` bool/int/float; nonzero = token generated by the policy.
        gamma: discount, finite, in [0, 1].
        lam: GAE lambda, finite, in [0, 1] (0: one-step TD, 1: Monte-Carlo minus V).
        whiten: also whiten the advantages over all masked-in tokens of the batch:
            ``(A - mean) / sqrt(var + 1e-8)``, unbiased (Bessel) variance as TRL/verl
            ``masked_whiten``; 0 on masked-out tokens; all zeros if fewer than 2 tokens.
        backend: ``"auto"`` (Triton on CUDA, torch otherwise), ``"triton"`` or ``"torch"``.
        cu_seqlens: packed inputs: every tensor is ``[N]`` or ``[1, N]`` (``S`` sequences
            back to back; the recursion stops at each sequence's end) and this is their
            ``fastrl.ops.PackedLayout`` or host ``cu_seqlens`` (``[S + 1]``). The outputs
            are then packed like ``rewards`` and equal those of the padded ``[S, T]`` rows.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` float32, no grad.
    """
    if cu_seqlens is not None:  # packed rows: this op on their padded [S, T] view
        layout, rows = packed_to_rows(cu_seqlens, rewards=rewards, values=values, mask=mask)
        adv, returns = gae(*rows, gamma=gamma, lam=lam, whiten=whiten, backend=backend)
        return layout.to_packed(adv, shape=rewards.shape), layout.to_packed(returns, shape=rewards.shape)
    gamma, lam = _validate(rewards, values, mask, gamma, lam)
    if not isinstance(whiten, bool):
        raise TypeError(f"whiten must be a bool, got {type(whiten).__name__}")
    impl = resolve_backend(backend, rewards.device)
    with torch.no_grad():
        if impl == "triton":
            from csrc_triton.scans import gae_fwd

            adv, returns = gae_fwd(rewards.detach(), values.detach(), mask, gamma, lam)
        else:
            adv, returns = _gae_torch(rewards.detach(), values.detach(), mask, gamma, lam)
        if whiten:
            adv = masked_whiten(adv, mask, eps=WHITEN_EPS, backend=impl)
        return adv.float(), returns.float()


def discounted_returns(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    backend: Backend = "auto",
    cu_seqlens: PackedLayout | torch.Tensor | Sequence[int] | None = None,
) -> torch.Tensor:
    """Discounted reward-to-go ``G[t] = r[t] + gamma * G_next`` over masked-in tokens.

    Masked-out tokens get 0 and pass ``G_next`` through unchanged (same rule as :func:`gae`).
    Used by REINFORCE / REINFORCE++ (token-level returns before whitening).

    Args:
        rewards: ``[B, T]`` float, any float dtype.
        mask: ``[B, T]`` bool/int/float; nonzero = token generated by the policy.
        gamma: discount, finite, in [0, 1].
        backend: ``"auto"`` (Triton on CUDA, torch otherwise), ``"triton"`` or ``"torch"``.
        cu_seqlens: packed inputs ``[N]`` or ``[1, N]`` with their ``fastrl.ops.PackedLayout``
            or host ``cu_seqlens``, as in :func:`gae`; the output is packed like ``rewards``.

    Returns:
        ``[B, T]`` float32, no grad.
    """
    if cu_seqlens is not None:  # packed rows: this op on their padded [S, T] view
        layout, (r, m) = packed_to_rows(cu_seqlens, rewards=rewards, mask=mask)
        return layout.to_packed(discounted_returns(r, m, gamma=gamma, backend=backend), shape=rewards.shape)
    gamma, _ = _validate(rewards, None, mask, gamma, None)
    impl = resolve_backend(backend, rewards.device)
    with torch.no_grad():
        if impl == "triton":
            from csrc_triton.scans import discounted_returns_fwd

            return discounted_returns_fwd(rewards.detach(), mask, gamma)
        return _discounted_torch(rewards.detach(), mask, gamma).float()

